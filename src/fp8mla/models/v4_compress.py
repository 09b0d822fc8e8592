"""DeepSeek-V4's KV compressors (CSA and HCA), the CSA layers' lightning indexer, and the pieces they share with
the attention block (the interleaved trailing RoPE, the norms).

A compressor turns every ``m`` tokens of a sequence into one 512-wide row (``m`` = 4 on CSA layers, 128 on HCA
layers), as transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``::

    kv_t, z_t = kv_proj(x_t), gate_proj(x_t)                       # per token
    row_w = kv_norm( sum_j softmax_j(z_j + position_bias) * kv_j )  # per channel, over the window's slots j
    row_w = rope(row_w, position w * m)                             # trailing 64 dims, the compress rope

HCA's window is its own ``m`` tokens. CSA's projections are twice as wide: the first half of each token's
``(kv, z)`` (``Ca``) belongs to the *next* window, the second half (``Cb``) to its own, so row ``w`` pools ``2m``
slots -- ``Ca`` of window ``w - 1`` and ``Cb`` of window ``w`` (window 0 has only its ``Cb``): overlapping windows
of width ``2m`` and stride ``m``. A row exists once its window's last token has arrived; a query at position
``p`` sees rows ``w < (p + 1) // m``.

Between steps a sequence keeps, per compressing layer, a :class:`CompressorState`: the projections of the tokens
of its unfinished window (< m of them) and, on CSA layers, the ``Ca`` half of its last finished window. It is
small (a few KiB per sequence and layer) and kept in the projections' dtype.

The indexer (CSA layers only) compresses the same windows at ``index_head_dim`` into its own key rows and scores
query ``t`` against row ``s`` as ``sum_h w_{t,h} relu(q_{t,h} . k_s) / sqrt(index_head_dim)`` with
``w = weights_proj(x) / sqrt(index_n_heads)`` and ``q`` = rope(``q_b_proj(q_resid)``) at the query's position;
the attention reads the ``index_topk`` best rows among those the query may see.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import YarnRope
from .v4_config import CSA, V4Config

__all__ = ["V4RMSNorm", "unweighted_rms_norm", "rope_tail", "CompressorState", "V4Compressor", "V4Indexer",
           "topk_rows"]


class V4RMSNorm(nn.Module):
    """transformers' ``DeepseekV4RMSNorm``: normalize in fp32, scale by the fp32 weight, cast back."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4UnweightedRMSNorm`` (the per-head query norm): statistics in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` dims of ``x [T, ..., D]`` as interleaved pairs ``(x0, x1), (x2,
    x3)...`` and keep that layout (K is also V here: the output's RoPE dims must stay where the values had them).
    ``cos, sin [T, r / 2]``; ``sin`` negated rotates back (the output's RoPE undo)."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    pe = x[..., -r:].float()
    x1, x2 = pe[..., 0::2], pe[..., 1::2]
    rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rot.to(x.dtype)], dim=-1)


@dataclass
class CompressorState:
    """What a sequence keeps between steps for one compressor (see the module docstring)."""

    pending_kv: torch.Tensor            # [r < m, width] projections of the unfinished window's tokens
    pending_gate: torch.Tensor          # [r, width] (position bias not added)
    overlap_kv: torch.Tensor | None = None    # CSA: [m, dim] Ca half of the last finished window
    overlap_gate: torch.Tensor | None = None  # CSA: [m, dim] its gates, position bias added
    rows: int = 0                       # rows emitted so far


class _Pool(nn.Module):
    """Projections and pooling shared by the compressor and the indexer (transformers' names)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, *, dtype, device):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32, device=device))
        self.kv_norm = V4RMSNorm(dim, eps, device=device)

    def empty_state(self, like: torch.Tensor) -> CompressorState:
        w = self.kv_proj.out_features
        return CompressorState(like.new_zeros(0, w), like.new_zeros(0, w))

    def pool(self, x: torch.Tensor, state: CompressorState, rope: YarnRope) -> tuple[torch.Tensor, CompressorState]:
        """New rows ``[n, dim]`` from one sequence's new tokens ``x [t, hidden]`` after ``state``; the next state."""
        m, d = self.rate, self.dim
        kv = torch.cat([state.pending_kv, self.kv_proj(x)])
        gate = torch.cat([state.pending_gate, self.gate_proj(x)])
        n = kv.shape[0] // m
        rest = CompressorState(kv[n * m:], gate[n * m:], state.overlap_kv, state.overlap_gate, state.rows + n)
        if n == 0:
            return kv.new_zeros(0, d), rest
        ckv = kv[: n * m].view(n, m, -1)
        cg = gate[: n * m].view(n, m, -1) + self.position_bias  # (promotes to fp32, as transformers)
        if self.overlap:
            slots_kv = ckv.new_zeros(n, 2 * m, d)
            slots_gate = cg.new_full((n, 2 * m, d), -math.inf)
            slots_kv[:, m:], slots_gate[:, m:] = ckv[..., d:], cg[..., d:]
            slots_kv[1:, :m], slots_gate[1:, :m] = ckv[:-1, :, :d], cg[:-1, :, :d]
            if state.overlap_kv is not None:
                slots_kv[0, :m], slots_gate[0, :m] = state.overlap_kv, state.overlap_gate
            rest.overlap_kv, rest.overlap_gate = ckv[-1, :, :d].clone(), cg[-1, :, :d].clone()
        else:
            slots_kv, slots_gate = ckv, cg
        w = slots_gate.softmax(dim=1, dtype=torch.float32).to(slots_kv.dtype)
        rows = self.kv_norm((slots_kv * w).sum(dim=1))
        cos, sin = rope.cos_sin(torch.arange(state.rows, state.rows + n, device=x.device) * m)
        return rope_tail(rows, cos.to(rows.dtype), sin.to(rows.dtype)), rest


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int, *, dtype, device):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False, dtype=dtype, device=device)


class V4Indexer(_Pool):
    """The lightning indexer of a CSA layer: its own compressor at ``index_head_dim`` plus the query projection
    and the per-head weights (transformers' ``DeepseekV4Indexer`` names)."""

    def __init__(self, cfg: V4Config, *, dtype, device):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.compress_rates[CSA], True, cfg.rms_norm_eps,
                         dtype=dtype, device=device)
        self.heads = cfg.index_n_heads
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False, dtype=dtype,
                                  device=device)
        self.scorer = _Scorer(cfg.hidden_size, cfg.index_n_heads, dtype=dtype, device=device)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[T, index_n_heads, index_head_dim]`` roped queries from the query latent ``q_resid [T, q_lora_rank]``."""
        q = self.q_b_proj(q_resid).view(q_resid.shape[0], self.heads, self.dim)
        return rope_tail(q, cos.to(q.dtype), sin.to(q.dtype))

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, index_n_heads]`` fp32, ``1 / sqrt(index_n_heads)`` folded in."""
        return self.scorer.weights_proj(x).float() * self.heads ** -0.5

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` fp32 scores of queries ``q [n, Hi, D]`` against key rows ``keys [L, D]``."""
        s = torch.relu(torch.einsum("nhd,ld->nhl", q.float(), keys.float())) * self.dim ** -0.5
        return torch.einsum("nh,nhl->nl", weights, s)


def topk_rows(scores: torch.Tensor, positions: torch.Tensor, rate: int, topk: int) -> torch.Tensor:
    """``[n, topk]`` int64 row ids, best first, ``-1`` where the query sees fewer rows: rows ``w`` with
    ``w < (p + 1) // rate`` of the query at position ``p`` compete."""
    n, L = scores.shape
    out = torch.full((n, topk), -1, dtype=torch.int64, device=scores.device)
    if L == 0:
        return out
    visible = torch.arange(L, device=scores.device)[None, :] < ((positions + 1) // rate)[:, None]
    k = min(topk, L)
    vals, idx = scores.masked_fill(~visible, -math.inf).topk(k, dim=-1)
    out[:, :k] = torch.where(vals == -math.inf, -1, idx)
    return out


class V4Compressor(_Pool):
    """The KV compressor of a CSA layer (with its ``indexer``) or an HCA layer (see the module docstring)."""

    def __init__(self, cfg: V4Config, layer_type: str, *, dtype, device):
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.compress_rates[layer_type], layer_type == CSA,
                         cfg.rms_norm_eps, dtype=dtype, device=device)
        self.indexer = V4Indexer(cfg, dtype=dtype, device=device) if layer_type == CSA else None
