"""The "gather_cast" strategy: gather the batch's tokens into a 16-bit workspace, then run a 16-bit kernel on it.

The workspace is sized by the tokens the batch uses, never by the pool: this is the gather-then-cast fix of the
whole-pool cast, kept as a baseline and a fallback. The inner plan reads the workspace as a pool of one-token
pages, so it is just another layout handed to another backend. Its size follows each plan's tokens, so it
cannot be captured in a CUDA graph that outlives a re-plan.
"""
from __future__ import annotations

import torch

from ..formats import get_format
from ..gather import gather_rows
from ..layout import PagedLayout
from . import AttentionSpec, build as build_backend

__all__ = ["build", "GatherCastPlan"]


class GatherCastPlan:
    def __init__(self, layout: PagedLayout, spec: AttentionSpec, inner_name: str, options: dict):
        self.inner_name = inner_name
        slots = layout.token_slots()
        T = slots.numel()
        self.slots = slots
        dev = spec.device
        # One token per "page": token_indptr is both the page pointer and the token pointer of the workspace.
        tok = layout.token_indptr()
        host_lens = None if layout.kv_lens is None or layout.qo_lens is None else [
            L if q else 0 for L, q in zip(layout.kv_lens, layout.qo_lens)]
        inner_layout = PagedLayout(layout.qo_indptr, tok, torch.arange(max(1, T), dtype=torch.int32, device=dev),
                                   layout.used_kv_len().to(torch.int32), 1, dev, layout.qo_lens, host_lens, T - 1)
        inner_spec = AttentionSpec(spec.num_heads, spec.head_dim_ckv, spec.head_dim_kpe, 1, spec.causal,
                                   spec.sm_scale, spec.q_dtype, get_format(spec.q_dtype), dev, False)
        self.inner = build_backend(inner_name, inner_layout, inner_spec, options, {})
        ws = dict(dtype=spec.q_dtype, device=dev)
        self.ckv = torch.empty(max(1, T), 1, spec.head_dim_ckv, **ws)
        self.kpe = torch.empty(max(1, T), 1, spec.head_dim_kpe, **ws)
        self.ones = torch.ones(2, dtype=torch.float32, device=dev)
        self.scale_values = None  # host floats of the run's per-tensor scales, set by MLAPagedAttention.run

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e: bool) -> None:
        ckv_s, kpe_s = self.scale_values if self.scale_values is not None else scales.tolist()  # tensor: a sync
        T = self.slots.numel()
        gather_rows(ckv_cache, kpe_cache, self.slots, self.ckv[:T, 0], self.kpe[:T, 0], ckv_scale=ckv_s,
                    kpe_scale=kpe_s, ckv_scale_arr=ckv_scale_arr,
                    backend="triton" if self.inner_name == "triton" else "torch")
        self.inner.run(q_nope, q_pe, self.ckv, self.kpe, self.ones, None, out, lse, base_e)


def build(layout, spec, options: dict, state=None, inner: str = "torch") -> GatherCastPlan:
    return GatherCastPlan(layout, spec, inner, options)
