"""V4SparseAttention (torch and Triton backends) against the float64 reference: formats x heads x segment lengths
x page sizes x several query rows (MTP) x -1 padding (scattered and trailing) x per-token lengths, over pools
whose unused bytes are all NaN, outputs poisoned before the call; sinks; rows with no key; splits and their
merge; named errors for bad input. CPU: under TRITON_INTERPRET=1 (conftest.py) at small sizes."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import fp8mla
from fp8mla.formats_v4 import get_v4_format
from fp8mla.reference import v4_attention_reference
from fp8mla.testing import assert_close
from fp8mla.v4 import write_v4_pool

from conftest import BACKEND_PARAMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The sparse kernel's budget (tests/test_sparse_triton.py); the torch backend computes in fp32, rounds out.
TOL = {"triton": 5e-3 if DEVICE == "cpu" else 3e-3, "torch": 3e-3}  # bf16 out: 2^-9 rounding
LSE_TOL = 1e-4
SM_SCALE = 512 ** -0.5


@dataclass
class V4Batch:
    plan_args: dict
    run_args: dict
    ref_args: dict

    def reference(self):
        return v4_attention_reference(**self.ref_args)


def _poisoned_pool(fmt, num_pages, page_size):
    pool = fmt.new_pool(num_pages, page_size, DEVICE)
    if fmt.is_fp8:
        pool.view(torch.uint8).fill_(0xFF)  # e4m3 NaN, bf16 NaN, ue8m0 NaN: every byte not written
    else:
        pool.fill_(math.nan)
    return pool


def _segment_rows(g, n, topk, keys, num_slots, pad, with_lengths):
    """Index rows [n, topk]: row t selects keys[t] distinct written slots, -1 padded scattered or trailing; with
    lengths, the entries past the length hold slots of NaN tokens (which must not be read)."""
    written, unwritten = num_slots
    idx = torch.full((n, topk), -1, dtype=torch.int32)
    for t in range(n):
        k = keys[t]
        sel = written[torch.randperm(len(written), generator=g)[:k]]
        if pad == "scattered" and not with_lengths:
            pos = torch.randperm(topk, generator=g)[:k]
            idx[t, pos] = sel.int()
        else:
            idx[t, :k] = sel.int()
            if with_lengths and k < topk and len(unwritten):
                idx[t, k:] = unwritten[torch.randint(len(unwritten), (topk - k,), generator=g)].int()
    lengths = torch.tensor(keys, dtype=torch.int32) if with_lengths else None
    return idx, lengths


def make_batch(fmt_name, heads, window_keys, window_topk, page_size, *, compressed_keys=None, compressed_topk=0,
               compressed_page_size=8, sinks=True, pad="scattered", lengths=False, q_dtype=torch.bfloat16,
               seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = get_v4_format(fmt_name)
    n = len(window_keys)
    segs = {}
    specs = [("window", window_topk, page_size, window_keys)]
    if compressed_topk:
        specs.append(("compressed", compressed_topk, compressed_page_size, compressed_keys))
    for name, topk, ps, keys in specs:
        num_pages = -(-max(keys + [1]) * 2 // ps) + 2
        pool = _poisoned_pool(fmt, num_pages, ps)
        slots = torch.randperm(num_pages * ps, generator=g)  # shuffled pages and offsets
        written, unwritten = slots[:max(keys + [1]) + 2], slots[max(keys + [1]) + 2:]
        write_v4_pool(fmt, pool, written.to(DEVICE), (torch.randn(len(written), 512, generator=g) * 2).to(DEVICE),
                      backend="torch")
        idx, lens = _segment_rows(g, n, topk, keys, (written, unwritten), pad, lengths)
        segs[name] = (pool, idx.to(DEVICE), None if lens is None else lens.to(DEVICE), ps)
    q = (torch.randn(n, heads, 512, generator=g) * 2).to(q_dtype).to(DEVICE)
    sink = (torch.randn(heads, generator=g) * 2).to(DEVICE) if sinks else None
    w = segs["window"]
    plan = dict(num_heads=heads, sm_scale=SM_SCALE, q_data_type=q_dtype, kv_format=fmt_name, window_topk=window_topk,
                window_page_size=page_size, device=DEVICE)
    run = dict(q=q, window_pool=w[0], window_indices=w[1], window_lengths=w[2], sinks=sink)
    ref = dict(q=q, window_pool=w[0], window_indices=w[1], window_lengths=w[2], window_page_size=page_size,
               sm_scale=SM_SCALE, kv_format=fmt_name, sinks=sink)
    if compressed_topk:
        c = segs["compressed"]
        plan.update(compressed_topk=compressed_topk, compressed_page_size=compressed_page_size)
        run.update(compressed_pool=c[0], compressed_indices=c[1], compressed_lengths=c[2])
        ref.update(compressed_pool=c[0], compressed_indices=c[1], compressed_lengths=c[2],
                   compressed_page_size=compressed_page_size)
    return V4Batch(plan, run, ref)


def run_batch(batch, backend, base_e=False, **plan_extra):
    attn = fp8mla.V4SparseAttention(backend=backend)
    attn.plan(**{**batch.plan_args, **plan_extra})
    assert attn.backend == backend
    q = batch.run_args["q"]
    n, H, _ = q.shape
    out = torch.full((n, H, 512), math.nan, dtype=q.dtype, device=DEVICE)
    lse = torch.full((n, H), math.nan, device=DEVICE)
    res = attn.run(**batch.run_args, out=out, lse=lse, return_lse=True, return_lse_base_on_e=base_e)
    assert res[0] is out and res[1] is lse
    return out, lse, attn


def check(batch, backend, **plan_extra):
    out, lse, attn = run_batch(batch, backend, **plan_extra)
    ro, rl = batch.reference()
    assert_close(out, ro, TOL[backend], "out")
    assert_close(lse, rl, LSE_TOL, "lse")
    return out, lse, attn


# (format, heads, window keys per row, window topk, page size, compressed keys per row, compressed topk, pad,
#  lengths, sinks): decode rows, MTP rows (several rows of one request share the pool), a sliding-only layer.
GRID = [
    ("fp8_v4", 8, [40, 3, 64], 64, 16, [20, 0, 7], 24, "scattered", False, True),
    ("fp8_v4", 16, [128, 100], 128, 64, [50, 64], 64, "trailing", True, True),
    ("fp8_v4", 128, [10], 16, 1, None, 0, "trailing", False, True),
    ("fp8_v41", 8, [33, 1, 17, 64], 64, 16, [5, 40, 0, 12], 40, "scattered", False, False),
    ("fp8_v41", 24, [50, 7], 50, 4, [30, 3], 32, "trailing", True, True),
    ("bf16", 16, [20, 0, 9], 32, 8, None, 0, "scattered", False, True),
    ("bf16", 8, [31], 31, 16, [13], 17, "trailing", True, False),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-h{c[1]}-w{c[3]}-c{c[6]}-p{c[4]}")
def test_grid_against_float64(backend, case):
    fmt, heads, wk, wt, ps, ck, ct, pad, lengths, sinks = case
    b = make_batch(fmt, heads, wk, wt, ps, compressed_keys=ck, compressed_topk=ct, pad=pad, lengths=lengths,
                   sinks=sinks, seed=len(wk) + heads)
    check(b, backend)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fp16_queries_and_base_e(backend):
    b = make_batch("fp8_v4", 8, [30, 12], 32, 16, compressed_keys=[8, 16], compressed_topk=16,
                   q_dtype=torch.float16, seed=5)
    out, lse, _ = run_batch(b, backend, base_e=True)
    ro, rl = b.reference()
    assert_close(out, ro, TOL[backend], "out")
    assert_close(lse, rl * math.log(2), LSE_TOL, "lse")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_splits_merge_with_sinks(backend):
    """A row split over several programs, the sink as one more partial: the same answer as one program."""
    b = make_batch("fp8_v41", 16, [100, 2, 0], 128, 16, compressed_keys=[60, 0, 0], compressed_topk=64, seed=7)
    out1, lse1, a1 = check(b, backend, num_splits=1)
    out3, lse3, a3 = check(b, backend, num_splits=3)
    if backend == "triton":
        assert a3.splits_for(3) == 3
        again, _, _ = run_batch(b, backend, num_splits=3)
        assert torch.equal(again, out3)  # deterministic merge


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("splits", [1, 2])
def test_rows_without_keys(backend, splits):
    """No valid key: out 0 and lse -inf; with a sink: out 0 and lse = the sink (base 2 here: sink x log2 e)."""
    for sinks in (False, True):
        b = make_batch("fp8_v4", 8, [0, 5], 64, 16, compressed_keys=[0, 0], compressed_topk=64, sinks=sinks,
                       seed=9)
        out, lse, _ = run_batch(b, backend, num_splits=splits)
        assert (out[0] == 0).all()
        want = b.run_args["sinks"] * (1 / math.log(2)) if sinks else torch.full((8,), -math.inf, device=DEVICE)
        assert torch.allclose(lse[0], want.float(), rtol=1e-6) if sinks else torch.equal(lse[0], want)
        assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_out_of_pool_entries_are_skipped_and_checked(backend, monkeypatch):
    b = make_batch("fp8_v4", 8, [10, 4], 16, 16, seed=11, sinks=False)
    idx = b.run_args["window_indices"]
    num_slots = b.run_args["window_pool"].shape[0] * 16
    ref_o, _ = b.reference()
    bad = idx.clone()
    bad[0, 15] = num_slots + 3  # outside the pool: skipped like -1
    bad[1, 15] = -7
    b.run_args["window_indices"] = bad
    out, _, _ = run_batch(b, backend)
    assert_close(out, ref_o, TOL[backend], "out")
    monkeypatch.setenv("FP8MLA_CHECK", "1")
    with pytest.raises(ValueError, match=r"window_indices: expected slots in \[0, \d+\) or -1"):
        run_batch(b, backend)


def _planned(backend="torch", **extra):
    attn = fp8mla.V4SparseAttention(backend=backend)
    args = dict(num_heads=8, sm_scale=SM_SCALE, q_data_type=torch.bfloat16, kv_format="fp8_v4", window_topk=16,
                window_page_size=16, compressed_topk=8, device=DEVICE)
    attn.plan(**{**args, **extra})
    return attn


def test_bad_input_is_named(monkeypatch):
    b = make_batch("fp8_v4", 8, [10], 16, 16, compressed_keys=[3], compressed_topk=8, seed=13)
    attn = _planned(compressed_page_size=8)
    r = dict(b.run_args)
    with pytest.raises(ValueError, match="sinks: expected shape"):
        attn.run(**{**r, "sinks": torch.zeros(9, device=DEVICE)})
    with pytest.raises(TypeError, match="sinks.dtype"):
        attn.run(**{**r, "sinks": torch.zeros(8, dtype=torch.float64, device=DEVICE)})
    wrong = torch.zeros(4, 16, 656, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="window_pool: format 'fp8_v4' has 584-byte records, got a record width"):
        attn.run(**{**r, "window_pool": wrong})
    with pytest.raises(ValueError, match=r"compressed_indices: expected shape \[1, 8\]"):
        attn.run(**{**r, "compressed_indices": torch.zeros(1, 9, dtype=torch.int32, device=DEVICE)})
    monkeypatch.setenv("FP8MLA_CHECK", "1")
    with pytest.raises(ValueError, match=r"window_lengths: expected lengths in \[0, 16\]"):
        attn.run(**{**r, "window_lengths": torch.tensor([17], dtype=torch.int32, device=DEVICE)})


def test_plan_errors_are_named():
    with pytest.raises(ValueError, match="num_heads: expected 1 to 128"):
        _planned(num_heads=129)
    with pytest.raises(ValueError, match="kv_format"):
        _planned(kv_format="fp8_ds_mla")
    attn = _planned(compressed_topk=0)
    b = make_batch("fp8_v4", 8, [10], 16, 16, compressed_keys=[3], compressed_topk=8, seed=13)
    with pytest.raises(ValueError, match="compressed_pool: the plan has no compressed rows"):
        attn.run(**b.run_args)
    with pytest.raises(ValueError, match="compressed_pool: the plan has compressed rows"):
        _planned(compressed_page_size=8).run(b.run_args["q"], b.run_args["window_pool"],
                                             b.run_args["window_indices"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_nan_in_a_selected_key_reaches_only_its_row(backend):
    b = make_batch("bf16", 8, [6, 6], 8, 16, sinks=True, seed=17)
    pool, idx = b.run_args["window_pool"], b.run_args["window_indices"]
    s = int(idx[0][idx[0] >= 0][0])
    pool[s // 16, s % 16, 7] = math.nan
    out, lse, _ = run_batch(b, backend)
    shared = set(idx[0].tolist()) & set(idx[1].tolist()) - {-1}
    assert torch.isnan(out[0]).all()
    if s not in shared:
        assert torch.isfinite(out[1]).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    """plan once, run captured in a CUDA graph: no sync, no allocation in run() when out / lse are given."""
    from fp8mla.testing import capture_then_replay
    b = make_batch("fp8_v4", 64, [128, 60, 3], 128, 64, compressed_keys=[500, 0, 40], compressed_topk=512, seed=19)
    attn = fp8mla.V4SparseAttention(backend="triton")
    attn.plan(**b.plan_args)
    q = b.run_args["q"]
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    lse = torch.empty(q.shape[:2], device=DEVICE)
    capture_then_replay(lambda: attn.run(**b.run_args, out=out, lse=lse), out)
    ro, rl = b.reference()
    assert_close(out, ro, TOL["triton"], "out")
