"""The DSA attention layer of GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) over a paged (FP8)
latent cache.

One step of a batch (any mix of new sequences, prefill chunks and decode tokens)::

    model = DSAModel.random(load_dsa_config("tiny-dsa"))
    cache = model.make_cache(num_pages=64, page_size=16, kv_format="fp8_e4m3")
    cache.add_sequence(0); cache.add_sequence(1)
    step = model.begin_step(cache, seq_ids=[0, 1], num_tokens=[7, 1])
    out = model(hidden, step)                                   # hidden [8, hidden_size]

Per layer: DeepSeek-V3's MLA projections (:class:`~fp8mla.models.deepseek.DeepseekMLA`, the same names and
rounding); every new token's ``(c_kv, k_pe)`` is quantized into the cache and its indexer key stored
(:class:`~fp8mla.models.indexer.DSACache`) before anything reads them; the lightning indexer
(:mod:`.indexer`) picks each token's ``index_topk`` slots among its sequence's tokens up to itself -- or, on a
GLM ``"shared"`` layer, the last full layer's selection is reused -- and **every** token, prefill or decode,
attends with weight absorption (``q_nope @ W_UK`` against the cached latents, ``W_UV`` after) to exactly its
selected slots through the sparse attention over the pool. Nothing is up-projected per cached token, and no
dense attention runs: a prefill token is a query with its own index list, as a decode token.

Serving stores the latents in FlashMLA's / vLLM's 656-byte ``fp8_ds_mla`` record (``make_cache(kv_format=
"fp8_ds_mla")``); every other format of :mod:`fp8mla.formats` works too. The indexer keys stay in the model's
dtype here (engines keep them in FP8: see :mod:`.indexer`).

Numerics (tests/test_model_dsa_hf.py, against transformers in fp32, each layer on transformers' own input): the
indexer runs in the model's dtype and selects the same positions as transformers on every row whose top-k
boundary is not a near tie (relative score gap > 1e-4); given transformers' selection, the layer's output is
within 3.4e-3 rel L2 with a bf16 cache (16-bit queries and latents, as the dense layer) and 3.6e-2 with FP8 e4m3
latents (``fp8_e4m3``, ``fp8_ds_mla``).

Not here: CUDA-graph capture (the selection loops over sequences on the host, sized by their lengths), an FP8
indexer key cache, MTP layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .._checks import as_int
from ..cache import PagedMLACache
from ..sparse import INDEX_BLOCK, MLASparseAttention
from .config import YarnRope
from .deepseek import DeepseekMLA, DeepseekMLAModel, RMSNorm, rope_step, write_latents
from .mla_step import attention_dtype, check_step_args, forked_since, refuse_stale_step, reserve_tokens
from .dsa_config import DSAConfig, load_dsa_config
from .indexer import DSACache, LightningIndexer, select_topk

__all__ = ["DSAAttention", "DSAModel", "DSAStep", "begin_dsa_step"]


@dataclass
class DSAStep:
    """What one forward step shares across layers: reserved slots, rope angles, each sequence's slots, and the
    selection of the last layer that ran its indexer (reused by ``"shared"`` layers).

    Rows of the step's hidden states are the sequences' new tokens, in ``seq_ids`` order; their positions are
    the sequences' lengths before the step, counting up.
    """

    cache: DSACache
    seq_ids: list
    num_tokens: list
    prefix_lens: list
    slots: torch.Tensor           # [T] int64 flat slots of the new tokens
    cos: torch.Tensor             # [T, rope_dim // 2] fp32
    sin: torch.Tensor
    rope: YarnRope
    attn_dtype: torch.dtype
    seqs: list                    # per sequence (row0, row1, pos0, slots [pos0 + row1 - row0] int64)
    sparse: MLASparseAttention    # planned once for the step, run by every layer
    index_width: int              # columns of the index rows: index_topk rounded up to the kernels' 64
    backend: str = "auto"
    indices: torch.Tensor | None = None   # [T, index_width] int32: the last full layer's selection
    selections: dict = field(default_factory=dict)  # layer -> its indices (kept for inspection and tests)
    reserved: bool = True
    committed: bool = False
    records: list | None = None   # the cache's record of each sequence at begin_step
    forks: int = 0                # the cache's fork count at begin_step (a later fork may share the step's pages)

    @property
    def num_rows(self) -> int:
        return self.slots.numel()

    def check_runnable(self) -> None:
        """Refuse a step that must not run: cancelled, its sequences' reservation given back, or its pages shared
        with a later fork (see :func:`~fp8mla.models.deepseek.refuse_stale_step`)."""
        refuse_stale_step(self)

    def cancel(self) -> None:
        """Give the step's reservation back to the cache (a failed step); a completed step keeps its tokens. A
        cancelled step never runs again (its slots may be another sequence's by then)."""
        if self.reserved and not self.committed:
            self.cache.unreserve(self.seq_ids)
            self.reserved = False


def begin_dsa_step(cache: DSACache, seq_ids, num_tokens, *, cfg: DSAConfig, rope: YarnRope, num_heads: int,
                   attn_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> DSAStep:
    """Reserve ``num_tokens[i]`` slots for each ``seq_ids[i]`` (already added to ``cache``), gather what the
    layers share and plan the sparse attention (:class:`~fp8mla.sparse.MLASparseAttention`, ``num_heads`` per
    rank). All or nothing: on failure the reservation is given back. Host work: O(batch) Python plus one slot
    table per sequence (vectorized)."""
    if not isinstance(cache, DSACache):
        raise TypeError(f"cache: expected a DSACache (the latent pool plus the indexer keys; DSAModel.make_cache "
                        f"builds one), got {type(cache).__name__}")
    ids, counts = check_step_args(cache, seq_ids, num_tokens, cfg)
    prefix = [cache.seq_len(s) for s in ids]
    slots = reserve_tokens(cache, ids, counts)
    try:
        dev = cache.device
        cnt = torch.tensor(counts, dtype=torch.int64)
        pre = torch.tensor(prefix, dtype=torch.int64)
        T = int(cnt.sum())
        start = torch.cumsum(cnt, 0) - cnt
        positions = torch.repeat_interleave(pre - start, cnt, output_size=T) + torch.arange(T)
        cos, sin = rope.cos_sin(positions.to(dev, non_blocking=True))
        seqs, r = [], 0
        for s, n, p in zip(ids, counts, prefix):
            seqs.append((r, r + n, p, cache.token_slots(s, p + n)))
            r += n
        width = -(-cfg.index_topk // INDEX_BLOCK) * INDEX_BLOCK  # -1 padded: what the Triton kernel walks
        sparse = MLASparseAttention(backend=backend)
        sparse.plan(num_heads, width, cache.page_size, cfg.sm_scale, attn_dtype, cache.format.name,
                    head_dim_ckv=cache.head_dim_ckv, head_dim_kpe=cache.head_dim_kpe, num_pages=cache.num_pages,
                    device=dev)
        step = DSAStep(cache, ids, counts, prefix, slots.to(dev), cos, sin, rope, attn_dtype, seqs, sparse, width,
                       backend)
        table = cache.seq_states
        step.records = [table[i] for i in ids]
        step.forks = cache.fork_count
        return step
    except BaseException:
        cache.unreserve(ids)
        raise


class DSAAttention(DeepseekMLA):
    """One DSA attention layer (``GlmMoeDsaAttention`` / ``DeepseekV32Attention``): the MLA projections plus
    ``indexer`` (None on a ``"shared"`` layer, which reuses the step's last selection)."""

    def __init__(self, cfg: DSAConfig, layer_idx: int, *, dtype=torch.bfloat16, device="cpu", tp_group=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device, tp_group=tp_group)
        self.shares_selection = cfg.indexer_types[layer_idx] == "shared"
        # The indexer is replicated under tensor parallelism: every rank needs every token's full selection.
        self.indexer = None if self.shares_selection else LightningIndexer(cfg, dtype=dtype, device=device)

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> None:
        super().init_random(seed)
        if self.indexer is not None:  # the key LayerNorm's weight near 1 (the base rule does so for *layernorm)
            self.indexer.k_norm.weight.add_(1.0)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, step: DSAStep, *, return_scores: bool = False):
        """Store the step's indexer keys and return its ``[T, index_topk]`` selection (see :mod:`.indexer`)."""
        c, ix, cache = self.cfg, self.indexer, step.cache
        cache.write_index_keys(self.layer_idx, step.slots, ix.keys(x, step.rope, step.cos, step.sin))
        q = ix.queries(q_resid, step.rope, step.cos, step.sin)
        return select_topk(q, ix.head_weights(x), cache.index_keys(self.layer_idx), step.seqs, c.index_topk,
                           c.index_softmax_scale, width=step.index_width, return_scores=return_scores)

    def forward(self, x: torch.Tensor, step: DSAStep, *, indices: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden_size]`` -> ``[T, hidden_size]``. ``indices [T, K]`` int32 slots: attend to these instead
        of the indexer's (tests hand in transformers' own selection)."""
        c = self.cfg
        T, H = step.num_rows, self.num_local_heads
        if not step.reserved or forked_since(step):
            step.check_runnable()  # (raises: a cancelled step, or one that would write a fork's pages)
        if x.dim() != 2 or x.shape != (T, c.hidden_size):
            raise ValueError(f"x: expected shape [{T}, {c.hidden_size}] (the step's new tokens), got {list(x.shape)}")
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, H, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        q_pe = rope_step(step, q_pe)
        _write_latents(step, self.layer_idx, ckv, rope_step(step, k_pe))  # before the attention reads them
        if self.indexer is not None:
            step.indices = self.select(x, q_resid, step)
        elif step.indices is None:
            raise ValueError(f"layer {self.layer_idx} shares the selection of an earlier layer ('shared' in "
                             "indexer_types), but no full layer ran before it in this step")
        step.selections[self.layer_idx] = step.indices
        sel = step.indices if indices is None else indices
        if sel.shape != (T, step.index_width) or sel.dtype != torch.int32:
            raise ValueError(f"indices: expected int32 [{T}, {step.index_width}], got {sel.dtype} {list(sel.shape)}")
        return self._out(self._attend(q_nope, q_pe, sel, step), T)

    def _attend(self, q_nope, q_pe, indices, step: DSAStep) -> torch.Tensor:
        adt = step.attn_dtype
        w_uk, w_uv = self._w_uk_uv()
        # Absorption: q_nope . (W_UK c) == (W_UK^T q_nope) . c, so each query scores the cached latents directly.
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk).to(adt)
        o_lat = step.sparse.run(q_lat, q_pe.to(adt).contiguous(), indices=indices,
                                **step.cache.sparse_run_inputs(self.layer_idx))
        return torch.einsum("nhc,hvc->nhv", o_lat.to(w_uv.dtype), w_uv)


def _write_latents(step: DSAStep, layer: int, ckv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Quantize-on-write of the step's tokens; on a GPU without the cache's range check (a host sync)."""
    cache = step.cache
    if cache.device.type == "cuda" and cache.is_record:
        from ..kernels.quant_ds_mla import quant_ds_mla
        quant_ds_mla(cache.pool[layer].view(cache.num_pages * cache.page_size, -1), step.slots, ckv, k_pe)
    else:
        write_latents(step, layer, ckv, k_pe)


class DSABlock(nn.Module):
    """``x + self_attn(input_layernorm(x))``: a decoder layer without its MLP."""

    def __init__(self, cfg: DSAConfig, layer_idx: int, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=kw.get("dtype"),
                                       device=kw.get("device"))
        self.self_attn = DSAAttention(cfg, layer_idx, **kw)

    def forward(self, x: torch.Tensor, step: DSAStep) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), step)


class DSAModel(nn.Module):
    """A stack of DSA attention layers with pre-norm residuals (attention only: no embedding, MLP or head).

    Args:
        cfg: a :class:`DSAConfig` or anything :func:`load_dsa_config` takes (``"tiny-dsa"``, ``"glm5"``,
            ``"dsv32"``, a ``config.json``).
        num_layers: layers to build (default: the config's). dtype, device: of the weights.
    """

    config_class = DSAConfig

    def __init__(self, cfg, num_layers: int | None = None, *, dtype=torch.bfloat16, device="cpu", tp_group=None,
                 backend: str = "auto"):
        super().__init__()
        self.cfg = cfg = load_dsa_config(cfg)
        n = cfg.num_layers if num_layers is None else as_int(num_layers)
        if n is None or not 1 <= n <= cfg.num_layers:
            raise ValueError(f"num_layers: expected an int in [1, {cfg.num_layers}], got {num_layers!r}")
        self.layers = nn.ModuleList(DSABlock(cfg, i, dtype=dtype, device=device, tp_group=tp_group)
                                    for i in range(n))
        self.backend, self.dtype, self.device = backend, dtype, torch.device(device)
        self.rope = YarnRope(cfg, device=device)

    # The dense stack's constructors, on this class: random weights reproducible from ``seed``; the attention
    # weights (the indexers' too) of a local glm_moe_dsa / deepseek_v32 checkpoint.
    random = classmethod(DeepseekMLAModel.random.__func__)
    from_pretrained = classmethod(DeepseekMLAModel.from_pretrained.__func__)

    def make_cache(self, num_pages: int, page_size: int, kv_format="fp8_e4m3", *, index_dtype=None,
                   **kw) -> DSACache:
        """The latent pool plus the indexer keys (in the model's dtype unless ``index_dtype`` says otherwise)."""
        full = [i for i, blk in enumerate(self.layers) if blk.self_attn.indexer is not None]
        return DSACache(len(self.layers), num_pages, page_size, kv_format, head_dim_ckv=self.cfg.kv_lora_rank,
                        head_dim_kpe=self.cfg.qk_rope_head_dim, index_head_dim=self.cfg.index_head_dim,
                        index_layers=full, index_dtype=self.dtype if index_dtype is None else index_dtype,
                        device=self.device, **kw)

    def begin_step(self, cache: PagedMLACache, seq_ids, num_tokens) -> DSAStep:
        """Reserve the new tokens' slots and gather what the layers share (see :func:`begin_dsa_step`)."""
        if cache.num_layers < len(self.layers):
            raise ValueError(f"cache: {cache.num_layers} layers, the model has {len(self.layers)}")
        return begin_dsa_step(cache, seq_ids, num_tokens, cfg=self.cfg, rope=self.rope,
                              num_heads=self.layers[0].self_attn.num_local_heads,
                              attn_dtype=attention_dtype(self.dtype), backend=self.backend)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: DSAStep) -> torch.Tensor:
        """The residual stream after every layer, ``[T, hidden_size]``. A failure gives the reservation back; a
        step that must not run is refused (see :meth:`DSAStep.check_runnable`)."""
        step.check_runnable()  # before the try: a refused step has nothing to give back
        try:
            for blk in self.layers:
                x = blk(x, step)
        except BaseException:
            step.cancel()
            raise
        step.committed = True
        return x
