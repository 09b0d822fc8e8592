"""The Triton decode kernel (issue 3): every page size, formats, H=128 multi-token, scales far from 1, splits,
determinism, NaN-poisoned pages, CUDA-graph replay. CPU: under TRITON_INTERPRET=1 (set by conftest.py) at small
sizes; GPU: the same cases plus larger ones."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in fp8mla.available_backends(DEVICE),
                                reason="triton backend unavailable here")
FORMATS = ["fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]
# Interpreter: fp32 dots, output rounding to bf16 by truncation (2x the GPU's error). GPU: the real kernel.
# The group format rounds dequantized KV to bf16 for its MMAs (see kernels/decode.py).
TOL = {"fp8_e4m3_group": 1e-2}
LSE_TOL = {"fp8_e4m3_group": 2e-3}
DEFAULT_TOL = 5e-3 if DEVICE == "cpu" else 3e-3


def run_case(batch, backend="triton", poison=True, **opts):
    attn = fp8mla.MLAPagedAttention(backend=backend, **opts)
    attn.plan(**batch.plan_args)
    n, H, Dc = batch.run_args["q_nope"].shape
    out = torch.full((n, H, Dc), float("nan"), dtype=batch.plan_args["q_data_type"], device=DEVICE)
    lse = torch.full((n, H), float("nan"), dtype=torch.float32, device=DEVICE)
    if not poison:
        out.zero_()
    res = attn.run(**batch.run_args, out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    return out, lse


def check(batch, out, lse, tol, lse_tol=1e-4):
    ref_o, ref_lse = batch.reference()
    assert_close(out, ref_o, tol, "out")
    assert_close(lse, ref_lse, lse_tol, "lse")


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64, 128])
def test_every_page_size(page_size):
    b = make_paged_batch([0, 1, page_size - 1 or 2, page_size + 1, 97], [1] * 5, 16, page_size, "fp8_e4m3",
                         device=DEVICE, seed=page_size)
    check(b, *run_case(b), DEFAULT_TOL)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_formats_and_query_dtypes(fmt, q_dtype):
    b = make_paged_batch([17, 130, 5], [1, 2, 1], 16, 16, fmt, q_dtype=q_dtype, device=DEVICE, seed=3)
    check(b, *run_case(b), TOL.get(fmt, DEFAULT_TOL), LSE_TOL.get(fmt, 1e-4))


@pytest.mark.parametrize("qo_len", [2, 3, 5, 8])
def test_h128_multi_token(qo_len):
    b = make_paged_batch([qo_len, 40, 97], [qo_len] * 3, 128, 16, "fp8_e4m3", device=DEVICE, seed=qo_len)
    check(b, *run_case(b), DEFAULT_TOL)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_group"])
@pytest.mark.parametrize("scales", [(1e-3, 2e-2), (40.0, 300.0)])
def test_scales_far_from_one(fmt, scales):
    ckv_scale, kpe_scale = scales
    # Real values around the scales so the stored values use the FP8 range. (Not the e5m2 subnormals: the
    # CPU interpreter flushes them to 0 when converting; the GPU converts them exactly.)
    b = make_paged_batch([33, 70], [1, 3], 16, 8, fmt, device=DEVICE, seed=5, ckv_scale=ckv_scale,
                         kpe_scale=kpe_scale, value_scale=ckv_scale * 50, sm_scale=1.0 / (ckv_scale * 50 * 24))
    check(b, *run_case(b), TOL.get(fmt, DEFAULT_TOL), LSE_TOL.get(fmt, 1e-4))


def test_scale_as_tensor_matches_float():
    b = make_paged_batch([50, 9], [1, 1], 16, 16, "fp8_e4m3", device=DEVICE, seed=6, ckv_scale=0.5, kpe_scale=2.0)
    out_f, lse_f = run_case(b)
    b.run_args["ckv_scale"] = torch.tensor(0.5, device=DEVICE)
    b.run_args["kpe_scale"] = torch.tensor([2.0], device=DEVICE)
    out_t, lse_t = run_case(b)
    assert torch.equal(out_f, out_t) and torch.equal(lse_f, lse_t)


def test_many_splits_and_non_causal():
    """Long requests cut into many splits (small min_chunk) merge exactly like one pass."""
    b = make_paged_batch([300, 1, 257], [1, 1, 1], 16, 4, "fp8_e4m3", device=DEVICE, seed=7, causal=False)
    out, lse = run_case(b, min_chunk=32, block_n=32, ctas_per_sm=16)
    check(b, out, lse, DEFAULT_TOL)
    attn = fp8mla.MLAPagedAttention(backend="triton", min_chunk=32, block_n=32, ctas_per_sm=16)
    attn.plan(**b.plan_args)
    assert attn._plan.impl.grid_items > 3, "the schedule should split these requests"


def test_deterministic():
    b = make_paged_batch([200, 77, 513], [1, 2, 1], 16, 16, "fp8_e4m3", device=DEVICE, seed=8)
    o1, l1 = run_case(b, min_chunk=64)
    o2, l2 = run_case(b, min_chunk=64)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_never_reads_outside_kv_indices():
    """Every page outside kv_indices, and every slot past kv_len, is NaN: any stray read shows up."""
    b = make_paged_batch([5, 64, 65], [1, 1, 1], 16, 64, "bf16", device=DEVICE, seed=9, spare_pages=6)
    pool = b.pool
    used = set(b.plan_args["kv_indices"].tolist())
    for p in range(pool.shape[0]):
        if p not in used:
            assert torch.isnan(pool[p].float()).all()
    out, lse = run_case(b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check(b, out, lse, DEFAULT_TOL)


def test_lse_base_e_and_return_forms():
    b = make_paged_batch([20], [1], 16, 16, "fp8_e4m3", device=DEVICE, seed=10)
    attn = fp8mla.MLAPagedAttention(backend="triton")
    attn.plan(**b.plan_args)
    out = attn.run(**b.run_args)
    assert isinstance(out, torch.Tensor)
    _, lse_e = attn.run(**b.run_args, return_lse=True, return_lse_base_on_e=True)
    _, ref_lse = b.reference()
    assert_close(lse_e, ref_lse * math.log(2.0), 1e-4, "lse base e")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_then_replan():
    H = 16
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="triton", max_batch_size=8)
    b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 16, "fp8_e4m3", device=DEVICE, seed=11, spare_pages=400)
    attn.plan(**b1.plan_args)
    # The graph reads these fixed tensors; a re-plan changes only the lengths and page tables.
    q_nope = b1.run_args["q_nope"].clone()
    q_pe = b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(3, H, device=DEVICE)
    pool = b1.pool
    kw = dict(ckv_cache=pool[..., :512], kpe_cache=pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    attn.run(q_nope, q_pe, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q_nope, q_pe, out=out, lse=lse, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref_o, _ = b1.reference()
    assert_close(out, ref_o, 3e-3, "first replay")
    # Re-plan the same pool with other lengths (and other page lists), replay the captured graph.
    a = dict(b1.plan_args)
    pages = a["kv_indices"]
    a["kv_len_arr"] = torch.tensor([2900, 5, 1], dtype=torch.int32, device=DEVICE)
    a["kv_indptr"] = torch.tensor([0, 188, 189, 190], dtype=torch.int32, device=DEVICE)
    a["kv_indices"] = torch.cat([pages[7:195], pages[:2]])
    attn.plan(**a)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    from fp8mla.reference import mla_reference
    ref2, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                            a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    assert_close(out, ref2, 3e-3, "replay after re-plan")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large cases on the GPU only")
@pytest.mark.parametrize("H,B,L,page,fmt", [(16, 4, 8192, 64, "fp8_e4m3"), (128, 2, 4096, 64, "fp8_e4m3"),
                                            (16, 3, 5000, 1, "fp8_e4m3"), (128, 2, 3000, 16, "bf16"),
                                            (64, 3, 2000, 32, "fp8_e4m3_group"), (32, 2, 3333, 128, "fp8_e5m2")])
def test_large_gpu(H, B, L, page, fmt):
    b = make_paged_batch([L] * B, [1] * B, H, page, fmt, device=DEVICE, seed=12)
    check(b, *run_case(b), TOL.get(fmt, 3e-3), LSE_TOL.get(fmt, 1e-4))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group", "bf16"])
def test_gather_cast_strategy(backend, fmt):
    """strategy='gather_cast': the batch's tokens into a 16-bit workspace, then the 16-bit kernel; same answers."""
    b = make_paged_batch([0, 40, 17], [1, 2, 1], 16, 16, fmt, device=DEVICE, seed=13, ckv_scale=0.5)
    attn = fp8mla.MLAPagedAttention(backend=backend, strategy="gather_cast")
    attn.plan(**b.plan_args)
    assert attn.backend.startswith("gather_cast")
    out, lse = attn.run(**b.run_args, return_lse=True)
    # The workspace holds dequantized values rounded to the query dtype: the group format's K loses bf16 bits.
    check(b, out, lse, TOL.get(fmt, DEFAULT_TOL), LSE_TOL.get(fmt, 1e-4))
    with pytest.raises(ValueError, match="strategy"):
        fp8mla.MLAPagedAttention(backend=backend, strategy="gather_cast", use_cuda_graph=True)


def test_separate_caches_match_pool_views():
    """FlashInfer layout (two contiguous tensors) and SGLang/vLLM layout (views of one [P, page, 576] pool)."""
    b = make_paged_batch([50, 130], [1, 2], 16, 16, "fp8_e4m3", device=DEVICE, seed=14, ckv_scale=0.5)
    out_views, lse_views = run_case(b)
    assert not b.run_args["ckv_cache"].is_contiguous()
    b.run_args["ckv_cache"] = b.run_args["ckv_cache"].contiguous()
    b.run_args["kpe_cache"] = b.run_args["kpe_cache"].contiguous()
    out_sep, lse_sep = run_case(b)
    assert torch.equal(out_views, out_sep) and torch.equal(lse_views, lse_sep)
