"""Quantize-on-write of the 656-byte ``fp8_ds_mla`` record (see ``fp8mla.formats`` for its bytes).

Stores exactly what ``formats.FP8_DS_MLA.pack`` stores: per 128-channel group ``scale = max(div_rn(amax, 448),
FLT_MIN)`` over the finite values, ``e4m3(clamp(div_rn(x, scale), +-448))`` and ``bf16(clamp(k_pe, +-bf16 max))``,
both rounded to nearest even. The stored bits are always computed with integer ops (``quant_append``'s
``f32_to_fp8_bits`` / ``f32_to_bf16_bits``): the same code on the CPU interpreter (whose casts do not round to
nearest even), on sm_80 (no FP8 type in Triton) and on newer GPUs; a write kernel is not where the cost is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_append import f32_to_bf16_bits, f32_to_fp8_bits

BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FLT_MIN = float(torch.finfo(torch.float32).tiny)


@triton.jit
def _quant_ds_mla_kernel(
    rec_ptr, rec32_ptr, rec16_ptr, slot_ptr, ckv_ptr, kpe_ptr, T,
    stride_rec, stride_rec32, stride_rec16, stride_ckv, stride_kpe,
    BLOCK_T: tl.constexpr, BF16_MAX_: tl.constexpr, FLT_MIN_: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)  # int64: slot x 656 passes 2^31
    t64 = t.to(tl.int64)
    # -- c_kv as [BLOCK_T, 4 groups, 128]: amax, scale, e4m3 bytes at [0, 512) --------------------------------
    g = tl.arange(0, 4)
    c = tl.arange(0, 128)
    col = g[None, :, None] * 128 + c[None, None, :]
    m3 = tmask[:, None, None] & (col < 512)
    x = tl.load(ckv_ptr + t64[:, None, None] * stride_ckv + col, mask=m3, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), 2)  # NaN and inf do not count
    gs = tl.math.div_rn(amax, 448.0)
    gs = tl.where(gs > FLT_MIN_, gs, FLT_MIN_)
    y = tl.math.div_rn(x, gs[:, :, None])
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # comparisons keep NaN
    tl.store(rec_ptr + slot[:, None, None] * stride_rec + col, f32_to_fp8_bits(y, True), mask=m3)
    # -- the 4 fp32 scales at bytes [512, 528) = fp32 elements [128, 132) -----------------------------------
    gm = tmask[:, None] & (g[None, :] < 4)
    tl.store(rec32_ptr + slot[:, None] * stride_rec32 + 128 + g[None, :], gs, mask=gm)
    # -- k_pe as bf16 at bytes [528, 656) = 16-bit elements [264, 328) ---------------------------------------
    d = tl.arange(0, 64)
    m = tmask[:, None] & (d[None, :] < 64)
    k = tl.load(kpe_ptr + t64[:, None] * stride_kpe + d[None, :], mask=m, other=0.0).to(tl.float32)
    k = tl.where(k > BF16_MAX_, BF16_MAX_, tl.where(k < -BF16_MAX_, -BF16_MAX_, k))
    tl.store(rec16_ptr + slot[:, None] * stride_rec16 + 264 + d[None, :], f32_to_bf16_bits(k), mask=m)


def quant_ds_mla(rows: torch.Tensor, slot_mapping: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, *,
                 block_t: int = 8, num_warps: int = 4) -> None:
    """Quantize ``c_kv [T, 512]`` / ``k_pe [T, 64]`` (fp32/fp16/bf16/fp64) into records ``rows [S, 656]`` uint8
    (one layer's pool as flat slots) at ``slot_mapping [T]`` (int32/int64, all in ``[0, S)``: the caller checks)."""
    T = slot_mapping.numel()
    assert rows.dim() == 2 and rows.shape[1] == 656 and rows.dtype == torch.uint8 and rows.stride(-1) == 1
    assert rows.stride(0) % 4 == 0 and rows.storage_offset() % 4 == 0, "records must be 4-byte aligned"
    assert c_kv.shape == (T, 512) and k_pe.shape == (T, 64)
    if T == 0:
        return
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    rec32, rec16 = rows.view(torch.float32), rows.view(torch.int16)
    _quant_ds_mla_kernel[(triton.cdiv(T, block_t),)](
        rows, rec32, rec16, slot_mapping, c_kv, k_pe, T,
        rows.stride(0), rec32.stride(0), rec16.stride(0), c_kv.stride(0), k_pe.stride(0),
        BLOCK_T=block_t, BF16_MAX_=BF16_MAX, FLT_MIN_=FLT_MIN, num_warps=num_warps,
    )
