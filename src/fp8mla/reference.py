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


def sparse_mla_reference(q_nope, q_pe, kv_cache, indices, *, sm_scale: float, kv_format, page_size: int,
                         kpe_cache=None, ckv_scale=1.0, kpe_scale=1.0, ckv_scale_arr=None):
    """Sparse attention of each query token over the slots of its index row, in float64 (loop per token).

    Args:
        q_nope ``[n, H, 512]``, q_pe ``[n, H, 64]``; indices ``[n, topk]`` global slots (page * page_size +
        offset), -1 (or any value outside the pool) = no token; a slot named twice counts twice.
        kv_cache: ``fp8_ds_mla``: uint8 ``[P, page, 656]``; else ``[P, page, 576]`` (or c_kv ``[P, page, 512]``
        with ``kpe_cache``). Scales as in :func:`mla_reference`.
    Returns:
        ``(out [n, H, 512] float64, lse [n, H] float64, base 2)``; a row with no token gets 0 and -inf.
    """
    from .formats import get_format
    fmt = get_format(kv_format, sparse_ok=True)
    n, H, Dc = q_nope.shape
    out = torch.zeros(n, H, Dc, dtype=torch.float64, device=q_nope.device)
    lse = torch.full((n, H), -math.inf, dtype=torch.float64, device=q_nope.device)
    P = kv_cache.shape[0]
    for t in range(n):
        row = [int(i) for i in indices[t].tolist() if 0 <= int(i) < P * page_size]
        if not row:
            continue
        ids = torch.tensor(row, dtype=torch.long, device=kv_cache.device)
        page, slot = ids // page_size, ids % page_size
        if fmt.scale_kind == "record":  # [P, page, 656] or FlashMLA's [P, page, 1, 656], uint8 or e4m3-typed
            rec = kv_cache.view(torch.uint8)
            rec = rec[:, :, 0] if rec.dim() == 4 else rec
            ckv, kpe = fmt.unpack(rec[page, slot], dtype=torch.float64)
        else:
            ckv_all = kv_cache if kpe_cache is not None else kv_cache[..., :Dc]
            kpe_all = kpe_cache if kpe_cache is not None else kv_cache[..., Dc:]
            ckv = ckv_all[page, slot].to(torch.float64)
            kpe = kpe_all[page, slot].to(torch.float64) * float(kpe_scale)
            if ckv_scale_arr is not None:
                ckv = ckv * expand_group_scales(ckv_scale_arr[page, slot].to(torch.float64), Dc)
            else:
                ckv = ckv * float(ckv_scale)
        ckv, kpe = ckv.to(q_nope.device), kpe.to(q_nope.device)
        s = (q_nope[t].double() @ ckv.T + q_pe[t].double() @ kpe.T) * sm_scale  # [H, k]
        o, ls = softmax_rows(s, ckv)
        out[t], lse[t] = o, ls * LOG2E
    return out, lse


def v4_attention_reference(q, window_pool, window_indices, *, sm_scale: float, kv_format, window_page_size: int,
                           window_lengths=None, compressed_pool=None, compressed_indices=None,
                           compressed_lengths=None, compressed_page_size: int | None = None, sinks=None):
    """DeepSeek V4 attention in float64 (loop per token): each query token over the window slots and then the
    compressed-row slots its index rows name (K = V: the 512 dequantized values of a row), with the per-head
    sink ``exp(sinks[h])`` in the softmax denominator (as Hugging Face's ``eager_attention_forward``).

    Args:
        q ``[n, H, 512]``; pools in a ``fp8mla.formats_v4`` format; indices ``[n, topk]`` global slots, -1 (or a
        value outside the pool, or a position at or past the row's length) = no token; lengths ``[n]`` or None.
    Returns:
        ``(out [n, H, 512] float64, lse [n, H] float64, base 2, the sink included)``; a row with no token gets
        out 0 and lse -inf, or with a sink out 0 and lse = sink / ln 2.
    """
    from .formats_v4 import get_v4_format
    fmt = get_v4_format(kv_format)
    n, H, D = q.shape
    out = torch.zeros(n, H, D, dtype=torch.float64, device=q.device)
    lse = torch.full((n, H), -math.inf, dtype=torch.float64, device=q.device)
    segments = [(window_pool, window_indices, window_lengths, window_page_size)]
    if compressed_indices is not None:
        segments.append((compressed_pool, compressed_indices, compressed_lengths, compressed_page_size))
    for t in range(n):
        rows = []
        for pool, idx, lengths, page_size in segments:
            num_slots = pool.shape[0] * page_size
            end = idx.shape[1] if lengths is None else max(0, min(int(lengths[t]), idx.shape[1]))
            ids = [int(i) for i in idx[t, :end].tolist() if 0 <= int(i) < num_slots]
            if ids:
                slots = torch.tensor(ids, dtype=torch.long, device=pool.device)
                rows.append(fmt.read(pool, slots, torch.float64, page_size=page_size).to(q.device))
        kv = torch.cat(rows) if rows else torch.zeros(0, D, dtype=torch.float64, device=q.device)
        s = (q[t].double() @ kv.T) * sm_scale  # [H, k]
        if sinks is not None:  # the sink: one more key with score sinks[h] and value 0
            s = torch.cat([s, sinks.double().to(q.device)[:, None]], dim=1)
            kv = torch.cat([kv, torch.zeros(1, D, dtype=torch.float64, device=q.device)])
        if s.shape[1] == 0:
            continue
        o, ls = softmax_rows(s, kv)
        out[t], lse[t] = o, ls * LOG2E
    return out, lse
