"""DeepSeek V4 attention in fp32 torch code (any device): gathers the selected rows (never the pool), a few query
tokens at a time, with the sink as one more key of score ``sinks[h]`` and value 0 (``_softmax.softmax_rows``'s
edge cases: no key gives out 0 and lse -inf; a sink alone gives out 0 and lse = the sink). The batch-invariant
mode runs one query row at a time (one softmax over the whole row: no cut, so nothing follows the call)."""
from __future__ import annotations

import torch

from .._softmax import softmax_rows
from ..runtime import LOG2E


def _gather(fmt, seg, rows: torch.Tensor, lengths):
    """(rows [T, k, 512] fp32 dequantized, valid [T, k]) of one segment's index rows."""
    num_slots = seg.num_pages * seg.page_size
    ids = rows.long()
    valid = (ids >= 0) & (ids < num_slots)
    if lengths is not None:
        valid &= torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths.long()[:, None]
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    kv = fmt.read(seg.view, safe.reshape(-1), torch.float32, page_size=seg.page_size).reshape(*ids.shape, -1)
    return torch.where(valid[..., None], kv, torch.zeros_like(kv)), valid


def run(p, q, window, compressed, sinks, out, lse, base_e: bool) -> None:
    n, H, D = q.shape
    topk = p.window_topk + p.compressed_topk
    step = max(1, (1 << 24) // (max(1, topk) * D))  # ~64 MB of gathered fp32 a chunk
    if p.invariant_chunk is not None:
        step = 1  # the batch-invariant mode: row by row, every op's shapes follow the row, never the call
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        parts = [_gather(p.fmt, window, window.indices[t0:t1],
                         None if window.lengths is None else window.lengths[t0:t1])]
        if compressed is not None:
            parts.append(_gather(p.fmt, compressed, compressed.indices[t0:t1],
                                 None if compressed.lengths is None else compressed.lengths[t0:t1]))
        kv = torch.cat([k for k, _ in parts], dim=1)
        valid = torch.cat([v for _, v in parts], dim=1)
        s = torch.einsum("thd,tkd->thk", q[t0:t1].float(), kv) * p.sm_scale
        vis = valid[:, None, :].expand(-1, H, -1)
        if sinks is not None:
            s = torch.cat([s, sinks.float()[None, :, None].expand(t1 - t0, H, 1)], dim=2)
            kv = torch.cat([kv, torch.zeros_like(kv[:, :1])], dim=1)
            vis = torch.cat([vis, torch.ones_like(vis[..., :1])], dim=2)
        o, ls = softmax_rows(s, kv, vis)
        out[t0:t1] = o.to(out.dtype)
        lse[t0:t1] = ls if base_e else ls * LOG2E
