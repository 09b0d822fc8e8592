"""The sparse API's batch-invariant mode: each query token's output and lse are the same bits whatever else a
call holds (its number of tokens from 1 up, their order, the pool's page order), torch and the Triton kernel (the
interpreter on the CPU) and the Gluon build (named; an sm_90 GPU); ``auto`` keeps the Triton kernel in the mode;
the default mode's split count follows the call."""
from __future__ import annotations

import pytest
import torch

import fp8mla
from fp8mla.backends._invariant import GLUON_AUTO, SPARSE_INVARIANT_SPLIT
from fp8mla.testing import assert_close, make_sparse_batch
from tests.conftest import BACKEND_PARAMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOPK = SPARSE_INVARIANT_SPLIT + 64   # every row split in two in the invariant mode
# Small splits: without the mode the split count would follow the call's size (8 programs at 1 token on the
# interpreter's 4 "SMs", 2 at 4 tokens): the mutation check (these tests fail with the mode ignored).
MIN_SPLIT = 64


def moved(run_args, page_size, seed):
    """The same pool with its pages in another order (and the index rows following them)."""
    g = torch.Generator().manual_seed(seed)
    pool = run_args["kv_cache"]
    P = pool.shape[0]
    perm = torch.randperm(P, generator=g).to(pool.device)   # page p moves to perm[p]
    new_pool = torch.empty_like(pool)
    new_pool[perm] = pool
    idx = run_args["indices"].long()
    new_idx = torch.where(idx >= 0, perm[idx.clamp(min=0) // page_size] * page_size + idx.clamp(min=0) % page_size,
                          idx).to(torch.int32)
    r = dict(run_args, kv_cache=new_pool, indices=new_idx)
    if r.get("ckv_scale_arr") is not None:
        sa = torch.empty_like(r["ckv_scale_arr"])
        sa[perm] = r["ckv_scale_arr"]
        r["ckv_scale_arr"] = sa
    return r


ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
GLUON = pytest.param("gluon", "fp8_ds_mla", id="gluon-fp8_ds_mla",
                     marks=pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon"))


@pytest.mark.parametrize("backend, fmt", [pytest.param(p.values[0], f, marks=p.marks, id=f"{p.id}-{f}")
                                          for p, f in zip(BACKEND_PARAMS, ["fp8_ds_mla", "fp8_e4m3"])] + [GLUON])
def test_same_bits_in_any_call(backend, fmt):
    scales = dict(ckv_scale=0.5, kpe_scale=2.0) if fmt == "fp8_e4m3" else {}
    b = make_sparse_batch([300, 7, 120, 64], [2, 1, 2, 1], 16, TOPK, 16, fmt, seed=3, device=DEVICE,
                          selected=lambda r, i: [300, 7, 100, 0][r] - i, **scales)
    attn = fp8mla.MLASparseAttention(backend=backend, batch_invariant=True)
    attn.plan(**b.plan_args, min_split=MIN_SPLIT)
    if backend in ("triton", "gluon"):
        assert attn.splits_for(1) == attn.splits_for(1000) == 2
    r = b.run_args
    n = r["q_nope"].shape[0]
    seen = {}
    for k, rows in enumerate([[0], [3, 0], list(range(n))[::-1], [5, 0, 2, 0, 1]]):
        call = moved(r, b.plan_args["page_size"], seed=k)
        sel = torch.tensor(rows, device=DEVICE)
        call.update(q_nope=r["q_nope"][sel], q_pe=r["q_pe"][sel], indices=call["indices"][sel])
        out, lse = attn.run(**call, return_lse=True)
        for j, row in enumerate(rows):
            if row not in seen:
                seen[row] = (out[j].clone(), lse[j].clone())
            o0, l0 = seen[row]
            assert torch.equal(out[j].view(torch.int16), o0.view(torch.int16)), f"row {row}: out in call {rows}"
            assert torch.equal(lse[j].view(torch.int32), l0.view(torch.int32)), f"row {row}: lse in call {rows}"
    out, lse = attn.run(**r, return_lse=True)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, 5e-3, "out")
    assert_close(lse, ref_l, 1e-4, "lse")


def test_auto_keeps_triton_and_gluon_is_taken_when_named(monkeypatch):
    assert fp8mla.MLASparseAttention(backend="gluon", batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant: expected True or False"):
        fp8mla.MLASparseAttention(batch_invariant=1)
    from fp8mla.backends.select import select, sparse_question
    from fp8mla.formats import get_format
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)   # an sm_90 GPU, to the selector
    monkeypatch.setattr(fp8mla.runtime, "triton_usable", lambda device: True)
    fmt = get_format("fp8_ds_mla", sparse_ok=True)
    q = sparse_question(64, 2048, fmt, torch.bfloat16, "cuda", True)
    auto = select(q, "auto")
    assert auto.backend == "triton" and auto.passed_over == (("gluon-sparse", GLUON_AUTO),)
    assert select(q, "gluon").backend == "gluon"
    assert select(sparse_question(64, 2048, fmt, torch.bfloat16, "cuda", False), "auto").backend == "gluon"


@pytest.mark.parametrize("backend", [p for p in BACKEND_PARAMS if p.id == "triton"])
def test_default_mode_splits_follow_the_call(backend):
    """Not claimed invariant: without the mode a row's split count changes with the call's token count."""
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(num_heads=16, topk=2048, page_size=64, sm_scale=0.1, q_data_type=torch.bfloat16,
              kv_data_type="fp8_ds_mla", num_pages=4, device=DEVICE)
    assert attn.splits_for(1) > attn.splits_for(4096) == 1
