"""The attention of a DeepSeek-V4 layer over gathered rows: one function, the seam between the model layer and the
attention kernels.

Each query token ``t`` (``q [T, H, 512]``) attends to the rows its index segments name: the window's token rows
and (CSA / HCA layers) the compressed rows, each segment an ``[T, K]`` int32 list of flat slots, ``-1`` padded,
into its own row pool. K = V = the row (shared-KV MQA)::

    s_j   = q . row_j * sm_scale                      for every listed row j
    p_j   = exp(s_j) / (sum_i exp(s_i) + exp(sink_h))  (the per-head sink sits in the denominator only)
    out   = sum_j p_j row_j,    lse = ln(sum_i exp(s_i) + exp(sink_h))

A query with no row gets out 0 and lse = its sink (-inf without sinks).
"""
from __future__ import annotations

import math

import torch

__all__ = ["attend_rows"]


def attend_rows(q: torch.Tensor, segments, sinks: torch.Tensor | None, sm_scale: float, *,
                compute_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, D] in q's dtype, lse [T, H] fp32, natural log)``.

    Args:
        q: ``[T, H, D]`` queries.
        segments: ``(read, indices)`` pairs: ``indices [T, K]`` int32 slots (-1: none) and ``read(slots [n])``
            giving those rows ``[n, D]`` (gathered, then dequantized).
        sinks: ``[H]`` fp32 or None; sm_scale: the score scale; compute_dtype: of the scores and the sum.
    """
    T, H, D = q.shape
    rows, masks = [], []
    for read, idx in segments:
        if idx.shape[0] != T or idx.dim() != 2:
            raise ValueError(f"indices: expected [{T}, K], got {list(idx.shape)}")
        if idx.shape[1] == 0:
            continue
        valid = idx >= 0
        got = read(torch.where(valid, idx, 0).reshape(-1).long()).reshape(T, idx.shape[1], D)
        # an unselected slot may hold anything (NaN included): zero it, do not rely on p = 0
        rows.append(torch.where(valid[..., None], got.to(compute_dtype), 0))
        masks.append(valid)
    kv = torch.cat(rows, dim=1) if rows else q.new_zeros(T, 0, D, dtype=compute_dtype)
    valid = torch.cat(masks, dim=1) if masks else torch.zeros(T, 0, dtype=torch.bool, device=q.device)
    s = torch.einsum("thd,tkd->thk", q.to(compute_dtype), kv) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    sink = (torch.full((H,), -math.inf, device=q.device) if sinks is None else sinks).to(compute_dtype)
    logits = torch.cat([s, sink.view(1, H, 1).expand(T, H, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    out = torch.einsum("thk,tkd->thd", p, kv)
    return out.to(q.dtype), lse.float()
