"""Softmax attention over score rows where some rows see no key, shared by every torch code path (the float64
reference, the torch backend, the ragged prefill's torch path): one definition of the edge cases.

- a row that sees no key (all scores -inf) gives out 0 and lse -inf: the "no keys" answer;
- NaN in a visible score (a NaN query, or NaN in a token the row sees) gives NaN out and NaN lse, never the
  "no keys" answer;
- masked keys (``visible`` False, or scores of -inf) never contribute, whatever their scores or values hold:
  a NaN value of a key a row does not see does not reach that row (no 0 x NaN).
"""
from __future__ import annotations

import math

import torch

__all__ = ["softmax_rows"]


def softmax_rows(s: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None, *,
                 masked_values_finite: bool = False):
    """Softmax over the last dim of scores ``s [..., L]`` (fp32/64), times ``v [..., L, D]``, with rows that see
    no key giving 0 and lse ``-inf`` (natural log). NaN in a visible score propagates to out and lse.

    ``masked_values_finite=True`` is the caller's promise that every key some row does not see holds finite
    values in ``v`` (for example: each row sees all the real keys, and padding keys were zeroed). Then no
    0 x NaN can reach a row through a masked key, and the scan of ``v`` for non-finite values (a full pass over
    the values and most of this function's time on a CPU) is skipped. Non-finite values of keys a row sees reach
    its output as plain arithmetic carries them (weight x NaN is NaN, even at weight 0).

    Returns ``(o [..., D], lse [...])``.
    """
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    seen = m > -math.inf                 # NaN compares False: handled below, never taken as "no keys"
    nan = torch.isnan(m)
    m0 = torch.where(seen, m, torch.zeros_like(m))
    p = torch.exp(s - m0)
    denom = p.sum(dim=-1, keepdim=True)
    bad_v = None if masked_values_finite else ~torch.isfinite(v)
    if bad_v is not None and bool(bad_v.any()):
        # A key a row does not see has weight 0, but 0 x NaN = NaN: zero non-finite values for the product and
        # mark NaN the rows that give such a value a weight > 0.
        hit = torch.matmul((p > 0).to(v.dtype), bad_v.to(v.dtype)) > 0
        o = torch.matmul(p, torch.where(bad_v, torch.zeros_like(v), v))
        o = torch.where(hit, torch.full_like(o, math.nan), o)
    else:
        o = torch.matmul(p, v)
    if bool(seen.all()):  # every row sees a key and no row max is NaN: the edge cases below change nothing
        return o / denom, (m + torch.log(denom)).squeeze(-1)
    o = o / torch.where(seen, denom, torch.ones_like(denom))
    o = torch.where(seen | nan, o, torch.zeros_like(o))
    lse = torch.where(seen | nan, m0 + torch.log(denom), torch.full_like(m, -math.inf)).squeeze(-1)
    return torch.where(nan, torch.full_like(o, math.nan), o), torch.where(nan.squeeze(-1), m.squeeze(-1), lse)
