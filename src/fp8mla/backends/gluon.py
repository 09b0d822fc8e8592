"""The "gluon" backend: the warp-specialized Hopper decode kernel (``fp8mla.kernels.sm90``).

Its two builds, the wide kernel and heads-on-M, declare what they take in ``capabilities.py`` (``GLUON_WIDE``,
``GLUON_HEADS_ON_M``); ``backends.select`` picks one for each plan, or says why neither takes it: the plan then
runs on the Triton kernel (``auto``) or is refused by name (``backend="gluon"``), never answered wrongly. Taken:
sm_90, H <= 16 (padded to 16) and 17..128 heads with the wide-heads variant (head groups of 32 or 64, ``nhg`` CTAs
per schedule slot), 1..8 query tokens per request (multi-token decode: rows = (query token, head) pairs, max
qo_len x H <= 512), page size 1 (rows copied with cp.async), 16, 32 or a multiple of 64 (TMA row boxes), FP8 e4m3
with per-tensor or per-token group scales, c_kv 512 + k_pe 64, bf16/fp16 queries. The split schedule is made on the
host when the layout has host lengths and the plan uses CUDA-graph buffers or the heads-on-M build
(``tile_items_host``, O(batch) Python, staged in one copy: the decode runner's path), else on the device from the
layout (no host read, no sync; in CUDA-graph buffers replayed from a graph per shape); lengths are clamped to the
pages each row lists either way. The schedules and the merge's block sizes live in ``kernels.split.tiles``.

``build`` makes the split schedule (tile ranges per CTA, request-aligned or contiguous: ``kernels.split.tiles``) and
the device arrays; ``run`` only launches the kernel and the merge. With CUDA graphs every array lives in buffers sized
once per wrapper (``state``), the grids are fixed (one CTA per SM; merge over ``max_batch_size`` requests) and the
kernels read the real counts from device memory, so a captured run replays right after a re-plan.

The batch-invariant mode (option ``batch_invariant``): each request is cut in chunks of ``invariant_chunk`` tokens
on its own (``kernels.split.tiles.invariant_lists`` / ``invariant_items_device``), one work item each, merged in
chunk order by the merge's sequential formula at fixed block sizes. The wide builds (both consumers over every
tile) and heads-on-M (one CTA per item) compute an item alike wherever it runs, so a request's bits follow its own
items; the <= 16-head build and multi-token plans are refused in the mode (``_invariant_refusal``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import LN2, num_sms
from ..kernels.split import (invariant_items_device, merge_sizes, safe_kv_len, tile_items_device,
                             tile_items_host)
from . import PlanState
from ._graph import GraphBuffers
from ._heads_on_m import aligned_slack
from ._invariant import INVARIANT_CHUNK, INVARIANT_PARTIALS
from .capabilities import DEFAULT_STAGES
from .select import Refusal, dense_question, qo_range, select

# Kernel options shared with the Triton backend (MLAPagedAttention's KERNEL_OPTIONS): num_stages = TMA ring stages,
# min_chunk = fewest tokens per CTA (the split granularity is 64-token tiles).
# (num_stages 3 is the wide variant's; the alternating-tile kernel at <= 16 heads takes 4, or 3 with group scales
# or the FP8-scores variant's Q terms, where 4 do not fit: sm90.ring_depth)
DEFAULTS = dict(num_stages=DEFAULT_STAGES, min_chunk=256, max_batch_size=256, max_kv_indices=1 << 20)
# fp8_math (opt-in, MLAPagedAttention(fp8_math=True)): Q as 2 e4m3 terms (hi + lo) against K straight from the ring,
# P x 2^8 in e4m3 against V^T's bytes: e4m3 x e4m3 wgmma for both products, no K or V conversion. Error budget rel
# L2 <= 2e-2; the default numerics stay exact FP8 -> fp16 with 16-bit MMAs.
# Per-token group scales (fp8_e4m3_group): the group build has 16 rows per consumer at any head count (H > 32:
# ceil(H / 32) head-group CTAs per schedule slot; at 32 per consumer it spills 1.4 KB). Its scale array must be rows
# of one pool with 16-byte aligned strides (the cache's own is); another layout is refused by name at run().


def _stages(ns: int, hpw: int, wide: bool, group: bool, fp8_math: bool) -> int:
    """The ring depth of a plan whose options ask for ``ns`` stages. The group tiles (and ``fp8_math``'s Q terms)
    take shared memory from the ring: a per-tensor setting that does not fit them (4 stages at 16 heads) is lowered
    to what fits, as the same wrapper's group plan is built from its options. The alternating-tile kernel (H <= 16)
    then takes the even depth above an odd request where it fits (sm90.ring_depth)."""
    from ..kernels import sm90 as k
    terms = k.FP8_MATH_TERMS if fp8_math and not group else 0
    if group or fp8_math:   # the group tiles, or fp8_math's Q terms, must fit beside the ring
        while ns > 2 and k.smem_bytes(ns, hpw, wide, terms, group=group) > k.SMEM_LIMIT:
            ns -= 1
    return k.ring_depth(ns, hpw, wide, terms, group)


def wide_build(q):
    """The wide build's named variant (``sm90.Sm90Build``) of a plan its record takes, at ``q.max_qo`` query tokens
    per request, or why its ring does not fit shared memory (``capabilities.GLUON_WIDE``'s finish)."""
    from ..kernels import sm90 as k
    if k.gluon is None:
        return f"gluon does not import: {k.GLUON_IMPORT_ERROR}"
    group = q.kv_format == "fp8_e4m3_group"
    hpw, _, wide = k.row_config(q.num_heads, q.max_qo, k.GROUP_MAX_HPW if group else 32)
    ns = _stages(q.num_stages or DEFAULTS["num_stages"], hpw, wide, group, q.fp8_math)
    b = k.Sm90Build.for_plan(q.num_heads, q.page_size, q.max_qo, q.causal, group, q.fp8_math, max(ns, 1))
    if ns < 2 or b.smem() > k.SMEM_LIMIT:
        most = max((n for n in range(2, 8) if k.smem_bytes(n, hpw, wide, b.q_terms, group=group) <= k.SMEM_LIMIT),
                   default=1)
        return (f"num_stages: the gluon kernel's ring takes 2..{most} stages at {q.num_heads} heads"
                f"{' with group scales' if group else ''}{' with fp8_math' if q.fp8_math else ''}; {ns} stages need "
                f"{b.smem()} B of shared memory, above {k.SMEM_LIMIT}")
    return _invariant_refusal(b, q)


def heads_on_m_build(q):
    """The heads-on-M build's named variant of a plan its record takes (``capabilities.GLUON_HEADS_ON_M``): the
    selector prefers it to the wide build wherever it takes the plan (``heads_on_m`` None; True requires it, False
    never takes it). Where it takes a plan, heads-on-M was measured faster than the wide build at every shape timed,
    plain and in CUDA-graph wrappers, with host or device-only lengths (its longest-first schedule is made on either
    side: ``tile_items_host`` / ``tile_items_device``): 0.80-0.93x the wide build's time at 14 shapes of 64 and
    128 heads (equal, uniform, log-normal and one-long lengths, B8-B128; H200, docs/benchmarks.md "Heads-on-M in
    CUDA-graph wrappers")."""
    from ..kernels import sm90 as k
    if k.gluon is None:
        return f"gluon does not import: {k.GLUON_IMPORT_ERROR}"
    return _invariant_refusal(k.Sm90Build.for_heads_on_m(q.num_heads, q.page_size), q)


def _invariant_refusal(b, q):
    """The build ``b`` of question ``q``, or (the batch-invariant mode) why the mode refuses it: a request's bits
    must follow its own work items only. The wide builds (both consumers take every tile of an item, each for its
    own heads) and heads-on-M (one CTA per item) compute an item alike wherever it runs; the <= 16-head build splits
    an item's tiles between its two consumers by the item's place in its CTA's tile stream (then merges their
    states), and a multi-token plan runs the variant of the batch's longest query."""
    if not q.batch_invariant or isinstance(b, str):
        return b
    if q.max_qo > 1:
        return (f"batch_invariant: the gluon builds take one query per request in this mode (the multi-token "
                f"variant follows the batch's longest query; got {q.max_qo})")
    if not (b.wide or b.heads_on_m):
        return ("batch_invariant: the gluon build at <= 16 heads splits a work item's tiles between its two "
                "consumers by the item's place in its CTA, so a request's bits would follow its batch")
    return b


def _named_build(spec, layout, options: dict, state: PlanState):
    """The named build of a plan on this backend (``select`` over the gluon builds), or the reason it refuses it.
    The build follows the plan's max_qo (fixed by the first plan of a CUDA-graph wrapper, ``plan_max_qo``); kept
    for the spec and the batch's query lengths, so a wrapper's repeated plans select once."""
    max_qo = plan_max_qo(layout, spec, state, keep=False)   # (build() fixes a graph wrapper's max_qo itself)
    qo = qo_range(layout)
    key = (spec, qo, max_qo, id(options))
    memo = state.selected
    if memo is not None and memo[0] == key:
        return memo[1]
    choice = select(dense_question(spec, qo, options, max_qo), "gluon")
    if isinstance(choice, Refusal):
        return choice.reason
    state.selected = (key, choice.build)
    return choice.build


def _invariant_chunk(opts: dict):
    """The batch-invariant mode's chunk (tokens; a multiple of the 64-token tile), None outside the mode."""
    return (opts.get("invariant_chunk") or INVARIANT_CHUNK) if opts.get("batch_invariant") else None


@dataclass
class GluonPlan:
    spec: object
    grid: int
    grid_batch: int
    merge_p: int
    merge_c: int
    t: dict
    build: object   # sm90.Sm90Build: the compiled variant

    @property
    def ns(self) -> int:
        return self.build.stages

    @property
    def max_qo(self) -> int:   # >= 2: the multi-token variant, rows = max_qo x num_heads
        return self.max_rows // self.spec.num_heads

    @property
    def group(self) -> bool:   # per-token group scales (fp8_e4m3_group): run() takes ckv_scale_arr
        return self.build.group

    @property
    def fp8_math(self) -> bool:
        return self.build.fp8_math

    max_rows: int = 0   # max_qo x num_heads (0: num_heads)
    slots: int = 0      # the schedule's CTAs
    n_items: int = 0    # heads-on-M: work items launched (the real count, or a cap: slots + batch, CUDA graphs
    #                     slots + max_batch; CTAs past the real count exit)
    # batch-invariant plans cut on the device: int32 [1], requests past the item capacity, run as one item
    overflow: object = None

    def __post_init__(self):
        if not self.max_rows:
            self.max_rows = self.spec.num_heads

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e: bool) -> None:
        from ..kernels import sm90 as k
        scale_desc = None
        if self.group:
            if ckv_scale_arr is None:
                raise ValueError("ckv_scale_arr: this plan's format has per-token group scales; got None")
            if not k.scale_rows_ok(ckv_scale_arr):
                raise ValueError(f"ckv_scale_arr: the gluon backend reads group scales with TMA and needs [P, page, "
                                 f"{k.GROUPS}] fp32 rows of one pool with 16-byte aligned strides; got "
                                 f"{ckv_scale_arr.dtype} {tuple(ckv_scale_arr.shape)} strides "
                                 f"{tuple(ckv_scale_arr.stride())} (a contiguous array, or backend='triton')")
            if tuple(ckv_scale_arr.shape[:2]) != tuple(ckv_cache.shape[:2]):   # the kernel reads one row per pool row
                raise ValueError(f"ckv_scale_arr: expected [{ckv_cache.shape[0]}, {ckv_cache.shape[1]}, {k.GROUPS}] "
                                 f"(the pool's pages and slots), got {tuple(ckv_scale_arr.shape)}")
            scale_desc = k.scale_descriptor(ckv_scale_arr)
        elif ckv_scale_arr is not None:   # never ignore group scales
            raise ValueError("ckv_scale_arr: this gluon plan takes per-tensor scales only (plan the group format)")
        for name, c in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if c.stride(-1) != 1 or c.stride(0) != c.shape[1] * c.stride(1) or (c.stride(1) % 16) \
                    or c.data_ptr() % 16:
                raise ValueError(f"{name}: the gluon backend reads pages with TMA and needs rows of one pool "
                                 f"with 16-byte aligned strides; got strides {tuple(c.stride())}")
        if self.build.heads_on_m:   # (no group scales: refused above)
            kv_desc, kpe_desc = k.mh_kv_descriptors(ckv_cache, kpe_cache)
            k.launch_heads_on_m(self.build, kv_desc, kpe_desc, q_nope, q_pe, scales, self.t, out, lse,
                                n_items=self.n_items, grid_batch=self.grid_batch,
                                num_heads=self.spec.num_heads, sm_scale=self.spec.sm_scale, merge_p=self.merge_p,
                                merge_c=self.merge_c)
            if base_e:
                lse.mul_(LN2)
            return
        kv_desc, kpe_desc = k.kv_descriptors(ckv_cache, kpe_cache)
        k.launch(self.build, kv_desc, kpe_desc, q_nope, q_pe, scales, self.t, out, lse, grid=self.grid,
                 grid_batch=self.grid_batch, max_rows=self.max_rows, num_heads=self.spec.num_heads,
                 sm_scale=self.spec.sm_scale, merge_p=self.merge_p, merge_c=self.merge_c, scale_desc=scale_desc)
        if base_e:
            lse.mul_(LN2)  # log2 -> ln


def build(layout, spec, options: dict, state: PlanState | None = None) -> GluonPlan:
    from ..kernels import sm90 as k
    if state is None:
        state = PlanState()
    opts = state.opts
    if opts is None or state.opts_from is not options:  # the wrapper's options dict: merged once
        opts = state.opts = {**DEFAULTS, **{key: v for key, v in options.items() if v is not None}}
        state.opts_from = options
    b = _named_build(spec, layout, opts, state)
    if isinstance(b, str):
        raise ValueError(f"backend 'gluon': {b}")
    device = spec.device
    buf = state.graph if spec.use_cuda_graph else None
    n_sm = buf.n_sm if buf is not None else num_sms(device)  # (the device's properties: a few us per ask)
    B = layout.batch_size
    min_tiles = max(1, int(opts["min_chunk"]) // k.TILE)
    max_qo = plan_max_qo(layout, spec, state)
    group, nhg = b.group, b.nhg
    max_hpw = k.GROUP_MAX_HPW if group else 32   # the group build: 16 rows per consumer, more head-group CTAs
    # H > 16: nhg head-group CTAs per schedule slot (adjacent in the grid, so they read the same tiles together)
    slots = max(1, n_sm // nhg)
    rows = k.padded_heads(spec.num_heads, max_qo, max_hpw)   # (heads-on-M: 64 x nhg, the same)
    mh = b.heads_on_m
    slack = aligned_slack(b)
    fixed = _invariant_chunk(opts)   # the batch-invariant cut's chunk (None: the default cut)
    h = None
    if layout.host is not None:
        # heads-on-M: one CTA per item, launched longest first (m_list, staged with the items, maps the partials)
        h = tile_items_host(layout.host, layout.page_size, num_indices=layout.kv_indices.numel(),
                            num_ctas=slots, min_tiles=min_tiles, slack=slack, longest_first=mh, fixed_chunk=fixed)
        parts = max(b - a for a, b in zip(h["m_ptr"], h["m_ptr"][1:])) if B else 1
    else:
        parts = None
    # (the mode: the merge's sizes and formula fixed, never the batch's: its sums would follow BLOCK_P)
    from ..kernels.split.merge import INVARIANT_BLOCKS, SEQ_ALWAYS
    mp, mc = INVARIANT_BLOCKS if fixed else merge_sizes(parts, B, slots, max_qo * spec.num_heads, n_sm)
    merge = dict(merge_seq=SEQ_ALWAYS) if fixed else {}   # (read by launch_merge; not a device array)
    if spec.use_cuda_graph:
        if buf is None:
            # (sized for the per-tensor variant's rows, >= the group variant's: a wrapper may plan either later)
            buf = state.graph = _GraphBuffers(opts, n_sm, device, state.external,
                                                 max(rows, k.padded_heads(spec.num_heads, max_qo)))
        buf.check(B, layout.kv_indices.numel(), rows)
        cap = buf.max_items if fixed else slots + buf.max_batch   # heads-on-M: the CTAs launched
        if h is not None:  # host lengths: schedule on the host, stage everything in one copy
            _check_items(h, buf.max_items, fixed)
            t = buf.load_host(h, layout.kv_indices)
            t.update(merge)
            return GluonPlan(spec, slots * nhg, buf.max_batch, mp, mc, t, b, max_qo * spec.num_heads, slots,
                             cap if mh else 0)
    base = dict(qo_indptr=layout.qo_indptr, kv_indptr=layout.kv_indptr, kv_indices=layout.kv_indices)
    overflow = None
    if not spec.use_cuda_graph:
        kv_len = base["kv_len"] = _device_kv_len(layout)
        cap = slots + B
        if h is not None and (mh or fixed):   # host lengths (no graph): the host schedule's items, its real count
            t = _stage_items(h, device)
            n_items = cap = len(h["item_req"])
        elif fixed:   # at most one item per request and one per chunk of the listed pages' tokens
            cap = B + -(-layout.kv_indices.numel() * layout.page_size // fixed)
            t, overflow = invariant_items_device(kv_len, fixed, slots, cap)
            n_items = cap
        else:
            t = tile_items_device(kv_len, slots, min_tiles, slack=slack, longest_first=mh)
            n_items = slots + B
        t.update(base, **merge, batch_size=torch.full((1,), B, dtype=torch.int32, device=device),
                 part_o=torch.empty(max(1, cap), rows, k.DC, dtype=torch.float32, device=device),
                 part_lse=torch.empty(max(1, cap), rows, dtype=torch.float32, device=device))
        return GluonPlan(spec, slots * nhg, max(1, B), mp, mc, t, b, max_qo * spec.num_heads, slots,
                         n_items if mh else 0, overflow)
    # the raw lengths into the buffers, then the clamp and the schedule on them, replayed from a CUDA graph per
    # shape (their ~90 small ops cost ~2.5 ms of host time per plan on an H100 host)
    t = buf.load(dict(base, kv_len=layout.kv_len, batch_size=torch.full((1,), B, dtype=torch.int32)))
    t.update(merge)
    n_idx = layout.kv_indices.numel()

    def clamp_lengths():
        lens = t["kv_len"][:B]
        lens.copy_(_clamped_kv_len(t["qo_indptr"][: B + 1], t["kv_indptr"][: B + 1], lens, layout.page_size, n_idx))
        return lens

    if fixed:   # (the mode keeps its overflow count, a tensor of this plan's own)
        overflow = invariant_items_device(clamp_lengths(), fixed, slots, buf.max_items, out=t)[1]
    else:
        buf.replay((B, n_idx, layout.page_size, slots, min_tiles, slack, mh),
                   lambda: tile_items_device(clamp_lengths(), slots, min_tiles, out=t, slack=slack, longest_first=mh))
    # (CUDA graphs: the most items any later plan of the wrapper can have, slots + max_batch (the mode: the
    # buffers' max_items) <= the buffers' max_items; CTAs past a plan's real count exit at once)
    return GluonPlan(spec, slots * nhg, buf.max_batch, mp, mc, t, b, max_qo * spec.num_heads, slots,
                     cap if mh else 0, overflow)


def _check_items(h: dict, max_items: int, fixed) -> None:
    """A host schedule's items fit the CUDA-graph buffers (the default cut always does: at most slots + batch)."""
    n = len(h["item_req"])
    if fixed is not None and n > max_items:
        raise ValueError(f"batch_invariant: this batch cuts into {n} KV chunks of <= {fixed} tokens, above the "
                         f"{max_items} work items the CUDA-graph buffers hold (max_batch_size + max_partials); "
                         "construct MLAPagedAttention with a larger max_partials")


def replan_rows(plan, layout, state: PlanState, fixed: bool = False):
    """:func:`build` for the decode runner's trusted re-plan (``MLAPagedAttention.replan_rows``: the same spec,
    options, batch size and page table as ``plan``, new host lengths, CUDA-graph buffers staged by the caller).
    While the host schedule's items are those ``plan`` was built with (``tile_items_host``'s memo: every request
    within the same 64-token tiles), the plan object is the same (its grids and merge sizes follow from the items)
    and only the staged arrays are new; otherwise :func:`build` runs (its tile_items_host hits the memo just made).
    ``fixed``: ``plan`` was captured in a CUDA graph, which replays right after any re-plan with its launch
    configuration (the grids are fixed and the merge loops over any count): the plan stays whatever the items,
    once it was built from a real schedule here (so the capture never holds the first, empty plan's merge size)."""
    from ..kernels import sm90 as k
    buf, opts = state.graph, state.opts
    if buf is None or opts is None or plan.t is not buf.buf or layout.host is None or _invariant_chunk(opts):
        return None   # (the mode: build() stages the new cut into the same buffers)
    nhg = plan.build.nhg
    h = tile_items_host(layout.host, layout.page_size, num_indices=layout.kv_indices.numel(),
                      num_ctas=max(1, buf.n_sm // nhg), min_tiles=max(1, int(opts["min_chunk"]) // k.TILE),
                      slack=aligned_slack(plan.build), longest_first=plan.build.heads_on_m)
    last = state.rows_items
    if last is not None and last[0] is plan and (fixed or last[1] is h["item_req"]):
        buf.load_host(h, layout.kv_indices)
        return plan
    plan = build(layout, plan.spec, state.opts_from, state)
    state.rows_items = (plan, h["item_req"])
    return plan


def plan_max_qo(layout, spec, state: PlanState, keep: bool = True) -> int:
    """The kernel variant's query tokens per request: 1, or the layout's max qo_len (multi-token decode). With
    CUDA graphs the launch grid and the variant are captured, so the wrapper's first plan fixes them: a later plan
    may have shorter queries (the kernel reads each request's qo_len on the device), never longer, and a wrapper
    first planned with one query per request stays there. ``keep``: a graph wrapper's first answer is recorded on
    ``state`` (False: only asked)."""
    max_qo = max(1, layout.max_qo_len or 1)
    if not spec.use_cuda_graph:
        return max_qo
    fixed = state.graph_max_qo
    if fixed is None:
        fixed = max_qo
        if keep:
            state.graph_max_qo = max_qo
    if max_qo > fixed:
        raise ValueError(f"plan: max qo_len {max_qo} exceeds the {fixed} this CUDA-graph wrapper's gluon kernel was "
                         "first planned (and captured) with; plan the longest qo_len first or use one wrapper per "
                         "qo_len")
    return fixed


def _stage_items(h: dict, device) -> dict:
    """A host schedule's work-item arrays and ``m_list`` (the merge's map to the partials) as int32 device views
    of one buffer, each 16-byte aligned as the graph buffers' are, filled by one pinned host -> device copy
    (``layout.stage_ints``)."""
    from ..layout import stage_ints, to_device
    arrays = {key: h[key] for key in ("cta_ptr", "item_req", "item_t0", "item_t1", "m_ptr", "m_list")}
    arrays["m_list"] = arrays["m_list"] or [0]
    caps = [-(-len(v) // 4) * 4 for v in arrays.values()]
    flat = to_device(stage_ints(list(zip(arrays.values(), caps))), device)
    views, o = {}, 0
    for (key, v), cap in zip(arrays.items(), caps):
        views[key] = flat[o: o + len(v)]
        o += cap
    return views


def _device_kv_len(layout) -> torch.Tensor:
    """Lengths clamped to the pages each row lists (a device-only table can never make the kernel read past them)
    and zeroed for rows without queries (engines pad those with any length), on the device."""
    return _clamped_kv_len(layout.qo_indptr, layout.kv_indptr, layout.kv_len, layout.page_size,
                           layout.kv_indices.numel())


def _clamped_kv_len(qo_indptr, kv_indptr, kv_len, page_size: int, num_indices: int) -> torch.Tensor:
    kv_len = safe_kv_len(kv_indptr, kv_len, page_size, num_indices)
    return torch.where(qo_indptr[1:] > qo_indptr[:-1], kv_len, 0).to(torch.int32)


class _GraphBuffers(GraphBuffers):
    """The gluon backend's CUDA-graph buffers (``GraphBuffers``): the work items' small arrays (each view 16-byte
    aligned, the merge list ``m_list`` among them), the page ids and the partials, sized once per wrapper."""

    def __init__(self, opts, n_sm, device, external: dict, rows: int):
        from ..kernels import sm90 as k
        self.max_batch = int(opts["max_batch_size"])
        self.max_items = n_sm + self.max_batch
        if opts.get("batch_invariant"):   # the cut follows each request's length: a capacity, not a bound
            self.max_items = self.max_batch + int(opts.get("max_partials") or INVARIANT_PARTIALS)
        self.n_sm = n_sm
        self.rows = rows   # head rows per item of the partials: fixed by the first plan's num_heads
        i32 = dict(dtype=torch.int32, device=device)
        mb, mi = self.max_batch, self.max_items
        # the arrays tile_items_host fills, the one that changes every decode step first (a caller staging them
        # through ``sink`` copies only up to the last one changed); m_list last (the identity but for a heads-on-M
        # plan's longest-first items).
        # FlashInfer's constructor kv_indices (int32) is the live tensor the kernel reads, at any size, as in
        # FlashInfer: vLLM writes page ids into its kv_indices buffer after plan(), inside the captured forward.
        super().__init__(
            dict(kv_len=mb, qo_indptr=mb + 1, kv_indptr=mb + 1, cta_ptr=n_sm + 1, item_req=mi, item_t0=mi,
                 item_t1=mi, m_ptr=mb + 1, batch_size=1, m_list=mi),
            dict(kv_indices=torch.zeros(int(opts["max_kv_indices"]), **i32),
                 part_o=torch.empty(mi, rows, k.DC, dtype=torch.float32, device=device),
                 part_lse=torch.empty(mi, rows, dtype=torch.float32, device=device)),
            device, {key: t for key, t in external.items() if key == "kv_indices"}, align=4, any_size=("kv_indices",))
        self.max_kv_indices = self.buf["kv_indices"].numel()

    def check(self, B, n_indices, rows):
        if rows > self.rows:
            raise ValueError(f"plan: num_heads needs {rows} partial rows per work item; the gluon backend's "
                             f"CUDA-graph buffers were sized for {self.rows} by the first plan (one wrapper per "
                             "head count)")
        for what, got, cap in (("batch size", B, self.max_batch), ("kv_indices entries", n_indices,
                                                                   self.max_kv_indices)):
            if got > cap:
                raise ValueError(f"plan: {what} {got} does not fit the gluon backend's CUDA-graph buffers ({cap}); "
                                 "construct MLAPagedAttention with a larger max_batch_size / max_kv_indices")
