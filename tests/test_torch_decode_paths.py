"""The torch backend's two gather paths: one pool whose tokens hold ckv then kpe (vLLM's and SGLang's latent
cache, read as ``[..., :512]`` / ``[..., 512:]`` views: one gather and one score product for both parts) and two
separate tensors (FlashInfer's layout). Both against the float64 reference, on NaN-poisoned pools with padded
decode rows and causal extend rows; and each layout takes the path meant for it."""
from __future__ import annotations

import pytest
import torch

from fp8mla import MLAPagedAttention
from fp8mla.backends.torch import _joint_rows
from fp8mla.testing import make_paged_batch


def _run(pb):
    attn = MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    return attn.run(**pb.run_args, return_lse=True)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e4m3_group"])
def test_pool_views_and_separate_caches_match_the_reference(fmt, case_seed):
    # one length bucket with padding (33..64) plus a causal extend row, a per-tensor scale far from 1
    pb = make_paged_batch([33, 61, 40, 57], [1, 1, 3, 1], 16, 16, fmt, seed=case_seed, ckv_scale=0.5,
                          kpe_scale=2.0)
    r = pb.run_args
    assert _joint_rows(r["ckv_cache"], r["kpe_cache"]) is not None   # the pool's views
    ref_out, ref_lse = pb.reference()
    out_views, lse_views = _run(pb)
    r["ckv_cache"], r["kpe_cache"] = r["ckv_cache"].contiguous(), r["kpe_cache"].contiguous()
    assert _joint_rows(r["ckv_cache"], r["kpe_cache"]) is None       # two tensors
    out_sep, lse_sep = _run(pb)
    for out, lse in ((out_views, lse_views), (out_sep, lse_sep)):
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert (out.double() - ref_out.double()).abs().max() < 0.02
        assert (lse.double() - ref_lse.double()).abs().max() < 1e-3
    assert (out_views.float() - out_sep.float()).abs().max() < 0.02


def test_joint_rows_refuses_views_that_are_not_one_token_row():
    pool = torch.randn(4, 16, 576).to(torch.bfloat16)
    assert _joint_rows(pool[..., :512], pool[..., 512:]) is not None
    assert _joint_rows(pool[..., :512], pool[..., 513:]) is None         # kpe does not follow ckv
    assert _joint_rows(pool[..., :448], pool[..., 512:]) is None         # a gap between them
    assert _joint_rows(pool[1:, :, :512], pool[:-1, :, 512:]) is None    # other pages
    assert _joint_rows(pool[..., :512], pool.clone()[..., 512:]) is None  # another tensor
    rows = _joint_rows(pool[..., :512], pool[..., 512:])
    assert torch.equal(rows, pool.reshape(-1, 576))
