"""Split-KV MLA decode over a paged latent pool: BF16/FP16 queries x FP8 (or 16-bit) KV, dequantized in registers.

One program owns (work item, row tile). A work item is a contiguous token range ``[kv_start, kv_end)`` of one
request (planned on the host, see ``fp8mla.backends.triton``); a row tile is ``BLOCK_M`` (query token, head)
rows of that request, so decode heads and multi-token (MTP/speculative) queries share one tile. The program
walks its tokens ``BLOCK_N`` at a time, loads each latent row once and uses it for both products:

    s = (q_nope . c_kv + q_pe . k_pe) * sm_scale        (c_kv, k_pe dequantized)
    o = softmax(s) @ c_kv                                (V = the first 512 columns of K)

Numerics by ``KV_MODE``:
  0  (``KV_FP8_FP16_MATH``) FP8 (e4m3/e5m2) or FP16 storage with per-tensor scales: stored values convert
     exactly to fp16 (one packed cvt per pair); the MMAs run in fp16. The scales and a per-row power-of-two range
     factor are folded into Q before its fp16 rounding, and undone on the scores, so Q never overflows fp16.
     V's scale multiplies the output once.
  1  (``KV_BF16``) BF16 storage: MMAs in bf16 (an fp16 query is split into two bf16 parts, ``Q_SPLIT``).
  2  (``KV_GROUP``) FP8 e4m3 with per-token group scales (one per 128 channels of c_kv): stored values convert
     exactly to fp16 as in mode 0 and never meet their scale element-wise. The c_kv columns are processed in
     ``NCH`` chunks inside one group each: a chunk's score product is multiplied by its [tokens] scale vector in
     fp32; for P.V the scale goes into P (``p * sc / max(sc)``, so P stays <= 1 in fp16) and the tile's
     ``max(sc)`` into the chunk accumulator's running factor. Error at the per-tensor FP8 level (an earlier
     version dequantized to fp32 and rounded K/V to bf16: 5e-3..1.3e-2 lse error on the H200).
Softmax in fp32 with exp2; P is rounded to the MMA's 16-bit type, never to FP8; accumulation in fp32.

Column chunks (``NCH`` = 1, 2 or 4 chunks of ``DC // NCH`` columns): the c_kv tile is loaded, converted and
multiplied chunk by chunk, with one fp32 accumulator per chunk. ``V_CVT`` picks how the V operand is converted:
  0  ``.to(tl.float16)``: Triton converts FP8 in each MMA operand layout; for the transposed V operand that means
     byte-wise shared loads (``LDS.U8``, 256 per 64-token tile). The fastest on the H200.
  1  inline-asm packed cvt (non-pure, so Triton cannot move it into the operand layout): V is converted once in
     the load layout and staged as fp16 (ldmatrix.trans, no LDS.U8). With 128-column chunks the fp16 staging
     is 4x smaller than converting the whole 512-column tile (which cost 126 KB of shared memory). The portable
     path for SM80/89/120 (DECODE_V2.md section 4); the K operand keeps the plain conversion (its bytes are
     consecutive along the MMA's K).
``RAW_FP8`` (SM80, where Triton has no FP8 type): the pool arrives as uint8 (1: e4m3, 2: e5m2) and converts by
bit manipulation (e5m2: the byte is the high byte of the fp16; e4m3: sign | (byte & 0x7f) << 7 is the value
/ 256, the 256 folded into the score and output scales; 0x7f / 0xff are NaN).

NaN and bad input: a NaN/inf in a query, or in a used token (any channel, its group scale included), makes the
rows that read it NaN (never 0 with lse -inf, the "no keys" answer): the epilogue tells "no keys" (l == 0) from
NaN (l is NaN). Slots past kv_len and padding rows are masked at the load, so NaN there never leaks. (A NaN in a
used token can also reach rows of the same tile that causally cannot see it, through 0 x NaN in the P.V MMA.)
A page id outside ``[0, num_pages)`` is never read: its tokens score NaN, so the request's rows become NaN.

A work item that covers a whole request writes ``out``/``lse`` directly; otherwise it writes a normalized
partial (o, lse) that the split merge (``kernels.split.merge``) combines by log-sum-exp, in a fixed order
(deterministic).
"""
from __future__ import annotations

import triton
import triton.language as tl

# The modes' constants and the launch configuration live in decode_config (host side), re-exported here.
from .decode_config import (GROUP_SIZE, KV_BF16, KV_FP8_FP16_MATH, KV_GROUP, LOG2E, RAW_E4M3, RAW_E5M2, V_ASM,
                            V_CONVERT, V_PLAIN, check_tile, column_chunks, default_config, device_arch, is_pow2)
from .softmax import softmax_step

__all__ = ["GROUP_SIZE", "KV_BF16", "KV_FP8_FP16_MATH", "KV_GROUP", "LAST_COMPILED", "LOG2E", "RAW_E4M3", "RAW_E5M2",
           "V_ASM", "V_CONVERT", "V_PLAIN", "check_tile", "column_chunks", "default_config", "device_arch",
           "mla_decode"]

LAST_COMPILED = None


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    # The CPU interpreter gets 16-bit tl.dot wrong without an error: there the same (already rounded) operands
    # are multiplied in fp32.
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bits_to_fp16(x, RAW_FP8: tl.constexpr):
    """uint8 FP8 bits -> fp16 with plain integer ops. e5m2: exact value. e4m3: value / 256 (exact; NaN kept)."""
    h = x.to(tl.int16)
    if RAW_FP8 == 2:
        h = h << 8
    else:
        h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        h = tl.where((x & 0x7F) == 0x7F, 0x7E00, h)  # e4m3's only NaN codes; the shift would give 1.875
    return h.to(tl.float16, bitcast=True)


@triton.jit
def _asm_to_fp16(x, RAW_FP8: tl.constexpr):
    """FP8 -> fp16 as non-pure inline PTX, 4 values per 32-bit register: converted once, in the load layout
    (Triton may neither move it into an MMA operand layout nor duplicate it). GPU only."""
    if RAW_FP8 == 2:  # uint8 e5m2 (SM80): each byte becomes the high byte of its fp16
        return tl.inline_asm_elementwise(
            "{ prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    elif RAW_FP8 == 1:  # uint8 e4m3 (SM80): sign | (bits & 0x7f) << 7, i.e. value / 256; NaN fixed below
        h = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b, s, t; prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424;"
            " shr.b32 s, a, 1; and.b32 s, s, 0x3F803F80; and.b32 a, a, 0x80008000; or.b32 $0, a, s;"
            " shr.b32 t, b, 1; and.b32 t, t, 0x3F803F80; and.b32 b, b, 0x80008000; or.b32 $1, b, t; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
        return tl.where(tl.abs(h) == 1.875, float("nan"), h)  # 0x7f: the shift made it 1.875 (480, no e4m3 value)
    elif x.dtype == tl.float16:
        return x
    elif x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _k16(x, RAW_FP8: tl.constexpr, FP32_DOT: tl.constexpr):
    """Stored KV -> fp16 MMA operand, exact (FP8 or fp16 storage)."""
    if RAW_FP8 != 0:
        return _bits_to_fp16(x, RAW_FP8)
    elif FP32_DOT and x.dtype == tl.float8e4nv:
        # The CPU interpreter turns e4m3 NaN (0x7f) into 480 (and e5m2 NaN / inf into finite values when
        # converting to fp32); the GPU's cvt keeps them. Use the exact bit path there.
        return _bits_to_fp16(x.to(tl.uint8, bitcast=True), 1) * 256.0
    elif FP32_DOT and x.dtype == tl.float8e5:
        return _bits_to_fp16(x.to(tl.uint8, bitcast=True), 2)
    else:
        return x.to(tl.float16)


@triton.jit
def _v16(x, V_CVT: tl.constexpr, RAW_FP8: tl.constexpr, FP32_DOT: tl.constexpr):
    """Stored KV -> fp16 for the P.V operand (same values as ``_k16``; see V_CVT in the module docstring)."""
    if V_CVT == 1 and not FP32_DOT:
        return _asm_to_fp16(x, RAW_FP8)
    else:
        return _k16(x, RAW_FP8, FP32_DOT)


@triton.jit
def _load_q(q_ptr, qrow, c0, CW: tl.constexpr, row_ok):
    offs = c0 + tl.arange(0, CW)
    return tl.load(q_ptr + qrow[:, None] + offs[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_kv(ptr, row_off, c0, CW: tl.constexpr, ok, EVICT: tl.constexpr):
    # The KV stream is read once: evict_first keeps it from pushing Q and the partials out of L2.
    offs = c0 + tl.arange(0, CW)
    return tl.load(ptr + row_off[:, None] + offs[None, :], mask=ok[:, None], other=0.0, eviction_policy=EVICT)


@triton.jit
def _score(s, qn, c, sc, KV_MODE: tl.constexpr, RAW_FP8: tl.constexpr, FP32_DOT: tl.constexpr):
    """Adds one column chunk's q_nope . c_kv^T to the scores (group mode: times the chunk's token scales)."""
    k = _k16(c, RAW_FP8, FP32_DOT)
    if KV_MODE == 2:
        return s + _dot(qn, tl.trans(k), tl.zeros_like(s), FP32_DOT) * sc[None, :]
    else:
        return _dot(qn, tl.trans(k), s, FP32_DOT)


@triton.jit
def _pv(acc, f, p, alpha, c, sc, KV_MODE: tl.constexpr, V_CVT: tl.constexpr, RAW_FP8: tl.constexpr,
        FP32_DOT: tl.constexpr):
    """One column chunk of ``acc = acc * alpha + p . V``; returns (acc, f) where the chunk's output is ``acc * f``.

    Group mode: P carries the token scales relative to their tile maximum ``m`` (<= 1, so fp16 keeps its
    precision whatever the scales' magnitude), and ``m`` becomes the accumulator's factor ``f``: rescaling the
    accumulator by ``alpha * f_old / m`` costs nothing beyond the ``alpha`` multiply every tile pays anyway."""
    v = _v16(c, V_CVT, RAW_FP8, FP32_DOT)
    if KV_MODE == 2:
        m = tl.max(sc, axis=0)
        m = tl.where(m > 0, m, 1.0)
        pg = (p * (sc / m)[None, :]).to(tl.float16)
        acc = _dot(pg, v, acc * (alpha * (f / m))[:, None], FP32_DOT)
        return acc, m
    else:
        return _dot(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT), f


@triton.jit
def _store_chunk(out, orow, c0, CW: tl.constexpr, stride_c, o, row_ok):
    offs = c0 + tl.arange(0, CW)
    tl.store(out + orow[:, None] + offs[None, :].to(tl.int64) * stride_c, o.to(out.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _store_row(dst, orow, stride_c, o0, o1, o2, o3, row_ok, CW: tl.constexpr, NCH: tl.constexpr):
    _store_chunk(dst, orow, 0, CW, stride_c, o0, row_ok)
    if NCH > 1:
        _store_chunk(dst, orow, CW, CW, stride_c, o1, row_ok)
    if NCH > 2:
        _store_chunk(dst, orow, 2 * CW, CW, stride_c, o2, row_ok)
        _store_chunk(dst, orow, 3 * CW, CW, stride_c, o3, row_ok)


@triton.jit
def _mla_decode_kernel(
    q_nope, q_pe, ckv, kpe, scale_arr, scales,
    out, lse_out, part_o, part_lse,
    qo_indptr, kv_indptr, kv_indices, kv_len,
    item_req, item_start, item_end, item_part, num_items,
    sm_scale_log2, H, num_pages,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_sa_p, stride_sa_s, stride_sa_g,
    stride_o_t, stride_o_h, stride_o_c, stride_lse_t, stride_lse_h,
    stride_po_i, stride_po_r, stride_pl_i,
    PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    CAUSAL: tl.constexpr, KV_MODE: tl.constexpr, FP32_DOT: tl.constexpr, Q_SPLIT: tl.constexpr,
    EVICT: tl.constexpr, IDX64: tl.constexpr, NCH: tl.constexpr, V_CVT: tl.constexpr, RAW_FP8: tl.constexpr,
):
    CW: tl.constexpr = DC // NCH
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
    # int64 offsets: n * stride can pass 2^31 for large batches.
    tok64 = (q0 + tok).to(tl.int64)
    qn_row = tok64 * stride_qn_t + head * stride_qn_h
    qp32 = _load_q(q_pe, tok64 * stride_qp_t + head * stride_qp_h, 0, DK, row_ok)
    qn0 = _load_q(q_nope, qn_row, 0, CW, row_ok)
    if NCH > 1:
        qn1 = _load_q(q_nope, qn_row, CW, CW, row_ok)
    if NCH > 2:
        qn2 = _load_q(q_nope, qn_row, 2 * CW, CW, row_ok)
        qn3 = _load_q(q_nope, qn_row, 3 * CW, CW, row_ok)
    ckv_scale = tl.load(scales)
    kpe_scale = tl.load(scales + 1)
    # RAW e4m3 converts to value / 256 (see _bits_to_fp16): the 256 goes into the score and output scales.
    raw_f = 256.0 if RAW_FP8 == 1 else 1.0

    # -- queries in the MMA type, scales folded in --------------------------------------------------------
    if KV_MODE == 1:
        qn_m0 = qn0
        qp_m = qp32
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale_log2
        if Q_SPLIT and not FP32_DOT:
            # An fp16 query loses 3 bits in bf16: split it into hi + lo bf16 parts and do the score MMAs twice
            # (only in this uncommon pairing), so Q keeps fp16 precision.
            qn_lo = (qn_m0 - qn_m0.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
            qp_lo = (qp_m - qp_m.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        # bf16 for the MMAs (fp32 under the interpreter, which rounds fp32 -> bf16 by truncation: skip it there)
        qn_m0 = qn_m0.to(tl.float32 if FP32_DOT else tl.bfloat16)
        qp_m = qp_m.to(tl.float32 if FP32_DOT else tl.bfloat16)
    else:
        # fp16 MMAs. Per-tensor mode folds ckv_scale into q_nope; kpe_scale always goes into q_pe.
        c_fold = ckv_scale if KV_MODE == 0 else 1.0
        qp32 = qp32 * kpe_scale
        amax = tl.max(tl.abs(qp32), axis=1)
        qn0 = qn0 * c_fold
        amax = tl.maximum(amax, tl.max(tl.abs(qn0), axis=1))
        if NCH > 1:
            qn1 = qn1 * c_fold
            amax = tl.maximum(amax, tl.max(tl.abs(qn1), axis=1))
        if NCH > 2:
            qn2 = qn2 * c_fold
            qn3 = qn3 * c_fold
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(qn2), axis=1), tl.max(tl.abs(qn3), axis=1)))
        # Largest |q| lands near 2^14: far from fp16's 65504, and small entries stay normal. (A row with inf
        # gets f = 0 and scores NaN: non-finite in, NaN out.)
        f = tl.where(amax > 0, tl.exp2(tl.floor(tl.log2(16384.0 / amax))), 1.0)
        # Rounded to fp16 (what the MMA sees); under the interpreter kept in fp32 after that rounding.
        qp_m = (qp32 * f[:, None]).to(tl.float16)
        qn_m0 = (qn0 * f[:, None]).to(tl.float16)
        if NCH > 1:
            qn_m1 = (qn1 * f[:, None]).to(tl.float16)
        if NCH > 2:
            qn_m2 = (qn2 * f[:, None]).to(tl.float16)
            qn_m3 = (qn3 * f[:, None]).to(tl.float16)
        row_scale = sm_scale_log2 * raw_f / f

    # Query token i sees kv positions <= L - qo_len + i (causal, aligned to the end).
    if CAUSAL:
        last = L - qo_len + tok
    else:
        last = tl.full([BLOCK_M], 0, tl.int32) + (L - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, CW], tl.float32)
    f0 = tl.full((), 1.0, tl.float32)  # group mode: chunk output = acc * f (see _pv)
    if NCH > 1:
        acc1 = tl.zeros([BLOCK_M, CW], tl.float32)
        f1 = tl.full((), 1.0, tl.float32)
    if NCH > 2:
        acc2 = tl.zeros([BLOCK_M, CW], tl.float32)
        acc3 = tl.zeros([BLOCK_M, CW], tl.float32)
        f2 = tl.full((), 1.0, tl.float32)
        f3 = tl.full((), 1.0, tl.float32)
    for start in tl.range(kv_s, kv_e, BLOCK_N, num_stages=NUM_STAGES):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < kv_e
        # One page id per row, as a vector load: the pipeliner prefetches it with the tile. (A scalar id per
        # tile, when pages hold whole tiles, measured 30% slower on the H200: scalar loads are not pipelined.)
        page = tl.load(kv_indices + page_base + t // PAGE, mask=t_ok, other=0)
        # A page id outside the pool is never read; its tokens score NaN below (the request's rows become NaN).
        ld_ok = t_ok & (page >= 0) & (page < num_pages)
        slot = t % PAGE
        if IDX64:  # pools past 2^31 elements; otherwise int32 offsets keep the address registers down
            page = page.to(tl.int64)
            slot = slot.to(tl.int64)
        ck_row = page * stride_ckv_p + slot * stride_ckv_s
        kp = _load_kv(kpe, page * stride_kpe_p + slot * stride_kpe_s, 0, DK, ld_ok, EVICT)
        c0 = _load_kv(ckv, ck_row, 0, CW, ld_ok, EVICT)
        if NCH > 1:
            c1 = _load_kv(ckv, ck_row, CW, CW, ld_ok, EVICT)
        if NCH > 2:
            c2 = _load_kv(ckv, ck_row, 2 * CW, CW, ld_ok, EVICT)
            c3 = _load_kv(ckv, ck_row, 3 * CW, CW, ld_ok, EVICT)
        if KV_MODE == 2:
            # [tokens] scale vector of each chunk's group (masked slots: 0, their P is 0 anyway)
            sa_row = scale_arr + page * stride_sa_p + slot * stride_sa_s
            sc0 = tl.load(sa_row, mask=ld_ok, other=0.0)
            if NCH > 1:
                sc1 = tl.load(sa_row + (CW // GROUP) * stride_sa_g, mask=ld_ok, other=0.0)
            if NCH > 2:
                sc2 = tl.load(sa_row + (2 * CW // GROUP) * stride_sa_g, mask=ld_ok, other=0.0)
                sc3 = tl.load(sa_row + (3 * CW // GROUP) * stride_sa_g, mask=ld_ok, other=0.0)
        else:
            sc0 = 0.0
            sc1 = 0.0
            sc2 = 0.0
            sc3 = 0.0
        # -- scores ---------------------------------------------------------------------------------------
        if KV_MODE == 1:  # bf16 storage, one chunk
            s = _dot(qp_m, tl.trans(kp), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), FP32_DOT)
            s = _dot(qn_m0, tl.trans(c0), s, FP32_DOT)
            if Q_SPLIT and not FP32_DOT:
                s = _dot(qn_lo, tl.trans(c0), s, FP32_DOT)
                s = _dot(qp_lo, tl.trans(kp), s, FP32_DOT)
        else:
            s = _dot(qp_m, tl.trans(_k16(kp, RAW_FP8, FP32_DOT)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), FP32_DOT)
            s = _score(s, qn_m0, c0, sc0, KV_MODE, RAW_FP8, FP32_DOT)
            if NCH > 1:
                s = _score(s, qn_m1, c1, sc1, KV_MODE, RAW_FP8, FP32_DOT)
            if NCH > 2:
                s = _score(s, qn_m2, c2, sc2, KV_MODE, RAW_FP8, FP32_DOT)
                s = _score(s, qn_m3, c3, sc3, KV_MODE, RAW_FP8, FP32_DOT)
        s = s * row_scale[:, None]
        visible = ld_ok[None, :] & (t[None, :] <= last[:, None])
        fill = tl.where(ld_ok, float("-inf"), tl.where(t_ok, float("nan"), float("-inf")))
        s = tl.where(visible, s, fill[None, :])
        # -- online softmax (log2 domain) -----------------------------------------------------------------
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)  # kernels/softmax.py: NaN and "no keys" rules
        if KV_MODE == 1:
            pb = p.to(tl.float32 if FP32_DOT else tl.bfloat16)
            acc0 = _dot(pb, c0, acc0 * alpha[:, None], FP32_DOT)
        else:
            acc0, f0 = _pv(acc0, f0, p, alpha, c0, sc0, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
            if NCH > 1:
                acc1, f1 = _pv(acc1, f1, p, alpha, c1, sc1, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
            if NCH > 2:
                acc2, f2 = _pv(acc2, f2, p, alpha, c2, sc2, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
                acc3, f3 = _pv(acc3, f3, p, alpha, c3, sc3, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
        m_i = m_new

    # -- epilogue: "no keys" is l == 0 (out 0, lse -inf); NaN anywhere gave l = NaN and stays NaN ----------------
    empty = l_i == 0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    if KV_MODE == 0:
        inv = inv * (ckv_scale * raw_f)
    elif KV_MODE == 2:
        inv = inv * raw_f
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    # where(), not a multiply: an empty row's accumulator may hold 0 x NaN from a causally hidden token.
    o0 = tl.where(empty[:, None], 0.0, acc0 * (inv * f0)[:, None])
    o1 = o0  # placeholders for the chunks this NCH does not have
    o2 = o0
    o3 = o0
    if NCH > 1:
        o1 = tl.where(empty[:, None], 0.0, acc1 * (inv * f1)[:, None])
    if NCH > 2:
        o2 = tl.where(empty[:, None], 0.0, acc2 * (inv * f2)[:, None])
        o3 = tl.where(empty[:, None], 0.0, acc3 * (inv * f3)[:, None])
    if part < 0:
        tl.store(lse_out + tok64 * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
        _store_row(out, tok64 * stride_o_t + head * stride_o_h, stride_o_c, o0, o1, o2, o3, row_ok, CW, NCH)
    else:
        part64 = part.to(tl.int64)
        tl.store(part_lse + part64 * stride_pl_i + rows, lse, mask=row_ok)
        _store_row(part_o, part64 * stride_po_i + rows.to(tl.int64) * stride_po_r, 1, o0, o1, o2, o3, row_ok,
                   CW, NCH)


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale_arr, scales, out, lse, part_o, part_lse,
               qo_indptr, kv_indptr, kv_indices, kv_len, item_req, item_start, item_end, item_part, num_items,
               split_indptr, batch_size, *, grid_items: int, grid_batch: int, num_heads: int, max_rows: int,
               sm_scale: float, causal: bool, kv_mode: int, block_m: int, block_n: int, num_warps: int,
               num_stages: int, fp32_dot: bool, q_split: bool = False, evict_first: bool = True,
               index64: bool | None = None, v_convert: str | None = None,
               raw_fp8: int = 0, column_chunks_override: int | None = None, invariant_merge: bool = False) -> None:
    """Launches the split kernel and the split merge (``kernels.split.merge``). ``lse`` is written base 2.

    Shapes: q_nope ``[n, H, Dc]``, q_pe ``[n, H, Dk]``, ckv_cache ``[P, page, Dc]``, kpe_cache ``[P, page, Dk]``
    (strided views of one pool are fine; last dim contiguous), scales fp32 ``[2]`` = (ckv_scale, kpe_scale),
    ckv_scale_arr ``[P, page, Dc // 128]`` fp32 or None, part_o ``[items, max_rows, Dc]`` fp32,
    part_lse ``[items, max_rows]`` fp32; the index/work arrays are int32 device tensors (see the plan);
    ``num_items`` and ``batch_size`` are 1-element int32 device tensors so a captured graph can be re-planned.
    ``out``, ``lse`` and ``ckv_scale_arr`` may have any strides (a transposed ``lse`` is fine).
    ``q_split``: bf16 MMAs (kv_mode 1) with an fp16 query: the query is split into two bf16 parts (ignored in the other
    modes, which run fp16 MMAs). ``v_convert``: ``"plain"`` or ``"asm"`` (V converted by inline PTX in 128-column
    chunks: no byte-wise shared loads; the portable path); None picks :func:`default_config`'s for the device (plain on
    sm_90 and the interpreter, asm elsewhere). ``raw_fp8``: 1 / 2 when the FP8 pool comes as uint8 holding e4m3 / e5m2
    bits; an FP8 pool on a GPU older than sm_89 (where Triton has no FP8 type) is viewed as uint8 automatically. Page
    ids outside ``[0, P)`` are never read: the request's rows come out NaN. ``invariant_merge``: every request's
    partials merged by the sequential formula with fixed block sizes (the batch-invariant mode).
    """
    P, page, Dc = ckv_cache.shape
    Dk = kpe_cache.shape[-1]
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
    check_tile("block_m", block_m)
    check_tile("block_n", block_n)
    if not is_pow2(Dc) or Dc < 16 or not is_pow2(Dk) or Dk < 16:
        raise ValueError(f"head_dim_ckv/head_dim_kpe: expected powers of two >= 16, got {Dc}/{Dk}")
    arch = device_arch(ckv_cache)
    if v_convert is None:
        v_convert = default_config(max_rows, kv_mode, arch)["v_convert"]
    if arch is not None and arch < 89 and str(ckv_cache.dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
        import torch  # SM80: no FP8 type in Triton; the same bytes as uint8, converted by bit manipulation
        raw_fp8 = RAW_E4M3 if ckv_cache.dtype == torch.float8_e4m3fn else RAW_E5M2
        ckv_cache, kpe_cache = ckv_cache.view(torch.uint8), kpe_cache.view(torch.uint8)
    if v_convert not in V_CONVERT:
        raise ValueError(f"v_convert: expected one of {sorted(V_CONVERT)}, got {v_convert!r}")
    v_cvt = V_CONVERT[v_convert]
    if str(ckv_cache.dtype) == "torch.uint8" and raw_fp8 not in (RAW_E4M3, RAW_E5M2):
        raise ValueError(f"raw_fp8: a uint8 pool needs raw_fp8={RAW_E4M3} (e4m3 bits) or {RAW_E5M2} (e5m2), "
                         f"got {raw_fp8!r}")
    if raw_fp8 and (str(ckv_cache.dtype) != "torch.uint8" or kv_mode == KV_BF16):
        raise ValueError(f"raw_fp8: only for FP8 pools passed as uint8, got a {ckv_cache.dtype} pool "
                         f"in kv_mode {kv_mode}")
    if kv_mode == KV_GROUP:
        if ckv_scale_arr is None or tuple(ckv_scale_arr.shape) != (P, page, Dc // GROUP_SIZE):
            got = None if ckv_scale_arr is None else tuple(ckv_scale_arr.shape)
            raise ValueError(f"ckv_scale_arr: expected shape {(P, page, Dc // GROUP_SIZE)}, got {got}")
        if Dc % GROUP_SIZE or Dc > 4 * GROUP_SIZE:
            raise ValueError(f"head_dim_ckv: the group format's triton decode takes 128, 256 or 512, got {Dc}")
    nch = column_chunks_override or column_chunks(kv_mode, Dc, v_cvt)
    if nch not in (1, 2, 4) or Dc // nch < 16 or (kv_mode == KV_GROUP and Dc // nch > GROUP_SIZE) or \
            (kv_mode == KV_BF16 and nch != 1):
        raise ValueError(f"column_chunks_override: {nch} chunks do not fit head_dim_ckv {Dc} in kv_mode {kv_mode}")
    sa = ckv_scale_arr if ckv_scale_arr is not None else scales
    if index64 is None:  # the largest element offset a KV load can form
        span = max((P - 1) * t.stride(0) + (page - 1) * t.stride(1) + t.shape[-1] for t in (ckv_cache, kpe_cache))
        if ckv_scale_arr is not None:
            span = max(span, sum((s - 1) * st for s, st in zip(ckv_scale_arr.shape, ckv_scale_arr.stride())) + 1)
        index64 = span >= 2**31
    sa_st = tuple(ckv_scale_arr.stride()) if ckv_scale_arr is not None else (0, 0, 0)
    grid = (grid_items, triton.cdiv(max_rows, block_m))
    compiled = _mla_decode_kernel[grid](
        q_nope, q_pe, ckv_cache, kpe_cache, sa, scales, out, lse, part_o, part_lse,
        qo_indptr, kv_indptr, kv_indices, kv_len, item_req, item_start, item_end, item_part, num_items,
        sm_scale * LOG2E, num_heads, P,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1), *sa_st,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        PAGE=page, DC=Dc, DK=Dk, GROUP=GROUP_SIZE, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages,
        CAUSAL=causal, KV_MODE=kv_mode, FP32_DOT=fp32_dot, Q_SPLIT=q_split and kv_mode == KV_BF16 and not fp32_dot,
        EVICT="evict_first" if evict_first else "", IDX64=index64, NCH=nch, V_CVT=v_cvt, RAW_FP8=raw_fp8,
        num_warps=num_warps,
    )
    global LAST_COMPILED  # registers / shared memory / spills of the last launch, for `bench decode --sweep`
    LAST_COMPILED = compiled
    from .split.merge import INVARIANT_BLOCKS, SEQ_ALWAYS, SEQ_PARTS, merge_requests
    # split_indptr lists each request's items; item_part maps an item to its partial (items of a request that is
    # not split have none: the merge skips requests of fewer than 2 items)
    merge_requests(out, lse, part_o, part_lse, qo_indptr, split_indptr, item_part, batch_size,
                   grid_batch=grid_batch, max_rows=max_rows, num_heads=num_heads, block_p=INVARIANT_BLOCKS[0],
                   block_c=INVARIANT_BLOCKS[1], seq=SEQ_ALWAYS if invariant_merge else SEQ_PARTS)
