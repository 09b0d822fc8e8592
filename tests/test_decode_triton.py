"""The Triton decode kernel: every page size, formats, H=128 multi-token, scales far from 1, splits,
determinism, NaN-poisoned pages, CUDA-graph replay; the group format at the per-tensor FP8 error level; NaN in
gives NaN out (never the "no keys" answer); any strides of out / lse / ckv_scale_arr; page ids outside the pool.
CPU: under TRITON_INTERPRET=1 (set by conftest.py) at small sizes, where the kernel rounds its MMA operands to
fp16 as on the GPU and multiplies them in fp32; GPU: the same cases plus larger ones."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in fp8mla.available_backends(DEVICE),
                                reason="triton backend unavailable here")
FORMATS = ["fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]
# Interpreter: fp32 dots, output rounding to bf16 by truncation (2x the GPU's error). GPU: the real kernel.
# The group format converts FP8 exactly to fp16 like the per-tensor formats (see kernels/decode.py): same
# tolerances. (It used to round dequantized K/V to bf16: 1e-2 / 2e-3 here, lse off by up to 1.3e-2 on the H200.)
TOL = {}
LSE_TOL = {}
# gather_cast rounds dequantized group-format values to the query dtype in its workspace (not this kernel).
GATHER_TOL, GATHER_LSE_TOL = {"fp8_e4m3_group": 1e-2}, {"fp8_e4m3_group": 2e-3}
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
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
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
    check(b, out, lse, GATHER_TOL.get(fmt, DEFAULT_TOL), GATHER_LSE_TOL.get(fmt, 1e-4))
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


# -- direct launches: the kernel's own contract, independent of the backend's plan ------------------------------
def launch(b, splits=1, out=None, lse=None, scale_arr=None, kv_indices=None, **kw):
    """Runs mla_decode on ``b`` with a hand-made schedule: each request cut into ``splits`` work items
    (block_n-aligned), merged by the merge kernel when > 1. Returns (out, lse base 2)."""
    from fp8mla.kernels.decode import KV_BF16, KV_FP8_FP16_MATH, KV_GROUP, mla_decode
    a, r = b.plan_args, b.run_args
    qn, qp = r["q_nope"], r["q_pe"]
    n, H, Dc = qn.shape
    kv_mode = (KV_GROUP if r["ckv_scale_arr"] is not None else
               KV_BF16 if r["ckv_cache"].dtype == torch.bfloat16 else KV_FP8_FP16_MATH)
    block_n = kw.pop("block_n", 16)
    qo = a["qo_indptr"].tolist()
    lens = a["kv_len_arr"].tolist()
    items, split_indptr, parts = [], [0], 0
    for i, L in enumerate(lens):
        per = max(block_n, -(-(-(-L // splits)) // block_n) * block_n) if L else 1
        starts = list(range(0, L, per)) or [0]
        for s in starts:
            items.append((i, s, min(L, s + per), parts if len(starts) > 1 else -1))
            parts += len(starts) > 1
        split_indptr.append(len(items))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    cols = list(zip(*items))
    max_rows = H * max(qo[i + 1] - qo[i] for i in range(len(lens)))
    out = torch.full((n, H, Dc), math.nan, dtype=qn.dtype, device=DEVICE) if out is None else out
    lse = torch.full((n, H), math.nan, dtype=torch.float32, device=DEVICE) if lse is None else lse
    scales = torch.tensor([float(r["ckv_scale"] or 1.0), float(r["kpe_scale"])], dtype=torch.float32, device=DEVICE)
    part_o = torch.full((max(parts, 1), max_rows, Dc), math.nan, device=DEVICE)
    part_lse = torch.full((max(parts, 1), max_rows), math.nan, device=DEVICE)
    mla_decode(qn, qp, r["ckv_cache"], r["kpe_cache"], r["ckv_scale_arr"] if scale_arr is None else scale_arr,
               scales, out, lse, part_o, part_lse, a["qo_indptr"], a["kv_indptr"],
               a["kv_indices"] if kv_indices is None else kv_indices, a["kv_len_arr"], i32(cols[0]),
               i32(cols[1]), i32(cols[2]), i32(cols[3]), i32([len(items)]), i32(split_indptr), i32([len(lens)]),
               grid_items=len(items), grid_batch=len(lens), num_heads=H, max_rows=max_rows, sm_scale=a["sm_scale"],
               causal=a["causal"], kv_mode=kv_mode, block_m=kw.pop("block_m", 16), block_n=block_n,
               num_warps=kw.pop("num_warps", 4), num_stages=1, fp32_dot=DEVICE == "cpu", **kw)
    return out, lse


def lse_abs_err(lse, ref):
    seen = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse.cpu()), seen.cpu())
    return (lse.double() - ref.double())[seen].abs().max().item()


@pytest.mark.parametrize("value_scale", [1e-4, 1.0, 300.0])
@pytest.mark.parametrize("splits", [1, 3])
def test_group_format_at_per_tensor_error(value_scale, splits, case_seed):
    """The group format within the per-tensor FP8 error: lse <= 1e-3 absolute (the H200 saw up to 1.3e-2 when
    K/V were rounded to bf16), out within the default tolerance, over tiny to large group scales (P carries
    sc / max(sc) in fp16: no underflow at value_scale 1e-4, whose scales are ~1e-6)."""
    g = torch.Generator().manual_seed(case_seed)
    b = make_paged_batch([150, 33, 1, 64], [1, 3, 1, 2], 16, 16, "fp8_e4m3_group", device=DEVICE,
                         generator=g, value_scale=value_scale, kpe_scale=value_scale / 100,
                         sm_scale=1.0 / (value_scale * 24))
    ref_o, ref_l = b.reference()
    out, lse = launch(b, splits=splits, block_n=32)
    assert_close(out, ref_o, DEFAULT_TOL, "out")
    assert lse_abs_err(lse, ref_l) <= 1e-3


def test_group_scales_spread_within_a_tile(case_seed):
    """Tokens whose group scales differ by 2^24 inside one tile: each chunk's P is normalized by its tile max.
    (sm_scale keeps the largest scores near 1, so small-scale tokens still carry weight in the softmax.)"""
    b = make_paged_batch([40, 7], [2, 1], 16, 8, "fp8_e4m3_group", device=DEVICE, seed=case_seed,
                         spare_pages=1, sm_scale=2.0 ** -12 / 24)
    r = b.run_args
    sa = r["ckv_scale_arr"]
    g = torch.Generator().manual_seed(case_seed)
    factor = (2.0 ** torch.randint(-12, 13, sa.shape, generator=g)).to(DEVICE)
    r["ckv_scale_arr"] = sa * factor  # NaN in unused slots stays NaN
    ref_o, ref_l = b.reference()
    out, lse = launch(b, block_n=16)
    assert_close(out, ref_o, DEFAULT_TOL, "out")
    assert lse_abs_err(lse, ref_l) <= 1e-3


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group", "bf16"])
def test_any_strides_for_out_lse_and_scale_arr(fmt, case_seed):
    """A transposed lse, an out whose last dim is strided, a ckv_scale_arr with channel-strided groups: the same
    answer as contiguous buffers (a transposed lse used to come out off by 9)."""
    b = make_paged_batch([37, 5, 64], [2, 1, 1], 16, 16, fmt, device=DEVICE, seed=case_seed, ckv_scale=0.5)
    n, H, Dc = b.run_args["q_nope"].shape
    want_o, want_l = launch(b, splits=2)
    out = torch.full((Dc, H, n), math.nan, dtype=b.plan_args["q_data_type"], device=DEVICE).permute(2, 1, 0)
    lse = torch.full((H, n), math.nan, device=DEVICE).t()
    sa = b.run_args["ckv_scale_arr"]
    if sa is not None:
        sa = sa.permute(2, 0, 1).contiguous().permute(1, 2, 0)
        assert sa.stride(-1) != 1
    got_o, got_l = launch(b, splits=2, out=out, lse=lse, scale_arr=sa)
    assert got_o.stride(-1) != 1 and got_l.stride(-1) != 1
    assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l)
    check(b, got_o, got_l, DEFAULT_TOL)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_nan_in_gives_nan_out(fmt, splits, case_seed):
    """NaN in a query row, or NaN / inf in one channel of one used token (or its group scale), makes the rows
    that read it NaN (out and lse), never 0 with lse -inf; the other requests are untouched."""
    def batch():
        return make_paged_batch([40, 70, 0, 20], [1, 2, 1, 1], 16, 16, fmt, device=DEVICE, seed=case_seed)

    def run(b):
        out, lse = launch(b, splits=splits)
        return out.float().cpu(), lse.cpu()

    clean_o, clean_l = run(batch())
    # NaN in one query row (token 0 = request 0, head 5)
    b = batch()
    b.run_args["q_nope"][0, 5, 7] = math.nan
    out, lse = run(b)
    assert torch.isnan(lse[0, 5]) and torch.isnan(out[0, 5]).all()
    assert torch.equal(lse[1:], clean_l[1:]) and torch.equal(out[1:], clean_o[1:])
    assert torch.equal(lse[0, :5], clean_l[0, :5])
    # NaN / inf in one channel of one used token of request 1 (the token every one of its queries sees)
    pages = b.plan_args["kv_indices"].tolist()
    ind = b.plan_args["kv_indptr"].tolist()
    # (e4m3 has no inf: torch stores inf as 448, so only the 16-bit pool gets infs. An inf in c_kv reaches every
    # row through V: inf x p, or 0 x inf = NaN where its score is -inf. An inf only in k_pe whose score is -inf
    # is a key of weight 0, as in exact arithmetic: not tested as an error.)
    cases = [(math.nan, 100), (math.nan, 520)] + ([(math.inf, 3), (-math.inf, 300)] if fmt == "bf16" else [])
    for bad, where in cases:
        b = batch()
        pool = b.pool
        pool[pages[ind[1]], 5, where] = bad
        out, lse = run(b)
        rows = slice(1, 3)  # request 1's two query tokens
        assert not torch.isfinite(out[rows]).all(dim=-1).any(), f"{bad} at channel {where}: a finite row"
        assert not torch.isinf(lse[rows]).any() or bad == math.inf, "lse -inf: the 'no keys' answer"
        assert not (out[rows] == 0).all(dim=-1).any()
        for keep in (0, 3, 4):
            assert torch.equal(out[keep], clean_o[keep]) and torch.equal(lse[keep], clean_l[keep])
    if fmt == "fp8_e4m3_group":  # a NaN group scale of a used token
        b = batch()
        b.run_args["ckv_scale_arr"][pages[ind[1]], 5, 2] = math.nan
        out, lse = run(b)
        assert torch.isnan(out[1:3]).any(dim=-1).all() and torch.isnan(lse[1:3]).all()
    # The request without tokens still answers 0 / -inf, the others as before.
    assert (clean_o[3] == 0).all() and (clean_l[3] == -math.inf).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group"])
def test_page_ids_outside_the_pool(fmt, case_seed):
    """A page id < 0 or >= P (a device-only page table the plan could not check) is never read: that request's
    rows come out NaN, the others are right."""
    b = make_paged_batch([30, 50, 17], [1, 2, 1], 16, 16, fmt, device=DEVICE, seed=case_seed)
    P = b.pool.shape[0]
    ind = b.plan_args["kv_indptr"].tolist()
    ref_o, ref_l = b.reference()
    for bad in (P, -1, 1 << 30):
        kv_indices = b.plan_args["kv_indices"].clone()
        kv_indices[ind[1] + 1] = bad  # request 1's second page
        for splits in (1, 2):
            out, lse = launch(b, splits=splits, kv_indices=kv_indices)
            assert torch.isnan(out[1:3]).all() and torch.isnan(lse[1:3]).all()
            for rows in (slice(0, 1), slice(3, 4)):
                assert_close(out[rows], ref_o[rows], DEFAULT_TOL, "out")
                assert_close(lse[rows], ref_l[rows], 1e-4, "lse")


@pytest.mark.parametrize("bad", [dict(block_n=48), dict(block_m=8), dict(block_n=8), dict(v_convert="fast")])
def test_bad_launch_options_are_named_errors(bad):
    b = make_paged_batch([20], [1], 16, 16, "fp8_e4m3", device=DEVICE, seed=0)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        launch(b, **bad)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_group"])
def test_uint8_pool_bit_conversion_matches(fmt, case_seed):
    """The SM80 path (the pool read as uint8, FP8 converted by bit manipulation; e4m3 as value / 256 with the 256
    folded into the scales) gives the same answer as the typed pool, NaN bytes included."""
    from fp8mla.kernels.decode import RAW_E4M3, RAW_E5M2
    b = make_paged_batch([40, 9, 70], [1, 2, 1], 16, 16, fmt, device=DEVICE, seed=case_seed, ckv_scale=0.5)
    pages, ind = b.plan_args["kv_indices"].tolist(), b.plan_args["kv_indptr"].tolist()
    b.pool[pages[ind[1]], 2, 30] = math.nan  # request 1: NaN out
    want_o, want_l = launch(b, v_convert="asm")
    r = b.run_args
    typed = r["ckv_cache"], r["kpe_cache"]
    r["ckv_cache"], r["kpe_cache"] = typed[0].view(torch.uint8), typed[1].view(torch.uint8)
    raw = RAW_E5M2 if fmt == "fp8_e5m2" else RAW_E4M3
    got_o, got_l = launch(b, v_convert="asm", raw_fp8=raw)
    assert torch.isnan(got_l[1:3]).all() and torch.isnan(want_l[1:3]).all()
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_l, want_l, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="raw_fp8"):
        launch(b)  # a uint8 pool without raw_fp8


@pytest.mark.skipif(DEVICE != "cuda", reason="the asm V conversion runs on a GPU only")
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3_group", "fp16"])
@pytest.mark.parametrize("v_convert,warps", [("plain", 4), ("asm", 4), ("asm", 8)])
def test_v_conversion_paths_on_gpu(fmt, v_convert, warps, case_seed):
    """Both V conversions (plain; inline asm in 128-column chunks: the portable path, and sm_90's candidate at
    8 warps) against the reference on the GPU, with splits."""
    b = make_paged_batch([3000, 77, 1025, 0], [1, 2, 1, 1], 16, 64, fmt, device=DEVICE, seed=case_seed,
                         ckv_scale=0.5, kpe_scale=0.25)
    ref_o, ref_l = b.reference()
    out, lse = launch(b, splits=3, block_n=64, v_convert=v_convert, num_warps=warps)
    assert_close(out, ref_o, DEFAULT_TOL, "out")
    assert lse_abs_err(lse, ref_l) <= 1e-3
