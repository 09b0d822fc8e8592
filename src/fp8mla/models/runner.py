"""A CUDA-graph decode runner for the DeepSeek MLA layer stack: the way serving engines run decode steps.

Eager decode leaves the GPU waiting on the host (~60 launches per layer, each a few microseconds of Python and
driver work). The runner captures the whole stack's decode step once per **batch bucket** (1, 2, 4, ... up to
``max_batch``) and replays it:

- **plan on the host, outside the graph**, into fixed device buffers: the batch is padded to its bucket with
  requests of no tokens (output 0, never read), the attention is planned through its ``use_cuda_graph=True``
  buffers (the captured kernels read the real lengths and page tables from device memory), and the new
  tokens' slots, positions and inputs are copied into the runner's static tensors;
- **replay inside**: norms, projections, rope + quantize-on-write (one fused kernel), absorbed attention, o_proj
  and, under tensor parallelism, the NCCL all-reduce, all in one graph per bucket.

Planning is O(batch) host work whatever the page size: the runner keeps a device **block table** (one row of page
ids per sequence) and updates only the entry of each new token (a device scatter), so a page-1 cache costs the same
as a page-64 one. A sequence the runner has not seen, or that an eager (prefill) step changed, has its row filled
once from the cache.

Steps that are not decode-only (a prompt joins, a chunked prefill) run eagerly through the model, as before; so do
batches above ``max_batch`` and devices without CUDA graphs (the CPU tests run the same padded plan eagerly).
A step that fails after reserving its slots gives them back (nothing leaks).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field

import torch

from ..attention import MLAPagedAttention
from .._checks import check_positive_int
from ..cache import PagedMLACache
from ..layout import PagedLayout, pack_ints
from .deepseek import DeepseekMLAModel
from .mla_step import MLAStep, attention_dtype, check_step_args

__all__ = ["DecodeRunner", "batch_buckets", "bucket_for"]


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two below ``max_batch``, and ``max_batch`` itself."""
    max_batch = check_positive_int("max_batch", max_batch)
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket_for(batch: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``batch`` requests."""
    for b in buckets:
        if b >= batch:
            return b
    raise ValueError(f"batch: {batch} requests, more than the largest bucket {buckets[-1]} (max_batch)")


class _Staging:
    """The host side of a bucket's one staging copy: a few host buffers used in turn, packed in place with
    ``struct`` (no tensor made per step). On a GPU they are pinned, and one is reused only once the copy that read
    it last has run (its CUDA event is queried, never waited on: while all are still being read, the step stages
    through a fresh pinned copy instead, as the caching host allocator would). On the CPU the copy is synchronous:
    one buffer."""

    def __init__(self, dev: torch.Tensor, n: int = 4):
        self.dev, self.i, self.views = dev, 0, {}
        cuda = dev.is_cuda
        self.host = [torch.empty(dev.numel(), dtype=torch.int32, pin_memory=cuda) for _ in range(n if cuda else 1)]
        self.events = [torch.cuda.Event() for _ in self.host] if cuda else None
        self.mem = [(ctypes.c_char * (4 * t.numel())).from_address(t.data_ptr()) for t in self.host]

    def copy(self, fmt: str, vals: list) -> None:
        """Pack ``vals`` by ``fmt`` (the device buffer's first bytes, up to all) and copy them into it
        (asynchronously)."""
        i, ev = self.i, self.events
        n = struct.calcsize(fmt) // 4
        if ev is not None:
            if not ev[i].query():  # (a never-recorded event counts as done)
                buf = bytearray(4 * n)
                struct.pack_into(fmt, buf, 0, *vals)
                self.dev[:n].copy_(torch.frombuffer(buf, dtype=torch.int32).pin_memory(), non_blocking=True)
                return
            self.i = (i + 1) % len(self.host)
        struct.pack_into(fmt, self.mem[i], 0, *vals)
        v = self.views.get((i, n))
        if v is None:
            v = self.views[(i, n)] = (self.dev[:n], self.host[i][:n])
        v[0].copy_(v[1], non_blocking=True)
        if ev is not None:
            ev[i].record(torch.cuda.current_stream(self.dev.device))  # the stream the copy went to


@dataclass(eq=False)
class _Bucket:
    """One batch bucket's attention, static step and buffers (``DecodeRunner._bucket``). ``dev`` is the staging
    buffer (int32, on the device) that one copy per step fills; ``pos``, ``ents``, ``rows`` and ``pages`` are views
    of it."""

    size: int                       # Bb: requests the bucket's step runs (the batch padded with empty requests)
    attn: MLAPagedAttention
    step: MLAStep                   # the bucket's static step (the graph reads its tensors)
    block_table: torch.Tensor       # [Bb, width] int32: the bucket's rows of the runner's table
    dev: torch.Tensor               # the staging buffer
    fast: bool                      # the attention re-plans through replan_rows, its arrays staged in ``dev``
    pos: torch.Tensor               # [Bb] int64 positions (read by the graph)
    ents: torch.Tensor              # [Bb] int64 the new tokens' entries of the flat table (the scatter's index)
    rows: torch.Tensor              # [Bb] int32 block-table rows (the gather's index)
    pages: torch.Tensor             # [Bb] int32 the new tokens' page ids
    staging: _Staging               # the host side of the one copy
    zeros: list                     # padding: kv_len 0, the padding slot, row and table entry, Bb of each
    pad_slots: list
    pad_rows: list
    pad_ents: list
    fmt: dict = field(default_factory=dict)   # batch size -> the struct format of the runner's part of the copy
    graph: object = None            # the captured CUDA graph; None before the capture, False if it failed
    out: torch.Tensor | None = None  # the graph's output tensor
    staged: list | None = None      # the plan's arrays in the last copy (those unchanged since are not copied)


class DecodeRunner:
    """Decode steps of ``model`` over ``cache`` with one CUDA graph per batch bucket.

    Args:
        model: a :class:`~fp8mla.models.deepseek.DeepseekMLAModel` (any tensor-parallel split: each rank runs its
            own runner with the same schedule, and its graphs hold the all-reduce).
        cache: the model's paged cache (one per rank).
        max_batch: the largest decode batch run in a graph (larger ones run eagerly).
        max_context: the longest sequence (tokens) a graph step may read; sets the block table's width
            (default: the whole pool).
        use_cuda_graph: capture graphs (default: on a CUDA device, any backend but torch); False runs the same
            padded, pre-planned step eagerly (what the CPU tests check).
    """

    def __init__(self, model: DeepseekMLAModel, cache: PagedMLACache, *, max_batch: int = 64,
                 max_context: int | None = None, use_cuda_graph: bool | None = None):
        self.model, self.cache = model, cache
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        dev = self.device = cache.device
        ps = cache.page_size
        if max_context is None:
            max_context = cache.num_pages * ps
        max_context = check_positive_int("max_context", max_context)
        self.max_context = max_context
        self.width = -(-max_context // ps)
        if use_cuda_graph is None:
            use_cuda_graph = dev.type == "cuda" and model.backend in ("auto", "triton", "gluon")
        if use_cuda_graph and dev.type != "cuda":
            raise ValueError(f"use_cuda_graph: CUDA graphs need a CUDA device, the cache is on {dev}")
        self.use_cuda_graph = bool(use_cuda_graph)
        cfg = model.cfg
        self.attn_dtype = attention_dtype(model.dtype)
        # Padding rows write their latents into a slot of the runner's own one-token sequence, never read.
        self.pad_id = cache.add_sequence(num_tokens=1)
        self.pad_slot = cache.pages(self.pad_id)[0] * ps
        B = max_batch
        self.x = torch.zeros(B, cfg.hidden_size, dtype=model.dtype, device=dev)
        # Block table: a row of page ids per sequence the runner tracks, a row of zeros for padding and a scratch
        # row that eager steps write the tokens of untracked sequences into.
        self.table = torch.zeros(B + 2, self.width, dtype=torch.int32, device=dev)
        self.pad_row, self.scratch_row = B, B + 1
        self._table_flat = self.table.view(-1)  # (the scatter's target, every step)
        self._free_rows = list(range(B - 1, -1, -1))
        # seq_id -> [row, the cache's sequence record, tokens whose pages the row holds] (a list: updated in place)
        self._rows: dict = {}
        self._graphs: dict[int, _Bucket] = {}   # bucket size -> its graph, attention, static step, buffers
        self._pool = None
        self.stats = dict(graph_steps=0, eager_steps=0, captures=0, row_fills=0)
        self.last_step: MLAStep | None = None  # the step step() ran last (its plans name the backends)

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def release(self, seq_id) -> None:
        """Forget ``seq_id`` (call when it leaves; rows of freed sequences are also reclaimed when rows run out)."""
        ent = self._rows.pop(seq_id, None)
        if ent is not None:
            self._free_rows.append(ent[0])

    def close(self) -> None:
        """Give the padding sequence's page back and drop the graphs."""
        if self.pad_id in self.cache.sequences:
            self.cache.free(self.pad_id)
        self._graphs.clear()

    def _reclaim(self) -> None:
        live = set(self.cache.sequences)
        for sid in [s for s in self._rows if s not in live]:
            self.release(sid)

    def _row(self, sid, prefix: int) -> list:
        """The sequence's entry ``[row, record, prefix]``, its block-table row filled from the cache when the row
        does not hold its current pages."""
        # identity of the cache's state: a freed-and-re-added id is a new sequence (seq_state: the error for a bad id)
        rec = self.cache.seq_state(sid)
        ent = self._rows.get(sid)
        if ent is not None and ent[1] is rec and ent[2] == prefix:
            return ent
        if ent is None:
            if not self._free_rows:
                self._reclaim()
            if not self._free_rows:
                raise ValueError(f"seq_ids: more than max_batch={self.max_batch} sequences tracked; call "
                                 "runner.release(seq_id) for sequences that left")
            row = self._free_rows.pop()
        else:
            row = ent[0]
        pages = self.cache.pages(sid)[: -(-prefix // self.cache.page_size)]
        if pages:
            self.table[row, : len(pages)].copy_(torch.tensor(pages, dtype=torch.int32), non_blocking=True)
        self.stats["row_fills"] += 1
        ent = self._rows[sid] = [row, rec, prefix]
        return ent

    def _rewind(self, ids: list, prefix: list) -> None:
        """A cancelled step: the rows hold the sequences' pages up to their old lengths again."""
        for sid, p in zip(ids, prefix):
            ent = self._rows.get(sid)
            if ent is not None:
                ent[2] = p

    def _follow(self, ids: list, counts: list, prefix: list, slots: torch.Tensor) -> None:
        """After an eager step: put its tokens' pages into the rows of the tracked sequences (a device scatter, no
        refill), so that their next decode step plans in O(batch)."""
        rows = []
        for sid, p, n in zip(ids, prefix, counts):
            ent = self._rows.get(sid)
            ok = ent is not None and ent[2] == p and ent[1] is self.cache.seq_state(sid)
            rows.append(ent[0] if ok else self.scratch_row)
            if ok:
                ent[2] = p + n
        if all(r == self.scratch_row for r in rows):
            return
        cnt = torch.tensor(counts)
        T = int(cnt.sum())
        start = torch.cumsum(cnt, 0) - cnt
        pos = torch.repeat_interleave(torch.tensor(prefix) - start, cnt, output_size=T) + torch.arange(T)
        row = torch.repeat_interleave(torch.tensor(rows), cnt, output_size=T)
        col = torch.div(pos, self.cache.page_size, rounding_mode="floor").clamp_(max=self.width - 1)
        dev = self.device
        self.table[row.to(dev), col.to(dev)] = (slots // self.cache.page_size).to(torch.int32)

    # -- one step -----------------------------------------------------------------------------------------------
    def is_graph_step(self, prefix_lens: list, counts: list) -> bool:
        return (len(counts) <= self.max_batch and all(n == 1 for n in counts) and all(p > 0 for p in prefix_lens)
                and max(prefix_lens) + 1 <= self.max_context)

    def step(self, seq_ids, num_tokens, x: torch.Tensor) -> torch.Tensor:
        """Reserve, plan and run one step of ``x [T, hidden]`` (rows: each sequence's new tokens, in order);
        returns ``[T, hidden]`` (a new tensor). Decode-only steps up to ``max_batch`` replay a graph; others run
        eagerly. A failure gives the reservation back."""
        ids, counts = check_step_args(self.cache, seq_ids, num_tokens, self.model.cfg)
        prefix = [self.cache.seq_len(s) for s in ids]
        if not self.is_graph_step(prefix, counts):
            st = self.last_step = self.model.begin_step(self.cache, ids, counts)
            self.stats["eager_steps"] += 1
            out = self.model(x, st)
            self._follow(ids, counts, prefix, st.slots)
            return out
        st = self.last_step = self.begin_step(ids, prefix)
        try:
            return self.forward(x, st)
        except BaseException:
            st.cancel()
            raise

    def begin_step(self, ids: list, prefix: list) -> MLAStep:
        """Reserve one token per sequence and plan its bucket's graph (O(batch) host work). Returns the bucket's
        static step with this batch's size in ``num_tokens``; on failure nothing stays reserved."""
        B = len(ids)
        Bb = bucket_for(B, self.buckets)
        slots = self.cache.reserve_slots(ids, 1)  # a host list: staged below with the rest, no sync
        try:
            return self._plan(ids, prefix, slots, B, Bb)
        except BaseException:
            self.cache.unreserve(ids)
            self._rewind(ids, prefix)
            raise

    def _plan(self, ids, prefix, slots, B, Bb) -> MLAStep:
        """O(batch) Python and three device ops, none sized by the context: ONE host -> device copy of everything
        the step stages (positions, slots, block-table rows, the new tokens' table entries and page ids, and the
        attention plan's schedule arrays), the new pages into the block table (one scatter), and the bucket's rows
        of the table gathered into the attention's own page-id buffer (one gather)."""
        ps, W = self.cache.page_size, self.width
        # Each sequence's row (filled when it does not hold its pages), marked as holding the new token's page
        # too (begin_step's failure path rewinds the marks): one pass, the common case inline.
        rows, seqs, tracked = [], self.cache.seq_states, self._rows
        for sid, p in zip(ids, prefix):
            ent = tracked.get(sid)
            if ent is None or ent[2] != p or ent[1] is not seqs.get(sid):
                ent = self._row(sid, p)
            rows.append(ent[0])
            ent[2] = p + 1
        g = self._bucket(Bb)
        attn, st, pad = g.attn, g.step, Bb - B
        kv_len = [p + 1 for p in prefix]
        if pad:
            kv_len += g.zeros[:pad]
        sink: list = []   # the attention plan's (values, capacity) segments, staged below with the runner's own
        fast = g.fast
        if fast:  # (a captured bucket's plan object stays: its graph holds the launch configuration)
            attn.replan_rows(kv_len, sink, fixed=bool(g.graph))
        # The staging buffer (see _bucket): int64 positions, slots, table entries; int32 rows, page ids; the plan's
        # arrays. Padding rows: position 0, the padding slot, the padding row; their table entries rewrite the
        # padding row's first entry with 0 (what it holds).
        ents = [r * W + p // ps for r, p in zip(rows, prefix)]
        pages = [x // ps for x in slots]
        if pad:
            slots, rows, ents = slots + g.pad_slots[:pad], rows + g.pad_rows[:pad], ents + g.pad_ents[:pad]
        fmt = g.fmt.get(B)
        if fmt is None:  # the runner's part of the struct format, per batch size (padding: zero bytes)
            fmt = g.fmt[B] = f"={B}q{8 * pad}x{2 * Bb}q{Bb}i{B}i{4 * pad}x"
        # The plan's arrays: those up to the last one that changed since this bucket's last copy (its buffers hold
        # the rest; the backends put the ones that change every step first). The same list object, or a short
        # equal one, is the same array: the schedules' lists are never changed once made.
        prev, n = g.staged, len(sink)
        if prev is not None and len(prev) == n:
            while n and (sink[n - 1][0] is prev[n - 1] or (len(prev[n - 1]) < 4 and sink[n - 1][0] == prev[n - 1])):
                n -= 1
        fmt, vals = pack_ints(sink[:n], "i", [fmt], [*prefix, *slots, *ents, *rows, *pages])
        g.staged = None  # (until the copy below was made)
        g.staging.copy("".join(fmt), vals)
        g.staged = [v for v, _ in sink]
        # Each new token's page goes into its row (the same page again while a page fills up; a new one at a page
        # boundary; the copy when a shared last page was unshared), then the bucket's rows into its table.
        self._table_flat.scatter_(0, g.ents, g.pages)
        torch.index_select(self.table, 0, g.rows, out=g.block_table)
        if not fast:
            self._plan_attention(attn, g.block_table, kv_len)
        st.seq_ids, st.num_tokens, st.prefix_lens = list(ids), [1] * B, list(prefix)
        st.reserved, st.committed, st.forks = True, False, self.cache.fork_count
        st.undo = lambda: self._rewind(ids, prefix)
        if g.graph is None and self.use_cuda_graph:
            self._capture(g)
        return st

    def _plan_attention(self, attn: MLAPagedAttention, block_table: torch.Tensor, kv_len: list) -> None:
        m, cache = self.model, self.cache
        H, cfg = m.num_local_heads, m.cfg
        lay = PagedLayout.decode_rows(block_table, kv_len, cache.page_size)
        attn.plan_layout(lay, H, cache.head_dim_ckv, cache.head_dim_kpe, True, cfg.sm_scale, self.attn_dtype,
                         cache.format.name)

    def _bucket(self, Bb: int) -> _Bucket:
        """The bucket's attention, static step and buffers (made on its first step). Its staging buffer, int32 on
        the device, filled by one copy per step: positions [Bb] and slots [Bb] as int64 (read by the graph), the
        new tokens' table entries [Bb] as int64 (the scatter's index), int32 block-table rows [Bb] (the gather's
        index) and page ids [Bb], then, with CUDA-graph buffers, the attention plan's own small arrays (its buffers
        are views of this one, see ``backends._graph.GraphBuffers.rebase``), so that the plan costs no copy of its
        own."""
        g = self._graphs.get(Bb)
        if g is not None:
            return g
        m, cache, dev = self.model, self.cache, self.device
        table = torch.zeros(Bb, self.width, dtype=torch.int32, device=dev)
        # Graphs: the bucket's gathered table is the attention's own page-id buffer (FlashInfer's kv_indices
        # argument), so planning copies no page ids.
        kw = dict(use_cuda_graph=True, max_batch_size=Bb, kv_indices=table.view(-1)) if self.use_cuda_graph else {}
        attn = MLAPagedAttention(backend=m.backend, **kw)
        lead = 8 * Bb  # int32 entries of the runner's part (a multiple of 4: the plan's arrays are 16-byte aligned)
        buf = None
        if self.use_cuda_graph:
            # A first plan (no tokens) makes the attention's CUDA-graph buffers; when the backend lets a caller
            # stage its arrays (triton, gluon), they move into this bucket's staging buffer and every later step
            # re-plans through the trusted fast path (MLAPagedAttention.replan_rows) into the same copy.
            self._plan_attention(attn, table, [0] * Bb)
            buf = attn.graph_buffers
        extra = 0 if buf is None else buf.flat.numel()
        stage = torch.zeros(lead + extra, dtype=torch.int32, device=dev)
        if buf is not None:
            buf.rebase(stage[lead:])
        st = MLAStep(cache, [], [], [], stage[2 * Bb: 4 * Bb].view(torch.int64), None, None, self.attn_dtype, None,
                     torch.arange(Bb, device=dev), None, None, None, attn, m.rope, m.backend, fused=m.fused)
        W = self.width
        g = self._graphs[Bb] = _Bucket(
            size=Bb, attn=attn, step=st, block_table=table, dev=stage, fast=buf is not None,
            pos=stage[: 2 * Bb].view(torch.int64), ents=stage[4 * Bb: 6 * Bb].view(torch.int64),
            rows=stage[6 * Bb: 7 * Bb], pages=stage[7 * Bb: 8 * Bb], staging=_Staging(stage), zeros=[0] * Bb,
            pad_slots=[self.pad_slot] * Bb, pad_rows=[self.pad_row] * Bb, pad_ents=[self.pad_row * W] * Bb)
        return g

    def _run_bucket(self, g: _Bucket) -> torch.Tensor:
        """The bucket's step on the static tensors: what the graph holds."""
        Bb, st, m = g.size, g.step, self.model
        st.cos, st.sin = m.rope.cos_sin(g.pos)
        y = self.x[:Bb]
        for blk in m.layers:
            y = blk(y, st)
        return y

    def _capture(self, g: _Bucket) -> None:
        """Capture the bucket's step. If capture fails, the bucket runs its padded step eagerly from then on and
        ``stats["capture_error"]`` says why (a warning too): slower, never wrong."""
        import warnings
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s), torch.no_grad():
            self._run_bucket(g)  # warm up: compiles the kernels, sets up the communicators, fills the caches
        torch.cuda.current_stream(self.device).wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the NCCL watchdog thread's event queries (tensor parallel) must not void the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), torch.no_grad():
                g.out = self._run_bucket(g)
        except Exception as e:  # noqa: BLE001 - any capture failure: run this bucket eagerly, say why
            torch.cuda.synchronize(self.device)
            g.graph, g.out = False, None
            self.stats["capture_error"] = f"bucket {g.size}: {type(e).__name__}: {e}"
            warnings.warn(f"DecodeRunner: CUDA-graph capture failed, running eagerly: {self.stats['capture_error']}",
                          RuntimeWarning, stacklevel=3)
            return
        g.graph = graph
        self.stats["captures"] += 1

    def forward(self, x: torch.Tensor, st: MLAStep) -> torch.Tensor:
        """Run a step planned by :meth:`begin_step`: ``x [B, hidden]`` -> a new ``[B, hidden]`` tensor. The step is
        the bucket's own (static) one: it stands for the bucket's last begin_step, and a cancelled one is refused
        (its slots went back to the pool), as is one whose pages a later ``cache.fork`` shares."""
        if not st.reserved or self.cache.fork_count != st.forks:
            st.check_runnable()  # (raises: a cancelled step, or one that would write a fork's pages)
        B, Bb = len(st.seq_ids), st.slots.numel()
        hid = self.model.cfg.hidden_size
        if x.shape != (B, hid):
            raise ValueError(f"x: expected shape [{B}, {hid}] (one row per sequence), got {list(x.shape)}")
        g = self._graphs[Bb]
        self.x[:B].copy_(x)
        self.x[B:Bb].zero_()
        with torch.no_grad():
            if g.graph:
                g.graph.replay()
                out = g.out
                self.stats["graph_steps"] += 1
            else:
                out = self._run_bucket(g)
                self.stats["eager_steps"] += 1
        st.committed = True
        return out[:B].clone()
