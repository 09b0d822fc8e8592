"""Merge two attention states over disjoint key sets: ``s = log2(2^s_a + 2^s_b)``,
``v = (2^(s_a - s) v_a + 2^(s_b - s) v_b)`` (lse base 2, fp32 math).

An empty state (``s = -inf``) has weight 0 and its ``v`` is ignored (it may hold anything, NaN included); two
empty states give ``v = 0, s = -inf``. May run in place (``v_out is v_a``): each program reads its rows before
writing them.
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
    stride_sa_n, stride_sb_n, stride_so_n,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)       # row = token * H + head
    rmask = r < R
    n = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    s_a = tl.load(sa_ptr + n * stride_sa_n + h, mask=rmask, other=float("-inf"))
    s_b = tl.load(sb_ptr + n * stride_sb_n + h, mask=rmask, other=float("-inf"))
    m = tl.maximum(s_a, s_b)
    m = tl.where(m == float("-inf"), 0.0, m)        # both empty: shift by 0 so exp2 gives 0, not NaN
    w_a = tl.exp2(s_a - m)
    w_b = tl.exp2(s_b - m)
    tot = w_a + w_b
    seen = tot > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, tot, 1.0), 0.0)
    s = tl.where(seen, m + tl.log2(tl.where(seen, tot, 1.0)), float("-inf"))

    d = tl.arange(0, BLOCK_D)
    dm = rmask[:, None] & (d[None, :] < D)
    va = tl.load(va_ptr + n[:, None] * stride_va_n + h[:, None] * stride_va_h + d[None, :], mask=dm, other=0.0)
    vb = tl.load(vb_ptr + n[:, None] * stride_vb_n + h[:, None] * stride_vb_h + d[None, :], mask=dm, other=0.0)
    # where(), not multiply: 0 x NaN from an empty state's v would poison the result.
    v = tl.where((w_a > 0)[:, None], va.to(tl.float32) * (w_a * inv)[:, None], 0.0) \
        + tl.where((w_b > 0)[:, None], vb.to(tl.float32) * (w_b * inv)[:, None], 0.0)
    tl.store(vo_ptr + n[:, None] * stride_vo_n + h[:, None] * stride_vo_h + d[None, :],
             v.to(vo_ptr.dtype.element_ty), mask=dm)
    tl.store(so_ptr + n * stride_so_n + h, s, mask=rmask)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                v_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """Launch the merge. ``v_*``: ``[n, H, D]`` (last dim contiguous), ``s_*``: ``[n, H]`` fp32 (last dim
    contiguous). ``v_out``/``s_out`` may alias ``v_a``/``s_a``."""
    n, H, D = v_a.shape
    R = n * H
    if R == 0:
        return
    for t in (v_a, v_b, v_out, s_a, s_b, s_out):
        assert t.stride(-1) == 1
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_R = max(1, min(64, 4096 // BLOCK_D))
    grid = (triton.cdiv(R, BLOCK_R),)
    _merge_state_kernel[grid](
        v_a, s_a, v_b, s_b, v_out, s_out, R, H,
        v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), v_out.stride(0), v_out.stride(1),
        s_a.stride(0), s_b.stride(0), s_out.stride(0),
        D=D, BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R, num_warps=4,
    )
