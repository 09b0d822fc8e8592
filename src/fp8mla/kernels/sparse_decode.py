"""Sparse (DSA) MLA over a paged latent pool: each query token attends to the cached tokens its index row names.

One program owns (query token, head tile, split). A split is a contiguous range of the token's index row
(``indices[t, j0:j1]``, global slots ``page * PAGE + offset``, -1 = none); the program walks it ``BLOCK_N``
entries at a time, gathers the selected rows, dequantizes them in registers and uses each row for both products:

    s = (q_nope . c_kv + q_pe . k_pe) * sm_scale       o = softmax(s) @ c_kv

Formats and numerics (``KV_MODE`` as in ``kernels/decode.py``, whose conversion and MMA helpers this reuses):
  0  FP8 e4m3/e5m2 with per-tensor scales, or fp16: stored values convert exactly to fp16, fp16 MMAs; the scales
     and a power-of-two range factor are folded into Q before its fp16 rounding.
  1  bf16: bf16 MMAs (an fp16 query is split into two bf16 parts).
  2  e4m3 with group scales (one per 128 channels of c_kv): the c_kv chunk's score product is multiplied by its
     [tokens] scale vector in fp32, P carries the scales relative to their tile maximum (so P <= 1 in fp16).
     Two sources of those scales: ``fp8_e4m3_group``'s side tensor (k_pe e4m3 with a per-tensor scale), or the
     ``fp8_ds_mla`` record itself (``KPE_BF16``: bytes 512..528 of the record; k_pe is bf16 and multiplies
     the query's rope part in a bf16 MMA, an fp16 query split into two bf16 parts).
The record pool is passed as three strided views of the same bytes (e4m3 c_kv, fp32 scales, bf16 k_pe), so
nothing converts or copies the pool. Softmax in fp32 with exp2; P is rounded to the MMA's 16-bit type.

Masking: an entry that is -1, or outside ``[0, num_slots)``, is never loaded (its row is masked at the load, so a
NaN in an unselected slot never reaches the output) and scores -inf. A row with no valid entry gives out 0 and
lse -inf; NaN in a selected token or in the query gives NaN (the epilogue tells l == 0 from l = NaN).

Splits: with few query tokens, a token's row is cut into ``num_splits`` ranges on as many programs; each writes a
normalized partial (o, lse base 2), and the split merge (``kernels.split.merge.merge_splits``) combines them by
log-sum-exp in split order (deterministic: the same inputs give the same bits).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .decode import (GROUP_SIZE, KV_BF16, KV_FP8_FP16_MATH, KV_GROUP, LOG2E, RAW_E4M3, RAW_E5M2, V_CONVERT,
                     _dot, _k16, _load_kv, _load_q, _pv, _score, _store_row, column_chunks, default_config,
                     device_arch)
from .softmax import softmax_step

LAST_COMPILED = None


@triton.jit
def _sparse_mla_kernel(
    q_nope, q_pe, ckv, kpe, scale_arr, scales, indices,
    out, lse_out, part_o, part_lse,
    sm_scale_log2, lse_scale, H, num_slots, topk, chunk, num_splits, num_head_tiles,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_sa_p, stride_sa_s, stride_sa_g,
    stride_idx_t, stride_o_t, stride_o_h, stride_o_c, stride_lse_t, stride_lse_h,
    stride_po_i, stride_po_h, stride_pl_i,
    PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    KV_MODE: tl.constexpr, KPE_BF16: tl.constexpr, FP32_DOT: tl.constexpr, Q_SPLIT: tl.constexpr,
    EVICT: tl.constexpr, IDX64: tl.constexpr, NCH: tl.constexpr, V_CVT: tl.constexpr, RAW_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
):
    CW: tl.constexpr = DC // NCH
    # The head tiles of one token are adjacent programs: they gather the same records, which the later tiles then
    # find in L2. (Axis 0, not 1: prefill can pass 65535 tokens, the limit of grid axes 1 and 2.)
    t = tl.program_id(0) // num_head_tiles
    sp = tl.program_id(1)
    heads = (tl.program_id(0) % num_head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < H
    t64 = t.to(tl.int64)
    qn_row = t64 * stride_qn_t + heads * stride_qn_h
    qp32 = _load_q(q_pe, t64 * stride_qp_t + heads * stride_qp_h, 0, DK, row_ok)
    qn0 = _load_q(q_nope, qn_row, 0, CW, row_ok)
    if NCH > 1:
        qn1 = _load_q(q_nope, qn_row, CW, CW, row_ok)
    if NCH > 2:
        qn2 = _load_q(q_nope, qn_row, 2 * CW, CW, row_ok)
        qn3 = _load_q(q_nope, qn_row, 3 * CW, CW, row_ok)
    ckv_scale = tl.load(scales)
    kpe_scale = tl.load(scales + 1)
    raw_f = 256.0 if RAW_FP8 == 1 else 1.0  # RAW e4m3 converts to value / 256 (decode._bits_to_fp16)

    # -- queries in the MMA types, scales folded in ---------------------------------------------------------
    if KV_MODE == 1:
        row_scale = tl.full([BLOCK_H], 1.0, tl.float32) * sm_scale_log2
        if Q_SPLIT and not FP32_DOT:
            qn_lo = (qn0 - qn0.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
            qp_lo = (qp32 - qp32.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        qn_m0 = qn0.to(tl.float32 if FP32_DOT else tl.bfloat16)
        qp_m = qp32.to(tl.float32 if FP32_DOT else tl.bfloat16)
    else:
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
        # Largest |q| near 2^14: far from fp16's 65504, small entries stay normal (a power of two: exact).
        f = tl.where(amax > 0, tl.exp2(tl.floor(tl.log2(16384.0 / amax))), 1.0)
        if KPE_BF16:
            # bf16 k_pe of the record: a bf16 MMA; an fp16 query keeps its precision as hi + lo bf16 parts.
            # row_scale below multiplies every score by raw_f (the uint8 e4m3 path's c_kv comes as value / 256);
            # the bf16 k_pe is not divided, so its query part takes 1 / raw_f (a power of two: exact).
            qp_s = qp32 * (f / raw_f)[:, None]
            if FP32_DOT:
                qp_m = qp_s
            else:
                qp_m = qp_s.to(tl.bfloat16)
                if Q_SPLIT:
                    qp_lo = (qp_s - qp_m.to(tl.float32)).to(tl.bfloat16)
        else:
            qp_m = (qp32 * f[:, None]).to(tl.float16)
        qn_m0 = (qn0 * f[:, None]).to(tl.float16)
        if NCH > 1:
            qn_m1 = (qn1 * f[:, None]).to(tl.float16)
        if NCH > 2:
            qn_m2 = (qn2 * f[:, None]).to(tl.float16)
            qn_m3 = (qn3 * f[:, None]).to(tl.float16)
        row_scale = sm_scale_log2 * raw_f / f

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, CW], tl.float32)
    f0 = tl.full((), 1.0, tl.float32)  # group mode: chunk output = acc * f (see decode._pv)
    if NCH > 1:
        acc1 = tl.zeros([BLOCK_H, CW], tl.float32)
        f1 = tl.full((), 1.0, tl.float32)
    if NCH > 2:
        acc2 = tl.zeros([BLOCK_H, CW], tl.float32)
        acc3 = tl.zeros([BLOCK_H, CW], tl.float32)
        f2 = tl.full((), 1.0, tl.float32)
        f3 = tl.full((), 1.0, tl.float32)
    j0 = sp * chunk
    j1 = tl.minimum(j0 + chunk, topk)
    for start in tl.range(j0, j1, BLOCK_N, num_stages=NUM_STAGES):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(indices + t64 * stride_idx_t + j, mask=j < j1, other=-1)
        # -1 and anything outside the pool is never read: masked at the load, -inf below.
        ld_ok = (idx >= 0) & (idx < num_slots)
        safe = tl.where(ld_ok, idx, 0)
        page = safe // PAGE
        slot = safe % PAGE
        if IDX64:  # pools past 2^31 elements
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
        # -- scores -------------------------------------------------------------------------------------------
        zero = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        if KV_MODE == 1:
            s = _dot(qp_m, tl.trans(kp), zero, FP32_DOT)
            s = _dot(qn_m0, tl.trans(c0), s, FP32_DOT)
            if Q_SPLIT and not FP32_DOT:
                s = _dot(qn_lo, tl.trans(c0), s, FP32_DOT)
                s = _dot(qp_lo, tl.trans(kp), s, FP32_DOT)
        else:
            if KPE_BF16:
                s = _dot(qp_m, tl.trans(kp), zero, FP32_DOT)
                if Q_SPLIT and not FP32_DOT:
                    s = _dot(qp_lo, tl.trans(kp), s, FP32_DOT)
            else:
                s = _dot(qp_m, tl.trans(_k16(kp, RAW_FP8, FP32_DOT)), zero, FP32_DOT)
            s = _score(s, qn_m0, c0, sc0, KV_MODE, RAW_FP8, FP32_DOT)
            if NCH > 1:
                s = _score(s, qn_m1, c1, sc1, KV_MODE, RAW_FP8, FP32_DOT)
            if NCH > 2:
                s = _score(s, qn_m2, c2, sc2, KV_MODE, RAW_FP8, FP32_DOT)
                s = _score(s, qn_m3, c3, sc3, KV_MODE, RAW_FP8, FP32_DOT)
        s = tl.where(ld_ok[None, :], s * row_scale[:, None], float("-inf"))
        # -- online softmax (log2 domain), P.V ----------------------------------------------------------------
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        if KV_MODE == 1:
            acc0 = _dot(p.to(tl.float32 if FP32_DOT else tl.bfloat16), c0, acc0 * alpha[:, None], FP32_DOT)
        else:
            acc0, f0 = _pv(acc0, f0, p, alpha, c0, sc0, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
            if NCH > 1:
                acc1, f1 = _pv(acc1, f1, p, alpha, c1, sc1, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
            if NCH > 2:
                acc2, f2 = _pv(acc2, f2, p, alpha, c2, sc2, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
                acc3, f3 = _pv(acc3, f3, p, alpha, c3, sc3, KV_MODE, V_CVT, RAW_FP8, FP32_DOT)
        m_i = m_new

    # -- epilogue: "no token" is l == 0 (out 0, lse -inf); NaN gave l = NaN and stays NaN ------------------------
    empty = l_i == 0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    if KV_MODE == 0:
        inv = inv * (ckv_scale * raw_f)
    elif KV_MODE == 2:
        inv = inv * raw_f
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o0 = tl.where(empty[:, None], 0.0, acc0 * (inv * f0)[:, None])
    o1 = o0
    o2 = o0
    o3 = o0
    if NCH > 1:
        o1 = tl.where(empty[:, None], 0.0, acc1 * (inv * f1)[:, None])
    if NCH > 2:
        o2 = tl.where(empty[:, None], 0.0, acc2 * (inv * f2)[:, None])
        o3 = tl.where(empty[:, None], 0.0, acc3 * (inv * f3)[:, None])
    if SPLIT:
        item = t64 * num_splits + sp
        tl.store(part_lse + item * stride_pl_i + heads, lse, mask=row_ok)
        _store_row(part_o, item * stride_po_i + heads.to(tl.int64) * stride_po_h, 1, o0, o1, o2, o3, row_ok,
                   CW, NCH)
    else:
        tl.store(lse_out + t64 * stride_lse_t + heads * stride_lse_h, lse * lse_scale, mask=row_ok)
        _store_row(out, t64 * stride_o_t + heads * stride_o_h, stride_o_c, o0, o1, o2, o3, row_ok, CW, NCH)


def kv_mode_of(fmt) -> int:
    """The kernel's KV_MODE for a :class:`fp8mla.formats.KVFormat`."""
    if fmt.scale_kind in ("group", "record"):
        return KV_GROUP
    if fmt.name == "bf16":
        return KV_BF16
    return KV_FP8_FP16_MATH


def launch_config(num_heads: int, fmt, device, *, block_h: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  v_convert: str | None = None) -> dict:
    """Launch settings for a plan: the dense decode's tile choice for ``num_heads`` rows on this device
    (``kernels/decode.default_config``: measured there; the sparse loop has the same tile body), any of them
    overridable. ``block_n`` must divide 64 (index rows are multiples of 64)."""
    import torch
    kv_mode = kv_mode_of(fmt)
    arch = device_arch(torch.empty(0, device=device)) if torch.device(device).type == "cuda" else None
    cfg = default_config(num_heads, kv_mode, arch)
    cfg = dict(block_h=block_h or cfg["block_m"], block_n=block_n or cfg["block_n"],
               num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
               v_convert=v_convert or cfg["v_convert"])
    for name in ("block_h", "block_n"):
        v = cfg[name]
        if v < 16 or v & (v - 1) or (name == "block_n" and 64 % v):
            raise ValueError(f"{name}: expected a power of two >= 16{' dividing 64' if name == 'block_n' else ''}, "
                             f"got {v}")
    if cfg["v_convert"] not in V_CONVERT:
        raise ValueError(f"v_convert: expected one of {sorted(V_CONVERT)}, got {cfg['v_convert']!r}")
    cfg.update(kv_mode=kv_mode, record=fmt.scale_kind == "record", fp32_dot=arch is None)
    return cfg


def sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, scales, indices, out, lse, part_o, part_lse, *,
               page_size: int, sm_scale: float, num_splits: int, lse_scale: float, kv_mode: int, record: bool,
               block_h: int, block_n: int, num_warps: int, num_stages: int, v_convert: str, fp32_dot: bool,
               evict_first: bool = True, index64: bool | None = None) -> None:
    """Launch the sparse kernel (and the split merge when ``num_splits > 1``).

    Shapes: q_nope ``[n, H, 512]``, q_pe ``[n, H, 64]``; ckv ``[P, page, 512]`` and kpe ``[P, page, 64]`` (strided
    views; last dim contiguous): for a record pool the e4m3 and bf16 views of its bytes; scale_arr ``[P, page, 4]``
    fp32 (group formats, any strides) or None; scales fp32 ``[2]`` (ckv_scale, kpe_scale); indices int32
    ``[n, topk]``; out ``[n, H, 512]``, lse ``[n, H]`` (any strides); part_o ``[>= n * splits, H, 512]`` fp32 and
    part_lse ``[>= n * splits, H]`` fp32 (contiguous) when splitting. ``lse_scale``: 1 (base 2) or ln 2 (base e).
    """
    import torch
    n, H, Dc = q_nope.shape
    P, page, _ = ckv.shape
    Dk = kpe.shape[-1]
    topk = indices.shape[1]
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv", ckv), ("kpe", kpe), ("indices", indices)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
    if n == 0:
        return
    raw_fp8 = 0
    arch = device_arch(ckv)
    if arch is not None and arch < 89 and ckv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # sm_80: no FP8 type in Triton; the same bytes as uint8, converted by bit manipulation
        raw_fp8 = RAW_E4M3 if ckv.dtype == torch.float8_e4m3fn else RAW_E5M2
        ckv = ckv.view(torch.uint8)
        if kpe.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # a record's k_pe is bf16: left as it is
            kpe = kpe.view(torch.uint8)
    v_cvt = V_CONVERT[v_convert]
    nch = column_chunks(kv_mode, Dc, v_cvt)
    sa = scale_arr if scale_arr is not None else scales
    sa_st = tuple(scale_arr.stride()) if scale_arr is not None else (0, 0, 0)
    if index64 is None:
        span = max((P - 1) * t.stride(0) + (page - 1) * t.stride(1) + t.shape[-1] for t in (ckv, kpe))
        if scale_arr is not None:
            span = max(span, sum((s - 1) * st for s, st in zip(scale_arr.shape, scale_arr.stride())) + 1)
        index64 = span >= 2**31
    from .split.merge import merge_splits
    from .split.rows import split_geometry
    chunk, num_splits = split_geometry(topk, num_splits)  # whole 64-entry blocks per split
    split = num_splits > 1
    po = part_o if split else out
    pl = part_lse if split else lse
    tiles = triton.cdiv(H, block_h)
    grid = (n * tiles, num_splits)
    compiled = _sparse_mla_kernel[grid](
        q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, po, pl,
        sm_scale * LOG2E, lse_scale, H, P * page, topk, chunk, num_splits, tiles,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1), *sa_st,
        indices.stride(0), out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        po.stride(0), po.stride(1), pl.stride(0),
        PAGE=page, DC=Dc, DK=Dk, GROUP=GROUP_SIZE, BLOCK_H=block_h, BLOCK_N=block_n, NUM_STAGES=num_stages,
        KV_MODE=kv_mode, KPE_BF16=record, FP32_DOT=fp32_dot,
        Q_SPLIT=q_nope.dtype == torch.float16 and (kv_mode == KV_BF16 or record) and not fp32_dot,
        EVICT="evict_first" if evict_first else "", IDX64=index64, NCH=nch, V_CVT=v_cvt, RAW_FP8=raw_fp8,
        SPLIT=split, num_warps=num_warps,
    )
    global LAST_COMPILED  # registers / spills of the last launch, for the bench
    LAST_COMPILED = compiled
    if split:
        merge_splits(out, lse, part_o, part_lse, num_parts=num_splits, lse_scale=lse_scale)
