"""Per-token group scales (format fp8_e4m3_group) in the Gluon sm_90 decode kernel (``GROUP``).

CPU: the group builds compile for sm_90a with the kernel's MMA counts and one more TMA box (or cp.async) per page
for the scales; the launch, plan and run checks (the scale array's layout, shared memory, the options
the group kernel does not take). GPU (an sm_90 device with Gluon): float64 checks through MLAPagedAttention over
NaN-poisoned pools (NaN scales in unused slots too), pages 1/16/64, 16/32/128 heads, scales spread over e^+-8
within a tile, many splits with bit-identical reruns, multi-token decode, routing, CUDA-graph replay.
"""
from __future__ import annotations

import pytest
import torch

import fp8mla
from conftest import compile_report_in_child
from test_decode_sm90 import check, run_case
from fp8mla.kernels import sm90 as k, split
from fp8mla.kernels.sm90 import config as sm90_config, kernel as sm90_kernel
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")
DEVICE = "cuda" if ON_SM90 else "cpu"
needs_gluon = pytest.mark.usefixtures("sm90_compile_tools")


# -- CPU --------------------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("page,heads", [(64, 16), (16, 16), (64, 128), (1, 16)])
def test_group_build_compiles_with_the_scale_copies(page, heads):
    r, sass = compile_report_in_child(page=page, ns=3, heads=heads, group=True)
    assert not r["serialized_wgmma"], r["ptxas"]
    assert sum(n for op, n in r["ops"].items() if op.startswith("HGMMA")) == 136, r["ops"]   # 2 x (36 QK + 32 PV)
    assert all(x["LDS.U8"] == 0 for x in r["loops"]), r["loops"]
    assert r["smem"] <= k.SMEM_LIMIT
    base, base_sass = compile_report_in_child(page=page, ns=3, heads=heads)
    if page == 1:   # one more cp.async per row and tile (the row's 16 bytes of scales)
        assert sass.count("LDGSTS") > base_sass.count("LDGSTS"), (sass.count("LDGSTS"), base_sass.count("LDGSTS"))
    else:           # one more TMA box per page: 5 -> 6 per row box
        rows_boxes = 64 // page if page < 64 else 1
        assert sass.count("UTMALDG") - base_sass.count("UTMALDG") == rows_boxes, (sass.count("UTMALDG"),
                                                                                   base_sass.count("UTMALDG"))
    # triton 3.6 (the H200's): H16 696 B of spill (18 reloads per tile per consumer), H32 596 B, H128 (16 heads per
    # consumer, 4 head-group CTAs) 544 B: the default kernel's consumers already use ~237 of their 240 registers. A
    # bound, so that a blow-up (32 heads per consumer: 1.4 KB, or serialized wgmma) is seen.
    assert sum(st for st, _ in r["spills"]) <= 1024, r["spills"]


def test_group_smem_fits_three_stages():
    for hpw, wide in ((16, False), (16, True)):
        assert k.smem_bytes(3, hpw, wide, group=True) <= k.SMEM_LIMIT
    assert k.smem_bytes(4, 16, True, group=True) <= k.SMEM_LIMIT < k.smem_bytes(4, 16, False, group=True)


def test_scale_rows_ok():
    a = torch.rand(10, 64, 4)
    assert k.scale_rows_ok(a)
    assert k.scale_rows_ok(torch.rand(10, 64, 8)[..., :4])          # 32-byte rows of one pool: fine for TMA
    assert not k.scale_rows_ok(torch.rand(10, 64, 5)[..., :4])      # 20-byte rows: not 16-byte aligned
    assert not k.scale_rows_ok(torch.rand(10, 70, 4)[:, :64])       # pages not adjacent rows of one pool
    assert not k.scale_rows_ok(a.double())
    assert not k.scale_rows_ok(torch.rand(4, 10, 64).permute(1, 2, 0))
    assert not k.scale_rows_ok(torch.rand(10, 64, 2))


def _launch_args(H=16, page=64):
    from types import SimpleNamespace
    q = torch.zeros(1, H, 512)
    desc = SimpleNamespace(base=None, strides=(576, 1), shape=(64, 512))
    t = {n: torch.zeros(2, dtype=torch.int32) for n in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len", "cta_ptr",
                                                        "item_req", "item_t0", "item_t1")}
    t.update(part_o=torch.empty(1, k.padded_heads(H), 512), part_lse=torch.empty(1, k.padded_heads(H)))
    sdesc = SimpleNamespace(base=None, strides=(4, 1), block_shape=[min(64, page), 4])
    return (desc, desc, q, q, None, t, q, torch.zeros(1, H)), dict(
        grid=132 * k.head_config(H)[1], grid_batch=1, max_rows=H, num_heads=H, sm_scale=0.1), sdesc


def _build(group=True, H=16, page=64, **kw):
    import dataclasses
    return dataclasses.replace(k.Sm90Build.for_plan(H, page, group=group, stages=2), **kw)


@pytest.mark.parametrize("bad,match", [(dict(fp8_math=True), "fp8_math"), (dict(stages=4), "shared"),
                                       (dict(box=[32, 4]), "boxes"), (dict(group=False), "scale_desc")])
def test_launch_refuses_what_the_group_kernel_does_not_take(monkeypatch, bad, match):
    monkeypatch.setattr(sm90_kernel, "mla_decode_sm90_kernel", None)   # never reached
    a, kw, sdesc = _launch_args()
    if "box" in bad:
        sdesc.block_shape = bad.pop("box")
    with pytest.raises(ValueError, match=match):
        k.launch(_build(**bad), *a, **kw, scale_desc=sdesc)
    with pytest.raises(ValueError, match="scale_desc"):   # a group build without its scales
        k.launch(_build(), *a, **kw)


def test_launch_passes_the_group_keywords_only_with_scales(monkeypatch):
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    monkeypatch.setattr(sm90_kernel, "mla_decode_sm90_kernel", Recorder())
    monkeypatch.setattr(sm90_kernel, "launch_merge", lambda *a, **kw: None)
    a, kw, sdesc = _launch_args()
    k.launch(_build(group=False), *a, **kw)
    k.launch(_build(), *a, **kw, scale_desc=sdesc)
    group = sm90_config.DECODE_CONSTEXPRS.index("GROUP")
    assert seen[0]["sc_desc"] is None and seen[0]["sc_rows"] is None and seen[0]["BUILD"][group] is False
    assert seen[1]["sc_desc"] is sdesc and seen[1]["sc_rows"] == (sdesc.base, 4) and seen[1]["BUILD"][group] is True


def _spec_layout(fmt_name, page=64, H=16):
    from fp8mla.backends import AttentionSpec
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    spec = AttentionSpec(H, 512, 64, page, True, 192 ** -0.5, torch.bfloat16, get_format(fmt_name),
                         torch.device("cpu"))
    lay = PagedLayout.from_block_table(torch.arange(130 // page + 1, dtype=torch.int32)[None],
                                       torch.tensor([130], dtype=torch.int32), page)
    return spec, lay


def test_group_build_has_16_rows_per_consumer():
    """The group build's variant: 16 heads per consumer at any H (ceil(H / 32) head-group CTAs), so its partial
    rows never exceed the per-tensor variant's (a CUDA-graph wrapper sizes them once, from its first plan)."""
    for H in (8, 16, 17, 32, 33, 40, 64, 72, 100, 128):
        hpw, nhg, wide = k.row_config(H, 1, k.GROUP_MAX_HPW)
        assert hpw == 16 and nhg == max(1, -(-H // 32)) and wide == (H > 16)
        assert k.padded_heads(H, 1, k.GROUP_MAX_HPW) <= k.padded_heads(H)
    for H, qo in ((16, 3), (128, 4), (64, 8)):
        hpw, nhg, _ = k.row_config(H, qo, k.GROUP_MAX_HPW)
        assert hpw == 16 and nhg == -(-H * qo // 32)
        assert k.padded_heads(H, qo, k.GROUP_MAX_HPW) <= k.padded_heads(H, qo)


def test_group_plan_run_refuses_scales_it_cannot_read():
    """A group plan names ckv_scale_arr when it is missing or not TMA-readable; a per-tensor plan never ignores
    group scales given to it."""
    from fp8mla.backends import gluon as gb
    spec, _ = _spec_layout("fp8_e4m3_group")
    plan = gb.GluonPlan(spec, 132, 1, 32, 128, {}, k.Sm90Build.for_plan(16, 64, group=True))
    args = [torch.zeros(1, 16, 512), torch.zeros(1, 16, 64), None, None, None]
    with pytest.raises(ValueError, match="ckv_scale_arr.*got None"):
        plan.run(*args, None, None, None, False)
    with pytest.raises(ValueError, match="ckv_scale_arr.*16-byte"):
        plan.run(*args, torch.rand(4, 64, 5)[..., :4], None, None, False)
    plain = gb.GluonPlan(spec, 132, 1, 32, 128, {}, k.Sm90Build.for_plan(16, 64))
    with pytest.raises(ValueError, match="ckv_scale_arr.*per-tensor"):
        plain.run(*args, torch.rand(4, 64, 4), None, None, False)


def test_graph_wrapper_run_with_group_scales_replans_its_group_plan():
    """FlashInfer's way (an e4m3 plan, ckv_scale_arr at run) on a CUDA-graph wrapper: once run with group scales,
    every plan() builds the group plan too (a captured run replays its kernels and calls no run()); a wrapper never
    run with them builds none, and neither does one without CUDA graphs (its run() builds it when needed)."""
    b = make_paged_batch([100, 65], [1, 1], 16, 64, "fp8_e4m3_group", seed=1)
    plain = dict(b.plan_args, kv_data_type=torch.float8_e4m3fn)
    for graph in (True, False):
        attn = fp8mla.MLAPagedAttention(use_cuda_graph=graph, backend="torch")
        attn.plan(**plain)
        attn.plan(**plain)
        assert attn._plan.group_impl is None
        out = attn.run(**b.run_args)
        assert attn._plan.group_impl is not None
        attn.plan(**dict(plain, kv_len_arr=torch.tensor([90, 1], dtype=torch.int32)))
        assert (attn._plan.group_impl is not None) == graph
        assert_close(out, b.reference()[0], 3e-3)


@pytest.mark.parametrize("lens,aligned", [([100, 3000, 0, 65], False), ([4096, 4096], True)])
def test_device_schedule_empties_the_slots_past_it(lens, aligned):
    """tile_items_device into larger buffers (a CUDA-graph wrapper's, shared by a per-tensor and a group plan whose
    grids differ): every slot past the schedule is an empty range (cta_ptr repeats the item count), so a kernel
    launched with more slots reads no stale items there; for either cut (contiguous, request-aligned)."""
    kv = torch.tensor(lens, dtype=torch.int32)
    assert (split.aligned_pieces([-(-x // 64) for x in lens], 8, 4) is not None) == aligned
    out = {n: torch.full((40,), -7, dtype=torch.int32) for n in
           ("cta_ptr", "item_req", "item_t0", "item_t1", "m_ptr", "m_list")}
    split.tile_items_device(kv, 8, 4, out=out)
    ptr = out["cta_ptr"]
    n_items = int(out["m_ptr"][len(lens)])
    assert n_items > 0 and int(ptr[8]) == n_items and (ptr[9:] == n_items).all(), ptr
    assert (ptr[1:] >= ptr[:-1]).all()


# -- GPU --------------------------------------------------------------------------------------------------------
def _spread(batch, seed, spread=8.0):
    """Multiply every used token's group scales by e^U(-spread, spread) in place (the reference reads them too):
    tiles whose tokens' scales differ by up to e^16, the P normalization's case."""
    sa = batch.run_args["ckv_scale_arr"]
    g = torch.Generator(device=sa.device).manual_seed(seed)
    sa.mul_(torch.exp((torch.rand(sa.shape, device=sa.device, generator=g) * 2 - 1) * spread))


@gpu
@pytest.mark.parametrize("H", [1, 16, 32, 40, 128])
@pytest.mark.parametrize("page", [1, 16, 32, 64, 128])
def test_group_odd_lengths_nan_pools(H, page):
    lens = [0, 1, 63, 65, 97, 514, 3000] if page > 1 else [0, 1, 63, 65, 700]
    b = make_paged_batch(lens, [1] * len(lens), H, page, "fp8_e4m3_group", device=DEVICE, seed=H + page,
                         extra_pages=1 if page > 1 else 0)
    attn, out, lse = run_case(b)
    assert type(attn._plan.impl).__name__ == "GluonPlan" and attn._plan.impl.group
    check(b, out, lse)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


@gpu
@pytest.mark.parametrize("H", [16, 128])
def test_group_scales_spread_within_tiles(H):
    b = make_paged_batch([777, 65, 2500], [1] * 3, H, 64, "fp8_e4m3_group", device=DEVICE, seed=5, kpe_scale=3.0,
                         value_scale=2.0)
    _spread(b, seed=H)
    check(b, *run_case(b)[1:], lse_tol=2e-4)


@gpu
def test_group_fp16_queries_and_four_stages_asked():
    """fp16 queries with k_pe scaled; num_stages=4 (fits per-tensor at 16 heads, not with the group tiles) is
    lowered to what fits (3: an odd depth has per-consumer ready barriers, kernels/sm90/ring.py), instead of failing the
    plan."""
    b = make_paged_batch([777, 65, 2500], [1] * 3, 16, 64, "fp8_e4m3_group", q_dtype=torch.float16, device=DEVICE,
                         seed=6, kpe_scale=7.0, value_scale=3.0)
    attn, out, lse = run_case(b, num_stages=4)
    assert attn._plan.impl.ns == 3
    check(b, out, lse, lse_tol=2e-4)


@gpu
@pytest.mark.parametrize("min_chunk", [64, 4096])
def test_group_many_splits_and_bit_identical_reruns(min_chunk):
    b = make_paged_batch([20000, 1, 4097], [1] * 3, 16, 64, "fp8_e4m3_group", device=DEVICE, seed=7)
    attn, out, lse = run_case(b, min_chunk=min_chunk)
    check(b, out, lse)
    o2, l2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attn.run(**b.run_args, out=o2, lse=l2, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)


@gpu
def test_group_multi_token_decode():
    """qo_len 1..2 at 16 heads (32 rows), causal; kv_len 1 < qo_len 2 for the last request."""
    b = make_paged_batch([300, 65, 1000, 1], [2, 1, 2, 2], 16, 64, "fp8_e4m3_group", device=DEVICE, seed=11)
    check(b, *run_case(b)[1:])


@gpu
def test_group_routing_and_a_plain_e4m3_plan_with_group_scales(monkeypatch):
    """auto: the Gluon kernel; backend="triton" (the escape hatch): the Triton kernel, the same answer; FlashInfer's
    way (an e4m3 plan given ckv_scale_arr at run) builds the group plan on first use, on the same kernel."""
    b = make_paged_batch([500, 70], [1, 1], 16, 64, "fp8_e4m3_group", device=DEVICE, seed=3)
    outs = {}
    for backend in ("auto", "triton"):
        attn, outs[backend], lse = run_case(b, backend=backend)
        assert type(attn._plan.impl).__name__ == ("GluonPlan" if backend == "auto" else "TritonPlan")
        check(b, outs[backend], lse)
    attn = fp8mla.MLAPagedAttention(backend="auto")
    attn.plan(**dict(b.plan_args, kv_data_type=torch.float8_e4m3fn))
    out = attn.run(**b.run_args)
    assert type(attn._plan.group_impl).__name__ == "GluonPlan"
    assert torch.equal(out, outs["auto"])


@gpu
@pytest.mark.parametrize("H,qo", [(16, 3), (128, 2)])
def test_group_wide_multi_token_decode(H, qo):
    """Multi-token rows past 32 (48 and 256): 16 per consumer, 2 and 8 row-group CTAs per schedule slot."""
    b = make_paged_batch([300, 65, 1000], [qo, 1, qo], H, 64, "fp8_e4m3_group", device=DEVICE, seed=H + qo)
    attn, out, lse = run_case(b)
    assert type(attn._plan.impl).__name__ == "GluonPlan"
    check(b, out, lse)


@gpu
def test_group_refuses_a_scale_array_tma_cannot_read():
    b = make_paged_batch([100], [1], 16, 64, "fp8_e4m3_group", device=DEVICE, seed=2)
    sa = b.run_args["ckv_scale_arr"]
    wide = torch.zeros(*sa.shape[:2], 5, device=DEVICE)
    wide[..., :4] = sa
    attn = fp8mla.MLAPagedAttention(backend="gluon")
    attn.plan(**b.plan_args)
    with pytest.raises(ValueError, match="ckv_scale_arr"):
        attn.run(**dict(b.run_args, ckv_scale_arr=wide[..., :4]))


def _replan_and_replay(attn, plan_args, run_args, graph, out):
    """Re-plan other lengths and page lists over the same pool (3 requests: 2900, 5, 0 tokens), replay ``graph``
    over a poisoned ``out`` and compare with float64 on the group scales."""
    from fp8mla.reference import mla_reference
    a = dict(plan_args)
    pages = a["kv_indices"]
    a.update(kv_len_arr=torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEVICE),
             kv_indptr=torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEVICE),
             kv_indices=torch.cat([pages[3:49]] + [pages[:1]]))
    attn.plan(**a)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    r = run_args
    ref, _ = mla_reference(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                           a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True,
                           kpe_scale=r["kpe_scale"], ckv_scale_arr=r["ckv_scale_arr"])
    assert_close(out, ref, 3e-3, "replay after re-plan")


@gpu
def test_group_cuda_graph_capture_then_replan():
    """Capture run() with group scales, re-plan other lengths and page lists over the same pool, replay."""
    b = make_paged_batch([100, 3000, 17], [1, 1, 1], 16, 64, "fp8_e4m3_group", device=DEVICE, seed=21, spare_pages=60)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    attn.plan(**b.plan_args)
    r = b.run_args
    out, lse = torch.empty_like(r["q_nope"]), torch.empty(3, 16, device=DEVICE)
    g = capture_then_replay(lambda: attn.run(**r, out=out, lse=lse), out)
    check(b, out, lse)
    _replan_and_replay(attn, b.plan_args, r, g, out)


@gpu
@pytest.mark.parametrize("backend,H", [("auto", 16), ("auto", 40), ("auto", 128), ("triton", 40)])
def test_group_scales_flashinfer_way_in_a_cuda_graph(backend, H):
    """An e4m3 CUDA-graph wrapper run with ckv_scale_arr (the group plan built on that first run: gluon under auto,
    where at H > 32 it has fewer schedule slots than the per-tensor plan; triton when asked), captured, re-planned
    with other lengths and page lists, replayed: the replay computes the new plan."""
    b = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 64, "fp8_e4m3_group", device=DEVICE, seed=H, spare_pages=60)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend=backend, max_batch_size=8)
    plain = dict(b.plan_args, kv_data_type=torch.float8_e4m3fn)
    attn.plan(**plain)
    r = b.run_args
    out = torch.empty_like(r["q_nope"])
    g = capture_then_replay(lambda: attn.run(**r, out=out), out)
    check(b, out, attn.run(**r, return_lse=True)[1])
    want = "GluonPlan" if backend == "auto" else "TritonPlan"
    assert type(attn._plan.group_impl).__name__ == want
    _replan_and_replay(attn, plain, r, g, out)
