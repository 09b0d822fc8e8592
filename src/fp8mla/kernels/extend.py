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
the end of the request's tokens; blocks every row fully sees run without masks. The online softmax and its
NaN / "no keys" rules are ``kernels/softmax.py``'s, shared with the ragged kernel: NaN in a query or a used
token gives NaN rows, never out 0 / lse -inf; a page id outside ``[0, num_pages)`` is never read, its tokens
score NaN.

Numerics under ``fp32_dot`` (required under TRITON_INTERPRET=1, where tl.dot on bf16 is wrong): the same
16-bit operands, multiplied in fp32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode import _asm_to_fp16, _bits_to_fp16, _k16, device_arch
from .softmax import attend_block, causal_bounds, dot, finish, mask_scores

LOG2E = 1.0 / math.log(2.0)
GROUP = 128  # c_kv channels per group scale (fp8mla.formats.GROUP_SIZE)


@triton.jit
def _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start, num_pages, kv_len, n0,
              qi, q_len, s_c, s_k, stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_gs_p,
              stride_gs_s, stride_gs_g,
              PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr, V_ASM: tl.constexpr,
              RAW_FP8: tl.constexpr):
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
    # A page id outside the pool is never read; its tokens score NaN (the request's rows become NaN).
    page_v = page + tl.zeros([BLOCK_N], tl.int64)  # [BLOCK_N] also when page is one scalar id
    page_ok = (page_v >= 0) & (page_v < num_pages)
    slot = (pos % PAGE).to(tl.int64)
    dc = tl.arange(0, BLOCK_DC)
    dk = tl.arange(0, BLOCK_DK)
    if MASKED:  # rows past kv_len may hold anything (NaN in the tests): never load them
        rmask = nmask & page_ok
    else:
        rmask = page_ok
    cmask = (dc[None, :] < DC) & rmask[:, None]
    kmask = (dk[None, :] < DK) & rmask[:, None]
    c = tl.load(ckv_ptr + (page * stride_ckv_p + slot * stride_ckv_s)[:, None] + dc[None, :], mask=cmask,
                other=0.0)
    k = tl.load(kpe_ptr + (page * stride_kpe_p + slot * stride_kpe_s)[:, None] + dk[None, :], mask=kmask,
                other=0.0)
    c_raw = c
    if RAW_FP8 != 0:  # uint8 FP8 bits (SM80): exact fp16 (e4m3: value / 256, the 256 is in s_c, s_k, the output)
        c = _bits_to_fp16(c, RAW_FP8)
        k = _bits_to_fp16(k, RAW_FP8)
    elif FP32_DOT and (c.dtype == tl.float8e4nv or c.dtype == tl.float8e5):
        # the interpreter's FP8 conversions lose NaN / inf: the exact bit path there
        c = _k16(c, 0, True)
        k = _k16(k, 0, True)
    elif c.dtype == tl.float8e5:
        # e5m2 -> fp16 is exact (a shift) and keeps NaN / inf; Triton's direct e5m2 -> bf16 on the H200 does not
        # keep a NaN (its answer differs from the uint8 path's). Every e5m2 value is exact in bf16 too.
        c = c.to(tl.float16)
        k = k.to(tl.float16)
    if HAS_GROUP:
        g = tl.load(gs_ptr + (page * stride_gs_p + slot * stride_gs_s)[:, None]
                    + (dc // GROUP_SIZE)[None, :] * stride_gs_g, mask=cmask, other=1.0)
        c = (c.to(tl.float32) * g).to(dt)
    else:
        c = c.to(dt)
    k = k.to(dt)
    # -- scores in log2 units; the c_kv tile serves as K here and as V below --
    zero = tl.zeros([qn.shape[0], BLOCK_N], tl.float32)
    s = dot(qn, tl.trans(c), zero, FP32_DOT) * s_c + dot(qp, tl.trans(k), zero, FP32_DOT) * s_k
    if MASKED:
        s = mask_scores(s, pos, kv_len, qi, q_len, CAUSAL)
    s = s + tl.where(rmask | (pos >= kv_len), 0.0, float("nan"))[None, :]
    if V_ASM and not FP32_DOT:
        # V as fp16 converted once by inline asm in the load layout (no byte-wise LDS.U8 for the transposed
        # operand; see kernels/decode.py V_CVT); P is rounded to fp16 for it. Per-tensor formats only.
        return attend_block(acc, m_i, l_i, s, _asm_to_fp16(c_raw, RAW_FP8), FP32_DOT)
    return attend_block(acc, m_i, l_i, s, c, FP32_DOT)


@triton.jit
def _extend_kernel(
    qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, gs_ptr, scales_ptr,
    qo_indptr, kv_indptr, kv_indices, kv_len_ptr, o_ptr, lse_ptr,
    sm_scale, H, num_pages,
    stride_qn_n, stride_qn_h, stride_qp_n, stride_qp_h,
    stride_ckv_p, stride_ckv_s, stride_kpe_p, stride_kpe_s, stride_gs_p, stride_gs_s, stride_gs_g,
    stride_o_n, stride_o_h, stride_lse_n, stride_lse_h,
    PAGE: tl.constexpr, DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_HB: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, FP32_DOT: tl.constexpr,
    V_ASM: tl.constexpr, RAW_FP8: tl.constexpr,
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
    raw_f = 256.0 if RAW_FP8 == 1 else 1.0           # uint8 e4m3 converts to value / 256
    s_c = sm_scale * ckv_scale * 1.4426950408889634 * raw_f  # 1/ln 2: exp2 instead of exp
    s_k = sm_scale * kpe_scale * 1.4426950408889634 * raw_f

    # Query i sees tokens <= kv_len - q_len + i; the block's first query bounds the unmasked blocks.
    full, hi = causal_bounds(kv_len, q_len, qblk * BLOCK_Q, BLOCK_Q, BLOCK_N, CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DC], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start,
                                  num_pages, kv_len, n0, qi, q_len, s_c, s_k, stride_ckv_p, stride_ckv_s,
                                  stride_kpe_p, stride_kpe_s, stride_gs_p, stride_gs_s, stride_gs_g, PAGE, DC, DK,
                                  BLOCK_DC, BLOCK_DK, BLOCK_N, HAS_GROUP, GROUP_SIZE, False, CAUSAL, FP32_DOT, V_ASM,
                                  RAW_FP8)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _kv_block(acc, l_i, m_i, qn, qp, ckv_ptr, kpe_ptr, gs_ptr, kv_indices, page_start,
                                  num_pages, kv_len, n0, qi, q_len, s_c, s_k, stride_ckv_p, stride_ckv_s,
                                  stride_kpe_p, stride_kpe_s, stride_gs_p, stride_gs_s, stride_gs_g, PAGE, DC, DK,
                                  BLOCK_DC, BLOCK_DK, BLOCK_N, HAS_GROUP, GROUP_SIZE, True, CAUSAL, FP32_DOT, V_ASM,
                                  RAW_FP8)

    # -- epilogue: the ckv scale folded into the output; rows that saw nothing get 0 and lse -inf, NaN stays --
    out, lse = finish(acc, m_i, l_i, ckv_scale * raw_f)
    tl.store(o_ptr + qrow[:, None] * stride_o_n + h64[:, None] * stride_o_h + dc[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (dc[None, :] < DC))
    tl.store(lse_ptr + qrow * stride_lse_n + h64 * stride_lse_h, lse, mask=rmask)


def default_tiles(num_heads: int, fp32_dot: bool, has_group: bool = False, arch: int | None = None) -> dict:
    """BLOCK_H, BLOCK_Q, BLOCK_N, num_warps, num_stages (and ``v_asm``) used when the caller gives none, for
    sm_<arch> (None: the interpreter, or sm_90's measured configuration)."""
    if arch is not None and arch != 90 and not fp32_dot:
        # The portable path (SM80/89/120): 32 rows x BLOCK_N 32, 8 warps, V converted by inline asm (per-tensor
        # FP8): no spills, no LDS.U8, 88 KB of shared memory (SM89/120 allow 99 KB); triton 3.9 compiles,
        # checked by tests/test_compile_targets.py. Not measured on such a GPU.
        # Group format: its fp32 dequantized tile needs BLOCK_N 16 to fit (78 KB; 24 B of spills, LDS.U8 remain:
        # the decode kernel is that format's exact, clean path).
        block_h = min(triton.next_power_of_2(num_heads), 32)
        return dict(block_h=block_h, block_q=max(1, 32 // block_h), block_n=16 if has_group else 32, num_warps=8,
                    num_stages=2, v_asm=not has_group)
    rows = 32 if fp32_dot else 64  # the interpreter: small tiles keep the numpy work per step low
    block_h = min(triton.next_power_of_2(num_heads), rows)
    # GPU: BLOCK_N 64, 8 warps, 2 stages are the fastest on the H200 (H=128 qo 1024 kv 8192, page 64:
    # FP8 11.8 ms vs 17.0 at BLOCK_N 32; BF16 7.2 vs 10.7), although ptxas reports more spills. The group format's
    # fp32 dequantization tiles do not fit shared memory at BLOCK_N 64 (OutOfResources on the H200): 32 there.
    t = dict(block_h=block_h, block_q=max(1, rows // block_h), block_n=32 if fp32_dot or has_group else 64,
             v_asm=False)
    t.update(num_warps=4, num_stages=1) if fp32_dot else t.update(num_warps=8, num_stages=2)
    return t


def mla_extend(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
               qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, *, sm_scale: float, causal: bool, scales: torch.Tensor,
               ckv_scale_arr: torch.Tensor | None, max_qo_len: int, fp32_dot: bool,
               block_h: int | None = None, block_q: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None, raw_fp8: int = 0,
               v_asm: bool | None = None) -> None:
    """Launch the paged extend; writes ``out`` and ``lse`` (base 2).

    Args:
        q_nope: ``[n, H, Dc]``, q_pe: ``[n, H, Dk]`` bf16/fp16 (rows may be strided, last dim contiguous).
        ckv_cache: ``[P, page, Dc]``, kpe_cache: ``[P, page, Dk]`` fp8 e4m3/e5m2, bf16 or fp16 (strided views of
            one ``[P, page, Dc + Dk]`` pool are fine; last dim contiguous).
        qo_indptr, kv_indptr: ``[B + 1]`` int32; kv_indices: int32 page ids; kv_len: ``[B]`` int32.
        out: ``[n, H, Dc]`` query dtype (last dim contiguous); lse: ``[n, H]`` fp32 (base 2, any strides).
        sm_scale: softmax scale; causal: queries aligned to the end of their request's tokens.
        scales: fp32 ``[2]`` on the device: (ckv_scale, kpe_scale); ckv_scale is ignored with group scales.
        ckv_scale_arr: ``[P, page, Dc // 128]`` fp32 group scales (any strides), or None.
        max_qo_len: the largest query count of a request (sizes the grid; no host sync here).
        fp32_dot: do the dots in fp32 (required under TRITON_INTERPRET=1).
        block_h, block_q, block_n, num_warps, num_stages: tile overrides (see :func:`default_tiles`); powers of
            two, block_n >= 16, block_h x block_q >= 16.
        raw_fp8: 1 / 2 when the FP8 pool comes as uint8 holding e4m3 / e5m2 bits (converted by bit manipulation;
            an FP8 pool on a GPU older than sm_89, where Triton has no FP8 type, is viewed so automatically).
        v_asm: convert V by inline asm (per-tensor FP8 pools; default: on GPUs other than sm_90).
    Bad arguments raise ValueError / TypeError naming them. Page ids outside ``[0, P)`` are never read: the
    request's rows come out NaN. NaN in a query or a used token gives NaN rows (never out 0 / lse -inf).
    """
    n, H, Dc = q_nope.shape
    Dk = q_pe.shape[2]
    P, page = ckv_cache.shape[:2]
    B = qo_indptr.numel() - 1
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache),
                    ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
    if q_nope.dtype not in (torch.bfloat16, torch.float16) or q_pe.dtype != q_nope.dtype or out.dtype != q_nope.dtype:
        raise TypeError(f"q_nope/q_pe/out: expected one dtype, bf16 or fp16, got {q_nope.dtype}/{q_pe.dtype}/"
                        f"{out.dtype}")
    if tuple(kpe_cache.shape[:2]) != (P, page) or kpe_cache.dtype != ckv_cache.dtype:
        raise ValueError(f"kpe_cache: expected [{P}, {page}, Dk] of {ckv_cache.dtype} like ckv_cache, got "
                         f"{list(kpe_cache.shape)} of {kpe_cache.dtype}")
    if scales.dtype != torch.float32 or scales.numel() < 2 or scales.device != q_nope.device:
        raise ValueError(f"scales: expected fp32 [2] on {q_nope.device}, got {scales.dtype} {list(scales.shape)} "
                         f"on {scales.device}")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_len", kv_len)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: expected int32, got {t.dtype}")
    if tuple(lse.shape) != (n, H) or lse.dtype != torch.float32:
        raise ValueError(f"lse: expected fp32 [{n}, {H}], got {lse.dtype} {list(lse.shape)}")
    has_group = ckv_scale_arr is not None
    if has_group:
        if Dc % GROUP or tuple(ckv_scale_arr.shape) != (P, page, Dc // GROUP) or \
                ckv_scale_arr.dtype != torch.float32:
            raise ValueError(f"ckv_scale_arr: expected fp32 [{P}, {page}, {Dc // GROUP}] (head_dim_ckv a multiple "
                             f"of {GROUP}), got {ckv_scale_arr.dtype} {list(ckv_scale_arr.shape)}")
    arch = device_arch(ckv_cache)
    if (ckv_cache.dtype == torch.uint8) != (raw_fp8 in (1, 2)):
        raise ValueError(f"raw_fp8: 1 (e4m3) or 2 (e5m2) exactly when the pool is uint8; got {raw_fp8!r} with a "
                         f"{ckv_cache.dtype} pool")
    if arch is not None and arch < 89 and str(ckv_cache.dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
        # SM80: no FP8 type in Triton; the same bytes as uint8, converted by bit manipulation
        raw_fp8 = 1 if ckv_cache.dtype == torch.float8_e4m3fn else 2
        ckv_cache, kpe_cache = ckv_cache.view(torch.uint8), kpe_cache.view(torch.uint8)
    t = default_tiles(H, fp32_dot, has_group, arch)
    v_asm = bool(t["v_asm"] if v_asm is None else v_asm) and ckv_cache.element_size() == 1 and not has_group
    bh, bq, bn = block_h or t["block_h"], block_q or t["block_q"], block_n or t["block_n"]
    for name, v, lo in (("block_h", bh, 1), ("block_q", bq, 1), ("block_n", bn, 16)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= {lo}, got {v!r}")
    if bh * bq < 16:
        raise ValueError(f"block_h x block_q: tl.dot needs at least 16 rows, got {bh} x {bq}")
    if n == 0 or B == 0 or max_qo_len == 0:
        return
    num_hb = triton.cdiv(H, bh)
    gs = ckv_scale_arr if has_group else scales  # unused pointer without group scales
    grid = (num_hb * triton.cdiv(max_qo_len, bq), B)
    _extend_kernel[grid](
        q_nope, q_pe, ckv_cache, kpe_cache, gs, scales,
        qo_indptr, kv_indptr, kv_indices, kv_len, out, lse,
        float(sm_scale), H, P,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
        *(gs.stride() if has_group else (0, 0, 0)),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        PAGE=page, DC=Dc, DK=Dk, BLOCK_DC=max(16, triton.next_power_of_2(Dc)),
        BLOCK_DK=max(16, triton.next_power_of_2(Dk)), BLOCK_Q=bq, BLOCK_H=bh, BLOCK_N=bn, NUM_HB=num_hb,
        CAUSAL=bool(causal), HAS_GROUP=has_group, GROUP_SIZE=GROUP, FP32_DOT=bool(fp32_dot), V_ASM=v_asm,
        RAW_FP8=raw_fp8, num_warps=num_warps or t["num_warps"], num_stages=num_stages or t["num_stages"],
    )
