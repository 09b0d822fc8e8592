"""Merge two attention states over disjoint key sets: ``s = log2(2^s_a + 2^s_b)``,
``v = (2^(s_a - s) v_a + 2^(s_b - s) v_b)`` (lse base 2, fp32 math).

An empty state (``s = -inf``) has weight 0 and its ``v`` is ignored (it may hold anything, NaN included); two
empty states give ``v = 0, s = -inf``. A NaN (or +inf) ``s`` is not empty: the merged row is NaN, never the
other state alone. May run in place (``v_out is v_a``): each program reads its rows before writing them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_state_kernel(
    va_ptr, sa_ptr, vb_ptr, sb_ptr, vo_ptr, so_ptr,
    R, H,
    stride_va_n, stride_va_h, stride_vb_n, stride_vb_h, stride_vo_n, stride_vo_h,
    stride_sa_n, stride_sa_h, stride_sb_n, stride_sb_h, stride_so_n, stride_so_h,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)       # row = token * H + head
    rmask = r < R
    n = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    s_a = tl.load(sa_ptr + n * stride_sa_n + h * stride_sa_h, mask=rmask, other=float("-inf"))
    s_b = tl.load(sb_ptr + n * stride_sb_n + h * stride_sb_h, mask=rmask, other=float("-inf"))
    m = tl.maximum(s_a, s_b)                        # NaN-ignoring; the NaN comes back through the weights
    m = tl.where(m == float("-inf"), 0.0, m)        # both empty: shift by 0 so exp2 gives 0, not NaN
    w_a = tl.exp2(s_a - m)
    w_b = tl.exp2(s_b - m)
    tot = w_a + w_b
    empty = tot == 0                                # NaN is not empty
    inv = 1.0 / tl.where(empty, 1.0, tot)
    s = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, tot)))

    d = tl.arange(0, BLOCK_D)
    dm = rmask[:, None] & (d[None, :] < D)
    va = tl.load(va_ptr + n[:, None] * stride_va_n + h[:, None] * stride_va_h + d[None, :], mask=dm, other=0.0)
    vb = tl.load(vb_ptr + n[:, None] * stride_vb_n + h[:, None] * stride_vb_h + d[None, :], mask=dm, other=0.0)
    # where() on "empty", not a multiply: 0 x NaN from an empty state's v would poison the result. A state with a
    # NaN weight keeps its product (NaN).
    v = tl.where((s_a == float("-inf"))[:, None], 0.0, va.to(tl.float32) * (w_a * inv)[:, None]) \
        + tl.where((s_b == float("-inf"))[:, None], 0.0, vb.to(tl.float32) * (w_b * inv)[:, None])
    tl.store(vo_ptr + n[:, None] * stride_vo_n + h[:, None] * stride_vo_h + d[None, :],
             v.to(vo_ptr.dtype.element_ty), mask=dm)
    tl.store(so_ptr + n * stride_so_n + h * stride_so_h, s, mask=rmask)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                v_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """Launch the merge. ``v_*``: ``[n, H, D]`` (last dim contiguous), ``s_*``: ``[n, H]`` fp32 (any strides).
    ``v_out``/``s_out`` may alias ``v_a``/``s_a``."""
    n, H, D = v_a.shape
    R = n * H
    if R == 0:
        return
    if D == 0:  # (no tile of 0 columns: fp8mla.ragged.merge_state merges such states' lse in torch)
        raise ValueError("v_a: expected a value dimension >= 1 for the kernel, got shape [n, H, 0]")
    for name, t in (("v_a", v_a), ("v_b", v_b), ("v_out", v_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_R = max(1, min(64, 4096 // BLOCK_D))
    grid = (triton.cdiv(R, BLOCK_R),)
    _merge_state_kernel[grid](
        v_a, s_a, v_b, s_b, v_out, s_out, R, H,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), v_out.stride(0), v_out.stride(1),
        s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1), s_out.stride(0), s_out.stride(1),
        D=D, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R, num_warps=4,
    )
