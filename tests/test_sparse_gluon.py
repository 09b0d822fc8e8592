"""The Hopper Gluon sparse build (backend="gluon", kernels/sm90/sparse.py + sparse_partitions.py) against the float64
reference on an sm_90 GPU (skipped elsewhere; CI compiles it in tests/test_compile_sparse_gluon.py): heads 8..128
(padded to 64-row groups), topk 2048 and odd ones (37, 129, 1000: the last tile masked per entry), the one-wave
splits and fixed split counts with their merge, shuffled pages with NaN in every unused record, -1 padding
(scattered, trailing), an all -1 row, out-of-pool and other negative entries, outputs poisoned with NaN, a rerun
bit-identical, a CUDA-graph replay, lse in base e, and backend="auto" picking this build."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.runtime import gluon_usable
from fp8mla.testing import assert_close, capture_then_replay, make_sparse_batch

ON_SM90 = torch.cuda.is_available() and gluon_usable(torch.device("cuda"))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with Gluon")]
TOL, LSE_TOL = 3e-3, 1e-4   # tests/test_sparse_triton.py's GPU budget


def _batch(heads, topk, B, pad, seed):
    b = make_sparse_batch([topk + 37] * B, [1] * B, heads, topk, 64, "fp8_ds_mla", pad=pad, seed=seed,
                          device="cuda")
    r = b.run_args
    if B > 2:
        idx = r["indices"]
        num_slots = r["kv_cache"].shape[0] * 64
        idx[B - 1] = -1                                        # no token: out 0, lse -inf
        ok0 = (idx[0] >= 0).nonzero()
        idx[0, int(ok0[0]) if len(ok0) else 0] = num_slots + 5   # out of the pool: skipped like -1
        idx[0, -1] = -7                                        # another negative id: skipped
    return b


def _check(heads, topk, B, pad="scattered", seed=0, base_e=False, backend="gluon", **plan_kw):
    b = _batch(heads, topk, B, pad, seed)
    r = b.run_args
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(**b.plan_args, **plan_kw)
    assert attn.backend == "gluon"
    out = torch.full((B, heads, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, heads), math.nan, device="cuda")
    attn.run(**r, out=out, lse=lse, return_lse_base_on_e=base_e)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l * (math.log(2) if base_e else 1.0), LSE_TOL, "lse")
    if B > 2:
        assert bool((out[B - 1] == 0).all()) and bool((lse[B - 1] == -math.inf).all())
    return attn, r, out, lse, ref_o


@pytest.mark.parametrize("heads,topk,B,pad", [(16, 2048, 1, "scattered"), (128, 2048, 8, "trailing"),
                                              (8, 128, 64, "trailing"), (64, 1000, 3, "scattered"),
                                              (16, 37, 5, "trailing"), (128, 129, 3, "scattered"),
                                              (16, 2048, 64, "scattered"), (128, 2048, 16, "trailing")])
def test_gluon_sparse_matches_reference(heads, topk, B, pad):
    _check(heads, topk, B, pad, seed=heads + topk + B)


@pytest.mark.parametrize("heads,topk,B,splits", [(8, 2048, 3, 1), (16, 2048, 4, 3), (16, 1000, 3, 2),
                                                 (64, 2048, 3, 7), (128, 129, 3, 3)])
def test_gluon_sparse_fixed_splits(heads, topk, B, splits):
    attn, *_ = _check(heads, topk, B, "scattered", seed=7 * splits + heads, num_splits=splits)
    assert attn.splits_for(B) == min(splits, -(-topk // 64))


def test_gluon_sparse_rerun_is_bit_identical():
    attn, r, out, lse, _ = _check(128, 2048, 4, seed=3)
    o2, l2 = torch.full_like(out, math.nan), torch.full_like(lse, math.nan)
    attn.run(**r, out=o2, lse=l2)
    assert torch.equal(out, o2) and torch.equal(lse.nan_to_num(), l2.nan_to_num())


def test_gluon_sparse_graph_replay_and_base_e():
    attn, r, out, _, ref_o = _check(64, 2048, 4, base_e=True)
    capture_then_replay(lambda: attn.run(**r, out=out), out)
    assert_close(out, ref_o, TOL, "out after graph replay")


def test_auto_picks_the_gluon_build_here():
    _check(16, 2048, 4, backend="auto", seed=11)
