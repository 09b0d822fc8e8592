"""The "torch" backend of MLAPagedAttention: gather the referenced tokens, dequantize them, fp32 math.

This is the gather-then-cast strategy: it reads only the tokens the batch references (never the whole pool),
so it is correct and bounded in memory, but it writes an fp32 copy of those tokens. It runs on CPU and GPU.
"""
from __future__ import annotations

import math

import torch

from .formats import expand_group_scales

LOG2E = 1.0 / math.log(2.0)


class TorchPlan:
    """Padded gather indices of one plan: request b's token t sits at ``slots[b, t]`` when ``valid[b, t]``."""

    def __init__(self, qo_lens: list[int], kv_pages: list[list[int]], kv_lens: list[int], page_size: int,
                 causal: bool, device: torch.device):
        B = len(kv_lens)
        L = max([0] + kv_lens)
        Q = max([0] + qo_lens)
        slots = torch.zeros(B, L, dtype=torch.int64)
        qidx = torch.zeros(B, Q, dtype=torch.int64)
        start = 0
        for b in range(B):
            pos = torch.arange(kv_lens[b])
            pages = torch.tensor(kv_pages[b], dtype=torch.int64)
            if kv_lens[b]:
                slots[b, : kv_lens[b]] = pages[pos // page_size] * page_size + pos % page_size
            qidx[b, : qo_lens[b]] = torch.arange(start, start + qo_lens[b])
            start += qo_lens[b]
        lens = torch.tensor(kv_lens, dtype=torch.int64)
        qlens = torch.tensor(qo_lens, dtype=torch.int64)
        kv_valid = torch.arange(L)[None, :] < lens[:, None]                        # [B, L]
        q_valid = torch.arange(Q)[None, :] < qlens[:, None]                        # [B, Q]
        visible = kv_valid[:, None, :].expand(B, Q, L)                              # [B, Q, L]
        if causal:
            last = lens[:, None] - qlens[:, None] + torch.arange(Q)[None, :]        # last visible position
            visible = visible & (torch.arange(L)[None, None, :] <= last[:, :, None])
        self.slots, self.kv_valid = slots.to(device), kv_valid.to(device)
        self.qidx, self.q_valid, self.visible = qidx.to(device), q_valid.to(device), visible.to(device)


def _scale(s, like: torch.Tensor):
    return s.to(device=like.device, dtype=like.dtype) if isinstance(s, torch.Tensor) else float(s)


def run_torch(tp: TorchPlan, q_nope, q_pe, ckv_cache, kpe_cache, sm_scale: float, ckv_scale, kpe_scale,
              ckv_scale_arr, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Writes ``out [n, H, Dc]`` and ``lse [n, H]`` (natural log) for the plan ``tp``."""
    B, L = tp.slots.shape
    if L == 0 or out.shape[0] == 0:  # no token anywhere: softmax over nothing
        out.zero_()
        lse.fill_(-math.inf)
        return
    slots = tp.slots.reshape(-1)
    # Gather first, convert second: only B x L tokens are converted, never the pool.
    ckv = ckv_cache.flatten(0, 1).index_select(0, slots).float()
    kpe = kpe_cache.flatten(0, 1).index_select(0, slots).float() * _scale(kpe_scale, out.new_empty(0).float())
    if ckv_scale_arr is not None:
        ckv = ckv * expand_group_scales(ckv_scale_arr.flatten(0, 1).index_select(0, slots).float(), ckv.shape[-1])
    else:
        ckv = ckv * _scale(ckv_scale, ckv)
    valid = tp.kv_valid.reshape(-1, 1)
    # Padding slots may point at pages full of NaN: zero them so 0-weight x NaN cannot leak into the output.
    ckv = torch.where(valid, ckv, 0.0).view(B, L, -1)
    kpe = torch.where(valid, kpe, 0.0).view(B, L, -1)
    qn = q_nope[tp.qidx].float()                                       # [B, Q, H, Dc]
    qp = q_pe[tp.qidx].float()
    s = (torch.einsum("bqhd,bld->bqhl", qn, ckv) + torch.einsum("bqhd,bld->bqhl", qp, kpe)) * sm_scale
    s = s.masked_fill(~tp.visible[:, :, None, :], -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    seen = torch.isfinite(m)
    m = torch.where(seen, m, 0.0)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bqhl,bld->bqhd", p, ckv) / torch.where(seen, denom, 1.0)
    o = torch.where(seen, o, 0.0)
    lse_b = torch.where(seen, m + torch.log(denom), -math.inf).squeeze(-1)
    rows = tp.qidx[tp.q_valid]
    out[rows] = o[tp.q_valid].to(out.dtype)
    lse[rows] = lse_b[tp.q_valid]
