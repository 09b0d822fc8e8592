"""The gluon backend's host schedule (``schedule_host``): ``sm90.schedule_device``'s work items made in O(batch)
Python from a layout's host lengths, for plans the gluon backend stages in one copy (the decode runner's path),
with a memo of the last schedule (``_LAST_ITEMS``: clear it here, not on ``gluon``); and the split merge's block
sizes from a schedule's partials (``merge_sizes``). Host lists only: no tensors are made here. (The Triton
backend's own host schedule is ``triton.schedule_host``.)"""
from __future__ import annotations


# One CTA per item (``longest_first``): the aligned cut's rule and its constants are the device schedule's
# (``sm90.longest_first_slack``, ``BALANCE``, ``ONE_WAVE_SLACK``), so both schedules give the same items.


def schedule_host(host: dict, page_size: int, *, num_indices: int, num_ctas: int, min_tiles: int,
                  aligned: bool = True, slack: int | None = None, longest_first: bool = False) -> dict:
    """``sm90.schedule_device`` on the host, in O(batch + CTAs) Python, from the layout's host arrays
    (``PagedLayout.host``): the same lengths (clamped to each row's pages, 0 for rows without queries) and the same
    work items, as lists of ints (the items' first ``m_ptr[-1]`` entries: the kernels read no further; ``m_list``
    the identity unless ``longest_first``). The plan stages them in one host -> device copy.

    ``longest_first`` (a build that launches one CTA per item: heads-on-M, plain or into CUDA-graph buffers): the
    aligned cut only where it is nearly balanced (``sm90.longest_first_slack``; ``slack`` is then ignored), else
    the contiguous cut, and the items reordered longest first (``_longest_first``), with ``m_list`` the merge's map
    to their new places."""
    global _LAST_ITEMS
    from ..kernels.sm90 import ALIGNED_SLACK, TILE, aligned_lists, aligned_pieces, longest_first_slack
    slack = ALIGNED_SLACK if slack is None else slack   # (``aligned_slack``: the heads-on-M build's is unbounded)
    fast = host.get("lists")  # PagedLayout.decode_rows: lengths within their rows, one query per row
    if fast is not None and fast[1][-1] <= num_indices:
        qo, kvp, L = fast
        B = len(L)
        ntiles = [(n + TILE - 1) // TILE for n in L]
    else:
        qo, kvp, L, ntiles = _clamped(host, page_size, num_indices, TILE)
        B = len(L)
    # The items depend on the tiles only: a decode step whose requests all stay within their 64-token tiles (most
    # steps of a small or uniform batch; ~1/3 of B=64 steps with spread lengths) reuses the last schedule's lists
    # (shared with that call's result: read only)
    key = (num_ctas, min_tiles, aligned, slack, longest_first)
    last = _LAST_ITEMS
    if last is not None and last[0] == key and last[1] == ntiles:
        return dict(qo_indptr=qo, kv_indptr=kvp, kv_len=L, **last[2], batch_size=[B])
    T = sum(ntiles)
    G = min(max((T + min_tiles - 1) // min_tiles, 1), num_ctas)
    if longest_first:
        slack = longest_first_slack((T + G - 1) // G)
    ks = aligned_pieces(ntiles, num_ctas, min_tiles, slack) if aligned else None
    if ks is not None:   # one piece per CTA, requests cut into their pieces (sm90.aligned_pieces)
        items = aligned_lists(ntiles, ks, num_ctas)[0]
        items = _longest_first(items) if longest_first else dict(items, m_list=_identity(len(items["item_req"])))
        _LAST_ITEMS = (key, ntiles, items)
        return dict(qo_indptr=qo, kv_indptr=kvp, kv_len=L, **items, batch_size=[B])
    Gm = G - 1
    # CTA c owns global tiles [lo[c], lo[c+1]), lo[c] = c*T//G (each owns one or more: G <= T). A request within
    # one CTA is one item (tiles 0..n); one across CTAs is an item per CTA, cut at the CTA boundaries: walking the
    # requests and the boundaries together, in order (no division per request; this loop runs every decode step
    # that changes the tiles). An empty request's item lies in the CTA of the next tile (the last CTA at the end).
    lo = [c * T // G for c in range(G + 1)]
    req, t0s, t1s, m_ptr = [], [], [], [0]
    ptr = [0] * (num_ctas + 1)   # cta_ptr: each CTA's first item; CTAs from G on: the end
    c = n = s = 0                # the current CTA; items so far; tiles so far
    nxt = lo[1]                  # the next CTA's first tile
    for b, nt in enumerate(ntiles):
        if s >= nxt and c < Gm:  # the request starts the next CTA
            c += 1
            nxt = lo[c + 1]
            ptr[c] = n
        e = s + nt
        req.append(b)
        t0s.append(0)
        n += 1
        while e > nxt:           # it runs into the next CTA: cut there
            x = nxt - s
            t1s.append(x)
            req.append(b)
            t0s.append(x)
            c += 1
            ptr[c] = n
            n += 1
            nxt = lo[c + 1]
        t1s.append(nt)
        m_ptr.append(n)
        s = e
    ptr[G:] = [n] * (num_ctas + 1 - G)
    items = dict(cta_ptr=ptr, item_req=req, item_t0=t0s, item_t1=t1s, m_ptr=m_ptr)
    items = _longest_first(items) if longest_first else dict(items, m_list=_identity(n))
    _LAST_ITEMS = (key, ntiles, items)  # (one tuple: a concurrent reader sees all or none)
    return dict(qo_indptr=qo, kv_indptr=kvp, kv_len=L, **items, batch_size=[B])


def _identity(n: int) -> list[int]:
    """``list(range(n))``, the same object while ``n`` stays (read only): a caller staging the arrays through a
    sink (the decode runner) skips a trailing segment that is the same object as last step's."""
    global _IDENTITY
    if len(_IDENTITY) != n:
        _IDENTITY = list(range(n))
    return _IDENTITY


_IDENTITY: list[int] = []


def _longest_first(items: dict) -> dict:
    """The items reordered longest first (a stable sort: equal pieces keep their order), for a build that launches
    one CTA per item: the GPU starts CTAs in grid order as SMs free up, so the long pieces run in the first wave and
    the short ones fill in behind them (list scheduling, longest first). ``m_list`` maps request b's partials
    ``m_ptr[b]:m_ptr[b+1]`` (in its tile order) to their new places, which the merge reads them through; the
    kernel writes an item's partial at its place. ``cta_ptr`` is kept (a one-CTA-per-item build does not read it)."""
    req, t0, t1 = items["item_req"], items["item_t0"], items["item_t1"]
    order = sorted(range(len(req)), key=lambda i: t0[i] - t1[i])
    place = [0] * len(req)
    for new, old in enumerate(order):
        place[old] = new
    return dict(cta_ptr=items["cta_ptr"], item_req=[req[i] for i in order], item_t0=[t0[i] for i in order],
                item_t1=[t1[i] for i in order], m_ptr=items["m_ptr"], m_list=place)


_LAST_ITEMS = None  # schedule_host's last (CTAs and tile quantum, tiles per request, items)


def _clamped(host: dict, page_size: int, num_indices: int, tile: int):
    """(qo_indptr, kv_indptr, lengths, tiles per request) as lists: ``safe_kv_len`` with rows without queries
    zeroed, from the layout's host arrays."""
    qo, kvp, lens = (host[key].tolist() for key in ("qo_indptr", "kv_indptr", "kv_len"))
    L, ntiles = [], []
    for b in range(len(lens)):
        n = lens[b]
        cap = (min(kvp[b + 1], num_indices) - kvp[b]) * page_size
        if n > cap:
            n = cap
        if n < 0 or qo[b + 1] <= qo[b]:
            n = 0
        L.append(n)
        ntiles.append((n + tile - 1) // tile)
    return qo, kvp, L, ntiles


MERGE_GUESS_CAP = 128


def merge_sizes(parts: int | None, batch: int, slots: int, rows: int, n_sm: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the split merge. ``parts``: a request's longest list of partials when the host
    schedule knows it; None when the schedule is made on the device (lengths only there): then the list a
    request of a *balanced* batch gets from the contiguous schedule, about slots / batch + 1 partials (at most one
    per CTA). Any value is correct for any batch (the merge loops over a request's real list); a size far above
    the real count costs masked work and narrow column blocks: a fixed 64 for device-only plans took ~85 us of
    H128 B64 L8k's .492 ms through the API on the H200 (kernel alone .407; the host-sized merge 15 us)."""
    if parts is None:
        # capped at 128: B1 L32k's real 128 partials take (128, 64), the sizes the H200 measured (kernel + merge
        # .0258 ms); a longer list loops over 128-partial steps
        parts = min(max(1, slots), MERGE_GUESS_CAP, -(-max(1, slots) // max(1, batch)) + 1)
    from ..kernels import sm90 as k
    return k.merge_blocks(max(1, parts), batch, rows, n_sm)
