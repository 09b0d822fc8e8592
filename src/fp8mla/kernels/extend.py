"""Paged MLA prefill ("extend"): long query blocks over a paged FP8 (or 16-bit) latent cache.

All heads of MLA share one latent per token, so a program's MMA rows are (query, head) pairs: ``BLOCK_Q``
queries x ``BLOCK_H`` heads of one request (64 rows by default: 1 query x 64 heads at H=128, 4 x 16 at H=16).
It walks the request's tokens in ``BLOCK_N`` blocks through ``kv_indices`` (any page size), loads each c_kv /
k_pe row once, converts it to the query dtype in registers and uses the c_kv tile for both products:

    s = (q_nope . c_kv^T) * sm_scale * ckv_scale + (q_pe . k_pe^T) * sm_scale * kpe_scale   (log2 units)
    o = softmax(s) . c_kv * ckv_scale

Per-tensor scales are folded into those two multipliers and the output (never per element); group scales
(one per 128 channels per token) multiply the c_kv tile in fp32 before the conversion. Online softmax in fp32
with exp2; P is rounded to the query dtype for the P.V product (never FP8). Causal masks align the queries to
the end of the request's tokens; blocks every row fully sees run without masks.

Numerics under ``fp32_dot`` (required under TRITON_INTERPRET=1, where tl.dot on bf16 is wrong): the same
16-bit operands, multiplied in fp32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
GROUP = 128  # c_kv channels per group scale (fp8mla.formats.GROUP_SIZE)


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    # Under TRITON_INTERPRET=1, tl.dot on bf16/fp16 gives wrong results without error: do it in fp32 there.
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start, kv_len, n0, qi, q_len,
              s_c, s_k, stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_gs_p, stride_gs_s,
              PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr):
    # The MMA type is the query's. Under the interpreter (fp32 dots, fp32 -> bf16 by truncation there) computed
    # values stay fp32: the interpreter checks indexing and softmax, the GPU run checks the rounding.
    dt = tl.float32 if FP32_DOT else qn.dtype
    pos = n0 + tl.arange(0, BLOCK_N)
    nmask = pos < kv_len
    # -- page table: one entry per block when pages hold whole blocks, else one per token --
    if PAGE % BLOCK_N == 0:
        page = tl.load(kv_indices + page_start + n0 // PAGE).to(tl.int64)
    elif MASKED:
        page = tl.load(kv_indices + page_start + pos // PAGE, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(kv_indices + page_start + pos // PAGE).to(tl.int64)
    slot = (pos % PAGE).to(tl.int64)
    dc = tl.arange(0, BLOCK_DC)
    dk = tl.arange(0, BLOCK_DK)
    cmask = dc[None, :] < DC
    kmask = dk[None, :] < DK
    if MASKED:  # rows past kv_len may hold anything (NaN in the tests): never load them
        cmask = cmask & nmask[:, None]
        kmask = kmask & nmask[:, None]
    c = tl.load(ckv_ptr + (page * stride_ckv_p + slot * stride_ckv_s)[:, None] + dc[None, :], mask=cmask,
                other=0.0)
    k = tl.load(kpe_ptr + (page * stride_kpe_p + slot * stride_kpe_s)[:, None] + dk[None, :], mask=kmask,
                other=0.0)
    if HAS_GROUP:
        g = tl.load(gs_ptr + (page * stride_gs_p + slot * stride_gs_s)[:, None] + (dc // GROUP_SIZE)[None, :],
                    mask=cmask, other=1.0)
        c = (c.to(tl.float32) * g).to(dt)
    else:
        c = c.to(dt)
    k = k.to(dt)
    # -- scores in log2 units; the c_kv tile serves as K here and as V below --
    s = _dot(qn, tl.trans(c), FP32_DOT) * s_c + _dot(qp, tl.trans(k), FP32_DOT) * s_k
    if MASKED:
        valid = nmask[None, :]
        if CAUSAL:
            valid = valid & (pos[None, :] <= (kv_len - q_len + qi)[:, None])
        s = tl.where(valid, s, float("-inf"))
    # -- online softmax; a row that has seen no token keeps m = -inf, so shift by 0 to avoid -inf - -inf --
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(dt), c, FP32_DOT)
    return acc, l_i, m_new


@triton.jit
def _extend_kernel(
    qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, gs_ptr, scales_ptr,
    qo_indptr, kv_indptr, kv_indices, kv_len_ptr, o_ptr, lse_ptr,
    sm_scale, H,
    stride_qn_n, stride_qn_h, stride_qp_n, stride_qp_h,
    stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_gs_p, stride_gs_s,
    stride_o_n, stride_o_h, stride_lse_n,
    PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_HB: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, FP32_DOT: tl.constexpr,
):
    # Last query blocks first: under causal masking they see the most tokens (longest programs start early).
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    qblk = pid // NUM_HB
    hb = pid % NUM_HB
    b = tl.program_id(1)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    if qblk * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_len_ptr + b)
    page_start = tl.load(kv_indptr + b).to(tl.int64)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    r = tl.arange(0, BLOCK_M)
    qi = qblk * BLOCK_Q + r // BLOCK_H          # query index within the request
    h = hb * BLOCK_H + r % BLOCK_H
    rmask = (qi < q_len) & (h < H)
    qrow = (q_start + qi).to(tl.int64)
    h64 = h.to(tl.int64)
    dc = tl.arange(0, BLOCK_DC)
    dk = tl.arange(0, BLOCK_DK)
    qn = tl.load(qn_ptr + qrow[:, None] * stride_qn_n + h64[:, None] * stride_qn_h + dc[None, :],
                 mask=rmask[:, None] & (dc[None, :] < DC), other=0.0)
    qp = tl.load(qp_ptr + qrow[:, None] * stride_qp_n + h64[:, None] * stride_qp_h + dk[None, :],
                 mask=rmask[:, None] & (dk[None, :] < DK), other=0.0)

    # Per-tensor scales come from a device tensor (no host sync); group scales are applied per tile instead.
    ckv_scale = tl.load(scales_ptr)
    kpe_scale = tl.load(scales_ptr + 1)
    if HAS_GROUP:
        ckv_scale = 1.0
    s_c = sm_scale * ckv_scale * 1.4426950408889634   # 1/ln 2: exp2 instead of exp
    s_k = sm_scale * kpe_scale * 1.4426950408889634

    if CAUSAL:
        # Query i sees tokens <= kv_len - q_len + i; the block's first query bounds the unmasked blocks.
        hi = tl.minimum(kv_len, kv_len - q_len + (qblk + 1) * BLOCK_Q)
        full = tl.minimum(hi, kv_len - q_len + qblk * BLOCK_Q + 1)
    else:
        hi = kv_len
        full = kv_len
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, l_i, m_i = _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start, kv_len,
                                  n0, qi, q_len, s_c, s_k, stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s,
                                  stride_gs_p, stride_gs_s, PAGE, DC, DK, BLOCK_DC, BLOCK_DK, BLOCK_N, HAS_GROUP,
                                  GROUP_SIZE, False, CAUSAL, FP32_DOT)
    for n0 in range(full, hi, BLOCK_N):
        acc, l_i, m_i = _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start, kv_len,
                                  n0, qi, q_len, s_c, s_k, stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s,
                                  stride_gs_p, stride_gs_s, PAGE, DC, DK, BLOCK_DC, BLOCK_DK, BLOCK_N, HAS_GROUP,
                                  GROUP_SIZE, True, CAUSAL, FP32_DOT)

    # -- epilogue: the ckv scale folded into the output; rows that saw nothing get 0 and lse -inf --
    seen = l_i > 0
    inv = tl.where(seen, ckv_scale / tl.where(seen, l_i, 1.0), 0.0)
    out = acc * inv[:, None]
    tl.store(o_ptr + qrow[:, None] * stride_o_n + h64[:, None] * stride_o_h + dc[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (dc[None, :] < DC))
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + qrow * stride_lse_n + h64, lse, mask=rmask)


def default_tiles(num_heads: int, fp32_dot: bool, has_group: bool = False) -> dict:
    """BLOCK_H, BLOCK_Q, BLOCK_N, num_warps, num_stages used when the caller gives none."""
    rows = 32 if fp32_dot else 64  # the interpreter: small tiles keep the numpy work per step low
    block_h = min(triton.next_power_of_2(num_heads), rows)
    # GPU: BLOCK_N 64, 8 warps, 2 stages measured fastest on the H200 (2026-11-29, H=128 qo 1024 kv 8192, page 64:
    # FP8 11.8 ms vs 17.0 at BLOCK_N 32; BF16 7.2 vs 10.7), although ptxas reports more spills. The group format's
    # fp32 dequantization tiles do not fit shared memory at BLOCK_N 64 (OutOfResources on the H200): 32 there.
    t = dict(block_h=block_h, block_q=max(1, rows // block_h), block_n=32 if fp32_dot or has_group else 64)
    t.update(num_warps=4, num_stages=1) if fp32_dot else t.update(num_warps=8, num_stages=2)
    return t


def mla_extend(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
               qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, *, sm_scale: float, causal: bool, scales: torch.Tensor,
               ckv_scale_arr: torch.Tensor | None, max_qo_len: int, fp32_dot: bool,
               block_h: int | None = None, block_q: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> None:
    """Launch the paged extend; writes ``out`` and ``lse`` (base 2).

    Args:
        q_nope: ``[n, H, Dc]``, q_pe: ``[n, H, Dk]`` bf16/fp16 (rows may be strided, last dim contiguous).
        ckv_cache: ``[P, page, Dc]``, kpe_cache: ``[P, page, Dk]`` fp8 e4m3/e5m2, bf16 or fp16 (strided views of
            one ``[P, page, Dc + Dk]`` pool are fine; last dim contiguous).
        qo_indptr, kv_indptr: ``[B + 1]`` int32; kv_indices: int32 page ids; kv_len: ``[B]`` int32.
        out: ``[n, H, Dc]`` query dtype; lse: ``[n, H]`` fp32 (base 2).
        sm_scale: softmax scale; causal: queries aligned to the end of their request's tokens.
        scales: fp32 ``[2]`` on the device: (ckv_scale, kpe_scale); ckv_scale is ignored with group scales.
        ckv_scale_arr: ``[P, page, Dc // 128]`` fp32 group scales, or None.
        max_qo_len: the largest query count of a request (sizes the grid; no host sync here).
        fp32_dot: do the dots in fp32 (required under TRITON_INTERPRET=1).
        block_h, block_q, block_n, num_warps, num_stages: tile overrides (see :func:`default_tiles`).
    """
    n, H, Dc = q_nope.shape
    Dk = q_pe.shape[2]
    P, page = ckv_cache.shape[:2]
    B = qo_indptr.numel() - 1
    for t in (q_nope, q_pe, ckv_cache, kpe_cache, out):
        assert t.stride(-1) == 1, "last dimension must be contiguous"
    assert q_nope.dtype in (torch.bfloat16, torch.float16) and q_pe.dtype == q_nope.dtype == out.dtype
    assert kpe_cache.shape[:2] == (P, page) and kpe_cache.dtype == ckv_cache.dtype
    assert scales.dtype == torch.float32 and scales.numel() >= 2 and scales.device == q_nope.device
    for t in (qo_indptr, kv_indptr, kv_indices, kv_len):
        assert t.dtype == torch.int32
    has_group = ckv_scale_arr is not None
    if has_group:
        assert Dc % GROUP == 0 and ckv_scale_arr.shape == (P, page, Dc // GROUP)
        assert ckv_scale_arr.dtype == torch.float32 and ckv_scale_arr.stride(-1) == 1
    if n == 0 or B == 0 or max_qo_len == 0:
        return
    t = default_tiles(H, fp32_dot, has_group)
    bh, bq, bn = block_h or t["block_h"], block_q or t["block_q"], block_n or t["block_n"]
    assert bh * bq >= 16, "tl.dot needs at least 16 rows"
    num_hb = triton.cdiv(H, bh)
    gs = ckv_scale_arr if has_group else scales  # unused pointer without group scales
    grid = (num_hb * triton.cdiv(max_qo_len, bq), B)
    _extend_kernel[grid](
        q_nope, q_pe, ckv_cache, kpe_cache, gs, scales,
        qo_indptr, kv_indptr, kv_indices, kv_len, out, lse,
        float(sm_scale), H,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
        gs.stride(0) if has_group else 0, gs.stride(1) if has_group else 0,
        out.stride(0), out.stride(1), lse.stride(0),
        PAGE=page, DC=Dc, DK=Dk, BLOCK_DC=max(16, triton.next_power_of_2(Dc)),
        BLOCK_DK=max(16, triton.next_power_of_2(Dk)), BLOCK_Q=bq, BLOCK_H=bh, BLOCK_N=bn, NUM_HB=num_hb,
        CAUSAL=bool(causal), HAS_GROUP=has_group, GROUP_SIZE=GROUP, FP32_DOT=bool(fp32_dot),
        num_warps=num_warps or t["num_warps"], num_stages=num_stages or t["num_stages"],
    )
