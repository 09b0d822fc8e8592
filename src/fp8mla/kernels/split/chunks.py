"""Token chunks per request: the Triton dense kernel's work items (and the torch backend's batch-invariant cut).

Every request's tokens are cut into chunks of at most ``chunk`` tokens (a multiple of BLOCK_N), balanced within
the request: ``n = ceil(L / chunk)`` chunks of ``per = ceil(L / n)`` rounded up to the block (the last the rest).
The default mode takes ``chunk = max(min_chunk, ceil(total tokens / items_target))`` with ``items_target`` about
``ctas_per_sm`` waves of the GPU's SMs over the row tiles; no chunk is shorter than ``min_chunk`` tokens, since
each split costs one fp32 partial (the size of ~57 FP8 tokens at H=16) and a merge. The number of work items is
then at most ``items_target + B``. The batch-invariant mode takes a constant ``chunk`` (``fixed_chunk``): each
request's cut follows its own length only (``chunk_bounds`` is the same cut for one request).

Two variants give the same items: ``chunk_items`` on the device from the layout's tensors (no host read, CUDA-graph
re-plans) and ``chunk_items_host`` in O(batch) Python from host lengths (staged in one copy).
"""
from __future__ import annotations

from operator import sub

import torch


def chunk_bounds(L: int, chunk: int, block: int = 64) -> list:
    """[(start, end)] of a request of ``L`` tokens: ceil(L / chunk) chunks of one size (a multiple of ``block``,
    the last the rest), as :func:`chunk_items` cuts it with ``fixed_chunk``."""
    n = -(-L // chunk)
    per = -(-(-(-L // n)) // block) * block
    return [(s, min(L, s + per)) for s in range(0, L, per)]


def items_target(row_tiles: int, n_sm: int, ctas_per_sm: int) -> int:
    """Work items the default cut aims at: ``ctas_per_sm`` waves of the GPU's ``n_sm`` SMs over the row tiles."""
    return max(1, (n_sm * ctas_per_sm) // max(1, row_tiles))


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


def chunk_items(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_len: torch.Tensor, page_size: int, *,
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


def chunk_items_host(host: dict, page_size: int, *, num_indices: int, target: int, block_n: int,
                  min_chunk: int, fixed_chunk: int | None = None) -> dict:
    """:func:`chunk_items` on the host, in O(batch) Python, from the layout's host arrays (``PagedLayout.host``):
    the same work items (its first ``num_items`` entries; the kernels read no further), as lists of ints.
    It costs no device op: the plan stages these with its other arrays in one host -> device copy.
    ``fixed_chunk``: the batch-invariant cut (see :func:`chunk_items`; the caller checks the item count)."""
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


_LAST_SPLIT = None  # chunk_items_host's last split schedule with its ranges (see there)


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
