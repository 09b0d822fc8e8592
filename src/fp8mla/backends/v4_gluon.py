"""DeepSeek V4 attention on the Hopper Gluon build (``kernels/sm90/v4.py``): the split workspace fixed at plan
(CUDA-graph safe), the launch per run (no copy, no sync). Which plans it takes is its record,
``capabilities.GLUON_V4``: ``backend="auto"`` picks it on an sm_90 GPU for every plan it takes, ``"gluon"`` names
why it does not."""
from __future__ import annotations

import torch

from ..kernels.split.rows import wave_splits
from ..runtime import LN2, num_sms
from .v4_triton import size_split_workspace

BACKEND = "gluon"


def prepare(p, kernel_options: dict) -> None:
    """Refuse Triton tuning options and fix the split workspace on plan ``p`` (``fp8mla.v4.V4Plan``): the largest
    tokens x (splits + sink partial) any call with the one-wave splits needs, O(SMs) rows, not O(batch)."""
    if kernel_options:
        raise TypeError(f"plan: kernel options {sorted(kernel_options)} are for the triton backend, not 'gluon'")
    p.config = {}
    if p.num_splits is None:   # (a pinned split count: allocated per call, as the triton backend)
        size_split_workspace(p, num_sms(p.device), splits)


def splits(p, n: int) -> int:
    """Splits per token in a call of ``n`` tokens: the plan's ``num_splits``, else one wave of one CTA per SM
    (``kernels.split.rows.wave_splits`` over the kernel's head groups and the row's tiles); never more than the
    row's 64-entry tiles (``kernels.sm90.v4.tile_splits``). Fixed per (plan, n)."""
    from ..kernels.sm90 import v4 as sm90_v4
    _, total = sm90_v4.tiles_of(p.window_topk, p.compressed_topk)
    if p.num_splits is not None:
        want = p.num_splits
    else:
        groups = -(-p.num_heads // sm90_v4.HEAD_GROUP)
        want = wave_splits(num_sms(p.device), n, groups, total * sm90_v4.TILE, p.min_split)
    return sm90_v4.tile_splits(total, want)[1]


def run(p, q, window, compressed, sinks, out, lse, base_e: bool) -> None:
    from ..kernels.sm90 import v4 as sm90_v4
    n = q.shape[0]
    s = splits(p, n)
    parts = s + (sinks is not None)
    part_o, part_lse = p.part_o, p.part_lse
    if s > 1 and (part_o is None or part_o.shape[0] < n * parts):
        # only with a fixed num_splits (plan sized nothing): allocated per call, not graph-safe
        part_o = torch.empty(n * parts, p.num_heads, 512, dtype=torch.float32, device=p.device)
        part_lse = torch.empty(n * parts, p.num_heads, dtype=torch.float32, device=p.device)
    sm90_v4.v4_attention(q, out, lse, part_o, part_lse, sinks, window, compressed,
                         fmt=sm90_v4.FORMATS[p.fmt.name], sm_scale=p.sm_scale, num_splits=s,
                         lse_scale=LN2 if base_e else 1.0)
