"""Split-KV MLA decode over a paged latent pool: BF16/FP16 queries x FP8 (or 16-bit) KV, dequantized in registers.

One program owns (work item, row tile). A work item is a contiguous token range ``[kv_start, kv_end)`` of one
request (planned on the host, see ``fp8mla._triton_backend``); a row tile is ``BLOCK_M`` (query token, head)
rows of that request, so decode heads and multi-token (MTP/speculative) queries share one tile. The program
walks its tokens ``BLOCK_N`` at a time, loads each latent row once and uses it for both products:

    s = (q_nope . c_kv + q_pe . k_pe) * sm_scale        (c_kv, k_pe dequantized)
    o = softmax(s) @ c_kv                                (V = the first 512 columns of K)

Numerics by ``KV_MODE``:
  0  FP8 (e4m3/e5m2) or FP16 storage with per-tensor scales: stored values convert exactly to fp16 (one
     packed cvt per pair); the MMAs run in fp16. The scales and a per-row power-of-two range factor are folded
     into Q before its fp16 rounding, and undone on the scores, so Q never overflows fp16. V's scale multiplies
     the output once.
  1  BF16 storage: MMAs in bf16 (queries converted to bf16 if they are fp16).
  2  FP8 e4m3 with per-token group scales (one per 128 channels of c_kv): dequantized in fp32, MMAs in bf16.
Softmax in fp32 with exp2; P is rounded to the MMA's 16-bit type, never to FP8; accumulation in fp32.

A work item that covers a whole request writes ``out``/``lse`` directly; otherwise it writes a normalized
partial (o, lse) that ``_merge_kernel`` combines by log-sum-exp, in a fixed order (deterministic).
"""
from __future__ import annotations

import triton
import triton.language as tl

KV_FP16_MATH, KV_BF16, KV_GROUP = 0, 1, 2
LAST_COMPILED = None


@triton.jit
def _to_fp16(x, ASM: tl.constexpr):
    """FP8 -> fp16. With ``ASM``: packed cvt (4 values per 32-bit register) as inline PTX (GPU only).

    Written as non-pure asm so that the compiler can neither move it into the MMA operand layouts nor
    duplicate it: the tile is converted once, right after its (pipelined, 16-byte cp.async) load, and staged
    in shared memory as fp16 for both MMAs. With a plain ``.to(tl.float16)`` Triton 3.6 converts twice, after
    reading FP8 in each operand layout: byte-wise ``LDS.U8`` for the transposed one (256 per tile at BLOCK_N 64),
    a synchronous load of the c_kv tile (not pipelined) and 256 B of spills (SASS of sm_90, ptxas -v).
    FP16 storage passes through.

    Measured on the H200 (2026-11-29) the asm path is nevertheless slower at H=16 (0.292 vs 0.211 ms at B64
    L8192): staging fp16 takes 126 KB of shared memory, one program per SM instead of two. Kept as the kernel
    option ``cvt_asm`` for tuning; the default is the plain conversion.
    """
    if not ASM or x.dtype == tl.float16:
        return x.to(tl.float16)
    elif x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _mla_decode_kernel(
    q_nope, q_pe, ckv, kpe, scale_arr, scales,
    out, lse_out, part_o, part_lse,
    qo_indptr, kv_indptr, kv_indices, kv_len,
    item_req, item_start, item_end, item_part, num_items,
    sm_scale_log2, H,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_sa_p, stride_sa_s,
    stride_o_t, stride_o_h, stride_lse_t,
    stride_po_i, stride_po_r, stride_pl_i,
    PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    CAUSAL: tl.constexpr, KV_MODE: tl.constexpr, FP32_DOT: tl.constexpr, Q_SPLIT: tl.constexpr,
    EVICT: tl.constexpr, IDX64: tl.constexpr, CVT_ASM: tl.constexpr,
):
    item = tl.program_id(0)
    if item >= tl.load(num_items):
        return
    b = tl.load(item_req + item)
    q0 = tl.load(qo_indptr + b)
    qo_len = tl.load(qo_indptr + b + 1) - q0
    row0 = tl.program_id(1) * BLOCK_M
    if row0 >= qo_len * H:
        return
    kv_s = tl.load(item_start + item)
    kv_e = tl.load(item_end + item)
    part = tl.load(item_part + item)
    L = tl.load(kv_len + b)
    page_base = tl.load(kv_indptr + b).to(tl.int64)

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // H
    head = rows % H
    row_ok = tok < qo_len
    offs_c = tl.arange(0, DC)
    offs_k = tl.arange(0, DK)
    # int64 offsets: n * stride can pass 2^31 for large batches.
    tok64 = (q0 + tok).to(tl.int64)
    qn = tl.load(q_nope + tok64[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_c[None, :],
                 mask=row_ok[:, None], other=0.0)
    qp = tl.load(q_pe + tok64[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_k[None, :],
                 mask=row_ok[:, None], other=0.0)
    ckv_scale = tl.load(scales)
    kpe_scale = tl.load(scales + 1)

    # -- queries in the MMA type, scales folded in --------------------------------------------------------
    if KV_MODE == 0:
        qn32 = qn.to(tl.float32) * ckv_scale
        qp32 = qp.to(tl.float32) * kpe_scale
        amax = tl.maximum(tl.max(tl.abs(qn32), axis=1), tl.max(tl.abs(qp32), axis=1))
        # Largest |q| lands near 2^14: far from fp16's 65504, and small entries stay normal.
        f = tl.where(amax > 0, tl.exp2(tl.floor(tl.log2(16384.0 / amax))), 1.0)
        qn_m = (qn32 * f[:, None]).to(tl.float16)
        qp_m = (qp32 * f[:, None]).to(tl.float16)
        row_scale = sm_scale_log2 / f
    elif KV_MODE == 1:
        qn_m = qn
        qp_m = qp
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_log2
    else:
        qn_m = qn
        qp_m = qp.to(tl.float32) * kpe_scale
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_log2
    if KV_MODE != 0 and not FP32_DOT:
        # bf16 MMAs. An fp16 (or scaled) query loses 3 bits in bf16: split it into hi + lo bf16 parts and
        # do the score MMAs twice (only in this uncommon pairing), so Q keeps fp16 precision.
        qn_lo = (qn_m.to(tl.float32) - qn_m.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        qp_lo = (qp_m.to(tl.float32) - qp_m.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        qn_m = qn_m.to(tl.bfloat16)
        qp_m = qp_m.to(tl.bfloat16)
    # The CPU interpreter gets 16-bit tl.dot wrong (and rounds fp32 -> bf16 by truncation): there the dots
    # run in fp32 on the same stored values, and rounding to bf16 of computed values is skipped.
    if FP32_DOT:
        qn_m = qn_m.to(tl.float32)
        qp_m = qp_m.to(tl.float32)

    # Query token i sees kv positions <= L - qo_len + i (causal, aligned to the end).
    if CAUSAL:
        last = L - qo_len + tok
    else:
        last = tl.full([BLOCK_M], 0, tl.int32) + (L - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DC], tl.float32)
    for start in tl.range(kv_s, kv_e, BLOCK_N, num_stages=NUM_STAGES):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < kv_e
        # One page id per row, as a vector load: the pipeliner prefetches it with the tile. (A scalar id per
        # tile, when pages hold whole tiles, measured 30% slower on the H200: scalar loads are not pipelined.)
        page = tl.load(kv_indices + page_base + t // PAGE, mask=t_ok, other=0)
        slot = t % PAGE
        if IDX64:  # pools past 2^31 elements; otherwise int32 offsets keep the address registers down
            page = page.to(tl.int64)
            slot = slot.to(tl.int64)
        # The KV stream is read once: evict_first keeps it from pushing Q and the partials out of L2.
        ck = tl.load(ckv + (page * stride_ckv_p + slot * stride_ckv_s)[:, None] + offs_c[None, :],
                     mask=t_ok[:, None], other=0.0, eviction_policy=EVICT)
        kp = tl.load(kpe + (page * stride_kpe_p + slot * stride_kpe_s)[:, None] + offs_k[None, :],
                     mask=t_ok[:, None], other=0.0, eviction_policy=EVICT)
        # -- dequantize in registers ----------------------------------------------------------------------
        if KV_MODE == 0:
            ck_m = _to_fp16(ck, CVT_ASM and not FP32_DOT)
            kp_m = _to_fp16(kp, CVT_ASM and not FP32_DOT)
        elif KV_MODE == 1:
            ck_m = ck
            kp_m = kp
        else:
            # [N, G] scales, broadcast over each group's 128 channels in registers (no [N, DC] gather).
            sc = tl.load(scale_arr + (page * stride_sa_p + slot * stride_sa_s)[:, None]
                         + tl.arange(0, DC // GROUP)[None, :], mask=t_ok[:, None], other=0.0)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, DC // GROUP, GROUP]), [BLOCK_N, DC])
            ck_m = ck.to(tl.float32) * sc
            if not FP32_DOT:
                ck_m = ck_m.to(tl.bfloat16)
            kp_m = kp.to(tl.bfloat16)
        if FP32_DOT:
            ck_m = ck_m.to(tl.float32)
            kp_m = kp_m.to(tl.float32)
        # -- scores ---------------------------------------------------------------------------------------
        s = tl.dot(qn_m, tl.trans(ck_m))
        s = tl.dot(qp_m, tl.trans(kp_m), s)
        if Q_SPLIT:
            s = tl.dot(qn_lo, tl.trans(ck_m), s)
            s = tl.dot(qp_lo, tl.trans(kp_m), s)
        s = s * row_scale[:, None]
        visible = t_ok[None, :] & (t[None, :] <= last[:, None])
        s = tl.where(visible, s, float("-inf"))
        # -- online softmax (log2 domain) -----------------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(ck_m.dtype), ck_m, acc)
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_MODE == 0:
        o = o * ckv_scale
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if part < 0:
        tl.store(out + tok64[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_c[None, :],
                 o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_out + tok64 * stride_lse_t + head, lse, mask=row_ok)
    else:
        part64 = part.to(tl.int64)
        tl.store(part_o + part64 * stride_po_i + rows[:, None].to(tl.int64) * stride_po_r + offs_c[None, :], o,
                 mask=row_ok[:, None])
        tl.store(part_lse + part64 * stride_pl_i + rows, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    out, lse_out, part_o, part_lse, qo_indptr, split_indptr, item_part, batch_size, H,
    stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
    DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Combines the partials of requests split over several work items (others were written directly).
    One program per (request, BLOCK_R rows, BLOCK_C columns): a long request's many partials are read by many
    SMs at once, not one."""
    b = tl.program_id(0)
    if b >= tl.load(batch_size):
        return
    i0 = tl.load(split_indptr + b)
    i1 = tl.load(split_indptr + b + 1)
    if i1 - i0 < 2:
        return
    q0 = tl.load(qo_indptr + b)
    qo_len = tl.load(qo_indptr + b + 1) - q0
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < qo_len * H
    if tl.program_id(1) * BLOCK_R >= qo_len * H:
        return
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i in range(i0, i1):
        p = tl.load(item_part + i).to(tl.int64)
        m = tl.maximum(m, tl.load(part_lse + p * stride_pl_i + rows, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for i in range(i0, i1):
        p = tl.load(item_part + i).to(tl.int64)
        lse_i = tl.load(part_lse + p * stride_pl_i + rows, mask=row_ok, other=float("-inf"))
        w = tl.exp2(lse_i - m_use)
        o_i = tl.load(part_o + p * stride_po_i + rows[:, None].to(tl.int64) * stride_po_r + offs_c[None, :],
                      mask=row_ok[:, None], other=0.0)
        acc += w[:, None] * o_i
        w_sum += w
    seen = w_sum > 0
    o = acc / tl.where(seen, w_sum, 1.0)[:, None]
    tok = (q0 + rows // H).to(tl.int64)
    head = rows % H
    tl.store(out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_c[None, :],
             o.to(out.dtype.element_ty), mask=row_ok[:, None])
    if tl.program_id(2) == 0:
        lse = tl.where(seen, m_use + tl.log2(tl.where(seen, w_sum, 1.0)), float("-inf"))
        tl.store(lse_out + tok * stride_lse_t + head, lse, mask=row_ok)


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale_arr, scales, out, lse, part_o, part_lse,
               qo_indptr, kv_indptr, kv_indices, kv_len, item_req, item_start, item_end, item_part, num_items,
               split_indptr, batch_size, *, grid_items: int, grid_batch: int, num_heads: int, max_rows: int,
               sm_scale: float, causal: bool, kv_mode: int, block_m: int, block_n: int, num_warps: int,
               num_stages: int, fp32_dot: bool, q_split: bool = False, evict_first: bool = True,
               index64: bool | None = None, cvt_asm: bool = False) -> None:
    """Launches the split kernel and the merge kernel. ``lse`` is written base 2.

    Shapes: q_nope ``[n, H, Dc]``, q_pe ``[n, H, Dk]``, ckv_cache ``[P, page, Dc]``, kpe_cache ``[P, page, Dk]``
    (strided views of one pool are fine; last dim contiguous), scales fp32 ``[2]`` = (ckv_scale, kpe_scale),
    ckv_scale_arr ``[P, page, Dc // 128]`` fp32 or None, part_o ``[items, max_rows, Dc]`` fp32,
    part_lse ``[items, max_rows]`` fp32; the index/work arrays are int32 device tensors (see the plan);
    ``num_items`` and ``batch_size`` are 1-element int32 device tensors so a captured graph can be re-planned.
    ``q_split``: bf16 MMAs (kv_mode 1, 2) with a query that bf16 cannot hold exactly (fp16, or scaled by kpe_scale
    in the group mode): the query is split into two bf16 parts.
    """
    P, page, Dc = ckv_cache.shape
    Dk = kpe_cache.shape[-1]
    sa = ckv_scale_arr if ckv_scale_arr is not None else scales
    if index64 is None:  # the largest element offset a KV load can form
        span = max((P - 1) * t.stride(0) + (page - 1) * t.stride(1) + t.shape[-1] for t in (ckv_cache, kpe_cache))
        if ckv_scale_arr is not None:
            span = max(span, ckv_scale_arr.numel())
        index64 = span >= 2**31
    sa_p, sa_s = (ckv_scale_arr.stride(0), ckv_scale_arr.stride(1)) if ckv_scale_arr is not None else (0, 0)
    LOG2E = 1.4426950408889634
    grid = (grid_items, triton.cdiv(max_rows, block_m))
    compiled = _mla_decode_kernel[grid](
        q_nope, q_pe, ckv_cache, kpe_cache, sa, scales, out, lse, part_o, part_lse,
        qo_indptr, kv_indptr, kv_indices, kv_len, item_req, item_start, item_end, item_part, num_items,
        sm_scale * LOG2E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1), sa_p, sa_s,
        out.stride(0), out.stride(1), lse.stride(0),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        PAGE=page, DC=Dc, DK=Dk, GROUP=128, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages,
        CAUSAL=causal, KV_MODE=kv_mode, FP32_DOT=fp32_dot, Q_SPLIT=q_split and not fp32_dot,
        EVICT="evict_first" if evict_first else "", IDX64=index64, CVT_ASM=cvt_asm,
        num_warps=num_warps,
    )
    global LAST_COMPILED  # registers / shared memory / spills of the last launch, for `bench decode --sweep`
    LAST_COMPILED = compiled
    block_r, block_c = 8, 64
    _merge_kernel[(grid_batch, triton.cdiv(max_rows, block_r), triton.cdiv(Dc, block_c))](
        out, lse, part_o, part_lse, qo_indptr, split_indptr, item_part, batch_size, num_heads,
        out.stride(0), out.stride(1), lse.stride(0), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        DC=Dc, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
