"""Quantize-on-write: new tokens' c_kv/k_pe scaled, saturated and stored into their pool slots in one pass.

Stores exactly what ``PagedMLACache.write``'s torch code stores (same bytes, same group scales), on the CPU
(interpreter) and on the GPU alike. Every scaling is an IEEE fp32 division rounded to nearest: the torch code
divides by fp32 tensors on the data's device (``formats._fp32_div``: per-tensor scales, group scales
``amax / max`` and ``c_kv / group scale``), the kernel by ``div_rn`` (``div.rn.f32`` on the GPU; Triton's ``/``
on fp32 is an approximate division there). Multiplying by a reciprocal instead is off by one fp32 ulp now and then,
which is enough to round an FP8 value to its other neighbour when the quotient lies near a midpoint (frequent
with bf16/fp16 inputs, whose few mantissa bits make quotients like 77.5 / 3.1 = 25 land on them).

The interpreter's fp32 -> fp8 and fp32 -> bf16 casts do not round to nearest even (fp8 subnormals come out
wrong, bf16 is truncated), so under ``SOFT_CVT`` the stored bits are computed with integer ops, the way
c10's ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value`` / ``round_to_nearest_even`` do; on the GPU
the hardware converts (``cvt.rn.satfinite``). Inputs are clamped to +-max first (every format saturates), so
both agree.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

# storage kinds
BF16, FP16, E4M3, E5M2 = 0, 1, 2, 3
STORAGE_KIND = {torch.bfloat16: BF16, torch.float16: FP16, torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
# how a per-tensor scale is applied (torch skips the division when the scale is exactly 1)
NO_SCALE, DIVIDE = 0, 1


@triton.jit
def f32_to_bf16_bits(x):
    """Round-to-nearest-even fp32 -> bf16, as int16 bits (c10 ``round_to_nearest_even``; NaN -> 0x7FC0)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def f32_to_fp8_bits(x, E4M3_: tl.constexpr):
    """Round-to-nearest-even fp32 -> e4m3fn / e5m2 bits (uint8) for ``|x| <= max`` or NaN (c10's rules)."""
    if E4M3_:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MIN_NORMAL: tl.constexpr = 0.015625      # 2^-6
        MAGIC: tl.constexpr = 16384.0            # 2^14: its fp32 ulp is the e4m3 subnormal step 2^-9
        MAGIC_BITS: tl.constexpr = 141 << 23
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        MAGIC: tl.constexpr = 128.0              # 2^7: its fp32 ulp is the e5m2 subnormal step 2^-16
        MAGIC_BITS: tl.constexpr = 134 << 23
    SHIFT: tl.constexpr = 23 - MANT
    b = x.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    ai = b & 0x7FFFFFFF
    a = ai.to(tl.float32, bitcast=True)
    normal = (ai + ((BIAS - 127) << 23) + ((1 << (SHIFT - 1)) - 1) + ((ai >> SHIFT) & 1)) >> SHIFT
    sub = (a + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS   # fp32 add rounds to nearest even for us
    r = tl.where(a < MIN_NORMAL, sub, normal)
    r = tl.where(a != a, 0x7F, r)
    return (r | sign).to(tl.uint8)


@triton.jit
def store_kv(ptr, y, mask, KIND: tl.constexpr, SOFT_CVT: tl.constexpr):
    """Store fp32 ``y`` (already saturated) as the pool's storage kind ``KIND`` (exact bits under ``SOFT_CVT``)."""
    # ``ptr`` points at uint8 (fp8) or int16 (bf16) views of the pool under SOFT_CVT, else at the pool's dtype.
    if SOFT_CVT and KIND == 0:
        tl.store(ptr, f32_to_bf16_bits(y), mask=mask)
    elif SOFT_CVT and KIND >= 2:
        tl.store(ptr, f32_to_fp8_bits(y, KIND == 2), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_saturate(x, s, HOW: tl.constexpr, MAXV: tl.constexpr):
    """``x / s`` (``HOW == DIVIDE``; ``x`` as is for ``NO_SCALE``) clamped to +-``MAXV``."""
    if HOW == 1:
        x = tl.math.div_rn(x, s)
    # Saturate (16-bit formats too: fp16 past 65504 would become inf); comparisons keep NaN, which
    # tl.minimum/maximum may drop.
    return tl.where(x > MAXV, MAXV, tl.where(x < -MAXV, -MAXV, x))


@triton.jit
def _quant_append_kernel(
    rows_ptr, scale_ptr, slot_ptr, ckv_ptr, kpe_ptr,
    T, ckv_s, kpe_s, max_s,
    stride_row, stride_scale, stride_ckv, stride_kpe,
    DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_T: tl.constexpr,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr, MAXV: tl.constexpr,
    KIND: tl.constexpr, CKV_HOW: tl.constexpr, KPE_HOW: tl.constexpr,
    SOFT_CVT: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    # int64: slot * row stride passes 2^31 for pools of a few million tokens.
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    t64 = t.to(tl.int64)

    if GROUPS > 0:
        # c_kv as [BLOCK_T, groups, 128]: each group's amax, scale and quantization in registers.
        g = tl.arange(0, BLOCK_G)
        c = tl.arange(0, GROUP_SIZE)
        col = g[None, :, None] * GROUP_SIZE + c[None, None, :]
        m3 = tmask[:, None, None] & (g[None, :, None] < GROUPS)
        x = tl.load(ckv_ptr + t64[:, None, None] * stride_ckv + col, mask=m3, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        # NaN and +-inf do not count in the amax (formats.group_scales); a zero scale (all-zero group, or an
        # underflow) becomes 1 so that quantizing never divides by zero.
        amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), 2)
        gs = tl.math.div_rn(amax, max_s)
        gs = tl.where(gs > 0, gs, 1.0)
        y = tl.math.div_rn(x, gs[:, :, None])
        y = tl.where(y > MAXV, MAXV, tl.where(y < -MAXV, -MAXV, y))
        store_kv(rows_ptr + slot[:, None, None] * stride_row + col, y, m3, KIND, SOFT_CVT)
        gm = tmask[:, None] & (g[None, :] < GROUPS)
        tl.store(scale_ptr + slot[:, None] * stride_scale + g[None, :], gs, mask=gm)
    else:
        dc = tl.arange(0, BLOCK_DC)
        m = tmask[:, None] & (dc[None, :] < DC)
        x = tl.load(ckv_ptr + t64[:, None] * stride_ckv + dc[None, :], mask=m, other=0.0).to(tl.float32)
        y = scale_saturate(x, ckv_s, CKV_HOW, MAXV)
        store_kv(rows_ptr + slot[:, None] * stride_row + dc[None, :], y, m, KIND, SOFT_CVT)

    dk = tl.arange(0, BLOCK_DK)
    m = tmask[:, None] & (dk[None, :] < DK)
    x = tl.load(kpe_ptr + t64[:, None] * stride_kpe + dk[None, :], mask=m, other=0.0).to(tl.float32)
    y = scale_saturate(x, kpe_s, KPE_HOW, MAXV)
    store_kv(rows_ptr + slot[:, None] * stride_row + DC + dk[None, :], y, m, KIND, SOFT_CVT)


def tensor_scale_rule(scale: float) -> tuple[int, float]:
    """How ``formats.KVFormat.quantize`` applies a per-tensor scale, and the fp32 divisor it uses."""
    if scale == 1.0:
        return NO_SCALE, 1.0
    return DIVIDE, float(np.float32(scale))


def quant_append(pool_rows: torch.Tensor, scale_rows: torch.Tensor | None, slot_mapping: torch.Tensor,
                 c_kv: torch.Tensor, k_pe: torch.Tensor, fmt, ckv_scale: float = 1.0, kpe_scale: float = 1.0,
                 *, soft_cvt: bool | None = None, block_t: int | None = None, num_warps: int = 4) -> None:
    """Quantize and store ``T`` tokens.

    Args:
        pool_rows: ``[S, Dc + Dk]`` one layer's pool as flat slots (``pool[layer].view(S, -1)``), storage dtype.
        scale_rows: ``[S, Dc // 128]`` fp32 group scales of that layer (group format), else None.
        slot_mapping: ``[T]`` int32/int64 flat slot ids, all in ``[0, S)`` (the caller checks).
        c_kv: ``[T, Dc]``, k_pe: ``[T, Dk]`` in fp32/fp16/bf16/fp64.
        fmt: the pool's :class:`fp8mla.formats.KVFormat`.
        ckv_scale, kpe_scale: per-tensor scales (real = stored x scale); ckv_scale is ignored by the group format.
        soft_cvt: compute stored bits with integer ops (default: under TRITON_INTERPRET=1, whose casts do not
            round to nearest even).
    """
    T = slot_mapping.numel()
    Dc, Dk = c_kv.shape[1], k_pe.shape[1]
    assert pool_rows.dim() == 2 and pool_rows.shape[1] == Dc + Dk and pool_rows.stride(-1) == 1
    if T == 0:
        return
    kind = STORAGE_KIND[fmt.storage_dtype]
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    if soft_cvt is None:
        soft_cvt = os.environ.get("TRITON_INTERPRET") == "1"
    rows = pool_rows
    if soft_cvt and kind in (BF16, E4M3, E5M2):
        rows = pool_rows.view(torch.int16 if kind == BF16 else torch.uint8)
    groups = fmt.num_groups(Dc)
    if groups:
        assert scale_rows is not None and scale_rows.shape[1] == groups and scale_rows.stride(-1) == 1
    fp8 = kind >= E4M3
    ckv_how, ckv_s = tensor_scale_rule(ckv_scale) if fp8 and not groups else (NO_SCALE, 1.0)
    kpe_how, kpe_s = tensor_scale_rule(kpe_scale) if fp8 else (NO_SCALE, 1.0)
    max_s = float(fmt.max_value)  # group scale = div_rn(amax, max)
    BLOCK_DC, BLOCK_DK = triton.next_power_of_2(Dc), triton.next_power_of_2(Dk)
    if block_t is None:  # ~4K elements of c_kv per program
        block_t = max(1, min(32, 4096 // BLOCK_DC))
    grid = (triton.cdiv(T, block_t),)
    _quant_append_kernel[grid](
        rows, scale_rows if groups else rows, slot_mapping, c_kv, k_pe,
        T, ckv_s, kpe_s, max_s,
        rows.stride(0), scale_rows.stride(0) if groups else 0, c_kv.stride(0), k_pe.stride(0),
        DC=Dc, DK=Dk, BLOCK_DC=BLOCK_DC, BLOCK_DK=BLOCK_DK, BLOCK_T=block_t,
        GROUPS=groups, BLOCK_G=triton.next_power_of_2(max(groups, 1)), GROUP_SIZE=128,
        MAXV=float(fmt.max_value), KIND=kind, CKV_HOW=ckv_how, KPE_HOW=kpe_how,
        SOFT_CVT=bool(soft_cvt), num_warps=num_warps,
    )
