"""The attention block of DeepSeek-V4 (``deepseek_v4``) over fp8mla's paged row caches.

One step of a batch (any mix of new sequences, prefill chunks and decode tokens)::

    model = V4Model.random(load_v4_config("tiny-v4"))
    cache = model.make_cache(num_pages=64, page_size=16, kv_format="fp8_v4")
    a, b = cache.add_sequence(), cache.add_sequence()
    step = model.begin_step(cache, seq_ids=[a, b], num_tokens=[7, 1])
    out = model(hidden, step)                                   # hidden [8, hidden_size]

Per layer, as transformers' ``DeepseekV4Attention`` (whose parameter names it keeps)::

    q_resid = q_a_norm(q_a_proj(x))
    q       = rope(rms(q_b_proj(q_resid) per head))          # [T, H, 512], an unweighted RMSNorm per head
    kv      = rope(kv_norm(kv_proj(x)))                       # [T, 512]: one head, both K and V
    out     = attention(q, [window rows | compressed rows], sinks)
    out     = rope(out, -position)                            # undo the values' rotation on the RoPE dims
    y       = o_b_proj(o_a_proj per group(out))               # grouped low-rank output projection

RoPE rotates the trailing 64 of the 512 dims as interleaved pairs; sliding layers use ``rope_theta``, CSA / HCA
layers ``compress_rope_theta`` with the checkpoint's YaRN. Every query attends to its ``sliding_window`` (128)
last tokens (itself included), plus on an HCA layer every compressed row it may see and on a CSA layer the
``index_topk`` rows its lightning indexer picks (:mod:`.v4_compress`). Every new token's row is written to the
cache (quantized on write) before any query reads it; compressed rows are written as their windows complete.

Numerics: see docs/v4_model.md (tests/test_model_v4_hf.py against transformers in fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import YarnRope
from .v4_attend import attend_rows
from ..v4 import V4SparseAttention
from .v4_cache import EXACT_FORMATS, V4Cache
from .v4_compress import V4Compressor, V4RMSNorm, rope_tail, topk_rows, unweighted_rms_norm
from .v4_config import CSA, HCA, NATIVE_NAMES, SLIDING, V4Config, load_v4_config

__all__ = ["V4Attention", "V4Model", "V4Step", "begin_v4_step"]


@dataclass
class V4Step:
    """What one forward step shares across layers. Rows of the step's hidden states are the sequences' new
    tokens in ``seq_ids`` order, at positions counting up from each sequence's length before the step."""

    cache: V4Cache
    seq_ids: list
    num_tokens: list
    prefix_lens: list
    positions: torch.Tensor        # [T] int64
    ropes: dict                    # "main" / "compress" -> (YarnRope, cos [T, 32], sin [T, 32])
    seqs: list                     # per sequence (row0, row1, pos0)
    window_slots: torch.Tensor     # [T] int64: the new tokens' window rows
    window_idx: torch.Tensor       # [T, sliding_window] int32: each query's window rows, -1 before position 0
    new_rows: dict = field(default_factory=dict)   # stream -> per sequence the slots of its new compressed rows
    all_rows: dict = field(default_factory=dict)   # stream -> per sequence the slots of all its compressed rows
    visible_idx: dict = field(default_factory=dict)  # stream -> [T, rows] int32: the rows each query may see
    states: dict = field(default_factory=dict)     # (seq, layer) -> the compressor states after this step
    selections: dict = field(default_factory=dict)  # CSA layer -> [T, index_topk] row ids (kept for tests)
    plans: dict = field(default_factory=dict)      # layer type -> its V4SparseAttention, planned once a step
    attn_dtype: torch.dtype = torch.bfloat16       # the queries' dtype in the attention
    committed: bool = False

    @property
    def num_rows(self) -> int:
        return self.positions.numel()

    def commit(self) -> None:
        """The step's tokens become the sequences' own; window pages no query will read again go back."""
        c, w = self.cache, self.cache.cfg.sliding_window
        c.states.update(self.states)
        for sid, n, p0 in zip(self.seq_ids, self.num_tokens, self.prefix_lens):
            c.lengths[sid] = p0 + n
            c.streams["window"].release_before(sid, p0 + n - (w - 1))
        self.committed = True

    def cancel(self) -> None:
        """Give the step's rows back (a failed step); the sequences stay as they were."""
        if self.committed:
            return
        c = self.cache
        for sid, p0 in zip(self.seq_ids, self.prefix_lens):
            c.streams["window"].truncate(sid, p0)
            for name in ("csa", "hca"):
                if name in c.streams:
                    c.streams[name].truncate(sid, p0 // _rate(c.cfg, name))
        self.committed = True  # never runs again


def _rate(cfg: V4Config, stream: str) -> int:
    return cfg.compress_rates[CSA if stream == "csa" else HCA]


def begin_v4_step(cache: V4Cache, seq_ids, num_tokens, *, num_heads: int, attn_dtype=torch.bfloat16,
                  backend: str = "auto") -> V4Step:
    """Reserve the step's window rows and compressed rows, build each query's window and visible-row lists and
    plan the attention of each layer type (:class:`fp8mla.V4SparseAttention`, ``num_heads`` heads, queries in
    ``attn_dtype``, ``backend``). All or nothing. Host work: O(batch) Python plus a few vectorized tables per
    sequence."""
    if not isinstance(cache, V4Cache):
        raise TypeError(f"cache: expected a V4Cache (V4Model.make_cache builds one), got {type(cache).__name__}")
    ids, counts = list(seq_ids), list(num_tokens)
    if len(ids) != len(counts) or not ids or len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids / num_tokens: expected as many distinct ids as counts (>= 1), got {ids} / "
                         f"{counts}")
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_tokens: expected positive ints, got {counts}")
    cfg, dev, W = cache.cfg, cache.device, cache.cfg.sliding_window
    prefix = [cache.seq_len(s) for s in ids]
    step = V4Step(cache, ids, counts, prefix, None, {}, [], None, None)
    try:
        win_slots, win_idx, positions, r = [], [], [], 0
        for sid, n, p0 in zip(ids, counts, prefix):
            win_slots.append(cache.streams["window"].reserve(sid, n, dev))
            start = max(0, p0 - (W - 1))
            slots = cache.streams["window"].slots(sid, start, p0 + n, dev)
            pos = torch.arange(p0, p0 + n, device=dev)
            cols = pos[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]  # token positions, oldest first
            safe = (cols - start).clamp(min=0)
            win_idx.append(torch.where(cols >= 0, slots[safe], -1).to(torch.int32))
            positions.append(pos)
            step.seqs.append((r, r + n, p0))
            r += n
        for name in ("csa", "hca"):
            if name in cache.streams:
                _reserve_compressed(step, name)
        step.positions = torch.cat(positions)
        step.window_slots, step.window_idx = torch.cat(win_slots), torch.cat(win_idx)
        for kind, layer_type in (("main", SLIDING), ("compress", CSA)):
            rope = YarnRope(cfg.rope_spec(layer_type), device=dev)
            step.ropes[kind] = (rope, *rope.cos_sin(step.positions))
        step.attn_dtype = attn_dtype
        if cache.format is not None:
            _plan(step, num_heads, attn_dtype, backend)
    except BaseException:
        step.cancel()
        raise
    return step


def _plan(step: V4Step, num_heads: int, attn_dtype, backend: str) -> None:
    """One V4SparseAttention plan per layer type: window rows only (sliding), plus ``index_topk`` selected rows
    (CSA), plus every row a query of the step may see (HCA)."""
    cache, cfg = step.cache, step.cache.cfg
    widths = {SLIDING: 0, CSA: cfg.index_topk, HCA: step.visible_idx["hca"].shape[1] if "hca" in
              step.visible_idx else 0}
    for t in set(cfg.layer_types[: cache.num_layers]):
        attn = V4SparseAttention(backend=backend)
        attn.plan(num_heads, cfg.sm_scale, attn_dtype, cache.kv_format, window_topk=cfg.sliding_window,
                  window_page_size=cache.page_size, compressed_topk=widths[t],
                  compressed_page_size=cache.page_size if widths[t] else None, num_window_pages=cache.num_pages,
                  num_compressed_pages=cache.num_compressed_pages if widths[t] else None, device=step.cache.device)
        step.plans[t] = attn


def _reserve_compressed(step: V4Step, name: str) -> None:
    cache, m = step.cache, _rate(step.cache.cfg, name)
    stream, dev = cache.streams[name], cache.device
    step.new_rows[name], step.all_rows[name] = [], []
    vis = []
    for sid, n, p0 in zip(step.seq_ids, step.num_tokens, step.prefix_lens):
        before, after = p0 // m, (p0 + n) // m
        assert stream.rows[sid] == before, (name, sid, stream.rows[sid], before)
        step.new_rows[name].append(stream.reserve(sid, after - before, dev))
        step.all_rows[name].append(stream.slots(sid, 0, after, dev))
        if name == "hca":  # HCA queries see every complete row; CSA queries get theirs from the indexer
            pos = torch.arange(p0, p0 + n, device=dev)
            see = torch.arange(after, device=dev)[None, :] < ((pos + 1) // m)[:, None]
            vis.append((see, step.all_rows[name][-1]))
    if not vis:
        return
    width = max(1, max(s.shape[1] for s, _ in vis))  # at least one (-1) column: the HCA plan has rows
    rows = [torch.full((s.shape[0], width), -1, dtype=torch.int32, device=dev) for s, _ in vis]
    for out, (see, slots) in zip(rows, vis):
        out[:, : see.shape[1]] = torch.where(see, slots[None, :], -1).to(torch.int32)
    step.visible_idx[name] = torch.cat(rows)


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention block (transformers' ``DeepseekV4Attention`` parameters and rounding)."""

    def __init__(self, cfg: V4Config, layer_idx: int, *, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        kw = dict(dtype=dtype, device=device)
        H, D = cfg.num_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, **kw)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, device=device)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * D, bias=False, **kw)
        self.kv_proj = nn.Linear(cfg.hidden_size, D, bias=False, **kw)
        self.kv_norm = V4RMSNorm(D, cfg.rms_norm_eps, device=device)
        # o_a_proj.weight [o_groups * o_lora_rank, H * D / o_groups]: group g maps its heads' outputs to rows
        # [g * o_lora_rank, (g + 1) * o_lora_rank)
        self.o_a_proj = nn.Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False, **kw)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False, **kw)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32, device=device))
        self.compressor = None if self.layer_type == SLIDING else V4Compressor(cfg, self.layer_type, **kw)

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> None:
        """N(0, 1/fan_in) matrices; norm weights 1 + N(0, 0.1^2); position biases and sinks N(0, 0.1^2) / N(0, 1)."""
        g = torch.Generator().manual_seed(seed * 1000 + self.layer_idx)
        for name, p in self.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 2 and not name.endswith("position_bias"):
                p.copy_(r / math.sqrt(p.shape[1]))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            else:
                p.copy_(r if name == "sinks" else 0.1 * r)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: V4Step, *, csa_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden_size]`` -> ``[T, hidden_size]``. ``csa_rows [T, k]`` int64 compressed-row ids (``-1``:
        none): attend to these instead of the indexer's on a CSA layer (tests hand in transformers' own)."""
        c, cache = self.cfg, step.cache
        T, H, D = step.num_rows, c.num_heads, c.head_dim
        if step.committed:
            raise ValueError("step: this step already ran (or was cancelled); begin a new one")
        if x.dim() != 2 or x.shape != (T, c.hidden_size):
            raise ValueError(f"x: expected shape [{T}, {c.hidden_size}] (the step's new tokens), got {list(x.shape)}")
        _, cos, sin = step.ropes[self.rope_kind]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = rope_tail(unweighted_rms_norm(self.q_b_proj(q_resid).view(T, H, D), c.rms_norm_eps), cos, sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
        cache.write_rows("window", self.layer_idx, step.window_slots, kv)  # before any query reads it
        segments = [("window", step.window_idx)]
        if self.compressor is not None:
            stream = cache.stream_of(self.layer_idx)
            self._compress(x, step, stream)
            if self.layer_type == HCA:
                idx = step.visible_idx[stream]
            else:
                rows = self.select(x, q_resid, step) if csa_rows is None else csa_rows
                step.selections[self.layer_idx] = rows
                idx = self._row_slots(rows, step, stream)
            segments.append((stream, idx))
        out, _ = self.attend(q, segments, step)
        out = rope_tail(out, cos, -sin)
        return self._project(out)

    # -- pieces ---------------------------------------------------------------------------------------------
    def _reader(self, cache: V4Cache, stream: str):
        return lambda slots: cache.read_rows(stream, self.layer_idx, slots)

    def attend(self, q: torch.Tensor, segments, step: V4Step):
        """The attention over the segments' rows: ``(out [T, H, 512] in q's dtype, lse [T, H] natural log)``.
        The V4 formats go through the step's :class:`fp8mla.V4SparseAttention` plan for this layer type (queries in
        the step's 16-bit dtype); the float32 / float64 rows through the torch code at their own precision."""
        cache = step.cache
        if cache.format is None:
            wide = EXACT_FORMATS[cache.kv_format]
            return attend_rows(q.to(wide), [(self._reader(cache, st), idx) for st, idx in segments], self.sinks,
                               self.cfg.sm_scale, compute_dtype=wide)
        (window, w_idx), extra = segments[0], segments[1:]
        kw = {}
        if extra:
            stream, idx = extra[0]
            kw = dict(compressed_pool=cache.pool(stream, self.layer_idx), compressed_indices=idx.contiguous())
        out, lse = step.plans[self.layer_type].run(
            q.to(step.attn_dtype).contiguous(), cache.pool(window, self.layer_idx), w_idx, sinks=self.sinks,
            return_lse=True, return_lse_base_on_e=True, **kw)
        return out.to(q.dtype), lse

    def _compress(self, x: torch.Tensor, step: V4Step, stream: str) -> None:
        """Pool the step's complete windows into new rows (and indexer keys), write them, stage the states."""
        cache, comp = step.cache, self.compressor
        ix = comp.indexer
        rope = step.ropes["compress"][0]
        for i, (sid, (r0, r1, _)) in enumerate(zip(step.seq_ids, step.seqs)):
            st, ist = cache.state(sid, self.layer_idx, comp, ix)
            rows, st = comp.pool(x[r0:r1], st, rope)
            slots = step.new_rows[stream][i]
            assert rows.shape[0] == slots.numel(), (rows.shape, slots.shape)
            if rows.shape[0]:
                cache.write_rows(stream, self.layer_idx, slots, rows)
            if ix is not None:
                keys, ist = ix.pool(x[r0:r1], ist, rope)
                if keys.shape[0]:
                    cache.index_keys(self.layer_idx)[slots] = keys.to(cache.index_pool.dtype)
            step.states[(sid, self.layer_idx)] = (st, ist)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, step: V4Step, *, return_scores: bool = False):
        """The lightning indexer's ``[T, index_topk]`` row ids per query (best first, -1 padded); with
        ``return_scores`` also each sequence's ``[n, rows]`` score matrix (unmasked)."""
        ix, c, cache = self.compressor.indexer, self.cfg, step.cache
        _, cos, sin = step.ropes["compress"]
        q = ix.queries(q_resid, cos, sin)
        w = ix.head_weights(x)
        keys_all = cache.index_keys(self.layer_idx)
        out, scores = [], []
        for (r0, r1, _), slots in zip(step.seqs, step.all_rows["csa"]):
            s = ix.scores(q[r0:r1], w[r0:r1], keys_all[slots])
            out.append(topk_rows(s, step.positions[r0:r1], c.compress_rates[CSA], c.index_topk))
            scores.append(s)
        rows = torch.cat(out)
        return (rows, scores) if return_scores else rows

    def _row_slots(self, rows: torch.Tensor, step: V4Step, stream: str) -> torch.Tensor:
        """Row ids ``[T, k]`` (per sequence) -> flat slots int32 ``[T, index_topk]``, -1 kept and padded."""
        if rows.dim() != 2 or rows.shape[0] != step.num_rows or rows.shape[1] > self.cfg.index_topk:
            raise ValueError(f"csa_rows: expected [{step.num_rows}, <= {self.cfg.index_topk}] row ids, got "
                             f"{list(rows.shape)}")
        out = torch.full((rows.shape[0], self.cfg.index_topk), -1, dtype=torch.int32, device=rows.device)
        for (r0, r1, _), slots in zip(step.seqs, step.all_rows[stream]):
            r = rows[r0:r1]
            if slots.numel():
                out[r0:r1, : r.shape[1]] = torch.where(r >= 0, slots[r.clamp(0, slots.numel() - 1)], -1)
        return out

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        T, G, R = out.shape[0], c.o_groups, c.o_lora_rank
        grouped = out.reshape(T, G, -1).transpose(0, 1)                       # [G, T, H * D / G]
        w = self.o_a_proj.weight.view(G, R, -1).transpose(1, 2)              # [G, H * D / G, R]
        return self.o_b_proj(torch.bmm(grouped, w).transpose(0, 1).reshape(T, G * R))


class V4Block(nn.Module):
    """``x + self_attn(input_layernorm(x))``: the attention half of a decoder layer (no hyper-connections)."""

    def __init__(self, cfg: V4Config, layer_idx: int, *, dtype, device):
        super().__init__()
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device)
        self.self_attn = V4Attention(cfg, layer_idx, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, step: V4Step) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), step)


class V4Model(nn.Module):
    """A stack of V4 attention blocks with pre-norm residuals (attention only: no embedding, hyper-connections,
    MoE or head). ``cfg``: a :class:`V4Config` or anything :func:`load_v4_config` takes."""

    def __init__(self, cfg, num_layers: int | None = None, *, dtype=torch.bfloat16, device="cpu",
                 backend: str = "auto"):
        super().__init__()
        self.cfg = cfg = load_v4_config(cfg)
        n = cfg.num_layers if num_layers is None else num_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.num_layers:
            raise ValueError(f"num_layers: expected an int in [1, {cfg.num_layers}], got {num_layers!r}")
        self.layers = nn.ModuleList(V4Block(cfg, i, dtype=dtype, device=device) for i in range(n))
        self.dtype, self.device, self.backend = dtype, torch.device(device), backend

    @classmethod
    def random(cls, cfg, num_layers=None, *, seed: int = 0, **kw) -> "V4Model":
        m = cls(cfg, num_layers, **kw)
        for blk in m.layers:
            blk.self_attn.init_random(seed)
        return m

    @classmethod
    def from_pretrained(cls, path, num_layers=None, **kw) -> "V4Model":
        """The attention weights of a local ``deepseek_v4`` checkpoint directory (``config.json`` + safetensors):
        DeepSeek's own names (``layers.{i}.attn.wq_a.weight``...; what transformers' save_pretrained writes too)
        or transformers' (``layers.{i}.self_attn.q_a_proj.weight``...), with or without the ``model.`` prefix.
        Block-scaled FP8 weights with ``weight_scale_inv`` are dequantized on load."""
        import json
        from pathlib import Path

        from .checkpoint import CheckpointReader
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint: {str(path)!r} has no config.json")
        cfg = V4Config.from_dict(json.loads((path / "config.json").read_text()), name=path.name)
        reader = CheckpointReader(path)
        try:
            prefix = next((p for p in ("model.", "") for a in ("attn.wq_a.weight", "self_attn.q_a_proj.weight")
                           if f"{p}layers.0.{a}" in reader), None)
            if prefix is None:
                raise ValueError(f"checkpoint: {str(path)!r} has no layers.0.attn.wq_a.weight (nor transformers' "
                                 "layers.0.self_attn.q_a_proj.weight): not a DeepSeek-V4 checkpoint?")
            native = f"{prefix}layers.0.attn.wq_a.weight" in reader
            model = cls(cfg, num_layers, **kw)
            with torch.no_grad():
                for i, blk in enumerate(model.layers):
                    base = f"{prefix}layers.{i}."
                    for name, p in blk.self_attn.named_parameters():
                        key = base + ("attn." + NATIVE_NAMES[name] if native else "self_attn." + name)
                        w = torch.as_tensor(reader.get(key)[:])
                        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # its scales not found
                            raise ValueError(f"checkpoint: {key} is FP8 without a {key}_scale_inv block scale; "
                                             "other scale layouts are not read (the values would be wrong)")
                        p.copy_(w.to(p.dtype))
                    norm = base + ("attn_norm.weight" if native else "input_layernorm.weight")
                    blk.input_layernorm.weight.copy_(torch.as_tensor(reader.get(norm)[:]).float())
        finally:
            reader.close()
        return model

    def make_cache(self, num_pages: int, page_size: int, kv_format="bf16", **kw) -> V4Cache:
        """Row streams, indexer keys (in the model's dtype unless ``index_dtype`` says) and compressor states."""
        kw.setdefault("index_dtype", self.dtype)
        kw.setdefault("write_backend", "torch" if self.backend == "torch" else "auto")
        return V4Cache(self.cfg, len(self.layers), num_pages, page_size, kv_format, device=self.device, **kw)

    def begin_step(self, cache: V4Cache, seq_ids, num_tokens) -> V4Step:
        if cache.num_layers < len(self.layers):
            raise ValueError(f"cache: {cache.num_layers} layers, the model has {len(self.layers)}")
        # the attention takes 16-bit queries; an fp32 / fp64 model (tests) runs it in bf16 over the V4 formats
        adt = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        return begin_v4_step(cache, seq_ids, num_tokens, num_heads=self.cfg.num_heads, attn_dtype=adt,
                             backend=self.backend)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: V4Step) -> torch.Tensor:
        """The residual stream after every block, ``[T, hidden_size]``; the step is committed after the last
        block (a failure gives its rows back)."""
        try:
            for blk in self.layers:
                x = blk(x, step)
        except BaseException:
            step.cancel()
            raise
        step.commit()
        return x
