"""One forward step of the MLA layer stack (:class:`MLAStep`): what the layers of a step share (the cache's
reserved slots, the rope angles, the attention plans), how a step is begun (:func:`begin_step`: check, reserve,
plan once for every layer) and the rules that refuse a step that must not run (cancelled, or its pages shared
by a later fork). The layers themselves are in :mod:`fp8mla.models.deepseek`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import MLAPagedAttention
from .._checks import as_int
from ..cache import PagedMLACache
from ..ragged import MLARaggedPrefill
from .config import MLAConfig, YarnRope

__all__ = ["MLAStep", "attention_dtype", "begin_step", "check_step_args", "forked_since", "plan_decode",
           "refuse_stale_step", "reserve_tokens"]


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    # The attention kernels take 16-bit queries; an fp32 model (tests) runs attention in bf16.
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass
class MLAStep:
    """Everything one forward step shares across layers: reserved slots, rope angles, and the plans.

    Rows of the step's hidden states are the sequences' new tokens, in ``seq_ids`` order (``num_tokens[i]`` rows
    for ``seq_ids[i]``); their positions are the sequences' lengths in the cache before the step, counting up.
    """

    cache: PagedMLACache
    seq_ids: list
    num_tokens: list
    prefix_lens: list            # tokens each sequence had in the cache before this step
    slots: torch.Tensor          # [T] int64 flat cache slots of the new tokens (from the cache's reservation)
    cos: torch.Tensor            # [T, rope_dim // 2] fp32
    sin: torch.Tensor
    attn_dtype: torch.dtype
    prefill_rows: torch.Tensor | None   # [Tp] rows of the prefill tokens (None: none)
    decode_rows: torch.Tensor | None    # [Td] rows of the decode tokens (None: none)
    ragged: MLARaggedPrefill | None     # causal attention over the fresh K/V of the prefill tokens
    ragged_prefix: MLARaggedPrefill | None  # prefill queries over the cached prefix (None: no prefix)
    prefix_gather: dict | None          # kv_indptr, kv_indices, kv_len_arr of those prefixes
    paged: MLAPagedAttention | None     # absorbed decode over the paged pool
    rope: YarnRope
    backend: str = "auto"
    fused: bool = False          # decode-only steps use the fused Triton kernels (models/fused.py)
    reserved: bool = True        # the slots are still this step's to give back (see cancel())
    committed: bool = False      # a forward pass finished: a later failure no longer gives the slots back
    undo: object = None          # called by cancel() after the cache's undo (the runner's own bookkeeping)
    records: list | None = None  # the cache's record of each sequence at begin_step (None: not checked)
    forks: int = 0               # the cache's fork count at begin_step (a later fork may share the step's pages)

    @property
    def num_rows(self) -> int:
        return self.slots.numel()

    @property
    def decode_only(self) -> bool:
        return self.prefill_rows is None

    def check_runnable(self) -> None:
        """Refuse a step that must not run (see :func:`refuse_stale_step`)."""
        refuse_stale_step(self)

    def cancel(self) -> None:
        """Give the step's reservation back to the cache (a failed step): nothing leaks. Once only; a step whose
        forward pass completed keeps its tokens. A cancelled step never runs again (its slots may be another
        sequence's by then): ``model(x, step)`` and ``DecodeRunner.forward`` refuse it."""
        if self.reserved and not self.committed:
            self.cache.unreserve(self.seq_ids)
            self.reserved = False
            if self.undo is not None:
                self.undo()


def refuse_stale_step(step) -> None:
    """Refuse a step (an :class:`MLAStep`, a DSA step) whose reservation went back to the cache.

    The contract: a step runs while it holds its reservation, from ``begin_step`` until ``step.cancel()`` (or a
    failed forward pass, which cancels it). A completed step may run again: it rewrites its own tokens in its
    own slots (what benchmarks time); a cancelled one would write into slots the pool may have handed to
    another sequence. With ``records`` (the model's steps), the sequences must also still hold the tokens:
    a ``cache.unreserve`` or ``cache.free`` behind the step's back is refused the same way. After a
    ``cache.fork``, the pages the step writes must be its sequences' own (a fork shares the pages of the tokens
    it copied). O(batch), plus O(pages written) when the cache forked since the step was planned."""
    if not step.reserved:
        raise ValueError("step: this step was cancelled (its reservation went back to the cache, whose pages may "
                         "hold another sequence's tokens by now); expected a step from a new begin_step")
    if forked_since(step):
        _refuse_shared_pages(step)
    if step.records is None:
        return
    table = step.cache.seq_states
    for sid, rec, p, n in zip(step.seq_ids, step.records, step.prefix_lens, step.num_tokens):
        now = table.get(sid)
        if now is not rec:
            raise ValueError(f"step: sequence {sid!r} is no longer in the cache as it was at begin_step (freed"
                             f"{' and added again' if now is not None else ''}): its slots may belong to another "
                             f"sequence; expected a step from a new begin_step")
        if rec.length < p + n:
            raise ValueError(f"step: sequence {sid!r} holds {rec.length} tokens, fewer than the {p + n} this step "
                             f"reserved (its reservation was given back: cache.unreserve); expected a step from a "
                             f"new begin_step")


def forked_since(step) -> bool:
    """The cache forked a sequence after ``step`` was planned (O(1): the step's pages may be shared since)."""
    return step.cache.fork_count != step.forks


def _refuse_shared_pages(step) -> None:
    """The pages this step writes hold no other sequence's tokens: a fork made after begin_step (or after the
    step ran, for a step run again) shares the page the step's tokens are in, and writing it would change the
    fork's tokens too. A new begin_step unshares the page first."""
    cache = step.cache
    live = cache.seq_states
    for sid, p, n in zip(step.seq_ids, step.prefix_lens, step.num_tokens):
        if sid not in live:
            continue  # (a freed sequence: the records check names it)
        page = cache.shared_page(sid, p, n)
        if page is not None:
            raise ValueError(
                f"step: sequence {sid!r} shares page {page}, where this step writes its tokens, with a fork "
                f"(cache.fork after begin_step, or after the step ran): writing would change the fork's tokens "
                f"too; expected a step from a new begin_step")


def reserve_tokens(cache: PagedMLACache, ids: list, counts: list) -> torch.Tensor:
    return cache.reserve(ids, counts)   # all or nothing


def check_step_args(cache: PagedMLACache, seq_ids, num_tokens, cfg: MLAConfig) -> tuple[list, list]:
    # One id (an int, a str) or an ordered collection of ids, as the cache takes them everywhere else.
    ids = cache.id_list(seq_ids)
    counts = list(num_tokens) if isinstance(num_tokens, (list, tuple)) else [num_tokens] * len(ids)
    if not ids:
        raise ValueError("seq_ids: expected at least one sequence")
    if len(counts) != len(ids):
        raise ValueError(f"num_tokens: expected one count per sequence ({len(ids)}), got {len(counts)}")
    ints = [as_int(c) for c in counts]  # numpy and 0-d CPU tensor counts become ints
    if any(c is None or c < 1 for c in ints):
        raise ValueError(f"num_tokens: expected positive ints, got {counts}")
    counts = ints
    if (cache.head_dim_ckv, cache.head_dim_kpe) != (cfg.kv_lora_rank, cfg.qk_rope_head_dim):
        raise ValueError(f"cache: head dims ({cache.head_dim_ckv}, {cache.head_dim_kpe}) differ from the model's "
                         f"kv_lora_rank/qk_rope_head_dim ({cfg.kv_lora_rank}, {cfg.qk_rope_head_dim})")
    return ids, counts


def plan_decode(attn: MLAPagedAttention, cache: PagedMLACache, seq_ids: list, *, num_heads: int, sm_scale: float,
                attn_dtype: torch.dtype) -> None:
    """Plan one decode query per sequence over the cache's page tables (its layout: no host copy of them)."""
    attn.plan_layout(cache.layout(seq_ids), num_heads, cache.head_dim_ckv, cache.head_dim_kpe, True, sm_scale,
                     attn_dtype, cache.format.name)


def begin_step(cache: PagedMLACache, seq_ids, num_tokens, *, cfg: MLAConfig, rope: YarnRope,
               num_heads: int, attn_dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
               fused: bool = False) -> MLAStep:
    """Reserve ``num_tokens[i]`` new slots for each ``seq_ids[i]`` (already added to ``cache``) and plan the
    step. Rows of the step's hidden states are the sequences' new tokens, in ``seq_ids`` order.

    A sequence takes the decode path when it adds one token to a non-empty prefix, else the prefill path.
    All or nothing: when the pool cannot hold the tokens, :class:`~fp8mla.cache.OutOfPagesError` is raised
    and nothing is reserved; when planning fails, the reservation is given back. Host work: O(batch) Python and
    vectorized tensor ops (the positions, rows and prefill index arrays are never built token by token).
    """
    ids, counts = check_step_args(cache, seq_ids, num_tokens, cfg)
    prefix = [cache.seq_len(s) for s in ids]
    slots = reserve_tokens(cache, ids, counts)
    try:
        step = _plan_step(cache, ids, counts, prefix, slots, cfg=cfg, rope=rope, num_heads=num_heads,
                          attn_dtype=attn_dtype, backend=backend, fused=fused)
        table = cache.seq_states
        step.records = [table[i] for i in ids]
        step.forks = cache.fork_count
        return step
    except BaseException:
        cache.unreserve(ids)
        raise


def _plan_step(cache, ids, counts, prefix, slots, *, cfg, rope, num_heads, attn_dtype, backend, fused) -> MLAStep:
    dev = cache.device
    B = len(ids)
    cnt = torch.tensor(counts, dtype=torch.int64)
    pre = torch.tensor(prefix, dtype=torch.int64)
    T = int(sum(counts))
    is_dec = (cnt == 1) & (pre > 0)
    n_dec = int(is_dec.sum())
    if n_dec == B:  # the common decode step: one token per sequence at position = its prefix
        positions = pre
    else:  # token i of sequence b sits at prefix[b] + i
        start = torch.cumsum(cnt, 0) - cnt
        positions = torch.repeat_interleave(pre - start, cnt, output_size=T) + torch.arange(T)
    cos, sin = rope.cos_sin(positions.to(dev, non_blocking=True))
    prefill_rows = decode_rows = None
    if n_dec == B:
        decode_rows = torch.arange(T, device=dev)
    elif n_dec == 0:
        prefill_rows = torch.arange(T, device=dev)
    else:
        tok_dec = torch.repeat_interleave(is_dec, cnt, output_size=T)
        decode_rows = torch.nonzero(tok_dec).view(-1).to(dev, non_blocking=True)
        prefill_rows = torch.nonzero(~tok_dec).view(-1).to(dev, non_blocking=True)
    step = MLAStep(cache, ids, counts, prefix, slots, cos, sin, attn_dtype, prefill_rows, decode_rows, None, None,
                   None, None, rope, backend, fused=fused and n_dec == B)
    sm_scale = cfg.sm_scale
    i32 = dict(dtype=torch.int32, device=dev)
    if n_dec < B:
        pre_b = torch.nonzero(~is_dec).view(-1).tolist()     # O(batch)
        qo = torch.zeros(len(pre_b) + 1, dtype=torch.int64)
        torch.cumsum(cnt[pre_b], 0, out=qo[1:])
        qo = qo.to(**i32)
        step.ragged = MLARaggedPrefill(backend=backend)
        step.ragged.plan(qo, qo, num_heads, num_heads, cfg.qk_head_dim, cfg.v_head_dim, causal=True,
                         sm_scale=sm_scale, q_data_type=attn_dtype, kv_data_type=attn_dtype)
        with_prefix = [b for b in pre_b if prefix[b]]
        if with_prefix:
            # The prefill chunks' cached prefixes: their pages (a prefill step reads its tokens anyway).
            ps = cache.page_size
            pages = [cache.pages(ids[b])[: -(-prefix[b] // ps)] for b in pre_b]
            n_pages = torch.tensor([len(p) for p in pages], dtype=torch.int64)
            kv_indptr = torch.zeros(len(pre_b) + 1, dtype=torch.int64)
            torch.cumsum(n_pages, 0, out=kv_indptr[1:])
            plen = pre[pre_b]
            step.prefix_gather = dict(
                kv_indptr=kv_indptr.to(**i32),
                kv_indices=torch.tensor([x for p in pages for x in p], **i32),
                kv_len_arr=plen.to(**i32))
            kv = torch.zeros(len(pre_b) + 1, dtype=torch.int64)
            torch.cumsum(plen, 0, out=kv[1:])
            step.ragged_prefix = MLARaggedPrefill(backend=backend)
            step.ragged_prefix.plan(qo, kv.to(**i32), num_heads, num_heads, cfg.qk_head_dim, cfg.v_head_dim,
                                    causal=False, sm_scale=sm_scale, q_data_type=attn_dtype,
                                    kv_data_type=attn_dtype)
    if n_dec:
        dec = [ids[b] for b in torch.nonzero(is_dec).view(-1).tolist()]
        step.paged = MLAPagedAttention(backend=backend)
        plan_decode(step.paged, cache, dec, num_heads=num_heads, sm_scale=sm_scale, attn_dtype=attn_dtype)
    return step
