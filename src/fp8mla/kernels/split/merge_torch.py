"""The torch backend's split merge (no triton): chunk partials combined by log-sum-exp in list order, the
formula of the Triton merge kernel (``merge.py``) in natural-log units."""
from __future__ import annotations

import math

import torch


def merge_chunks(parts: list):
    """(o, lse) of chunk partials ``[(o [..., D], lse [...]) natural log]``, merged by log-sum-exp in list order: a
    chunk a row does not see (lse -inf) weighs 0, NaN stays NaN, a row that sees no chunk gives 0 and -inf."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([p[1] for p in parts])                                  # [n, ...]
    m = lses.amax(0)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    o = torch.zeros_like(parts[0][0])
    w_sum = torch.zeros_like(m)
    for p_o, p_lse in parts:
        w = torch.exp(p_lse - m0)
        o = o + w[..., None] * p_o
        w_sum = w_sum + w
    empty = w_sum == 0
    o = torch.where(empty[..., None], torch.zeros_like(o), o / torch.where(empty, 1.0, w_sum)[..., None])
    ls = torch.where(empty, torch.full_like(m, -math.inf), m0 + torch.log(torch.where(empty, 1.0, w_sum)))
    return o, torch.where(torch.isnan(m), m, ls)
