"""gather_dequant (torch and Triton) against the float64 per-request dequantization, over NaN-poisoned pools with
shuffled page order: every format and output dtype, odd lengths, buffers with spare rows, bad inputs."""
from __future__ import annotations

import os

import pytest
import torch

from fp8mla.gather import gather_dequant
from fp8mla.reference import gather_sequence_kv
from fp8mla.testing import assert_close, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="triton cannot run"))]
FORMATS = ["fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]


def batch(fmt, kv_lens, page_size, seed, **kw):
    fp8 = fmt.startswith("fp8")
    return make_paged_batch(kv_lens, [1] * len(kv_lens), 1, page_size, fmt, device=DEVICE, seed=seed,
                            ckv_scale=0.37 if fmt in ("fp8_e4m3", "fp8_e5m2") else 1.0,
                            kpe_scale=1.7 if fp8 else 1.0, value_scale=3.0, **kw)


def gather(b, backend, dtype, **kw):
    a, r = b.plan_args, b.run_args
    return gather_dequant(r["ckv_cache"], r["kpe_cache"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"],
                          ckv_scale=r["ckv_scale"], kpe_scale=r["kpe_scale"], ckv_scale_arr=r["ckv_scale_arr"],
                          dtype=dtype, backend=backend, **kw)


def check_against_reference(b, ckv, kpe, token_indptr, tol):
    a, r = b.plan_args, b.run_args
    lens = a["kv_len_arr"].tolist()
    kvp = a["kv_indptr"].tolist()
    assert token_indptr.dtype == torch.int32
    assert token_indptr.tolist() == torch.tensor([0] + lens).cumsum(0).tolist()
    assert ckv.shape[0] == kpe.shape[0] == sum(lens)  # sized by the tokens used, not the pool
    for i, L in enumerate(lens):
        ref_c, ref_k = gather_sequence_kv(r["ckv_cache"], r["kpe_cache"], a["kv_indices"][kvp[i]:kvp[i + 1]], L,
                                          ckv_scale=r["ckv_scale"], kpe_scale=r["kpe_scale"],
                                          ckv_scale_arr=r["ckv_scale_arr"])
        t0, t1 = token_indptr[i].item(), token_indptr[i + 1].item()
        if L:
            assert_close(ckv[t0:t1], ref_c, tol, f"ckv of request {i}")
            assert_close(kpe[t0:t1], ref_k, tol, f"kpe of request {i}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_matches_reference(backend, fmt, dtype):
    b = batch(fmt, [5, 0, 17, 1, 33], 8, seed=FORMATS.index(fmt), head_dim_ckv=256, head_dim_kpe=32)
    ckv, kpe, ti = gather(b, backend, dtype)
    assert ckv.dtype == kpe.dtype == dtype and not torch.isnan(ckv).any() and not torch.isnan(kpe).any()
    check_against_reference(b, ckv, kpe, ti, {torch.bfloat16: 4e-3, torch.float16: 1e-3}.get(dtype, 1e-7))


@pytest.mark.skipif(not TRITON_OK, reason="triton cannot run")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_triton_bit_identical_to_torch(fmt, page_size):
    """Both do (stored.float() * scale).to(dtype): the same bits."""
    b = batch(fmt, [page_size + 1, 3, 2 * page_size - 1], page_size, seed=page_size)
    t = gather(b, "torch", torch.bfloat16)
    g = gather(b, "triton", torch.bfloat16)
    for x, y in zip(t, g):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers_with_spare_rows(backend):
    b = batch("fp8_e4m3", [9, 4], 4, seed=7, head_dim_ckv=128, head_dim_kpe=64)
    out_c = torch.full((20, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out_k = torch.full((20, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ckv, kpe, ti = gather(b, backend, torch.bfloat16, out_ckv=out_c, out_kpe=out_k)
    assert ckv.data_ptr() == out_c.data_ptr() and ckv.shape[0] == 13
    assert torch.isnan(out_c[13:]).all()  # untouched past T
    check_against_reference(b, ckv, kpe, ti, 2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    b = batch("fp8_e4m3", [0, 0], 4, seed=1, head_dim_ckv=128, head_dim_kpe=64)
    ckv, kpe, ti = gather(b, backend, torch.bfloat16)
    assert ckv.shape == (0, 128) and kpe.shape == (0, 64) and ti.tolist() == [0, 0, 0]


def test_bad_inputs_name_the_argument():
    b = batch("fp8_e4m3", [9, 4], 4, seed=2, head_dim_ckv=128, head_dim_kpe=64)
    a, r = b.plan_args, b.run_args
    args = (r["ckv_cache"], r["kpe_cache"], a["kv_indptr"], a["kv_indices"])
    with pytest.raises(ValueError, match="kv_len_arr: request 0"):
        gather_dequant(*args, a["kv_len_arr"] + 100)
    bad = a["kv_indices"].clone()
    bad[0] = 10_000
    with pytest.raises(ValueError, match="kv_indices: request 0"):
        gather_dequant(r["ckv_cache"], r["kpe_cache"], a["kv_indptr"], bad, a["kv_len_arr"])
    with pytest.raises(TypeError, match="dtype"):
        gather_dequant(*args, a["kv_len_arr"], dtype=torch.int8)
    with pytest.raises(ValueError, match="out_ckv"):
        gather_dequant(*args, a["kv_len_arr"], out_ckv=torch.empty(3, 128, dtype=torch.bfloat16, device=DEVICE),
                       out_kpe=torch.empty(3, 64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="ckv_scale"):
        gather_dequant(*args, a["kv_len_arr"], ckv_scale=-1.0)
