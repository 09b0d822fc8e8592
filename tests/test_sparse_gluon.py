"""The Hopper Gluon sparse kernel (backend="gluon", kernels/sm90/sparse.py) against the float64 reference on an sm_90
GPU (skipped elsewhere; CI compiles it in tests/test_compile_sparse_gluon.py): each gather, heads 8..128 (padded to
64-row groups), topk 128 / 2048 with splits and their merge, -1 padding, NaN in unused slots, an empty row, an
out-of-pool entry, poisoned outputs, a CUDA-graph replay, lse in base e."""
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


def _check(heads, topk, B, gather, pad="scattered", seed=0, base_e=False):
    b = make_sparse_batch([topk + 37] * B, [1] * B, heads, topk, 64, "fp8_ds_mla", pad=pad, seed=seed,
                          device="cuda")
    r = b.run_args
    if B > 2:
        r["indices"][0] = -1                                   # no token: out 0, lse -inf
        r["indices"][1, 0] = r["kv_cache"].shape[0] * 64 + 3   # out of the pool: skipped
    attn = fp8mla.MLASparseAttention(backend="gluon")
    attn.plan(**b.plan_args, gather=gather)
    assert attn.backend == "gluon"
    out = torch.full((B, heads, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, heads), math.nan, device="cuda")
    attn.run(**r, out=out, lse=lse, return_lse_base_on_e=base_e)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l * (math.log(2) if base_e else 1.0), LSE_TOL, "lse")
    return attn, r, out, ref_o


@pytest.mark.parametrize("gather", ["async", "regs", "prefetch"])
@pytest.mark.parametrize("heads,topk,B", [(16, 2048, 1), (128, 2048, 8), (8, 128, 64), (64, 128, 8)])
def test_gluon_sparse_matches_reference(gather, heads, topk, B):
    _check(heads, topk, B, gather, pad="scattered" if B % 2 else "trailing", seed=heads + topk)


def test_gluon_sparse_graph_replay_and_base_e():
    attn, r, out, ref_o = _check(64, 2048, 4, "async", base_e=True)
    capture_then_replay(lambda: attn.run(**r, out=out), out)
    assert_close(out, ref_o, TOL, "out after graph replay")
