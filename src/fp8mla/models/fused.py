"""Small fused Triton kernels of the MLA decode step: one launch where torch takes six to ten.

- :func:`rms_norm`: transformers' ``DeepseekV3RMSNorm`` (normalize in fp32, round to the model dtype, times the
  weight, round again), one program per row.
- :func:`kv_norm_rope_write`: the latent path of a decode token in one pass: RMSNorm of ``c_kv``, rope of
  ``k_pe``, both rounded to the model dtype as the torch code rounds them, then quantized and stored into the
  token's pool slot (quantize-on-write). Slots < 0 are skipped (padding rows of a CUDA-graph batch).
- :func:`q_rope`: rope of the queries' rope part, written contiguous in the attention dtype (what the paged
  attention reads), straight from the ``q_b_proj`` output (no split, cat or copy).

Every intermediate is rounded exactly where the torch code rounds (bf16 with integer round-to-nearest-even, so
the CPU interpreter, whose casts truncate, stores what the GPU stores). Left: fp32 reductions in another order
and fused multiply-adds may move a value across a rounding boundary now and then (one ulp of the model dtype or
of FP8; tests/test_runner.py bounds how often). Per-tensor formats only (fp8_e4m3, fp8_e5m2, bf16, fp16); the
group format keeps the torch norm/rope and :func:`fp8mla.kernels.quant_append.quant_append`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kernels.quant_append import (BF16 as KV_BF16, E4M3, E5M2, STORAGE_KIND, f32_to_bf16_bits, scale_saturate,
                                     store_kv, tensor_scale_rule)

__all__ = ["rms_norm", "kv_norm_rope_write", "q_rope", "supports_kv_format"]

F32, BF16_, FP16_ = 0, 1, 2  # how intermediate values are rounded: the model's (or the attention's) dtype
_ROUND = {torch.float32: F32, torch.bfloat16: BF16_, torch.float16: FP16_}


@triton.jit
def _round(x, KIND: tl.constexpr):
    """``x`` (fp32) rounded to nearest even in bf16 / fp16 (back in fp32); fp32: unchanged."""
    if KIND == 1:
        b = f32_to_bf16_bits(x).to(tl.int32)
        return (b << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps,
                     BLOCK_D: tl.constexpr, MODEL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    h = _round(x * r, MODEL)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = _round(w * h, MODEL)
    tl.store(out_ptr + row * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=m)  # exact: y is rounded


@triton.jit
def _rope_pair(base, HALF, j, m, INTERLEAVE: tl.constexpr):
    if INTERLEAVE:
        x1 = tl.load(base + 2 * j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + j, mask=m, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _kv_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, rows_ptr,
               stride_kv, stride_cs, stride_row, eps, ckv_s, kpe_s,
               DC: tl.constexpr, BLOCK_DC: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
               MODEL: tl.constexpr, INTERLEAVE: tl.constexpr, MAXV: tl.constexpr, KIND: tl.constexpr,
               CKV_HOW: tl.constexpr, KPE_HOW: tl.constexpr, SOFT_CVT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dc = tl.arange(0, BLOCK_DC)
    slot = tl.load(slot_ptr + t + dc * 0).to(tl.int64)  # the token's slot, as a vector (masks must be tensors)
    m = (dc < DC) & (slot >= 0)
    x = tl.load(kv_ptr + t * stride_kv + dc, mask=m, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DC + eps)
    w = tl.load(w_ptr + dc, mask=m, other=0.0).to(tl.float32)
    c = _round(w * _round(x * r, MODEL), MODEL)
    store_kv(rows_ptr + slot * stride_row + dc, scale_saturate(c, ckv_s, CKV_HOW, MAXV), m, KIND, SOFT_CVT)

    j = tl.arange(0, BLOCK_H)
    slot_h = tl.load(slot_ptr + t + j * 0).to(tl.int64)
    mh = j < HALF
    row = rows_ptr + slot_h * stride_row
    x1, x2 = _rope_pair(kv_ptr + t * stride_kv + DC, HALF, j, mh, INTERLEAVE)
    co = tl.load(cos_ptr + t * stride_cs + j, mask=mh, other=0.0)
    si = tl.load(sin_ptr + t * stride_cs + j, mask=mh, other=0.0)
    o1 = _round(x1 * co - x2 * si, MODEL)
    o2 = _round(x2 * co + x1 * si, MODEL)
    live = mh & (slot_h >= 0)
    store_kv(row + DC + j, scale_saturate(o1, kpe_s, KPE_HOW, MAXV), live, KIND, SOFT_CVT)
    store_kv(row + DC + HALF + j, scale_saturate(o2, kpe_s, KPE_HOW, MAXV), live, KIND, SOFT_CVT)


@triton.jit
def _q_rope_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_qt, stride_qh, stride_cs, stride_ot, stride_oh,
                   NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
                   MODEL: tl.constexpr, ADT: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    m = (h[:, None] < H) & (j[None, :] < HALF)
    base = q_ptr + t * stride_qt + h[:, None].to(tl.int64) * stride_qh + NOPE
    if INTERLEAVE:
        x1 = tl.load(base + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + j[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    co = tl.load(cos_ptr + t * stride_cs + j, mask=j < HALF, other=0.0)[None, :]
    si = tl.load(sin_ptr + t * stride_cs + j, mask=j < HALF, other=0.0)[None, :]
    o1 = _round(_round(x1 * co - x2 * si, MODEL), ADT)
    o2 = _round(_round(x2 * co + x1 * si, MODEL), ADT)
    ob = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + j[None, :]
    ety = out_ptr.dtype.element_ty
    tl.store(ob, o1.to(ety), mask=m)   # exact: already rounded to the output dtype
    tl.store(ob + HALF, o2.to(ety), mask=m)


def _soft_cvt() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm(x [T, D])`` in ``x``'s dtype (rows may be strided; the last dim must be contiguous)."""
    T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T:
        BLOCK_D = _pow2(D)
        _rms_norm_kernel[(T,)](x, weight, out, D, x.stride(0), out.stride(0), float(eps), BLOCK_D=BLOCK_D,
                               MODEL=_ROUND[x.dtype], num_warps=8 if BLOCK_D >= 4096 else 4)
    return out


def supports_kv_format(fmt) -> bool:
    """Formats :func:`kv_norm_rope_write` stores (per-tensor scales)."""
    return fmt.scale_kind != "group"


def kv_norm_rope_write(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, slots: torch.Tensor, pool_rows: torch.Tensor, fmt, ckv_scale: float,
                       kpe_scale: float, *, interleave: bool, head_dim_ckv: int) -> None:
    """Write ``T`` decode tokens' latents: ``kv [T, Dc + Dk]`` (``kv_a_proj_with_mqa``'s output, model dtype)
    -> RMSNorm(c_kv), rope(k_pe) -> quantized into ``pool_rows [S, Dc + Dk]`` (one layer, flat slots) at
    ``slots [T]`` (int64; < 0: skipped). ``cos``/``sin``: fp32 ``[T, Dk // 2]``."""
    T, W = kv.shape
    Dc = head_dim_ckv
    half = (W - Dc) // 2
    if not supports_kv_format(fmt):
        raise ValueError(f"kv_format: {fmt.name!r} has group scales; the fused write takes per-tensor formats")
    if T == 0:
        return
    kind = STORAGE_KIND[fmt.storage_dtype]
    soft = _soft_cvt()
    rows = pool_rows  # the interpreter's casts do not round to nearest: store bits through integer views
    if soft and kind == KV_BF16:
        rows = pool_rows.view(torch.int16)
    elif soft and kind in (E4M3, E5M2):
        rows = pool_rows.view(torch.uint8)
    fp8 = kind in (E4M3, E5M2)
    ckv_how, ckv_s = tensor_scale_rule(ckv_scale) if fp8 else (0, 1.0)
    kpe_how, kpe_s = tensor_scale_rule(kpe_scale) if fp8 else (0, 1.0)
    _kv_kernel[(T,)](kv, norm_weight, cos, sin, slots, rows, kv.stride(0), cos.stride(0), rows.stride(0),
                     float(eps), ckv_s, kpe_s, DC=Dc, BLOCK_DC=_pow2(Dc), HALF=half, BLOCK_H=_pow2(half),
                     MODEL=_ROUND[kv.dtype], INTERLEAVE=bool(interleave), MAXV=float(fmt.max_value), KIND=kind,
                     CKV_HOW=ckv_how, KPE_HOW=kpe_how, SOFT_CVT=soft, num_warps=4)


def q_rope(q: torch.Tensor, nope_dim: int, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, *,
           interleave: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, H, nope + rope]`` (model dtype, any row strides) -> rope of its last ``rope`` dims as a contiguous
    ``[T, H, rope]`` tensor of ``out_dtype`` (rotate-half layout, as :meth:`YarnRope.apply`)."""
    T, H, Dq = q.shape
    rope = Dq - nope_dim
    if out is None:
        out = torch.empty(T, H, rope, dtype=out_dtype, device=q.device)
    if T:
        BLOCK_H = min(16, _pow2(H))
        _q_rope_kernel[(T, triton.cdiv(H, BLOCK_H))](
            q, cos, sin, out, H, q.stride(0), q.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            NOPE=nope_dim, HALF=rope // 2, BLOCK_H=BLOCK_H, BLOCK_J=_pow2(rope // 2), MODEL=_ROUND[q.dtype],
            ADT=_ROUND[out_dtype], INTERLEAVE=bool(interleave), num_warps=4)
    return out
