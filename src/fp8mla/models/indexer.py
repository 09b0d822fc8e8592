"""The lightning indexer of DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2) and its key cache.

Per query token at position ``p`` of a sequence, with ``q_resid`` = ``q_a_layernorm(q_a_proj(x))`` (the MLA
query latent)::

    q[h]  = rope(wq_b(q_resid))[h]          # index_n_heads heads of index_head_dim; rope on the first
    k     = rope(k_norm(wk(x)))             #   qk_rope_head_dim dims (GLM-5 interleaved, V3.2 half-split)
    w[h]  = weights_proj(x)[h] / sqrt(index_n_heads)                              (fp32)
    score(j) = sum_h w[h] * relu(q[h] . k_j / sqrt(index_head_dim))   for the sequence's tokens j <= p
    selection = the index_topk tokens of highest score

as transformers' ``GlmMoeDsaIndexer`` / ``DeepseekV32Indexer`` (whose names the parameters keep). The selection
is handed to the sparse attention as global cache slots (``page * page_size + offset``) in an ``[n_tokens,
index_topk]`` int32 array; a token that sees fewer than ``index_topk`` tokens gets them all and ``-1`` in the
rest. (transformers' top-k runs over the whole key axis, so its rows for such tokens also name *future*
positions, at ``-inf`` scores, which its causal mask then drops: the tokens attended are the same.)

Key cache: :class:`DSACache` keeps one key per token for every layer that runs an indexer, on the same pages and
slots as the latent pool, in the model's dtype (16-bit for a served model; transformers keeps it so too).
Serving engines store it in FP8: vLLM's ``DeepseekV32IndexerCache`` and SGLang's NSA pool
(``index_k_with_scale_buffer``) keep e4m3 keys with one fp32 scale per 128 values (``index_head_dim +
index_head_dim // 128 * 4`` = 132 bytes a token) and score them with DeepGEMM's FP8 MQA-logits kernels; an
FP8 key cache is not built here.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import as_int
from ..cache import PagedMLACache
from .config import YarnRope
from .dsa_config import DSAConfig

__all__ = ["DSACache", "LightningIndexer", "select_topk"]

INDEX_KEY_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)
_SCORE_CHUNK = 1 << 24     # score elements (rows x heads x keys) computed at once: bounds a long prefill's memory


class DSACache(PagedMLACache):
    """:class:`~fp8mla.cache.PagedMLACache` plus the indexer key cache: ``index_pool [len(index_layers),
    num_pages, page_size, index_head_dim]`` in ``index_dtype``, one key per token of every layer listed in
    ``index_layers`` (those that run their own indexer), at the same slots as the latents."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_format="fp8_e4m3", *,
                 index_head_dim: int, index_layers, index_dtype=torch.bfloat16, **kw):
        super().__init__(num_layers, num_pages, page_size, kv_format, **kw)
        self.index_layers = [i if as_int(i) is None else as_int(i) for i in index_layers]
        bad = [i for i in self.index_layers if not (as_int(i) is not None and 0 <= i < num_layers)]
        if bad or len(set(self.index_layers)) != len(self.index_layers):
            raise ValueError(f"index_layers: expected distinct layer ids in [0, {num_layers}), got "
                             f"{self.index_layers}")
        self._index_row = {layer: r for r, layer in enumerate(self.index_layers)}
        self.index_head_dim = index_head_dim
        self.index_pool = torch.zeros(len(self.index_layers), num_pages, page_size, index_head_dim,
                                      dtype=index_dtype, device=self.device)

    def index_keys(self, layer: int) -> torch.Tensor:
        """``[num_pages * page_size, index_head_dim]`` view of ``layer``'s indexer keys, by flat slot."""
        if layer not in self._index_row:
            raise ValueError(f"layer: {layer!r} keeps no indexer keys (layers with an indexer: "
                             f"{self.index_layers})")
        return self.index_pool[self._index_row[layer]].view(self.num_pages * self.page_size, -1)

    def write_index_keys(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store ``keys [T, index_head_dim]`` at flat ``slots [T]`` (the step's reserved slots)."""
        self.index_keys(layer)[slots] = keys.to(self.index_pool.dtype)

    def token_slots(self, seq_id, num_tokens: int) -> torch.Tensor:
        """Flat slots (int64, on the cache's device) of the first ``num_tokens`` tokens of ``seq_id``."""
        ps = self.page_size
        pages = torch.tensor(list(self.pages(seq_id)[: -(-num_tokens // ps)]), dtype=torch.int64)
        slots = (pages[:, None] * ps + torch.arange(ps)).view(-1)[:num_tokens]
        return slots.to(self.device, non_blocking=True)

    def _unshare_last_page(self, seq) -> None:
        old = seq.pages[-1]
        super()._unshare_last_page(seq)
        self.index_pool[:, seq.pages[-1]] = self.index_pool[:, old]


class LightningIndexer(nn.Module):
    """The DSA indexer's projections (transformers' names) and its scoring; see the module docstring."""

    def __init__(self, cfg: DSAConfig, *, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        Hi, D = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, Hi * D, bias=False, **kw)
        self.wk = nn.Linear(cfg.hidden_size, D, bias=False, **kw)
        self.k_norm = nn.LayerNorm(D, eps=INDEX_KEY_NORM_EPS, **kw)
        # fp32 whatever the model's dtype, as transformers keeps it (_keep_in_fp32_modules)
        self.weights_proj = nn.Linear(cfg.hidden_size, Hi, bias=False, dtype=torch.float32, device=device)

    def _rope(self, x: torch.Tensor, rope: YarnRope, cos, sin) -> torch.Tensor:
        r = self.cfg.qk_rope_head_dim  # the first r dims are roped (the main attention ropes its last ones)
        rot = rope.apply(x[..., :r], cos, sin, interleave=self.cfg.indexer_rope_interleave)
        return torch.cat([rot, x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, rope: YarnRope, cos, sin) -> torch.Tensor:
        """``[T, index_head_dim]`` keys of the step's tokens ``x [T, hidden]`` (what the key cache stores)."""
        return self._rope(self.k_norm(self.wk(x)), rope, cos, sin)

    def queries(self, q_resid: torch.Tensor, rope: YarnRope, cos, sin) -> torch.Tensor:
        """``[T, index_n_heads, index_head_dim]`` from the MLA query latent ``q_resid [T, q_lora_rank]``."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.cfg.index_n_heads, self.cfg.index_head_dim)
        return self._rope(q, rope, cos, sin)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, index_n_heads]`` fp32 per-head weights, ``1/sqrt(index_n_heads)`` folded in."""
        w = F.linear(x.to(self.weights_proj.weight.dtype), self.weights_proj.weight).float()
        return w * self.cfg.index_n_heads ** -0.5


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n, L]`` fp32 scores of queries ``q [n, Hi, D]`` (head weights ``[n, Hi]``) against ``keys [L, D]``."""
    s = F.relu(torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * scale)
    return torch.einsum("nh,nhl->nl", weights, s)


def select_topk(q: torch.Tensor, weights: torch.Tensor, key_rows: torch.Tensor, seqs, topk: int, scale: float,
                *, width: int | None = None, return_scores: bool = False):
    """The indexer's causal top-k, per sequence.

    Args:
        q: ``[T, Hi, D]`` queries of the step's tokens; weights: ``[T, Hi]`` fp32 head weights.
        key_rows: ``[num_slots, D]`` the layer's key cache by flat slot (the step's keys already written).
        seqs: per sequence ``(row0, row1, pos0, slots)``: its query rows ``row0:row1`` at positions
            ``pos0, pos0 + 1...``, and ``slots [pos0 + row1 - row0]`` its tokens' flat slots in order.
        topk: tokens to select (``index_topk``); width: columns of the result (>= topk; -1 padded).

    Returns:
        ``[T, width]`` int32 flat slots, highest score first, ``-1`` past a token's causal horizon; with
        ``return_scores``, also the per-sequence ``[n, L]`` masked score matrices (for tests).
    """
    T = q.shape[0]
    out = torch.full((T, topk if width is None else max(width, topk)), -1, dtype=torch.int32, device=q.device)
    all_scores = []
    for r0, r1, p0, slots in seqs:
        L = slots.numel()
        keys = key_rows[slots]
        step = max(1, _SCORE_CHUNK // max(1, q.shape[1] * L))
        rows = []
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            s = index_scores(q[a:b], weights[a:b], keys, scale)
            pos = p0 + (a - r0) + torch.arange(b - a, device=q.device)
            s = s.masked_fill(torch.arange(L, device=q.device)[None, :] > pos[:, None], -math.inf)
            k = min(topk, L)
            vals, idx = s.topk(k, dim=-1)
            sel = slots[idx].to(torch.int32)
            out[a:b, :k] = torch.where(vals == -math.inf, -1, sel)
            if return_scores:
                rows.append(s)
        if return_scores:
            all_scores.append(torch.cat(rows) if rows else q.new_zeros(0, L))
    return (out, all_scores) if return_scores else out
