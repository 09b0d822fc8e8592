"""Quantize-on-write of DeepSeek V4 rows into an ``fp8mla.formats_v4`` pool (``fp8_v4``, ``fp8_v41``, ``bf16``).

Stores exactly what ``V4Format.write`` stores: per group of 64 (``fp8_v4``) or 32 (``fp8_v41``) values the
ue8m0 byte of ``2^ceil(log2(max(amax / 448, 1e-4)))`` over the finite values (from the fp32 bits: the exponent
field plus one when a mantissa bit is set), ``e4m3(clamp(x * 2^-(e - 127), +-448))`` rounded to nearest even,
the RoPE part of ``fp8_v4`` as ``bf16(clamp(x))``. The stored bits come from integer ops (``quant_append``'s
``f32_to_fp8_bits`` / ``f32_to_bf16_bits``): the same code on the CPU interpreter, sm_80 and newer GPUs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_append import f32_to_bf16_bits, f32_to_fp8_bits

BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@triton.jit
def _quant_v4_kernel(
    p8, p16, slot_ptr, kv_ptr, T, stride_kv, stride_p, stride_s, scale_off, scale_stride, page_size,
    FMT: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr, BLOCK_T: tl.constexpr,
    BF16_MAX_: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    row = page * stride_p + off * stride_s
    t64 = t.to(tl.int64)
    if FMT == 0:
        col = tl.arange(0, 512)
        m = tmask[:, None] & (col[None, :] < 512)
        x = tl.load(kv_ptr + t64[:, None] * stride_kv + col[None, :], mask=m, other=0.0).to(tl.float32)
        x = tl.where(x > BF16_MAX_, BF16_MAX_, tl.where(x < -BF16_MAX_, -BF16_MAX_, x))
        tl.store(p16 + row[:, None] + col[None, :], f32_to_bf16_bits(x), mask=m)
    else:
        g = tl.arange(0, NG)
        c = tl.arange(0, G)
        col = g[None, :, None] * G + c[None, None, :]
        m3 = tmask[:, None, None] & (col < NQ)
        x = tl.load(kv_ptr + t64[:, None, None] * stride_kv + col, mask=m3, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), 2)  # NaN and inf do not count
        r = tl.math.div_rn(amax, 448.0)
        r = tl.where(r > 1e-4, r, 1e-4)
        bits = r.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2 r) + 127
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)                # 2^-(e - 127): exact
        y = x * inv[:, :, None]
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))     # comparisons keep NaN
        tl.store(p8 + row[:, None, None] + col, f32_to_fp8_bits(y, True), mask=m3)
        srow = page * stride_p + scale_off + off * scale_stride
        gm = tmask[:, None] & (g[None, :] < NQ // G)
        tl.store(p8 + srow[:, None] + g[None, :], e.to(tl.uint8), mask=gm)
        if FMT == 1:
            pad = tmask[:, None] & (g[None, :] == NQ // G)  # the scale row's eighth byte: written 0
            tl.store(p8 + srow[:, None] + g[None, :], tl.zeros([BLOCK_T, NG], tl.uint8), mask=pad)
            d = tl.arange(0, 64)
            dm = tmask[:, None] & (d[None, :] < 64)
            k = tl.load(kv_ptr + t64[:, None] * stride_kv + NQ + d[None, :], mask=dm, other=0.0).to(tl.float32)
            k = tl.where(k > BF16_MAX_, BF16_MAX_, tl.where(k < -BF16_MAX_, -BF16_MAX_, k))
            tl.store(p16 + (row // 2 + NQ // 2)[:, None] + d[None, :], f32_to_bf16_bits(k), mask=dm)


def quant_v4(fmt, view: torch.Tensor, page_size: int, slots: torch.Tensor, kv: torch.Tensor, *,
             block_t: int = 4, num_warps: int = 4) -> None:
    """Write rows ``kv [T, 512]`` (fp32/fp16/bf16) at ``slots [T]`` (int32/int64, all in the pool: the caller
    checks) of a pool page view from ``formats_v4.pool_geometry``: uint8 ``[P, page_bytes]`` or bf16
    ``[P, page_size, 512]``."""
    T = slots.numel()
    if T == 0:
        return
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if fmt.kind == 0:
        p8 = p16 = view.view(torch.int16)
        stride_p, stride_s, scale_off, scale_stride = view.stride(0), view.stride(1), 0, 0
        ng, g, nq = 1, 1, 512
    else:
        if view.stride(0) % 2 or view.storage_offset() % 2:
            raise ValueError(f"pool: pages must start at even byte offsets, got page stride {view.stride(0)}")
        p8, p16 = view, view.view(torch.int16)
        if fmt.kind == 1:
            stride_p, stride_s, scale_off, scale_stride, ng, g, nq = view.stride(0), 576, page_size * 576, 8, 8, 64, 448
        else:
            stride_p, stride_s, scale_off, scale_stride, ng, g, nq = view.stride(0), 528, 512, 528, 16, 32, 512
    _quant_v4_kernel[(triton.cdiv(T, block_t),)](
        p8, p16, slots, kv, T, kv.stride(0), stride_p, stride_s, scale_off, scale_stride, page_size,
        FMT=fmt.kind, NG=ng, G=g, NQ=nq, BLOCK_T=block_t, BF16_MAX_=BF16_MAX, num_warps=num_warps)
