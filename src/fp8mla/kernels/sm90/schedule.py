"""The split schedule: the concatenated 64-token tiles of all requests cut into one range per CTA, as
request-aligned pieces (one work item per CTA, where that balances) or contiguous ranges split at request
boundaries into items ``(request, first tile, end tile)``; on the host (``schedule``) and on the device
(``schedule_device``: no host read, CUDA-graph safe)."""
from __future__ import annotations

from .config import TILE


# The request-aligned schedule (``aligned_pieces``) may give a CTA this many tiles more than the contiguous cut's
# largest share: a CTA that runs two items (the contiguous cut splits requests at CTA boundaries) pays a second
# Q prologue, first-load latency and partial write-out, about a tile's time.
ALIGNED_SLACK = 1
# The heads-on-M build runs one CTA per work item (not persistent): a request-aligned cut that fits the CTAs is one
# wave of whole pieces, while the contiguous cut's items (a range split at request boundaries) become extra CTAs,
# each with its own Q prologue, partial and merge, and a second wave. Its device schedule (device-only lengths)
# takes the aligned cut whenever it fits (H128 B64 L8k on 66 slots: 64 whole requests of 128 tiles, against the
# contiguous share of 125); its host schedule (``schedule_host(longest_first=True)``) has its own rule.
UNBOUNDED_SLACK = 1 << 30
# The longest-first schedule of a build that launches one CTA per item (heads-on-M; ``longest_first`` below and
# ``backends._gluon_host_schedule.schedule_host``): the request-aligned cut is kept where its longest piece is within
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
    tiles (``slack``) over the contiguous cut's share ``ceil(T / G)``, which splits requests wherever CTA boundaries fall
    (CTAs then run two or more items). The equal-length shapes of the benchmarks fit (B8 L8k on 132 CTAs: 16 pieces
    of 8 tiles per request, where the contiguous cut gives 7.76 tiles per CTA across request boundaries); equal
    lengths whose share rounds badly do not (17 requests of 128 tiles on 132 CTAs: 7 pieces of 19 against a share of
    17), nor do more non-empty requests than CTAs. An empty request (a padding row of a CUDA-graph bucket) takes
    no CTA: its empty item runs in the CTA of the next piece (the last CTA after the last piece; ``aligned_lists``).
    ``schedule_device`` computes the same on the device, ``backends._gluon_host_schedule.schedule_host`` on the host."""
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
    """The request-aligned cut's work items as lists (``_gluon_host_schedule.schedule_host``'s arrays) and its
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


def schedule(kv_lens: list[int], num_ctas: int, min_tiles_per_cta: int = 4, aligned: bool = True,
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


def schedule_device(kv_len, num_ctas: int, min_tiles_per_cta: int, out: dict | None = None,
                    aligned: bool = True, slack: int = ALIGNED_SLACK, longest_first: bool = False) -> dict:
    """``schedule`` computed with torch ops on ``kv_len``'s device: no host read, no sync (CUDA-graph re-plans).
    Both cuts are CTA boundaries in the concatenated tiles, and one item generator turns either into work items:
    the contiguous cut's ``c * T // G``, or (``aligned``, where ``aligned_pieces`` takes it: chosen element-wise,
    no host read) the starts of the request-aligned pieces with G = their count; an empty request's item falls in
    the CTA of the next tile either way (the last CTA at the end).

    Same cut as ``schedule`` (CTA c owns global tiles [c*T//G, (c+1)*T//G), G = min(num_ctas, ceil(T/min))),
    but the launch grid is always ``num_ctas`` (CTAs past G get empty ranges) and the arrays have fixed sizes:
    ``cta_ptr [num_ctas + 1]``, items ``[num_ctas + B]`` (padding past the real count is never read),
    ``m_ptr [B + 1]`` = 2 x the request's first item (its partials are consecutive), ``m_list`` = identity.
    ``out``: preallocated int32 buffers to write into (graph mode); returns the dict of arrays.

    ``longest_first`` (a build that launches one CTA per item): ``schedule_host(longest_first=True)`` on the device,
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
