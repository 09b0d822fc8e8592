"""The "triton" backend: the portable split-KV decode kernel (and the paged extend kernel for long query blocks).

The work items are token chunks per request (``kernels.split.chunks``: a share of the batch's tokens over about
``ctas_per_sm`` waves of the GPU's SMs, no chunk under ``min_chunk`` tokens), cut on the device from the layout's
tensors (no host read of the page table or the lengths) or, with host lengths, on the host and staged in one copy.
The grids are sized by the item bound and the kernels read the real count from device memory. A request with one
chunk is written directly; the others go through the split merge (``kernels.split.merge``).

With ``use_cuda_graph=True`` every device tensor run() touches lives in buffers allocated once (capacities from
the constructor), and plan() writes into them: a captured run() replays correctly after a re-plan.

The batch-invariant mode (option ``batch_invariant``): ``chunk`` is the constant ``invariant_chunk`` instead of a
share of the batch's tokens, the kernel configuration follows the heads and not the batch's longest query, and
every plan runs the decode kernel, so a request's work items and their order follow from its own length only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.decode import KV_BF16, KV_FP8_FP16_MATH, KV_GROUP, default_config, mla_decode
from ..kernels.split import chunk_items, chunk_items_host, items_target, max_parts, safe_kv_len
from ..runtime import LN2, interpreting, num_sms
from . import PlanState
from ._graph import GraphBuffers
from ._invariant import INVARIANT_CHUNK, INVARIANT_PARTIALS

__all__ = ["build", "DEFAULTS", "KERNEL_OPTIONS", "kernel_config"]

DEFAULTS = dict(block_n=None, num_stages=None, ctas_per_sm=2, min_chunk=256, evict_first=True, max_batch_size=256,
                max_qo_len=None, max_kv_indices=1 << 20, batch_invariant=False, invariant_chunk=INVARIANT_CHUNK,
                max_partials=INVARIANT_PARTIALS)
# Tuning options this backend reads (validated by MLAPagedAttention's constructor).
KERNEL_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm", "min_chunk", "evict_first",
                  "index64", "v_convert", "invariant_chunk")
EXTEND_MIN_QO = 9  # plans with longer query blocks run the extend (paged prefill) kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_config(num_heads: int, max_qo_len: int, kv_mode: int, opts: dict, device=None) -> dict:
    """BLOCK_M / BLOCK_N / warps / stages / V conversion for a plan: the kernel's per-GPU defaults
    (``kernels.decode.default_config``: the measured sm_90 configuration, the spill-free portable one on
    SM80/89/120), overridable through the constructor's keywords."""
    rows = num_heads * max_qo_len
    arch = None
    if device is not None and torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = major * 10 + minor
    d = default_config(rows, kv_mode, arch)
    block_m = opts.get("block_m") or d["block_m"]
    block_n = opts.get("block_n") or d["block_n"]
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v != _pow2(v) or v < 16:
            raise ValueError(f"{name}: expected a power of two >= 16, got {v}")
    v_convert = opts.get("v_convert") or d["v_convert"]
    if v_convert not in ("plain", "asm"):
        raise ValueError(f"v_convert: expected 'plain' or 'asm', got {v_convert!r}")
    return dict(block_m=block_m, block_n=block_n, evict_first=opts.get("evict_first", DEFAULTS["evict_first"]),
                index64=opts.get("index64"), v_convert=v_convert,
                num_warps=opts.get("num_warps") or (d["num_warps"] if not opts.get("block_m")
                                                    else (4 if block_m <= 16 else 8)),
                num_stages=opts.get("num_stages") or d["num_stages"])


def _kv_mode(spec) -> int:
    fmt = spec.kv_format
    if fmt.scale_kind == "group":
        return KV_GROUP
    return KV_BF16 if fmt.storage_dtype == torch.bfloat16 else KV_FP8_FP16_MATH


def check_dims(spec) -> None:
    for name, d in (("head_dim_ckv", spec.head_dim_ckv), ("head_dim_kpe", spec.head_dim_kpe)):
        if d != _pow2(d) or d < 16:
            raise ValueError(f"{name}: the triton backend needs a power of two >= 16, got {d}; "
                             "use backend='torch'")


@dataclass
class TritonPlan:
    spec: object
    kv_mode: int
    cfg: dict
    max_rows: int
    grid_items: int
    grid_batch: int
    t: dict             # device tensors the kernels read
    extend_qo: int = 0  # > 0: run the extend kernel with this max_qo_len instead of the decode kernel
    # batch-invariant plans scheduled on the device: int32 [1], requests that did not fit the workspace and ran
    # as one item (see kernels.split.chunk_items); None otherwise
    overflow: object = None
    invariant: bool = False   # the batch-invariant mode: the merge's sequential formula for every request

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e: bool) -> None:
        t, c, spec = self.t, self.cfg, self.spec
        if self.extend_qo:
            from ..kernels.extend import mla_extend
            mla_extend(q_nope, q_pe, ckv_cache, kpe_cache, t["qo_indptr"], t["kv_indptr"], t["kv_indices"],
                       t["kv_len"], out, lse, sm_scale=spec.sm_scale, causal=spec.causal, scales=scales,
                       ckv_scale_arr=ckv_scale_arr, max_qo_len=self.extend_qo, fp32_dot=interpreting())
        else:
            mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale_arr, scales, out, lse, t["part_o"],
                       t["part_lse"], t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"],
                       t["item_req"], t["item_start"], t["item_end"], t["item_part"], t["num_items"],
                       t["split_indptr"], t["batch_size"], grid_items=self.grid_items,
                       grid_batch=self.grid_batch, num_heads=spec.num_heads, max_rows=self.max_rows,
                       sm_scale=spec.sm_scale, causal=spec.causal, kv_mode=self.kv_mode, block_m=c["block_m"],
                       block_n=c["block_n"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                       fp32_dot=interpreting(), evict_first=c["evict_first"], index64=c["index64"],
                       v_convert=c["v_convert"], invariant_merge=self.invariant,
                       q_split=self.kv_mode == KV_GROUP or (self.kv_mode == KV_BF16
                                                            and spec.q_dtype == torch.float16))
        if base_e:
            lse.mul_(LN2)  # log2 -> ln


def build(layout, spec, options: dict, state: PlanState | None = None) -> TritonPlan:
    check_dims(spec)
    if state is None:
        state = PlanState()
    opts = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    kv_mode = _kv_mode(spec)
    H, Dc, device = spec.num_heads, spec.head_dim_ckv, spec.device
    B = layout.batch_size
    graph = spec.use_cuda_graph
    plan_qo = layout.max_qo_len
    if plan_qo is None:  # device-only qo_indptr (MLAPagedAttention reads it on the host; others may not)
        plan_qo = int((layout.qo_indptr[1:] - layout.qo_indptr[:-1]).max()) if B else 0
    if graph:
        buffers = state.graph
        max_qo = buffers.max_qo if buffers is not None else (opts["max_qo_len"] or max(1, plan_qo))
        if plan_qo > max_qo:
            raise ValueError(f"qo_indptr: a request has {plan_qo} query tokens, above the {max_qo} the CUDA-graph "
                             "buffers were sized for (by the first plan's longest request); construct "
                             f"MLAPagedAttention with max_qo_len={plan_qo} (or more) to plan longer ones")
    else:
        max_qo = max(1, plan_qo)
    # The extend kernel rounds dequantized K/V to the query dtype: fine for FP8 and same-dtype pools, but the
    # group format and an fp16 pool under bf16 queries lose bits there; those plans stay on the decode kernel,
    # which handles any query length (taller row tiles, exact numerics).
    fmt = spec.kv_format
    extend_ok = fmt.scale_kind != "group" and not (fmt.storage_dtype == torch.float16
                                                    and spec.q_dtype == torch.bfloat16)
    # The batch-invariant mode: one kernel configuration per heads / format / device / options (the tile a row is
    # computed in never follows the batch's longest query), every plan on the decode kernel, each request cut in
    # chunks of a fixed size (its own length decides its cut; partials merged in item order).
    invariant = bool(opts["batch_invariant"])
    fixed = opts["invariant_chunk"] if invariant else None
    extend_qo = plan_qo if extend_ok and not graph and not invariant and plan_qo >= EXTEND_MIN_QO else 0
    # CUDA-graph wrappers re-plan every step: the config and split target (which ask the device's properties, a few
    # microseconds each) are kept for the same heads / query rows / format / options
    ck = (H, max_qo, kv_mode, extend_qo, device)
    kept = state.config if graph else None
    if kept is not None and kept[0] == ck and kept[1] is options:
        cfg, max_rows, target = kept[2:]
    else:
        cfg = kernel_config(H, 1 if invariant else max_qo, kv_mode, opts, device)
        max_rows = 0 if extend_qo else H * max_qo
        row_tiles = -(-max_rows // cfg["block_m"]) if max_rows else 1
        target = items_target(row_tiles, num_sms(device), opts["ctas_per_sm"])
        if graph:
            state.config = (ck, options, cfg, max_rows, target)
    base = dict(qo_indptr=layout.qo_indptr, kv_indptr=layout.kv_indptr, kv_indices=layout.kv_indices)
    if extend_qo:
        kv_len = safe_kv_len(layout.kv_indptr, layout.kv_len, layout.page_size, layout.kv_indices.numel())
        return TritonPlan(spec, kv_mode, cfg, 0, 1, 1, dict(base, kv_len=kv_len), extend_qo)
    if graph:
        buffers = state.graph
        if buffers is None:
            buffers = state.graph = _GraphBuffers(opts, H, Dc, max_qo, device, target, state.external)
        buffers.check(H, Dc, H * max_qo, B, layout.kv_indices.numel())
        if layout.host is not None:  # host lengths: schedule on the host, stage everything in one copy
            rule = (target, cfg["block_n"], opts["min_chunk"], fixed)
            sched = _host_schedule(layout, rule, buffers.max_items)
            t = buffers.load_host(sched, layout.kv_indices)
            plan = TritonPlan(spec, kv_mode, cfg, buffers.max_rows, buffers.max_items, buffers.max_batch, t,
                              invariant=invariant)
            state.host_plan = (plan, rule)  # for replan_rows
            return plan
        # the raw lengths into the buffers, then the schedule on them (it clamps them in place), replayed from a
        # CUDA graph per shape: its ~60 small ops cost ~1.2 ms of host time per plan on an H100 host
        t = buffers.load(dict(base, kv_len=layout.kv_len, batch_size=torch.full((1,), B, dtype=torch.int32)))
        n_idx, got = layout.kv_indices.numel(), {}

        def device_schedule():
            sched = chunk_items(t["qo_indptr"][: B + 1], t["kv_indptr"][: B + 1], t["kv_len"][:B],
                                layout.page_size, num_indices=n_idx, target=target, max_items=buffers.max_items,
                                block_n=cfg["block_n"], min_chunk=opts["min_chunk"], fixed_chunk=fixed)
            got["overflow"] = sched.pop("overflow", None)
            for name, v in sched.items():
                t[name][: v.numel()].copy_(v)

        if fixed is None:
            buffers.replay((B, n_idx, layout.page_size, target, cfg["block_n"], opts["min_chunk"]), device_schedule)
        else:   # the batch-invariant mode keeps its overflow count, a tensor of this plan's own
            device_schedule()
        plan = TritonPlan(spec, kv_mode, cfg, buffers.max_rows, buffers.max_items, buffers.max_batch, t,
                          invariant=invariant)
        plan.overflow = got.get("overflow") if fixed is not None else None
        return plan
    max_items = target + B
    if invariant:  # every request's chunks: at most one per request plus one per chunk of the listed pages' tokens
        max_items = B + -(-layout.kv_indices.numel() * layout.page_size // fixed)
    overflow = None
    if layout.host is not None:  # host lengths: schedule on the host, one host -> device copy
        h = _host_schedule(layout, (target, cfg["block_n"], opts["min_chunk"], fixed), max_items)
        if invariant:
            max_items = h["num_items"][0]
        sizes = dict(item_req=max(1, max_items), split_indptr=B + 1, num_items=1, kv_len=B, batch_size=1)
        sched = _stage({k: (h[k], sizes.get(k, sizes["item_req"])) for k in _HOST_KEYS}, device)
    else:
        sched = chunk_items(layout.qo_indptr, layout.kv_indptr, layout.kv_len, layout.page_size,
                         num_indices=layout.kv_indices.numel(), target=target, max_items=max_items,
                         block_n=cfg["block_n"], min_chunk=opts["min_chunk"], fixed_chunk=fixed)
        overflow = sched.pop("overflow", None)
        sched["batch_size"] = torch.full((1,), B, dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    parts = max(1, max_items) if invariant else max_parts(target, max_items)
    t = dict(base, **sched, part_o=torch.empty(parts, max_rows, Dc, **f32),
             part_lse=torch.empty(parts, max_rows, **f32))
    plan = TritonPlan(spec, kv_mode, cfg, max_rows, max(1, max_items), max(1, B), t, invariant=invariant)
    plan.overflow = overflow
    return plan


def _host_schedule(layout, rule: tuple, max_items: int) -> dict:
    """``kernels.split.chunk_items_host`` under ``rule`` = (target, block_n, min_chunk, fixed_chunk); a
    batch-invariant cut (fixed_chunk set) that needs more than ``max_items`` work items is refused, naming the
    capacity."""
    target, block_n, min_chunk, fixed = rule
    h = chunk_items_host(layout.host, layout.page_size, num_indices=layout.kv_indices.numel(), target=target,
                      block_n=block_n, min_chunk=min_chunk, fixed_chunk=fixed)
    if fixed is not None and h["num_items"][0] > max_items:
        raise ValueError(f"batch_invariant: this batch cuts into {h['num_items'][0]} KV chunks of <= {fixed} tokens, "
                         f"above the {max_items} work items the CUDA-graph buffers hold (max_batch_size + "
                         "max_partials); construct MLAPagedAttention with a larger max_partials")
    return h


def replan_rows(plan, layout, state: PlanState, fixed: bool = False):
    """:func:`build` for the decode runner's trusted re-plan (``MLAPagedAttention.replan_rows``: the same spec,
    options, batch size and page table as ``plan``, new host lengths): only the host schedule is new, the plan
    object (config, grids, CUDA-graph buffers) is the same (``fixed``, a captured plan: the same either way). None
    when ``plan`` is not the last host-scheduled graph plan (then :func:`build` runs)."""
    kept = state.host_plan
    if kept is None or kept[0] is not plan or layout.host is None:
        return None
    sched = _host_schedule(layout, kept[1], state.graph.max_items)
    state.graph.load_host(sched, layout.kv_indices)
    return plan


# The schedule's arrays a host-scheduled plan stages (item arrays first: their capacity is the largest).
_HOST_KEYS = ("item_req", "item_start", "item_end", "item_part", "split_indptr", "num_items", "kv_len", "batch_size")


def _stage(arrays: dict, device) -> dict:
    """``{name: (list of ints, capacity)}`` -> int32 device views of one buffer, filled by one host -> device copy
    (zero-padded to each capacity)."""
    from ..layout import to_device
    flat, where = [], {}
    for k, (vals, cap) in arrays.items():
        where[k] = (len(flat), cap)
        flat += vals
        flat += [0] * (cap - len(vals))
    d = to_device(torch.tensor(flat, dtype=torch.int32), device)
    return {k: d[o: o + n] for k, (o, n) in where.items()}


class _GraphBuffers(GraphBuffers):
    """The triton backend's CUDA-graph buffers (``GraphBuffers``): the split schedule's small arrays, the page ids
    and the partials, sized by the constructor's capacities."""

    def __init__(self, opts, H, Dc, max_qo, device, target, external: dict):
        self.H, self.Dc, self.max_qo = H, Dc, max_qo
        self.max_batch = opts["max_batch_size"]
        self.max_rows = H * max_qo
        self.max_items = target + self.max_batch
        parts = max_parts(target, self.max_items)
        if opts["batch_invariant"]:  # the cut follows each request's length: a capacity, not a bound from the GPU
            self.max_items = parts = self.max_batch + opts["max_partials"]
        self.max_kv_indices = opts["max_kv_indices"]
        mb, mi = self.max_batch, self.max_items
        # the arrays that change every decode step first (a caller staging them through ``sink`` copies only up
        # to the last one changed: kv_len and item_end while the splits stay, see kernels.split.chunk_items_host)
        super().__init__(
            dict(kv_len=mb, item_end=mi, qo_indptr=mb + 1, kv_indptr=mb + 1, split_indptr=mb + 1, num_items=1,
                 batch_size=1, item_req=mi, item_start=mi, item_part=mi),
            dict(kv_indices=torch.zeros(max(1, self.max_kv_indices), dtype=torch.int32, device=device),
                 part_o=torch.empty(parts, self.max_rows, Dc, dtype=torch.float32, device=device),
                 part_lse=torch.empty(parts, self.max_rows, dtype=torch.float32, device=device)),
            device, external)

    def check(self, H, Dc, rows, B, n_indices):
        for what, got, cap in (("num_heads", H, self.H), ("head_dim_ckv", Dc, self.Dc),
                               ("batch size", B, self.max_batch), ("kv_indices entries", n_indices,
                                                                   self.max_kv_indices),
                               ("query rows", rows, self.max_rows)):
            if (got != cap) if what in ("num_heads", "head_dim_ckv") else (got > cap):
                raise ValueError(f"plan: {what} {got} does not fit the CUDA-graph buffers ({cap}); construct "
                                 "MLAPagedAttention with larger buffers (max_batch_size / max_qo_len / "
                                 "max_kv_indices, or FlashInfer's qo_indptr= / kv_indices= buffers)")
