"""The "triton" backend: the portable split-KV decode kernel (and the paged extend kernel for long query blocks).

Scheduling runs on the device, from the layout's device tensors, so plan() never reads the page table or the
lengths on the host: every request's tokens are cut into chunks of at most ``chunk`` tokens (a multiple of
BLOCK_N), with ``chunk = max(min_chunk, ceil(total tokens / items_target))`` and ``items_target`` about
``ctas_per_sm`` waves of the GPU's SMs over the row tiles; no chunk is shorter than ``min_chunk`` tokens, since
each split costs one fp32 partial (the size of ~57 FP8 tokens at H=16) and a merge. The number of work items is
then at most ``items_target + B``: the grids are sized by that bound and the kernels read the real count from
device memory. A request with one chunk is written directly; the others go through the merge kernel.

With ``use_cuda_graph=True`` every device tensor run() touches lives in buffers allocated once (capacities from
the constructor), and plan() writes into them: a captured run() replays correctly after a re-plan.

The batch-invariant mode (option ``batch_invariant``): ``chunk`` is the constant ``invariant_chunk`` instead of a
share of the batch's tokens, the kernel configuration follows the heads and not the batch's longest query, and
every plan runs the decode kernel, so a request's work items and their order follow from its own length only.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import sub

import torch

from ..kernels.decode import KV_BF16, KV_FP8_FP16_MATH, KV_GROUP, default_config, mla_decode
from ..runtime import LN2, interpreting, num_sms
from ._graph import GraphBuffers
from ._invariant import INVARIANT_CHUNK, INVARIANT_PARTIALS

__all__ = ["build", "DEFAULTS", "KERNEL_OPTIONS", "schedule", "kernel_config"]

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


def items_target(row_tiles: int, device, ctas_per_sm: int) -> int:
    return max(1, (num_sms(device) * ctas_per_sm) // max(1, row_tiles))


def max_parts(target: int, max_items: int) -> int:
    """Partials a schedule can write: only split requests write them, and each has more tokens than a chunk
    (>= total / target), so at most ``target`` such requests with ``tokens / chunk + 1`` parts each: <= 2 target.
    The fp32 partial buffers follow the GPU's size, not the batch's."""
    return max(1, min(max_items, 2 * target))


def safe_kv_len(kv_indptr: torch.Tensor, kv_len: torch.Tensor, page_size: int, num_indices: int) -> torch.Tensor:
    """int32 ``[B]``: each kv_len clamped to the pages its row lists and to the page ids that exist
    (``num_indices``, a host number), on the device. A device-only table that claims more tokens than it holds
    can never make a kernel read past its pages (``FP8MLA_CHECK=1`` refuses such a table instead)."""
    B = kv_len.numel()
    start = kv_indptr[:B].long()
    pages = torch.minimum(kv_indptr[1: B + 1].long(), torch.full_like(start, num_indices)) - start
    return torch.minimum(kv_len.long(), pages.clamp(min=0) * page_size).clamp(min=0).to(torch.int32)


def schedule(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_len: torch.Tensor, page_size: int, *,
             num_indices: int, target: int, max_items: int, block_n: int, min_chunk: int,
             fixed_chunk: int | None = None) -> dict:
    """Work items on the device (no host sync): ``item_req/start/end/part [max_items]``, ``split_indptr [B+1]``,
    ``num_items [1]`` and ``kv_len`` clamped to each request's pages (a device-only table that claims more tokens
    than its pages can never make a kernel read past them). int32 tensors on kv_len's device.

    ``fixed_chunk`` (the batch-invariant mode): the chunk size is this constant, not a share of the batch's
    tokens, so each request's cut depends on its own length only. Its item count is then not bounded by
    ``target``: a request whose items would pass ``max_items`` runs as one item instead (never a read past the
    arrays), and ``overflow [1]`` counts such requests."""
    dev = kv_len.device
    B = kv_len.numel()
    i64 = dict(dtype=torch.int64, device=dev)
    L = safe_kv_len(kv_indptr, kv_len, page_size, num_indices).long()
    active = (qo_indptr[1: B + 1] - qo_indptr[:B]) > 0
    if fixed_chunk is None:
        total = (L * active).sum()
        chunk = torch.clamp(torch.div(total + target - 1, target, rounding_mode="floor"), min=min_chunk)
        chunk = torch.div(chunk + block_n - 1, block_n, rounding_mode="floor") * block_n
    else:
        chunk = torch.full((), -(-fixed_chunk // block_n) * block_n, **i64)
    n = torch.clamp(torch.div(L + chunk - 1, chunk, rounding_mode="floor"), min=1)
    per = torch.div(torch.div(L + n - 1, n, rounding_mode="floor") + block_n - 1, block_n,
                    rounding_mode="floor") * block_n
    per = torch.where(L > 0, per, torch.ones_like(per))
    cnt = torch.where(L > 0, torch.div(L + per - 1, per, rounding_mode="floor"), torch.ones_like(L)) * active
    split_indptr = torch.zeros(B + 1, **i64)
    torch.cumsum(cnt, 0, out=split_indptr[1:])
    overflow = torch.zeros(1, **i64)
    if fixed_chunk is not None:
        # Requests past the capacity (only where the batch holds more tokens than the workspace was sized for):
        # one item each, whole (correct, but not the invariant cut; counted in ``overflow``).
        late = split_indptr[1:] > max_items - (B - torch.arange(1, B + 1, **i64))
        over = late & (cnt > 1)
        overflow = over.sum().reshape(1)
        per = torch.where(over, torch.clamp(L, min=1), per)
        cnt = torch.where(over, torch.ones_like(cnt) * active, cnt)
        torch.cumsum(cnt, 0, out=split_indptr[1:])
    multi = cnt > 1
    part_base = torch.zeros(B + 1, **i64)
    torch.cumsum(cnt * multi, 0, out=part_base[1:])
    i = torch.arange(max_items, **i64)
    if B:
        req = torch.searchsorted(split_indptr[1:], i, right=True).clamp(max=B - 1)
        local = i - split_indptr[req]
        start = local * per[req]
        end = torch.minimum(L[req], start + per[req])
        part = torch.where(multi[req], part_base[req] + local, torch.full_like(local, -1))
    else:
        req = start = end = torch.zeros_like(i)
        part = torch.full_like(i, -1)
    i32 = torch.int32
    out = dict(item_req=req.to(i32), item_start=start.to(i32), item_end=end.to(i32), item_part=part.to(i32),
               split_indptr=split_indptr.to(i32), num_items=split_indptr[B:].to(i32), kv_len=L.to(i32))
    if fixed_chunk is not None:
        out["overflow"] = overflow.to(i32)
    return out


def schedule_host(host: dict, page_size: int, *, num_indices: int, target: int, block_n: int,
                  min_chunk: int, fixed_chunk: int | None = None) -> dict:
    """:func:`schedule` on the host, in O(batch) Python, from the layout's host arrays (``PagedLayout.host``):
    the same work items (its first ``num_items`` entries; the kernels read no further), as lists of ints.
    It costs no device op: the plan stages these with its other arrays in one host -> device copy.
    ``fixed_chunk``: the batch-invariant cut (see :func:`schedule`; the caller checks the item count)."""
    fast = host.get("lists")  # PagedLayout.decode_rows: lengths within their rows, one query per row
    if fast is not None and fast[1][-1] <= num_indices:
        qo, kvp, L = fast
        B = len(L)
        active, total = [True] * B, sum(L)
    else:
        qo, kvp, L, active, total = _clamped(host, page_size, num_indices)
        B = len(L)
    chunk = max(-(-total // target), min_chunk) if fixed_chunk is None else fixed_chunk
    chunk = -(-chunk // block_n) * block_n
    if all(active) and max(L, default=0) <= chunk:  # no request is split: one item each, built whole
        req, start, end, part, split = list(range(B)), [0] * B, list(L), [-1] * B, list(range(B + 1))
        return dict(qo_indptr=qo, kv_indptr=kvp, item_req=req, item_start=start, item_end=end, item_part=part,
                    split_indptr=split, num_items=[B], kv_len=L, batch_size=[B])
    # A decode step makes each length longer: while every request keeps its split (chunks and their size), the
    # items are the last schedule's but for each request's last end. Each request's longest length with the same
    # split is kept with the items (all rows active only; the lists are shared with that call's result: read only).
    key = (target, block_n, min_chunk, chunk, B)
    last = _LAST_SPLIT
    if last is not None and last[0] == key and min(map(sub, L, last[1])) >= 0 >= max(map(sub, L, last[2])) \
            and all(active):
        end = last[5][:]
        for i, n in zip(last[7], L):
            end[i] = n
        return dict(qo_indptr=qo, kv_indptr=kvp, item_req=last[3], item_start=last[4], item_end=end,
                    item_part=last[6], split_indptr=last[8], num_items=[last[8][-1]], kv_len=L, batch_size=[B])
    # (this loop runs every decode step that changes a split: few operations per request, splits in 2 or 3 inline)
    split, req, start, end, part = [0], [], [], [], []
    hi = []   # each request's longest length with the same split
    n_items = n_parts = 0
    for b, n in enumerate(L):
        if not active[b]:
            split.append(n_items)
            hi.append(n)
            continue
        if n > chunk:  # split in c chunks of per tokens (a multiple of block_n); every chunk but the last full
            k = -(-n // chunk)
            per = -(-(-(-n // k)) // block_n) * block_n
            c = -(-n // per)
            if c == 2:
                req += (b, b)
                start += (0, per)
                end += (per, n)
                part += (n_parts, n_parts + 1)
            elif c == 3:
                req += (b, b, b)
                start += (0, per, 2 * per)
                end += (per, 2 * per, n)
                part += (n_parts, n_parts + 1, n_parts + 2)
            else:
                req += [b] * c
                start += range(0, c * per, per)
                end += range(per, c * per, per)
                end.append(n)
                part += range(n_parts, n_parts + c)
            # the same k up to k*chunk, the same per up to k*per, the same c up to c*per (<= k*per: c <= k)
            x, y = k * chunk, c * per
            hi.append(x if x < y else y)
            n_parts += c
            n_items += c
        else:
            req.append(b)
            start.append(0)
            end.append(n)
            part.append(-1)
            hi.append(chunk)
            n_items += 1
        split.append(n_items)
    if all(active):  # (kept with the lengths: a later length must be >= these and <= hi)
        _keep_split((key, list(L), hi, req, start, end[:], part, [x - 1 for x in split[1:]], split))
    return dict(qo_indptr=qo, kv_indptr=kvp, item_req=req, item_start=start, item_end=end, item_part=part,
                split_indptr=split, num_items=[split[-1]], kv_len=L, batch_size=[B])


_LAST_SPLIT = None  # schedule_host's last split schedule with its ranges (see there)


def _keep_split(entry: tuple) -> None:
    global _LAST_SPLIT
    _LAST_SPLIT = entry  # (one tuple: a concurrent reader sees all or none)


def _clamped(host: dict, page_size: int, num_indices: int):
    """(qo_indptr, kv_indptr, lengths, active rows, tokens of active rows): ``safe_kv_len`` and the rows with
    queries, from the layout's host arrays (one pass: this runs every decode step)."""
    qo, kvp, lens = (host[k].tolist() for k in ("qo_indptr", "kv_indptr", "kv_len"))
    L, active, total = [], [], 0
    for b in range(len(lens)):
        n = lens[b]
        cap = (min(kvp[b + 1], num_indices) - kvp[b]) * page_size
        n = n if n <= cap else cap
        n = n if n > 0 else 0
        L.append(n)
        a = qo[b + 1] > qo[b]
        active.append(a)
        if a:
            total += n
    return qo, kvp, L, active, total


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
    # as one item (see schedule); None otherwise
    overflow: object = None

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
                       v_convert=c["v_convert"],
                       q_split=self.kv_mode == KV_GROUP or (self.kv_mode == KV_BF16
                                                            and spec.q_dtype == torch.float16))
        if base_e:
            lse.mul_(LN2)  # log2 -> ln


def build(layout, spec, options: dict, state: dict) -> TritonPlan:
    check_dims(spec)
    opts = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    kv_mode = _kv_mode(spec)
    H, Dc, device = spec.num_heads, spec.head_dim_ckv, spec.device
    B = layout.batch_size
    graph = spec.use_cuda_graph
    plan_qo = layout.max_qo_len
    if plan_qo is None:  # device-only qo_indptr (MLAPagedAttention reads it on the host; others may not)
        plan_qo = int((layout.qo_indptr[1:] - layout.qo_indptr[:-1]).max()) if B else 0
    if graph:
        buffers = state.get("graph")
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
    kept = state.get("config") if graph else None
    if kept is not None and kept[0] == ck and kept[1] is options:
        cfg, max_rows, target = kept[2:]
    else:
        cfg = kernel_config(H, 1 if invariant else max_qo, kv_mode, opts, device)
        max_rows = 0 if extend_qo else H * max_qo
        row_tiles = -(-max_rows // cfg["block_m"]) if max_rows else 1
        target = items_target(row_tiles, device, opts["ctas_per_sm"])
        if graph:
            state["config"] = (ck, options, cfg, max_rows, target)
    base = dict(qo_indptr=layout.qo_indptr, kv_indptr=layout.kv_indptr, kv_indices=layout.kv_indices)
    if extend_qo:
        kv_len = safe_kv_len(layout.kv_indptr, layout.kv_len, layout.page_size, layout.kv_indices.numel())
        return TritonPlan(spec, kv_mode, cfg, 0, 1, 1, dict(base, kv_len=kv_len), extend_qo)
    if graph:
        buffers = state.get("graph")
        if buffers is None:
            buffers = state["graph"] = _GraphBuffers(opts, H, Dc, max_qo, device, target,
                                                     state.get("external", {}))
        buffers.check(H, Dc, H * max_qo, B, layout.kv_indices.numel())
        if layout.host is not None:  # host lengths: schedule on the host, stage everything in one copy
            rule = (target, cfg["block_n"], opts["min_chunk"], fixed)
            sched = _host_schedule(layout, rule, buffers.max_items)
            t = buffers.load_host(sched, layout.kv_indices)
            plan = TritonPlan(spec, kv_mode, cfg, buffers.max_rows, buffers.max_items, buffers.max_batch, t)
            state["host_plan"] = (plan, rule)  # for replan_rows
            return plan
        # the raw lengths into the buffers, then the schedule on them (it clamps them in place), replayed from a
        # CUDA graph per shape: its ~60 small ops cost ~1.2 ms of host time per plan on an H100 host
        t = buffers.load(dict(base, kv_len=layout.kv_len, batch_size=torch.full((1,), B, dtype=torch.int32)))
        n_idx, got = layout.kv_indices.numel(), {}

        def device_schedule():
            sched = schedule(t["qo_indptr"][: B + 1], t["kv_indptr"][: B + 1], t["kv_len"][:B], layout.page_size,
                             num_indices=n_idx, target=target, max_items=buffers.max_items,
                             block_n=cfg["block_n"], min_chunk=opts["min_chunk"], fixed_chunk=fixed)
            got["overflow"] = sched.pop("overflow", None)
            for name, v in sched.items():
                t[name][: v.numel()].copy_(v)

        if fixed is None:
            buffers.replay((B, n_idx, layout.page_size, target, cfg["block_n"], opts["min_chunk"]), device_schedule)
        else:   # the batch-invariant mode keeps its overflow count, a tensor of this plan's own
            device_schedule()
        plan = TritonPlan(spec, kv_mode, cfg, buffers.max_rows, buffers.max_items, buffers.max_batch, t)
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
        sched = schedule(layout.qo_indptr, layout.kv_indptr, layout.kv_len, layout.page_size,
                         num_indices=layout.kv_indices.numel(), target=target, max_items=max_items,
                         block_n=cfg["block_n"], min_chunk=opts["min_chunk"], fixed_chunk=fixed)
        overflow = sched.pop("overflow", None)
        sched["batch_size"] = torch.full((1,), B, dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    parts = max(1, max_items) if invariant else max_parts(target, max_items)
    t = dict(base, **sched, part_o=torch.empty(parts, max_rows, Dc, **f32),
             part_lse=torch.empty(parts, max_rows, **f32))
    plan = TritonPlan(spec, kv_mode, cfg, max_rows, max(1, max_items), max(1, B), t)
    plan.overflow = overflow
    return plan


def _host_schedule(layout, rule: tuple, max_items: int) -> dict:
    """:func:`schedule_host` under ``rule`` = (target, block_n, min_chunk, fixed_chunk); a batch-invariant cut
    (fixed_chunk set) that needs more than ``max_items`` work items is refused, naming the capacity."""
    target, block_n, min_chunk, fixed = rule
    h = schedule_host(layout.host, layout.page_size, num_indices=layout.kv_indices.numel(), target=target,
                      block_n=block_n, min_chunk=min_chunk, fixed_chunk=fixed)
    if fixed is not None and h["num_items"][0] > max_items:
        raise ValueError(f"batch_invariant: this batch cuts into {h['num_items'][0]} KV chunks of <= {fixed} tokens, "
                         f"above the {max_items} work items the CUDA-graph buffers hold (max_batch_size + "
                         "max_partials); construct MLAPagedAttention with a larger max_partials")
    return h


def replan_rows(plan, layout, state: dict, fixed: bool = False):
    """:func:`build` for the decode runner's trusted re-plan (``MLAPagedAttention.replan_rows``: the same spec,
    options, batch size and page table as ``plan``, new host lengths): only the host schedule is new, the plan
    object (config, grids, CUDA-graph buffers) is the same (``fixed``, a captured plan: the same either way). None
    when ``plan`` is not the last host-scheduled graph plan (then :func:`build` runs)."""
    kept = state.get("host_plan")
    if kept is None or kept[0] is not plan or layout.host is None:
        return None
    sched = _host_schedule(layout, kept[1], state["graph"].max_items)
    state["graph"].load_host(sched, layout.kv_indices)
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
        # to the last one changed: kv_len and item_end while the splits stay, see schedule_host)
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
