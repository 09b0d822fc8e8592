"""BASELINE ONLY — the legacy "cast the whole pool" attention path, kept to be measured, never to be used.

This is the bug fp8mla exists to remove. A serving engine whose attention kernel could not read FP8 did, on every
layer of every decode step::

    k_buffer = token_to_kv_pool.get_key_buffer(layer_id).to(q.dtype)   # the WHOLE pool, FP8 -> BF16

and ran BF16 attention on the copy. The cast reads and writes every token of the pool (495,552 tokens, 857 MB
moved per layer for GLM-5 on 8 GPUs), although a decode step references only the batch's tokens: 69% of the
step went to ``aten::copy_``. ``fp8mla demo`` and ``fp8mla bench step`` run this path side by side with
gather-then-cast and the native FP8 kernel, so the cost is shown, not asserted.

Nothing outside ``fp8mla.bench`` and ``fp8mla.commands.demo`` may import this module.
"""
from __future__ import annotations

import torch

from ..attention import MLAPagedAttention

__all__ = ["CastPoolAttention"]


class CastPoolAttention:
    """The legacy path: per layer, ``pool.to(q_dtype)`` of the whole layer pool, then attention on the copy.

    Args:
        attn_backend: backend of the attention that runs on the BF16 copy. ``"auto"`` gives it the same kernel
            the native path gets (Triton on CUDA), so the difference measured is the cast and the wider read;
            the seed deployment ran FlashInfer's BF16 kernel there. ``"torch"`` forces the torch backend.
    """

    def __init__(self, attn_backend: str = "auto", use_cuda_graph: bool = False):
        self.attn = MLAPagedAttention(backend=attn_backend, use_cuda_graph=use_cuda_graph)
        self.head_dim_ckv = 0
        self.q_dtype = torch.bfloat16

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type=None):
        # The legacy code plans a BF16 pool whatever the cache holds: the cast makes it one. kv_data_type is
        # accepted (and ignored) so that the same plan arguments fit every way.
        self.head_dim_ckv, self.q_dtype = head_dim_ckv, q_data_type
        self.attn.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
                       page_size, causal, sm_scale, q_data_type, q_data_type)

    @property
    def backend(self):
        return self.attn.backend

    def run(self, q_nope, q_pe, k_buffer: torch.Tensor, out=None, return_lse=False):
        """``k_buffer``: the layer's whole ``[P, page, Dc + Dk]`` pool (FP8), as ``get_key_buffer(layer)`` returns
        it. Scales must be 1: the legacy ``.to(q.dtype)`` ignores them (one more reason it is a baseline only).
        ``fp8mla audit`` flags the next line, as it should."""
        kv = k_buffer.to(q_nope.dtype)  # <- the bug: converts every token of the pool, every layer
        Dc = self.head_dim_ckv
        return self.attn.run(q_nope, q_pe, kv[..., :Dc], kv[..., Dc:], out=out, return_lse=return_lse)
