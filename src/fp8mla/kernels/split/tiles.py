"""64-token tile ranges per CTA: the Gluon dense builds' work items.

The concatenated 64-token tiles of all requests are cut into one range per CTA, as request-aligned pieces (one
work item per CTA, where that balances: ``aligned_pieces``) or contiguous ranges split at request boundaries into
items ``(request, first tile, end tile)``. Three forms give the same items: ``tile_items`` (lists, the reference
the tests read), ``tile_items_device`` (torch ops on the device: no host read, CUDA-graph safe) and
``tile_items_host`` (O(batch) Python from a layout's host lengths, staged in one copy; with a memo of the last
schedule, ``_LAST_ITEMS``); ``merge_sizes`` gives the split merge's block sizes from a schedule's partials.
"""
from __future__ import annotations

# The builds' KV tile (kernels.sm90.config.TILE): the cut's unit.
TILE = 64


# The request-aligned schedule (``aligned_pieces``) may give a CTA this many tiles more than the contiguous cut's
# largest share: a CTA that runs two items (the contiguous cut splits requests at CTA boundaries) pays a second
# Q prologue, first-load latency and partial write-out, about a tile's time.
ALIGNED_SLACK = 1
# The heads-on-M build runs one CTA per work item (not persistent): a request-aligned cut that fits the CTAs is one
# wave of whole pieces, while the contiguous cut's items (a range split at request boundaries) become extra CTAs,
# each with its own Q prologue, partial and merge, and a second wave. Its device schedule (device-only lengths)
# takes the aligned cut whenever it fits (H128 B64 L8k on 66 slots: 64 whole requests of 128 tiles, against the
# contiguous share of 125); its host schedule (``tile_items_host(longest_first=True)``) has its own rule.
UNBOUNDED_SLACK = 1 << 30
# The longest-first schedule of a build that launches one CTA per item (heads-on-M; ``longest_first`` below and
# ``tile_items_host``): the request-aligned cut is kept where its longest piece is within
# max(share / BALANCE, ONE_WAVE_SLACK) tiles of the contiguous cut's share; otherwise the contiguous cut, whose
# pieces are at most a share but which splits more requests (partials and their merge: ~16 us more, about 6 tiles of
# the heads-on-M build, in an H200 A/B at B8-B16, where the aligned cut's longest piece was 1.4-1.7x
# a share of 6-13 tiles and still faster; at 2x and beyond the contiguous cut won).
BALANCE = 32
ONE_WAVE_SLACK = 6


def aligned_pieces(tiles: list[int], num_ctas: int, min_tiles: int, slack: int = ALIGNED_SLACK) -> list[int] | None:
    """Pieces per request for the request-aligned schedule, or None where the contiguous cut is used.

    Request b gets ``k_b = max(1, min(n_b * num_ctas // T, n_b // min_tiles))`` CTAs (its share of the CTAs,
    rounded down; a split request's pieces have at least ``min_tiles`` tiles, a request of one piece is whole
    whatever its size; an empty request one CTA for its empty item), each piece ``[j * n_b // k_b, (j + 1) * n_b
    // k_b)`` its own CTA: one work item per CTA, and a request whose share is one CTA is not split at all (no
    partial, no merge). Taken when the pieces fit ``num_ctas`` and the largest piece is at most ``ALIGNED_SLACK``
    tiles (``slack``) over the contiguous cut's share ``ceil(T / G)``, which splits requests wherever CTA boundaries
    fall (CTAs then run two or more items). The equal-length shapes of the benchmarks fit (B8 L8k on 132 CTAs: 16 pieces
    of 8 tiles per request, where the contiguous cut gives 7.76 tiles per CTA across request boundaries); equal lengths
    whose share rounds badly do not (17 requests of 128 tiles on 132 CTAs: 7 pieces of 19 against a share of 17), nor do
    more non-empty requests than CTAs. An empty request (a padding row of a CUDA-graph bucket) takes no CTA: its empty
    item runs in the CTA of the next piece (the last CTA after the last piece; ``aligned_lists``). ``tile_items_device``
    computes the same on the device, ``tile_items_host`` on the host."""
    B, T = len(tiles), sum(tiles)
    if B == 0 or sum(1 for n in tiles if n) > num_ctas:
        return None
    G = min(max(-(-T // min_tiles), 1), num_ctas)
    share = -(-T // G)
    ks, most = [], 0
    for n in tiles:
        kb = max(1, min(n * num_ctas // T if T else 0, n // min_tiles))
        ks.append(kb)
        most = max(most, -(-n // kb))
    if sum(kb for kb, n in zip(ks, tiles) if n) > num_ctas or most > share + slack:
        return None
    return ks


def aligned_lists(tiles: list[int], ks: list[int], num_ctas: int) -> tuple[dict, int]:
    """The request-aligned cut's work items as lists (``tile_items_host``'s arrays) and its
    grid: request b's ``ks[b]`` pieces in order, each its own CTA; an empty request's one empty item in the CTA of
    the next piece (the last piece's CTA at the end, CTA 0 when every request is empty). ``cta_ptr`` has
    ``num_ctas + 1`` entries (CTAs past the grid: empty ranges)."""
    req, t0s, t1s, m_ptr, cta = [], [], [], [0], []
    c = 0   # pieces placed so far = the next piece's CTA
    for b, (n, kb) in enumerate(zip(tiles, ks)):
        if n == 0:
            req.append(b)
            t0s.append(0)
            t1s.append(0)
            cta.append(c)
        else:
            for j in range(kb):
                req.append(b)
                t0s.append(j * n // kb)
                t1s.append((j + 1) * n // kb)
                cta.append(c)
                c += 1
        m_ptr.append(len(req))
    last = max(c - 1, 0)
    ptr, i = [], 0
    for x in range(num_ctas + 1):   # CTA x's first item: the first with a CTA >= x
        while i < len(cta) and min(cta[i], last) < x:
            i += 1
        ptr.append(i)
    return dict(cta_ptr=ptr, item_req=req, item_t0=t0s, item_t1=t1s, m_ptr=m_ptr), max(c, 1)


def longest_first_slack(share):
    """The aligned cut's slack in the longest-first schedule: max(ALIGNED_SLACK, ONE_WAVE_SLACK, share //
    BALANCE) tiles over the contiguous cut's share (an int, or a tensor on the device)."""
    least = max(ALIGNED_SLACK, ONE_WAVE_SLACK)
    if isinstance(share, int):
        return max(least, share // BALANCE)
    import torch
    return torch.clamp(share // BALANCE, min=least)


def tile_items(kv_lens: list[int], num_ctas: int, min_tiles_per_cta: int = 4, aligned: bool = True,
             slack: int = ALIGNED_SLACK):
    """Cut the concatenated 64-token tiles of all requests into per-CTA ranges: request-aligned pieces, one item
    per CTA (``aligned_pieces``, when ``aligned`` and they fit), else contiguous per-CTA ranges.

    Returns ``(grid, cta_ptr, items, m_ptr, m_list)``: CTA c runs items ``cta_ptr[c]:cta_ptr[c+1]``; an item is
    ``(request, first tile, end tile)``; item i writes partial i (both consumers' states merged in shared
    memory), or the final out/lse when it is the whole request;
    request b merges partials ``m_list[m_ptr[b]:m_ptr[b+1]]`` (when it has two or more). A request with kv_len 0
    gets one empty item, which writes 0 and lse = -inf.
    """
    tiles = [-(-L // TILE) for L in kv_lens]
    ks = aligned_pieces(tiles, num_ctas, max(1, min_tiles_per_cta), slack) if aligned else None
    if ks is not None:
        a, grid = aligned_lists(tiles, ks, num_ctas)
        items = list(zip(a["item_req"], a["item_t0"], a["item_t1"]))
        return grid, a["cta_ptr"][: grid + 1], items, a["m_ptr"], list(range(len(items)))
    T = sum(tiles)
    grid = max(1, min(num_ctas, -(-T // max(1, min_tiles_per_cta))))
    bounds = [(c * T) // grid for c in range(grid + 1)]   # CTA c owns global tiles [bounds[c], bounds[c+1])
    items, cta_ptr, per_req = [], [0], [[] for _ in kv_lens]
    c = pos = 0
    for b, n in enumerate(tiles):
        if n == 0:
            per_req[b].append(len(items))
            items.append((b, 0, 0))
            continue
        t = 0
        while t < n:
            while pos >= bounds[c + 1]:
                cta_ptr.append(len(items))
                c += 1
            take = min(n - t, bounds[c + 1] - pos)
            per_req[b].append(len(items))
            items.append((b, t, t + take))
            t += take
            pos += take
    while len(cta_ptr) <= grid:
        cta_ptr.append(len(items))
    m_ptr, m_list = [0], []
    for lst in per_req:
        m_list += lst
        m_ptr.append(len(m_list))
    return grid, cta_ptr, items, m_ptr, m_list


def tile_items_device(kv_len, num_ctas: int, min_tiles_per_cta: int, out: dict | None = None,
                    aligned: bool = True, slack: int = ALIGNED_SLACK, longest_first: bool = False) -> dict:
    """``tile_items`` computed with torch ops on ``kv_len``'s device: no host read, no sync (CUDA-graph re-plans).
    Both cuts are CTA boundaries in the concatenated tiles, and one item generator turns either into work items:
    the contiguous cut's ``c * T // G``, or (``aligned``, where ``aligned_pieces`` takes it: chosen element-wise,
    no host read) the starts of the request-aligned pieces with G = their count; an empty request's item falls in
    the CTA of the next tile either way (the last CTA at the end).

    Same cut as ``tile_items`` (CTA c owns global tiles [c*T//G, (c+1)*T//G), G = min(num_ctas, ceil(T/min))),
    but the launch grid is always ``num_ctas`` (CTAs past G get empty ranges) and the arrays have fixed sizes:
    ``cta_ptr [num_ctas + 1]``, items ``[num_ctas + B]`` (padding past the real count is never read),
    ``m_ptr [B + 1]`` = 2 x the request's first item (its partials are consecutive), ``m_list`` = identity.
    ``out``: preallocated int32 buffers to write into (graph mode); returns the dict of arrays.

    ``longest_first`` (a build that launches one CTA per item): ``tile_items_host(longest_first=True)`` on the device,
    the same items in the same order: the aligned cut only within ``longest_first_slack`` of the share (``slack``
    is then ignored), the valid items sorted longest first (a stable sort, the padding after them), ``m_list`` the
    merge's map from each item's place in the unsorted order to its new one; ``cta_ptr`` stays the unsorted cut's
    (a one-CTA-per-item build does not read it).
    """
    import torch
    dev = kv_len.device
    B = kv_len.numel()
    cap = num_ctas + B
    i64 = dict(dtype=torch.int64, device=dev)
    tiles = (kv_len.to(torch.int64) + (TILE - 1)) // TILE
    req_end = torch.cumsum(tiles, 0)
    req_start = req_end - tiles
    T = req_end[-1:] if B else torch.zeros(1, **i64)
    G = torch.clamp((T + (min_tiles_per_cta - 1)) // min_tiles_per_cta, 1, num_ctas)
    if longest_first:   # (a tensor: the share is known on the device only)
        slack = longest_first_slack((T + G - 1) // G)
    c = torch.arange(num_ctas + 1, **i64)
    bound = torch.where(c <= G, (c * T) // G, T)
    if aligned and B > 0:   # the request-aligned cut's boundaries, where aligned_pieces takes it
        kb = torch.clamp(torch.minimum(tiles * num_ctas // torch.clamp(T, min=1), tiles // min_tiles_per_cta), min=1)
        kc = torch.where(tiles > 0, kb, 0)        # CTAs a request takes (an empty one: none)
        pc = torch.cumsum(kc, 0)
        P = pc[-1:]
        take = (P <= num_ctas) & (((tiles + kb - 1) // kb).amax().reshape(1) <= (T + G - 1) // G + slack)
        ab = torch.clamp(torch.searchsorted(pc, c, right=True), max=B - 1)   # CTA c's piece: request, index
        aj = c - (pc - kc)[ab]
        al = torch.where(c < P, req_start[ab] + aj * tiles[ab] // torch.clamp(kc[ab], min=1), T)
        bound = torch.where(take, al, bound)
        G = torch.where(take, torch.clamp(P, min=1), G)
    c_first = torch.clamp(torch.searchsorted(bound, req_start, right=True) - 1, min=0)
    c_first = torch.minimum(c_first, G - 1)
    c_last = torch.searchsorted(bound, torch.clamp(req_end - 1, min=0), right=True) - 1
    c_last = torch.maximum(torch.minimum(c_last, G - 1), c_first)
    n_it = c_last - c_first + 1
    it_end = torch.cumsum(n_it, 0)
    it_start = it_end - n_it
    i = torch.arange(cap, **i64)
    b = torch.clamp(torch.searchsorted(it_end, i, right=True), max=max(B - 1, 0))
    valid = i < (it_end[-1:] if B else torch.zeros(1, **i64))
    if B:
        cc = c_first[b] + (i - it_start[b])
        cc = torch.clamp(cc, max=num_ctas - 1)
        t0 = torch.maximum(req_start[b], bound[cc]) - req_start[b]
        t1 = torch.minimum(req_end[b], bound[cc + 1]) - req_start[b]
        t1 = torch.maximum(t1, t0)
        item_cta = torch.where(valid, cc, num_ctas)
    else:
        t0 = t1 = torch.zeros(cap, **i64)
        item_cta = torch.full((cap,), num_ctas, **i64)
    cta_ptr = torch.searchsorted(item_cta, c)
    zero = torch.zeros(1, **i64)
    res = dict(cta_ptr=cta_ptr, item_req=torch.where(valid, b, 0), item_t0=torch.where(valid, t0, 0),
               item_t1=torch.where(valid, t1, 0), m_ptr=torch.cat([zero, it_end]), m_list=torch.arange(cap, **i64))
    if longest_first:
        # valid items by length, longest first, ties in schedule order (as the host's stable sort); padding last
        key = torch.where(valid, res["item_t0"] - res["item_t1"], cap)
        order = torch.sort(key, stable=True).indices
        for name in ("item_req", "item_t0", "item_t1"):
            res[name] = res[name][order]
        place = torch.empty_like(order)
        place[order] = torch.arange(cap, **i64)
        res["m_list"] = place
    if out is None:
        return {key: v.to(torch.int32) for key, v in res.items()}
    for key, v in res.items():
        out[key][: v.numel()].copy_(v)
    # the slots past num_ctas, empty: a kernel launched with more slots (a per-tensor and a group plan of one
    # CUDA-graph wrapper share these buffers, the group one with fewer slots at H > 32) reads no stale items there
    last = res["cta_ptr"][-1:]
    out["cta_ptr"][last.numel() + num_ctas:].copy_(last.expand(out["cta_ptr"].numel() - num_ctas - 1))
    return out


# The batch-invariant cut. A request of L tokens is cut in ceil(L / chunk) pieces of one size (whole tiles, the last
# the rest: ``chunks.chunk_bounds``, the token boundaries the Triton kernel's invariant cut uses too), each piece
# one work item, in order; an empty request one empty item. The cut reads the request's length and the chunk only.
# The items are then placed in CTAs in order (CTA c: the items whose first tile, in the concatenation, falls in its
# share of the tiles): that placement follows the batch, but a build whose items are computed alike wherever they
# run (the wide builds, heads-on-M) gives the same bits for each.


def invariant_lists(kv_lens: list[int], chunk: int, num_ctas: int) -> dict:
    """The batch-invariant cut's work items as lists (``tile_items_host``'s arrays): ``cta_ptr`` [num_ctas + 1],
    ``item_req / item_t0 / item_t1``, ``m_ptr`` [B + 1] and ``m_list`` (the identity)."""
    from .chunks import chunk_bounds
    req, t0s, t1s, m_ptr, first = [], [], [], [0], []
    s = 0   # tiles of the requests before
    for b, n in enumerate(kv_lens):
        for a, e in (chunk_bounds(n, chunk, TILE) if n > 0 else [(0, 0)]):
            req.append(b)
            t0s.append(a // TILE)
            t1s.append(-(-e // TILE))
            first.append(s + a // TILE)
        s += -(-max(n, 0) // TILE)
        m_ptr.append(len(req))
    g = max(1, num_ctas)
    cta = [min(g - 1, f * g // max(1, s)) for f in first]
    ptr, i = [], 0
    for x in range(num_ctas + 1):   # CTA x's first item: the first placed in a CTA >= x
        while i < len(cta) and cta[i] < x:
            i += 1
        ptr.append(i)
    return dict(cta_ptr=ptr, item_req=req, item_t0=t0s, item_t1=t1s, m_ptr=m_ptr, m_list=list(range(len(req))))


def invariant_items_device(kv_len, chunk: int, num_ctas: int, cap: int, out: dict | None = None):
    """``invariant_lists`` with torch ops on ``kv_len``'s device (int32 [B], clamped to the pages and 0 for rows
    without queries): no host read, CUDA-graph safe. Returns (arrays, overflow): int32 arrays of fixed sizes,
    ``cta_ptr [num_ctas + 1]``, items ``[cap]`` (zero past the real count ``m_ptr[B]``), ``m_ptr [B + 1]``,
    ``m_list`` the identity (``out``: preallocated buffers, written and returned); ``overflow`` int32 [1], the
    requests whose pieces would pass ``cap`` items, which run as one item each (correct attention, not the
    invariant cut; a capacity sized for the batch's tokens has none)."""
    import torch
    dev = kv_len.device
    B = kv_len.numel()
    i64 = dict(dtype=torch.int64, device=dev)
    L = kv_len.to(torch.int64).clamp(min=0)
    tiles = (L + TILE - 1) // TILE
    k = torch.clamp((L + chunk - 1) // chunk, min=1)
    per = torch.where(L > 0, ((L + k - 1) // k + TILE - 1) // TILE, 1)       # tiles per piece
    cnt = torch.where(L > 0, (tiles + per - 1) // per, 1)
    ends = torch.cumsum(cnt, 0)
    late = ends > cap - (B - torch.arange(1, B + 1, **i64))   # (leaves one item for each request after it)
    over = late & (cnt > 1)
    per = torch.where(over, torch.clamp(tiles, min=1), per)
    cnt = torch.where(over, 1, cnt)
    ends = torch.cumsum(cnt, 0)
    req_start = torch.cumsum(tiles, 0) - tiles
    T = torch.clamp(tiles.sum(), min=1)
    i = torch.arange(cap, **i64)
    n_items = ends[-1:] if B else torch.zeros(1, **i64)
    valid = i < n_items
    if B:
        b = torch.clamp(torch.searchsorted(ends, i, right=True), max=B - 1)
        t0 = (i - (ends - cnt)[b]) * per[b]
        t1 = torch.minimum(tiles[b], t0 + per[b])
        g = max(1, num_ctas)
        cta = torch.where(valid, torch.clamp((req_start[b] + t0) * g // T, max=g - 1), num_ctas)
    else:
        b = t0 = t1 = torch.zeros(cap, **i64)
        cta = torch.full((cap,), num_ctas, **i64)
    zero = torch.zeros(1, **i64)
    res = dict(cta_ptr=torch.searchsorted(cta, torch.arange(num_ctas + 1, **i64)),
               item_req=torch.where(valid, b, 0), item_t0=torch.where(valid, t0, 0),
               item_t1=torch.where(valid, t1, 0), m_ptr=torch.cat([zero, ends]), m_list=torch.arange(cap, **i64))
    overflow = over.sum().reshape(1).to(torch.int32)
    if out is None:
        return {key: v.to(torch.int32) for key, v in res.items()}, overflow
    for key, v in res.items():
        out[key][: v.numel()].copy_(v)
    last = res["cta_ptr"][-1:]   # (the slots past num_ctas, empty, as tile_items_device leaves them)
    out["cta_ptr"][num_ctas + 1:].copy_(last.expand(out["cta_ptr"].numel() - num_ctas - 1))
    return out, overflow


# One CTA per item (``longest_first``): the aligned cut's rule and its constants are the device schedule's
# (``longest_first_slack``, ``BALANCE``, ``ONE_WAVE_SLACK``), so both schedules give the same items.


def tile_items_host(host: dict, page_size: int, *, num_indices: int, num_ctas: int, min_tiles: int,
                    aligned: bool = True, slack: int | None = None, longest_first: bool = False,
                    fixed_chunk: int | None = None) -> dict:
    """``tile_items_device`` on the host, in O(batch + CTAs) Python, from the layout's host arrays
    (``PagedLayout.host``): the same lengths (clamped to each row's pages, 0 for rows without queries) and the same
    work items, as lists of ints (the items' first ``m_ptr[-1]`` entries: the kernels read no further; ``m_list``
    the identity unless ``longest_first``). The plan stages them in one host -> device copy.

    ``longest_first`` (a build that launches one CTA per item: heads-on-M, plain or into CUDA-graph buffers): the
    aligned cut only where it is nearly balanced (``longest_first_slack``; ``slack`` is then ignored), else
    the contiguous cut, and the items reordered longest first (``_longest_first``), with ``m_list`` the merge's map
    to their new places.

    ``fixed_chunk`` (the batch-invariant mode): each request cut on its own (``invariant_lists``), whatever the
    batch and ``num_ctas`` (which only place the items in CTAs); the other cut options are then not read."""
    global _LAST_ITEMS
    slack = ALIGNED_SLACK if slack is None else slack   # (``aligned_slack``: the heads-on-M build's is unbounded)
    fast = host.get("lists")  # PagedLayout.decode_rows: lengths within their rows, one query per row
    if fast is not None and fast[1][-1] <= num_indices:
        qo, kvp, L = fast
        B = len(L)
        ntiles = [(n + TILE - 1) // TILE for n in L]
    else:
        qo, kvp, L, ntiles = _clamped(host, page_size, num_indices, TILE)
        B = len(L)
    if fixed_chunk is not None:
        return dict(qo_indptr=qo, kv_indptr=kvp, kv_len=L, **invariant_lists(L, fixed_chunk, num_ctas),
                    batch_size=[B])
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
    if ks is not None:   # one piece per CTA, requests cut into their pieces (aligned_pieces)
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


_LAST_ITEMS = None  # tile_items_host's last (CTAs and tile quantum, tiles per request, items)


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
    from .merge import merge_blocks
    return merge_blocks(max(1, parts), batch, rows, n_sm)
