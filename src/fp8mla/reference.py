"""Float64 loop-per-sequence reference of paged MLA attention. Only tests, checks and demos use it.

It dequantizes the tokens a sequence references (``stored * scale``) in float64 and computes plain softmax
attention, so comparing a kernel with it measures the kernel's own error, not the quantization error.
"""
from __future__ import annotations

import math

import torch

from ._softmax import softmax_rows
from .formats import expand_group_scales
from .runtime import LOG2E


def gather_sequence_kv(ckv_cache, kpe_cache, pages, kv_len, *, ckv_scale=1.0, kpe_scale=1.0,
                       ckv_scale_arr=None, dtype=torch.float64):
    """The ``kv_len`` tokens held by ``pages`` (page ids in order), dequantized: (c_kv [L, Dc], k_pe [L, Dk])."""
    page_size = ckv_cache.shape[1]
    pos = torch.arange(kv_len, device=ckv_cache.device)
    page = pages.to(ckv_cache.device).long()[pos // page_size]
    slot = pos % page_size
    ckv = ckv_cache[page, slot].to(dtype)
    kpe = kpe_cache[page, slot].to(dtype) * float(kpe_scale)
    if ckv_scale_arr is not None:
        ckv = ckv * expand_group_scales(ckv_scale_arr[page, slot].to(dtype), ckv.shape[-1])
    else:
        ckv = ckv * float(ckv_scale)
    return ckv, kpe


def mla_reference(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len_arr, *,
                  sm_scale: float, causal: bool, ckv_scale=1.0, kpe_scale=1.0, ckv_scale_arr=None):
    """Attention of each query over its request's paged latents, in float64.

    Args:
        q_nope: ``[n, H, Dc]``; q_pe: ``[n, H, Dk]``; ckv_cache: ``[P, page, Dc]``; kpe_cache: ``[P, page, Dk]``.
        qo_indptr, kv_indptr: ``[B + 1]``; kv_indices: page ids; kv_len_arr: ``[B]``.
        causal: query ``i`` of ``q`` queries sees kv positions ``<= kv_len - q + i`` (aligned to the end).
    Returns:
        ``(out [n, H, Dc] float64, lse [n, H] float64, base 2)``. A query that sees no token gets 0 and -inf;
        NaN in a query or in a token it sees gives NaN.
    """
    n, H, Dc = q_nope.shape
    out = torch.zeros(n, H, Dc, dtype=torch.float64, device=q_nope.device)
    lse = torch.full((n, H), -math.inf, dtype=torch.float64, device=q_nope.device)
    qo, kvp, lens = qo_indptr.tolist(), kv_indptr.tolist(), kv_len_arr.tolist()
    for b in range(len(lens)):
        q0, q1, L = qo[b], qo[b + 1], int(lens[b])
        if q1 == q0 or L == 0:
            continue
        ckv, kpe = gather_sequence_kv(ckv_cache, kpe_cache, kv_indices[kvp[b]:kvp[b + 1]], L,
                                      ckv_scale=ckv_scale, kpe_scale=kpe_scale, ckv_scale_arr=ckv_scale_arr)
        ckv, kpe = ckv.to(q_nope.device), kpe.to(q_nope.device)
        qn, qp = q_nope[q0:q1].double(), q_pe[q0:q1].double()
        s = (torch.einsum("qhd,ld->qhl", qn, ckv) + torch.einsum("qhd,ld->qhl", qp, kpe)) * sm_scale
        if causal:
            nq = q1 - q0
            last = L - nq + torch.arange(nq, device=s.device)  # last visible position per query
            hidden = torch.arange(L, device=s.device)[None, :] > last[:, None]
            s = s.masked_fill(hidden[:, None, :], -math.inf)
        o, ls = softmax_rows(s, ckv)
        out[q0:q1] = o
        lse[q0:q1] = ls * LOG2E
    return out, lse
