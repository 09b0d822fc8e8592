"""DeepSeek V4 attention on the portable Triton kernel (``kernels/v4_attention.py``): the launch configuration
and split workspace fixed at plan, the pool views built per run (strides only: no copy, no sync)."""
from __future__ import annotations

import torch

from ..kernels.split.rows import fill_splits, split_geometry
from ..runtime import LN2, num_sms


def prepare(p, kernel_options: dict) -> None:
    """Fix the launch configuration and the split workspace on plan ``p`` (``fp8mla.v4.V4Plan``). The
    batch-invariant mode's workspace follows the calls instead (see :func:`run`)."""
    from ..kernels import v4_attention
    p.config = v4_attention.launch_config(p.fmt.kind, p.device, **kernel_options)
    if p.invariant_chunk is not None:
        if p.invariant_chunk % p.config["block_n"]:
            raise ValueError(f"invariant_chunk: expected a multiple of the kernel's key block (block_n="
                             f"{p.config['block_n']}), got {p.invariant_chunk}")
        return
    if p.num_splits is None:   # (a pinned split count: allocated per call)
        size_split_workspace(p, 2 * num_sms(p.device), splits)


def size_split_workspace(p, max_tokens: int, splits_of) -> None:
    """Plan ``p``'s split workspace, fixed at plan (the Triton and Gluon V4 backends): the largest ``tokens x
    (splits + sink partial)`` any call of 1 .. ``max_tokens`` tokens needs (``splits_of(p, tokens)``, the
    backend's rule): O(SMs) rows, not O(batch); none when no such call splits."""
    cap = 0
    for n in range(1, max_tokens + 1):
        s = splits_of(p, n)
        if s > 1:
            cap = max(cap, n * (s + 1))
    if cap:
        p.part_o = torch.empty(cap, p.num_heads, 512, dtype=torch.float32, device=p.device)
        p.part_lse = torch.empty(cap, p.num_heads, dtype=torch.float32, device=p.device)


def splits(p, n: int) -> int:
    """Programs per token: enough that ``n x head tiles x splits`` reaches twice the SM count, each split walking
    at least ``min_split`` keys (``kernels.split.rows.fill_splits``), whole key blocks a split as the launcher
    cuts them (``split_geometry``). Fixed per (plan, n): the same inputs split and merge the same way."""
    total = p.window_topk + p.compressed_topk
    if p.invariant_chunk is not None:  # the grid of the invariant cut: a full row's pieces, whatever the call
        from ..kernels.v4_attention import invariant_programs
        return invariant_programs(total, p.invariant_chunk)
    if p.num_splits is not None:
        want = p.num_splits
    else:
        want = fill_splits(2 * num_sms(p.device), n, -(-p.num_heads // p.config["block_h"]), total, p.min_split)
    return split_geometry(total, want, p.config["block_n"])[1]


def _kernel_segment(fmt, seg):
    from ..kernels.v4_attention import Segment
    view = seg.view
    if fmt.kind == 0:  # bf16 [P, page, 512]: element strides
        return Segment(view, view, view.stride(0), view.stride(1), 0, 0, seg.page_size,
                       seg.num_pages * seg.page_size, seg.indices, seg.lengths)
    # uint8 [P, page_bytes]; the bf16 view of the same bytes reads fp8_v4's RoPE (even offsets: 576-byte rows)
    if fmt.kind == 1:
        if view.stride(0) % 2 or view.storage_offset() % 2:
            raise ValueError(f"pool: an fp8_v4 pool's pages must start at even byte offsets, got page stride "
                             f"{view.stride(0)}, offset {view.storage_offset()}")
        p16 = view.view(torch.bfloat16)
        return Segment(view, p16, view.stride(0), 576, seg.page_size * 576, 8, seg.page_size,
                       seg.num_pages * seg.page_size, seg.indices, seg.lengths)
    return Segment(view, view, view.stride(0), 528, 512, 528, seg.page_size, seg.num_pages * seg.page_size,
                   seg.indices, seg.lengths)


def run(p, q, window, compressed, sinks, out, lse, base_e: bool) -> None:
    from ..kernels import v4_attention
    n = q.shape[0]
    s = splits(p, n)
    parts = s + (sinks is not None)
    part_o, part_lse = p.part_o, p.part_lse
    if s > 1 and (part_o is None or part_o.shape[0] < n * parts):
        # a fixed num_splits: allocated per call, not graph-safe. The batch-invariant mode keeps its workspace,
        # grown to a power of two of the largest call; the one it replaces stays alive in ``p.retired`` (shared by
        # the object's plans: a graph captured on it replays on it, never on freed memory)
        rows = n * parts if p.invariant_chunk is None else 1 << (n * parts - 1).bit_length()
        part_o = torch.empty(rows, p.num_heads, 512, dtype=torch.float32, device=p.device)
        part_lse = torch.empty(rows, p.num_heads, dtype=torch.float32, device=p.device)
        if p.invariant_chunk is not None:
            p.retired.append((p.part_o, p.part_lse))
            p.part_o, p.part_lse = part_o, part_lse
    cfg = p.config
    v4_attention.v4_attention(
        q, out, lse, part_o, part_lse, sinks, _kernel_segment(p.fmt, window),
        None if compressed is None else _kernel_segment(p.fmt, compressed), fmt=p.fmt.kind, sm_scale=p.sm_scale,
        num_splits=s, lse_scale=LN2 if base_e else 1.0, block_h=cfg["block_h"], block_n=cfg["block_n"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], fp32_dot=cfg["fp32_dot"],
        invariant_chunk=p.invariant_chunk)
