"""Gather-then-cast kernel: rows of the paged pool, picked by flat slot id, dequantized into a dense workspace.

``out_ckv[t] = ckv_pool[slots[t]] * scale`` (per tensor, or per 128 channels from ``ckv_scale_arr``) and
``out_kpe[t] = kpe_pool[slots[t]] * kpe_scale``, converted to the workspace dtype. Products are fp32, so the
result is bit-identical to ``(stored.float() * scale).to(dtype)`` in torch (under the interpreter, whose fp32 ->
bf16 cast truncates, bf16 rows are rounded with integer ops: ``SOFT_BF16``). Pure data movement: one program
copies ``BLOCK_T`` rows; reads ``T * (Dc + Dk)`` stored elements, writes ``T * (Dc + Dk)`` output elements.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .quant_append import f32_to_bf16_bits

GROUP = 128  # channels of c_kv per group scale (fp8mla.formats.GROUP_SIZE)


@triton.jit
def _store_row(ptr, x, mask, SOFT_BF16: tl.constexpr):
    if SOFT_BF16:  # ptr is an int16 view of a bf16 buffer
        tl.store(ptr, f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dequant_kernel(
    ckv_ptr, kpe_ptr, gs_ptr, slots_ptr, out_ckv_ptr, out_kpe_ptr,
    T, ckv_scale, kpe_scale,
    stride_ckv_slot, stride_kpe_slot, stride_gs_slot, stride_oc, stride_ok,
    DC: tl.constexpr, DK: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_T: tl.constexpr, HAS_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    # int64: slot * stride overflows int32 for pools past 2^31 elements (e.g. 61 layers x 131K tokens x 576).
    slot = tl.load(slots_ptr + rows, mask=rmask, other=0).to(tl.int64)
    rows64 = rows.to(tl.int64)

    dc = tl.arange(0, BLOCK_DC)
    m = rmask[:, None] & (dc[None, :] < DC)
    c = tl.load(ckv_ptr + slot[:, None] * stride_ckv_slot + dc[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_GROUP:
        g = tl.load(gs_ptr + slot[:, None] * stride_gs_slot + dc[None, :] // GROUP_SIZE, mask=m, other=1.0)
        c = c * g
    else:
        c = c * ckv_scale
    _store_row(out_ckv_ptr + rows64[:, None] * stride_oc + dc[None, :], c, m, SOFT_BF16)

    dk = tl.arange(0, BLOCK_DK)
    m = rmask[:, None] & (dk[None, :] < DK)
    k = tl.load(kpe_ptr + slot[:, None] * stride_kpe_slot + dk[None, :], mask=m, other=0.0).to(tl.float32)
    k = k * kpe_scale
    _store_row(out_kpe_ptr + rows64[:, None] * stride_ok + dk[None, :], k, m, SOFT_BF16)


def gather_dequant_rows(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, slots: torch.Tensor,
                        out_ckv: torch.Tensor, out_kpe: torch.Tensor, *, ckv_scale: float = 1.0,
                        kpe_scale: float = 1.0, ckv_scale_arr: torch.Tensor | None = None,
                        block_t: int | None = None, num_warps: int = 4) -> None:
    """Launch the gather.

    Args:
        ckv_cache: ``[P, page, Dc]``, kpe_cache: ``[P, page, Dk]`` (views of one pool are fine; pages must be
            dense in rows: ``stride(0) == page * stride(1)``, last dim contiguous).
        slots: ``[T]`` int32/int64 flat slot ids (``page * page_size + slot``).
        out_ckv: ``[T, Dc]``, out_kpe: ``[T, Dk]`` (bf16/fp16/fp32, last dim contiguous).
        ckv_scale_arr: ``[P, page, Dc // 128]`` fp32 or None (then ``ckv_scale`` applies).
    """
    T = slots.numel()
    P, page, Dc = ckv_cache.shape
    Dk = kpe_cache.shape[2]
    assert ckv_cache.stride(-1) == 1 and kpe_cache.stride(-1) == 1
    assert ckv_cache.stride(0) == page * ckv_cache.stride(1) and kpe_cache.stride(0) == page * kpe_cache.stride(1)
    assert out_ckv.stride(-1) == 1 and out_kpe.stride(-1) == 1
    if T == 0:
        return
    has_group = ckv_scale_arr is not None
    if has_group:
        assert ckv_scale_arr.stride(-1) == 1 and ckv_scale_arr.stride(0) == page * ckv_scale_arr.stride(1)
    gs = ckv_scale_arr if has_group else ckv_cache  # unused pointer when no group scales
    BLOCK_DC, BLOCK_DK = triton.next_power_of_2(Dc), triton.next_power_of_2(Dk)
    if block_t is None:  # ~8K elements of c_kv per program: enough bytes in flight, few registers per thread
        block_t = max(1, min(64, 8192 // BLOCK_DC))
    soft_bf16 = out_ckv.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if soft_bf16:
        out_ckv, out_kpe = out_ckv.view(torch.int16), out_kpe.view(torch.int16)
    grid = (triton.cdiv(T, block_t),)
    _gather_dequant_kernel[grid](
        ckv_cache, kpe_cache, gs, slots, out_ckv, out_kpe,
        T, float(ckv_scale), float(kpe_scale),
        ckv_cache.stride(1), kpe_cache.stride(1), gs.stride(1) if has_group else 0,
        out_ckv.stride(0), out_kpe.stride(0),
        DC=Dc, DK=Dk, BLOCK_DC=BLOCK_DC, BLOCK_DK=BLOCK_DK, BLOCK_T=block_t, HAS_GROUP=has_group,
        GROUP_SIZE=GROUP, SOFT_BF16=soft_bf16, num_warps=num_warps,
    )
