"""The paged extend (prefill) kernel against the float64 reference on NaN-poisoned pools with shuffled pages:
every format, page sizes 1..128, causal and not, more queries than tokens, fp16 queries, strided queries,
H=128, the full DeepSeek widths; NaN in gives NaN out, page ids outside the pool, a transposed lse, named errors.
CPU: TRITON_INTERPRET=1 at small sizes; GPU: the same plus a large case and both V conversions."""
from __future__ import annotations

import math
import os

import pytest
import torch

from fp8mla.testing import assert_close, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton cannot run here")
FP32_DOT = os.environ.get("TRITON_INTERPRET") == "1"
FORMATS = ["fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]
# The interpreter truncates fp32 -> bf16 (the GPU rounds): ~2x the GPU's output error. The group format
# rounds its dequantized c_kv to the query dtype for the MMAs (the per-tensor formats convert exactly), and so
# does an fp16 pool read by bf16 queries.
TOL = {"fp8_e4m3_group": 1.2e-2, "fp16": 1.2e-2}
LSE_TOL = {"fp8_e4m3_group": 2e-3, "fp16": 2e-3}
DEFAULT_TOL = 6e-3 if FP32_DOT else 3e-3


def run_extend(b, poison=True, **tiles):
    from fp8mla.kernels.extend import mla_extend
    a, r = b.plan_args, b.run_args
    n, H, Dc = r["q_nope"].shape
    out = torch.full((n, H, Dc), float("nan") if poison else 0.0, dtype=a["q_data_type"], device=DEVICE)
    lse = torch.full((n, H), float("nan"), dtype=torch.float32, device=DEVICE)
    qo = a["qo_indptr"].tolist()
    scales = torch.tensor([float(r["ckv_scale"] or 1.0), float(r["kpe_scale"])], dtype=torch.float32, device=DEVICE)
    mla_extend(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
               a["kv_indices"], a["kv_len_arr"], out, lse, sm_scale=a["sm_scale"], causal=a["causal"],
               scales=scales, ckv_scale_arr=r["ckv_scale_arr"],
               max_qo_len=max(qo[i + 1] - qo[i] for i in range(len(qo) - 1)), fp32_dot=FP32_DOT, **tiles)
    return out, lse


def check(b, out, lse, tol=DEFAULT_TOL, lse_tol=1e-4):
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, tol, "out")
    assert_close(lse, ref_l, lse_tol, "lse")


def small(kv_lens, qo_lens, H, page, fmt="fp8_e4m3", **kw):
    kw = dict(head_dim_ckv=128, head_dim_kpe=32, device=DEVICE) | kw
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        kw = dict(ckv_scale=0.3, kpe_scale=2.5) | kw
    return make_paged_batch(kv_lens, qo_lens, H, page, fmt, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [True, False])
def test_formats(fmt, causal, case_seed):
    # kv_len 0, kv_len < qo_len (causal: the first queries see nothing), a prefix plus 9..40 new tokens
    b = small([40, 0, 5, 70], [20, 3, 9, 12], 8, 16, fmt, causal=causal, seed=case_seed)
    check(b, *run_extend(b), TOL.get(fmt, DEFAULT_TOL), LSE_TOL.get(fmt, 1e-4))


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 32, 64, 128])
def test_page_sizes(page_size, case_seed):
    b = small([page_size + 1, 2 * page_size - 1 or 1, 37], [9, 12, 10], 4, page_size, seed=case_seed)
    check(b, *run_extend(b))


def test_fp16_queries_and_small_tiles(case_seed):
    b = small([50, 17], [17, 17], 6, 8, "fp8_e4m3", q_dtype=torch.float16, seed=case_seed)
    out, lse = run_extend(b, block_h=4, block_q=4, block_n=16)
    assert out.dtype == torch.float16
    check(b, out, lse)


def test_strided_queries(case_seed):
    """q_nope/q_pe as column slices of one [n, H, 576] tensor (how models split q)."""
    b = small([30, 21], [10, 21], 4, 16, seed=case_seed)
    r = b.run_args
    q = torch.cat([r["q_nope"], r["q_pe"]], dim=-1)
    r["q_nope"], r["q_pe"] = q[..., :128], q[..., 128:]
    assert not r["q_nope"].is_contiguous()
    check(b, *run_extend(b))


def test_h128(case_seed):
    b = small([24, 11], [12, 11], 128, 16, seed=case_seed, head_dim_ckv=128, head_dim_kpe=16)
    check(b, *run_extend(b))


def test_deepseek_widths(case_seed):
    b = make_paged_batch([33], [12], 2, 16, "fp8_e4m3", ckv_scale=0.5, device=DEVICE, seed=case_seed)
    check(b, *run_extend(b))


def test_large_values_and_sm_scale(case_seed):
    """Scores far from 1 (sharp softmax): the online max must track them exactly."""
    b = small([45], [15], 4, 16, value_scale=8.0, sm_scale=0.5, seed=case_seed)
    out, lse = run_extend(b)
    assert torch.isfinite(lse).all()
    check(b, out, lse, lse_tol=1e-4)


def test_empty_rows_are_zero_and_minus_inf(case_seed):
    b = small([0, 3], [10, 10], 4, 8, seed=case_seed)
    out, lse = run_extend(b)
    assert (out[:10] == 0).all() and (lse[:10] == -math.inf).all()      # kv_len 0
    assert (out[10:17] == 0).all() and (lse[10:17] == -math.inf).all()  # causal: 7 queries before token 0
    check(b, out, lse)


@pytest.mark.skipif(DEVICE != "cuda", reason="large case on the GPU only")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group", "bf16"])
def test_large_gpu(fmt, case_seed):
    b = make_paged_batch([2000, 300, 1025], [1000, 300, 17], 128, 64, fmt, device=DEVICE, seed=case_seed)
    check(b, *run_extend(b), TOL.get(fmt, DEFAULT_TOL), LSE_TOL.get(fmt, 1e-4))


# -- bad input: NaN in gives NaN out, page ids outside the pool, strides, named errors --------------------------
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "bf16"])
def test_nan_in_gives_nan_out(fmt, case_seed):
    """NaN in one query row, or in one channel of one used token, gives NaN rows (out and lse), never out 0 with
    lse -inf; other requests are untouched; rows without keys still answer 0 / -inf."""
    def batch():
        return small([40, 30, 0], [12, 9, 3], 4, 16, fmt, seed=case_seed)

    clean_o, clean_l = (t.float().cpu() for t in run_extend(batch()))
    b = batch()
    b.run_args["q_nope"][2, 1, 5] = math.nan          # request 0, query 2, head 1
    out, lse = (t.float().cpu() for t in run_extend(b))
    assert torch.isnan(lse[2, 1]) and torch.isnan(out[2, 1]).all()
    assert torch.equal(lse[12:], clean_l[12:]) and torch.equal(out[12:], clean_o[12:])
    b = batch()
    pages, ind = b.plan_args["kv_indices"].tolist(), b.plan_args["kv_indptr"].tolist()
    b.pool[pages[ind[1]], 3, 77] = math.nan             # request 1, token 3: seen by all its 9 queries (causal)
    out, lse = (t.float().cpu() for t in run_extend(b))
    assert torch.isnan(lse[12:21]).all() and torch.isnan(out[12:21]).any(dim=-1).all()
    assert torch.equal(lse[:12], clean_l[:12]) and torch.equal(out[:12], clean_o[:12])
    assert (out[21:] == 0).all() and (lse[21:] == -math.inf).all()  # kv_len 0


@pytest.mark.parametrize("page_size", [4, 16])   # per-token page ids (4 < BLOCK_N) and one id per block (16)
def test_page_ids_outside_the_pool(page_size, case_seed):
    """A page id < 0 or >= P (a device-only page table the plan could not check) is never read: that request's
    rows come out NaN, the others are right."""
    b = small([40, 30, 9], [12, 9, 9], 4, page_size, seed=case_seed)
    P = b.pool.shape[0]
    ind = b.plan_args["kv_indptr"].tolist()
    ref_o, ref_l = b.reference()
    good = b.plan_args["kv_indices"].clone()
    for bad in (P, -1):
        b.plan_args["kv_indices"] = good.clone()
        b.plan_args["kv_indices"][ind[1] + 1] = bad      # request 1's second page
        out, lse = run_extend(b, block_n=16)
        assert torch.isnan(out[12:21]).all() and torch.isnan(lse[12:21]).all()
        for rows in (slice(0, 12), slice(21, 30)):
            assert_close(out[rows], ref_o[rows], DEFAULT_TOL, "out")
            assert_close(lse[rows], ref_l[rows], 1e-4, "lse")


def test_transposed_lse_and_strided_scale_arr(case_seed):
    b = small([40, 17], [12, 9], 4, 16, "fp8_e4m3_group", seed=case_seed)
    want_o, want_l = run_extend(b)
    from fp8mla.kernels.extend import mla_extend
    a, r = b.plan_args, b.run_args
    n, H, Dc = r["q_nope"].shape
    out = torch.full((n, H, Dc), math.nan, dtype=a["q_data_type"], device=DEVICE)
    lse = torch.full((H, n), math.nan, device=DEVICE).t()
    sa = r["ckv_scale_arr"].permute(2, 0, 1).contiguous().permute(1, 2, 0)
    scales = torch.tensor([1.0, float(r["kpe_scale"])], dtype=torch.float32, device=DEVICE)
    mla_extend(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
               a["kv_indices"], a["kv_len_arr"], out, lse, sm_scale=a["sm_scale"], causal=a["causal"],
               scales=scales, ckv_scale_arr=sa, max_qo_len=12, fp32_dot=FP32_DOT)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)


@pytest.mark.parametrize("bad,match", [(dict(block_n=48), "block_n"), (dict(block_h=3), "block_h"),
                                       (dict(block_n=8), "block_n"), (dict(block_h=2, block_q=2), "block_h"),
                                       (dict(strided_out=True), "out")])
def test_bad_arguments_are_named_errors(bad, match, case_seed):
    b = small([20], [10], 4, 16, seed=case_seed)
    if bad.pop("strided_out", False):
        from fp8mla.kernels.extend import mla_extend
        a, r = b.plan_args, b.run_args
        out = torch.empty(128, 4, 10, dtype=torch.bfloat16, device=DEVICE).permute(2, 1, 0)
        lse = torch.empty(10, 4, device=DEVICE)
        scales = torch.ones(2, device=DEVICE)
        with pytest.raises(ValueError, match=match):
            mla_extend(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                       a["kv_indices"], a["kv_len_arr"], out, lse, sm_scale=1.0, causal=True, scales=scales,
                       ckv_scale_arr=None, max_qo_len=10, fp32_dot=FP32_DOT)
        return
    with pytest.raises(ValueError, match=match):
        run_extend(b, **bad)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_uint8_pool_bit_conversion_matches(fmt, case_seed):
    """The SM80 path (the pool read as uint8, FP8 converted by bit manipulation, e4m3 as value / 256 with the 256
    in the scales) gives the typed pool's answer, NaN bytes included."""
    b = small([40, 17], [12, 9], 4, 16, fmt, seed=case_seed)
    pages, ind = b.plan_args["kv_indices"].tolist(), b.plan_args["kv_indptr"].tolist()
    b.pool[pages[ind[1]], 2, 30] = math.nan
    want = run_extend(b)
    r = b.run_args
    r["ckv_cache"], r["kpe_cache"] = r["ckv_cache"].view(torch.uint8), r["kpe_cache"].view(torch.uint8)
    got = run_extend(b, raw_fp8=2 if fmt == "fp8_e5m2" else 1)
    assert torch.isnan(got[1][12:]).all()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="raw_fp8"):
        run_extend(b)


@pytest.mark.skipif(DEVICE != "cuda", reason="the asm V conversion runs on a GPU only")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("v_asm", [False, True])
def test_v_conversion_paths_on_gpu(fmt, v_asm, case_seed):
    """Both V conversions (plain, and inline asm: the portable path's) against the reference on the GPU."""
    b = make_paged_batch([300, 77, 1025], [100, 77, 17], 16, 64, fmt, device=DEVICE, seed=case_seed,
                         ckv_scale=0.5, kpe_scale=0.25)
    check(b, *run_extend(b, v_asm=v_asm))
