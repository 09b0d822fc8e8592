"""The host side of the Hopper Gluon V4 build, on the CPU: which plans it takes and the reason it names otherwise,
``backend="auto"``'s choice on an sm_90 device (simulated: ``runtime.gluon_usable`` / ``triton_usable`` patched),
the tile and split geometry, the plan's split workspace, and the pool addressing the kernel uses (typed bases,
page strides in 16-byte units, record and scale-word offsets) replayed in torch against ``V4Format.read`` for every
format and page size, and the launch's bundles leaf by leaf against the kernel's unpacking. The GPU checks are
tests/test_v4_gluon.py; the compile checks tests/test_compile_v4_gluon.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import fp8mla  # noqa: E402
from fp8mla import runtime  # noqa: E402
from fp8mla.backends import v4_gluon  # noqa: E402
from fp8mla.formats_v4 import get_v4_format, pool_geometry  # noqa: E402
from fp8mla.kernels.sm90 import v4 as sm90_v4  # noqa: E402


def test_supports_names_what_it_refuses():
    assert sm90_v4.supports(64, "fp8_v4", "bfloat16") == (True, "")
    for fmt in ("fp8_v41", "bf16"):
        assert sm90_v4.supports(8, fmt, "bfloat16")[0]
    ok, why = sm90_v4.supports(64, "fp8_v4", "float16")
    assert not ok and "q_data_type" in why and "float16" in why
    ok, why = sm90_v4.supports(129, "fp8_v4", "bfloat16")
    assert not ok and "num_heads" in why
    ok, why = sm90_v4.supports(16, "fp8_ds_mla", "bfloat16")
    assert not ok and "kv_format" in why and "fp8_ds_mla" in why


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 device as the selector sees it."""
    monkeypatch.setattr(runtime, "gluon_usable", lambda device: True)
    monkeypatch.setattr(runtime, "triton_usable", lambda device: True)
    return torch.device("cuda", 0)


def _pick(requested, device, q_dtype, heads=64, fmt="fp8_v4", invariant=False):
    from fp8mla.backends.select import Refusal, refusal_error, select, v4_question
    from fp8mla.formats_v4 import get_v4_format
    choice = select(v4_question(heads, get_v4_format(fmt), q_dtype, device, 640, batch_invariant=invariant),
                    requested)
    if isinstance(choice, Refusal):
        raise refusal_error(choice)
    return choice.backend


def test_auto_picks_gluon_on_hopper_where_it_takes_the_plan(hopper):
    assert _pick("auto", hopper, torch.bfloat16) == "gluon"
    assert _pick("auto", hopper, torch.bfloat16, fmt="fp8_v41") == "gluon"
    assert _pick("auto", hopper, torch.float16) == "triton"
    assert _pick("auto", hopper, torch.bfloat16, heads=129) == "triton"
    assert _pick("gluon", hopper, torch.bfloat16) == "gluon"
    with pytest.raises(ValueError, match="q_data_type"):
        _pick("gluon", hopper, torch.float16)


def test_the_batch_invariant_mode_never_picks_gluon(hopper):
    assert _pick("auto", hopper, torch.bfloat16, invariant=True) == "triton"


def test_gluon_on_the_cpu_names_why():
    attn = fp8mla.V4SparseAttention(backend="gluon")
    with pytest.raises(RuntimeError, match="sm_90"):
        attn.plan(num_heads=16, sm_scale=0.04, q_data_type=torch.bfloat16, kv_format="fp8_v4", window_topk=128,
                  window_page_size=64, device="cpu")
    auto = fp8mla.V4SparseAttention()
    auto.plan(num_heads=16, sm_scale=0.04, q_data_type=torch.bfloat16, kv_format="fp8_v4", window_topk=128,
              window_page_size=64, device="cpu")
    assert auto.backend == "torch"


def test_tiles_and_splits(monkeypatch):
    assert sm90_v4.tiles_of(128, 512) == (2, 10)
    assert sm90_v4.tiles_of(1, 0) == (1, 1)
    assert sm90_v4.tiles_of(100, 37) == (2, 3)     # each segment padded to whole tiles: tiles never mix pools
    assert sm90_v4.tile_splits(10, 3) == (4, 3)
    assert sm90_v4.tile_splits(10, 7) == (2, 5)
    assert sm90_v4.tile_splits(10, 40) == (1, 10)
    assert sm90_v4.tile_splits(1, 8) == (1, 1)
    # one wave: 132 SMs over tokens x head groups, at least min_split entries and one tile a split
    # (tests/test_v4_splits.py: the rule over a grid)
    monkeypatch.setattr(v4_gluon, "num_sms", lambda device: 132)
    for n, heads, wt, min_split, want in ((2, 64, 640, 256, 2), (2, 64, 640, 64, 10), (64, 128, 640, 64, 1),
                                          (1, 8, 64, 256, 1)):
        assert v4_gluon.splits(_Plan(heads, wt, 0, min_split=min_split), n) == want


class _Plan:
    def __init__(self, num_heads, window_topk, compressed_topk, num_splits=None, min_split=64):
        self.num_heads, self.window_topk, self.compressed_topk = num_heads, window_topk, compressed_topk
        self.num_splits, self.min_split, self.device = num_splits, min_split, torch.device("cpu")
        self.part_o = self.part_lse = None


@pytest.mark.parametrize("heads,wt,ct,min_split", [(64, 128, 512, 64), (128, 128, 2048, 256), (8, 37, 0, 16)])
def test_plan_workspace_covers_every_call(heads, wt, ct, min_split):
    p = _Plan(heads, wt, ct, min_split=min_split)
    v4_gluon.prepare(p, {})
    for n in range(1, 4 * runtime.num_sms("cpu") + 1):
        s = v4_gluon.splits(p, n)
        if s > 1:
            assert p.part_o is not None and p.part_o.shape[0] >= n * (s + 1), (n, s)
            assert p.part_lse.shape[0] == p.part_o.shape[0]
    with pytest.raises(TypeError, match="triton"):
        v4_gluon.prepare(p, {"block_n": 32})


def test_fixed_splits_count_non_empty_ones():
    assert v4_gluon.splits(_Plan(64, 128, 512, num_splits=7), 3) == 5
    assert v4_gluon.splits(_Plan(64, 128, 512, num_splits=1), 3) == 1


def _kernel_rows(fmt, view, page_size, slots):
    """The 512 values of each slot as the kernel addresses and decodes them (v4_partitions._seg_rows and
    _converter), from the typed bases of ``pool_pointers``."""
    kind = sm90_v4.FORMATS[fmt.name]
    p8, p16, p32, stride_q = sm90_v4.pool_pointers(view, kind)
    nb = p8.untyped_storage().nbytes() - p8.storage_offset()   # the bytes from the base on, as the kernel sees them
    flat8 = torch.as_strided(p8.view(torch.uint8), (nb,), (1,))
    flat16 = torch.as_strided(p16, (nb // 2,), (1,))
    flat32 = torch.as_strided(p32, (nb // 4,), (1,))
    out = torch.empty(len(slots), 512, dtype=torch.float32)
    for i, s in enumerate(slots.tolist()):
        pg, off = s // page_size, s % page_size
        words = {0: 256, 1: 144, 2: 132}[kind]
        row = pg * stride_q * 4 + off * words
        srow = pg * stride_q * 4 + page_size * 144 + off * 2 if kind == 1 else row + 128
        for c in range(8):
            if kind == 0 or (kind == 1 and c == 7):
                e = row * 2 + (224 if kind == 1 else 64 * c)
                out[i, 64 * c:64 * c + 64] = flat16[e:e + 64].float()
                continue
            codes = flat8[row * 4 + 64 * c:row * 4 + 64 * c + 64].view(torch.float8_e4m3fn).float()
            if kind == 1:
                word, bytes_ = int(flat32[srow + c // 4]), [c % 4] * 64
            else:
                word = int(flat32[srow + (c // 4) * 2 + (c % 4) // 2])
                bytes_ = [(2 * c) % 4] * 32 + [(2 * c + 1) % 4] * 32
            scale = torch.tensor([2.0 ** (((word >> (8 * b)) & 0xFF) - 127) for b in bytes_])
            out[i, 64 * c:64 * c + 64] = codes * scale
    return out


@pytest.mark.parametrize("fmt_name", ["fp8_v4", "fp8_v41", "bf16"])
@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_kernel_addressing_reads_the_format(fmt_name, page_size):
    fmt = get_v4_format(fmt_name)
    g = torch.Generator().manual_seed(page_size)
    pool = fmt.new_pool(3, page_size)
    slots = torch.randperm(3 * page_size, generator=g)[:6]
    fmt.write(pool, slots, torch.randn(len(slots), 512, generator=g) * 3)
    _, view = pool_geometry(fmt, pool, page_size)
    got = _kernel_rows(fmt, view, page_size, slots)
    want = fmt.read(pool, slots, torch.float32, page_size=page_size)
    assert torch.equal(got, want)


def test_pool_pointers_refuse_misaligned_pages():
    fmt = get_v4_format("fp8_v41")
    pool = torch.zeros(3, 5 * 528 + 4, dtype=torch.uint8)   # pages 2644 bytes apart: not a multiple of 16
    _, view = pool_geometry(fmt, pool, 5)
    with pytest.raises(ValueError, match="16-byte"):
        sm90_v4.pool_pointers(view, sm90_v4.FORMATS["fp8_v41"])


def _launch_leaves(monkeypatch, split: bool, has_sink: bool) -> tuple[dict, dict]:
    """({leaf name: value} of the bundles ``sm90_v4.v4_attention`` launches the kernel with (the kernel replaced by
    a recorder, the merge by a no-op), named by ``devtools.sass.V4_BUNDLES``; the host values each should be)."""
    import types
    from devtools import sass
    from fp8mla.kernels.sm90 import v4_partitions
    from fp8mla.kernels.split import merge
    if v4_partitions.gluon is None:
        pytest.skip(f"triton.experimental.gluon: {v4_partitions.GLUON_IMPORT_ERROR}")
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*bundles, **constexprs):
                seen.update(bundles=bundles, constexprs=constexprs)
            return launch

    monkeypatch.setattr(v4_partitions, "v4_attention_kernel", Recorder(), raising=False)
    monkeypatch.setattr(merge, "merge_splits", lambda *a, **k: None)
    fmt = get_v4_format("fp8_v4")
    n, H, page = 3, 72, 16
    pools = [fmt.new_pool(pages, page) for pages in (5, 7)]
    segs = [types.SimpleNamespace(view=pool_geometry(fmt, pool, page)[1], page_size=page, num_pages=pool.shape[0],
                                  indices=torch.zeros(n, topk + 8, dtype=torch.int32)[:, :topk],
                                  lengths=torch.full((n,), topk, dtype=torch.int32))
            for pool, topk in zip(pools, (128, 320))]
    q = torch.zeros(n, H, 1024, dtype=torch.bfloat16)[..., :512]     # strides unlike out's
    out = torch.zeros(n, H, 512, dtype=torch.bfloat16)
    lse = torch.zeros(n, H + 4)[:, :H]
    sinks = torch.zeros(H) if has_sink else None
    want_splits = 3 if split else 1
    parts = want_splits + has_sink
    part_o = torch.zeros(n * parts, H + 8, 512)
    part_lse = torch.zeros(n * parts + 2, H + 8)
    sm90_v4.v4_attention(q, out, lse, part_o, part_lse, sinks, segs[0], segs[1], fmt=sm90_v4.FORMATS["fp8_v4"],
                         sm_scale=0.25, num_splits=want_splits, lse_scale=0.5)
    names = [leaf for bundle in sass.V4_BUNDLES.values() for leaf in bundle]
    leaves = [leaf for bundle in seen["bundles"] for leaf in bundle]
    assert [len(b) for b in seen["bundles"]] == [len(b) for b in sass.V4_BUNDLES.values()]
    got = dict(zip(names, leaves))
    po, pl = (part_o, part_lse) if split else (out, lse)
    w_tiles, total = sm90_v4.tiles_of(128, 320)
    chunk, splits = sm90_v4.tile_splits(total, want_splits)
    want = dict(q=q, out=out, lse_out=lse, part_o=po, part_lse=pl, sinks=sinks if has_sink else lse,
                sm_scale_log2=0.25 * sm90_v4.LOG2E, lse_scale=0.5, H=H, chunk=chunk, num_splits=splits,
                num_parts=splits + has_sink, num_groups=2, w_tiles=w_tiles, total_tiles=total,
                stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_o_t=out.stride(0), stride_o_h=out.stride(1),
                stride_lse_t=lse.stride(0), stride_lse_h=lse.stride(1), stride_po_i=po.stride(0),
                stride_po_h=po.stride(1), stride_pl_i=pl.stride(0))
    for s, seg in zip("wc", segs):
        p8, p16, p32, stride_q = sm90_v4.pool_pointers(seg.view, sm90_v4.FORMATS["fp8_v4"])
        want.update({f"{s}8": p8, f"{s}16": p16, f"{s}32": p32, f"{s}_stride": stride_q, f"{s}_page": page,
                     f"{s}_slots": seg.num_pages * page, f"{s}_idx": seg.indices,
                     f"{s}_sidx": seg.indices.stride(0), f"{s}_topk": seg.indices.shape[1], f"{s}_len": seg.lengths})
    assert seen["constexprs"]["SPLIT"] == split and seen["constexprs"]["HAS_SINK"] == has_sink
    return got, want


@pytest.mark.parametrize("split,has_sink", [(False, True), (True, True), (True, False)])
def test_launch_bundles_are_the_kernels(monkeypatch, split, has_sink):
    """The host's tuples leaf by leaf as ``devtools.sass.V4_BUNDLES`` names them (the compile checks' signature),
    and the kernel unpacking each bundle in that order: a leaf out of place would read another value silently."""
    import ast
    import inspect
    import textwrap
    from devtools import sass
    from fp8mla.kernels.sm90 import v4_partitions
    kernel = getattr(v4_partitions, "v4_attention_kernel", None)
    got, want = _launch_leaves(monkeypatch, split, has_sink)
    assert got.keys() == want.keys()
    for name, value in want.items():
        g = got[name]
        if isinstance(value, torch.Tensor):
            assert isinstance(g, torch.Tensor) and (g.data_ptr(), g.dtype, g.shape) == \
                (value.data_ptr(), value.dtype, value.shape), name
        else:
            assert not isinstance(g, torch.Tensor) and g == value, (name, g, value)
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    unpacked = {st.value.id: [e.id for e in st.targets[0].elts] for st in ast.walk(tree)
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Name) and st.value.id in sass.V4_BUNDLES}
    assert unpacked == {k: list(v) for k, v in sass.V4_BUNDLES.items()}
