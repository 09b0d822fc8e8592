"""The sparse API's "torch" backend: fp32 torch code on any device (the reference-like fallback; the CPU path).
Its record: ``capabilities.TORCH_SPARSE``. One program per row: no splits, no workspace."""
from __future__ import annotations

import torch

from .._softmax import softmax_rows
from ..runtime import LOG2E


class TorchSparsePlan:
    def __init__(self, spec):
        self.spec = spec

    def splits_for(self, n: int) -> int:
        return 1

    def run(self, q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, base_e: bool) -> None:
        """Gathers the selected tokens (never the pool), a few query tokens at a time."""
        p = self.spec
        n, H, Dc = q_nope.shape
        page = p.page_size
        num_slots = ckv.shape[0] * page
        c_scale, k_scale = scales[0], scales[1]
        step = max(1, (1 << 24) // (p.topk * (Dc + p.head_dim_kpe)))  # ~64 MB of gathered fp32 per chunk
        if p.batch_invariant:
            step = 1  # row by row: every op's shapes follow the row, never the call's token count
        for t0 in range(0, n, step):
            t1 = min(n, t0 + step)
            ids = indices[t0:t1].long()
            valid = (ids >= 0) & (ids < num_slots)
            safe = torch.where(valid, ids, torch.zeros_like(ids))
            pg, sl = safe // page, safe % page
            c = ckv[pg, sl].float()
            k = kpe[pg, sl].float()
            if sa is not None:
                c = c * sa[pg, sl].repeat_interleave(128, dim=-1)
            else:
                c = c * c_scale
            k = k * k_scale
            vis = valid[:, None, :]
            c = torch.where(valid[..., None], c, torch.zeros_like(c))
            k = torch.where(valid[..., None], k, torch.zeros_like(k))
            s = (torch.einsum("thd,tkd->thk", q_nope[t0:t1].float(), c) +
                 torch.einsum("thd,tkd->thk", q_pe[t0:t1].float(), k)) * p.sm_scale
            o, ls = softmax_rows(s, c, vis)
            out[t0:t1] = o.to(out.dtype)
            lse[t0:t1] = ls if base_e else ls * LOG2E


def build(spec, options: dict, state: dict | None = None) -> TorchSparsePlan:
    if options:
        raise TypeError(f"plan: kernel options {sorted(options)} are for the triton backend, not 'torch'")
    return TorchSparsePlan(spec)
