"""The Hopper Gluon V4 build (backend="gluon", kernels/sm90/v4.py + v4_partitions.py) against the float64 reference
on an sm_90 GPU (skipped elsewhere; CI compiles it in tests/test_compile_v4_gluon.py): formats fp8_v4 / fp8_v41 /
bf16, heads 8 / 16 / 64 / 128 (one or two 64-row groups), window and compressed segments of V4's sizes and odd
ones (the last tile of a segment masked per entry), sliding-only layers, page sizes 1..64, -1 padding (scattered,
trailing), per-token lengths with NaN slots past them, rows with no key (with and without a sink), out-of-pool
and other negative entries, pools whose unused bytes are all NaN, outputs poisoned with NaN, the one-wave splits
and fixed split counts with their merge (the sink as a partial), no split, a rerun bit-identical, a CUDA-graph
replay, lse in base e, and backend="auto" picking this build for bf16 queries only."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.runtime import gluon_usable
from fp8mla.testing import assert_close, capture_then_replay

from test_v4_attention import make_batch, run_batch

ON_SM90 = torch.cuda.is_available() and gluon_usable(torch.device("cuda"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with Gluon")]
TOL, LSE_TOL = 3e-3, 1e-4   # tests/test_v4_attention.py's GPU budget (bf16 K, V and P; bf16 out)

# (format, heads, window keys per row, window topk, page size, compressed keys per row, compressed topk, pad,
#  lengths, sinks). V4-Flash: window 128, compressed topk 512; V4-Pro 128 heads; odd topks mask their last tile.
GRID = [
    ("fp8_v4", 8, [128, 3, 100, 0], 128, 64, [512, 20, 0, 0], 512, "scattered", False, True),
    ("fp8_v4", 16, [128, 77], 128, 1, [300, 512], 512, "trailing", True, True),
    ("fp8_v4", 64, [100, 128, 5], 128, 16, [1000, 2048, 17], 2048, "scattered", False, False),
    ("fp8_v4", 128, [128, 64, 0], 128, 64, None, 0, "trailing", True, True),
    ("fp8_v4", 128, [37, 2], 37, 2, [129, 0], 129, "scattered", True, False),
    ("fp8_v41", 64, [128, 50], 128, 64, [512, 400], 512, "trailing", True, True),
    ("fp8_v41", 8, [20, 1, 64], 64, 16, [5, 40, 0], 40, "scattered", False, False),
    ("fp8_v41", 128, [128], 128, 32, [1024], 1024, "scattered", False, True),
    ("bf16", 16, [128, 9], 128, 64, [256, 100], 256, "scattered", False, True),
    ("bf16", 128, [31, 0], 31, 16, [13, 0], 17, "trailing", True, False),
]


def _batch(case, seed):
    fmt, heads, wk, wt, ps, ck, ct, pad, lengths, sinks = case
    return make_batch(fmt, heads, wk, wt, ps, compressed_keys=ck, compressed_topk=ct, pad=pad, lengths=lengths,
                      sinks=sinks, seed=seed)


def _check(batch, base_e=False, **plan_extra):
    out, lse, attn = run_batch(batch, "gluon", base_e=base_e, **plan_extra)
    ro, rl = batch.reference()
    assert_close(out, ro, TOL, "out")
    assert_close(lse, rl * (math.log(2) if base_e else 1.0), LSE_TOL, "lse")
    return out, lse, attn


def _empty_rows_checked(batch, out, lse):
    """Rows with no key: out 0; lse -inf without a sink, the sink (base 2) with one."""
    r = batch.run_args
    n = r["q"].shape[0]
    for t in range(n):
        keys = int((r["window_indices"][t] >= 0).sum())
        if r["window_lengths"] is not None:
            keys = min(keys, int(r["window_lengths"][t]))
        if r.get("compressed_indices") is not None:
            c = int((r["compressed_indices"][t] >= 0).sum())
            if r["compressed_lengths"] is not None:
                c = min(c, int(r["compressed_lengths"][t]))
            keys += c
        if keys == 0:
            assert bool((out[t] == 0).all()), f"row {t}: no key, out not 0"
            want = (r["sinks"] * math.log2(math.e)) if r["sinks"] is not None else \
                torch.full_like(lse[t], -math.inf)
            assert torch.allclose(lse[t], want), f"row {t}: lse {lse[t]} want {want}"


@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-h{c[1]}-w{c[3]}-c{c[6]}-p{c[4]}")
def test_gluon_v4_matches_reference(case, splits):
    b = _batch(case, seed=case[1] + case[3] + case[6] + (splits or 0))
    out, lse, attn = _check(b, num_splits=splits)
    if splits == 1:
        assert attn.splits_for(out.shape[0]) == 1
    _empty_rows_checked(b, out, lse)


@pytest.mark.parametrize("splits", [2, 3, 7, 40])
def test_gluon_v4_fixed_splits_merge_with_sink(splits):
    b = _batch(("fp8_v4", 64, [128, 100, 0], 128, 16, [512, 300, 0], 512, "scattered", False, True), seed=splits)
    out, lse, attn = _check(b, num_splits=splits)
    tiles = 2 + 8
    chunk = -(-tiles // splits)
    assert attn.splits_for(3) == -(-tiles // chunk)
    _empty_rows_checked(b, out, lse)


def test_gluon_v4_out_of_pool_entries_are_skipped():
    b = _batch(("fp8_v4", 16, [100, 60], 128, 16, [200, 30], 256, "trailing", False, True), seed=5)
    r = b.run_args
    num_slots = r["window_pool"].shape[0] * 16
    r["window_indices"][0, 110] = num_slots + 5   # past the pool: skipped like -1 (the reference too)
    r["window_indices"][1, 127] = -7              # another negative id
    r["compressed_indices"][0, 250] = 1 << 30
    _check(b)


def test_gluon_v4_rerun_bit_identical_and_graph_replay():
    b = _batch(("fp8_v4", 128, [128, 128, 40], 128, 64, [512, 100, 512], 512, "scattered", False, True), seed=11)
    out, lse, attn = _check(b, base_e=True)
    r = b.run_args
    o2, l2 = torch.full_like(out, math.nan), torch.full_like(lse, math.nan)
    attn.run(**r, out=o2, lse=l2, return_lse_base_on_e=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    capture_then_replay(lambda: attn.run(**r, out=o2), o2)
    assert torch.equal(out, o2), "graph replay differs from the plain launch"


def test_gluon_v4_auto_picks_gluon_for_bf16_only():
    b = _batch(("fp8_v4", 16, [64], 128, 64, [64], 64, "trailing", False, True), seed=2)
    attn = fp8mla.V4SparseAttention()
    attn.plan(**b.plan_args)
    assert attn.backend == "gluon"
    attn.plan(**{**b.plan_args, "q_data_type": torch.float16})
    assert attn.backend == "triton"
    with pytest.raises(ValueError, match="q_data_type"):
        fp8mla.V4SparseAttention(backend="gluon").plan(**{**b.plan_args, "q_data_type": torch.float16})
