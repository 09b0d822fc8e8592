"""The Gluon dense builds' work items (``fp8mla.kernels.split.tiles``): 64-token tile ranges per CTA, the
request-aligned and the contiguous cut, in their three forms (``tile_items`` lists, ``tile_items_device`` torch ops,
``tile_items_host`` O(batch) Python from host lengths) giving the same items; and the merge's block sizes for a
schedule (``merge_sizes``). Pure Python / torch on the CPU."""
from __future__ import annotations

import torch
import pytest

from fp8mla.kernels import split


@pytest.mark.parametrize("lens,ctas", [([1, 63, 65, 97, 514, 0, 4096, 130], 132), ([1, 63, 65, 97, 514, 0], 3),
                                       ([32768], 132), ([8192] * 64, 132), ([0, 0], 5), ([], 8),
                                       ([2048] * 128, 132)])
@pytest.mark.parametrize("aligned", [True, False])
def test_schedule_covers_every_tile_once(lens, ctas, aligned):
    grid, cta_ptr, items, m_ptr, m_list = split.tile_items(lens, ctas, 4, aligned=aligned)
    tiles = [-(-L // 64) for L in lens]
    assert 1 <= grid <= ctas and len(cta_ptr) == grid + 1 and cta_ptr[0] == 0 and cta_ptr[-1] == len(items)
    assert all(a <= b for a, b in zip(cta_ptr, cta_ptr[1:]))
    covered = [[] for _ in lens]
    for b, t0, t1 in items:
        covered[b].append((t0, t1))
    for b, spans in enumerate(covered):   # contiguous, in order, exactly the request's tiles
        assert spans, f"request {b} has no item (kv_len 0 still needs one: the merge writes 0 / -inf)"
        assert spans[0][0] == 0 and spans[-1][1] == tiles[b]
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    loads = [sum(items[i][2] - items[i][1] for i in range(cta_ptr[c], cta_ptr[c + 1])) for c in range(grid)]
    if split.aligned_pieces(tiles, ctas, 4) is not None and aligned:   # one piece per CTA, within a tile of the cut
        share = -(-sum(tiles) // max(1, min(ctas, -(-sum(tiles) // 4))))
        pieces = [sum(items[i][2] > items[i][1] for i in range(cta_ptr[c], cta_ptr[c + 1])) for c in range(grid)]
        assert max(loads) <= share + split.ALIGNED_SLACK, (loads, share)
        assert pieces == [1] * grid or not any(tiles), pieces   # empty requests' items ride along, taking no CTA
    else:
        assert max(loads) - min(loads) <= 1   # balanced to one tile
    assert m_ptr[-1] == len(m_list) == len(items) and sorted(m_list) == list(range(len(items)))


@pytest.mark.parametrize("lens,ctas,want", [
    ([8192] * 8, 132, [16] * 8),          # 16 CTAs of 8 tiles per request (the cut: 7.76 tiles across requests)
    ([2048] * 128, 132, [1] * 128),       # every request whole in one CTA: no partials, no merge
    ([4096] * 32, 132, [4] * 32),
    ([8192] * 64, 132, [2] * 64),         # 64 tiles per CTA, one over the cut's 63
    ([32768], 132, [128]),                # min_tiles 4: 128 pieces of 4
    ([8192] * 8, 66, [8] * 8),            # H128's 66 slots
    ([64] * 200, 132, None),              # more requests than CTAs: the cut
    ([64 * 8, 64 * 556], 132, None),      # the short one's share rounds down to 1 CTA: 8 tiles, the cut's 5
    ([8192] * 5 + [0] * 3, 132, [26] * 5 + [1] * 3),   # a padded bucket: the empty rows take no CTA (130 of 132)
])
def test_aligned_pieces(lens, ctas, want):
    tiles = [-(-L // 64) for L in lens]
    assert split.aligned_pieces(tiles, ctas, 4) == want
    grid, cta_ptr, items, m_ptr, _ = split.tile_items(lens, ctas, 4)
    if want is not None:
        real = sum(kb for kb, n in zip(want, tiles) if n)
        assert grid == real and len(items) == sum(want) and m_ptr[-1] == len(items)
        items = [it for it in items if tiles[it[0]]]
        sizes = {t1 - t0 for _, t0, t1 in items}
        assert max(sizes) - min(sizes) <= 1, sizes   # a request's pieces differ by at most a tile


def test_device_schedule_matches_host_schedule_both_cuts():
    """tile_items_device (torch ops, no host read) gives tile_items's items for either cut, on random lengths. (The
    contiguous cuts differ in one thing, both valid: where an empty request's item goes at a CTA boundary, the
    CTA before it in ``tile_items``, the one of the next tile on the device; so they are compared without empty
    requests. tile_items_host follows the device: test_host_schedule_matches_device_schedule.)"""
    g = torch.Generator().manual_seed(5)
    seen = set()
    for trial in range(150):
        B = int(torch.randint(1, [4, 40, 150][trial % 3], (1,), generator=g))
        lens = torch.randint(0, [300, 5000, 40000][trial % 3], (B,), generator=g)
        if trial % 4 == 0:
            lens[:] = lens[0]   # equal lengths: the aligned cut's case
        lens[torch.rand(B, generator=g) < 0.1] = 0
        ctas, mt = [132, 66, 33, 7][trial % 4], [1, 4, 8][trial % 3]
        for aligned in (True, False):
            taken = aligned and split.aligned_pieces([-(-x // 64) for x in lens.tolist()], ctas, mt) is not None
            if not taken and (lens == 0).any():
                continue
            grid, cta_ptr, items, m_ptr, _ = split.tile_items(lens.tolist(), ctas, mt, aligned=aligned)
            d = split.tile_items_device(lens.to(torch.int32), ctas, mt, aligned=aligned)
            n = int(d["m_ptr"][-1])
            assert d["cta_ptr"].tolist() == cta_ptr + [cta_ptr[-1]] * (ctas - grid), (trial, aligned)
            got = list(zip(d["item_req"][:n].tolist(), d["item_t0"][:n].tolist(), d["item_t1"][:n].tolist()))
            assert got == items and d["m_ptr"].tolist() == m_ptr, (trial, aligned)
            seen.add(taken)
    assert seen == {True, False}   # both cuts were exercised


def test_host_schedule_matches_device_schedule():
    """The gluon plan's O(batch) host schedule (host lengths, CUDA-graph buffers: the decode runner's path) gives
    the device schedule's lengths and work items: random lengths, rows without queries, empty rows, lengths past
    their pages, a last row that lost pages, everything in one CTA, more CTAs than tiles, B = 1."""
    from fp8mla.backends.gluon import _device_kv_len
    from fp8mla.layout import PagedLayout
    g = torch.Generator().manual_seed(13)
    for trial in range(120):
        B = [1, 2, 7, 64, int(torch.randint(1, 90, (1,), generator=g))][trial % 5]
        ps = [16, 32, 64, 128, int(torch.randint(1, 70, (1,), generator=g))][trial % 5]
        qo_lens = torch.randint(0, 2, (B,), generator=g) if trial % 4 == 1 else torch.ones(B, dtype=torch.long)
        pages = torch.randint(0, [3, 40, 200][trial % 3], (B,), generator=g)
        kv_len = (pages * ps - torch.randint(0, ps, (B,), generator=g)).clamp(min=0)
        kv_len[torch.rand(B, generator=g) < 0.2] += ps * 3       # lengths past their pages: clamped
        kv_len[torch.rand(B, generator=g) < 0.1] = 0
        qo = torch.zeros(B + 1, dtype=torch.int32)
        kv = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(qo_lens, 0, out=qo[1:])
        torch.cumsum(pages, 0, out=kv[1:])
        num_indices = max(0, int(kv[-1]) - int(torch.randint(0, 3, (1,), generator=g)))
        ctas = [1, 3, 66, 132, int(torch.randint(1, 200, (1,), generator=g))][(trial // 5) % 5]
        min_tiles = [1, 4, 16][trial % 3]
        lay = PagedLayout(qo, kv, torch.zeros(num_indices, dtype=torch.int32), kv_len.to(torch.int32), ps,
                          torch.device("cpu"))
        L = _device_kv_len(lay)
        aligned = trial % 2 == 0   # both cuts (the aligned one is taken where it fits)
        dev = split.tile_items_device(L, ctas, min_tiles, aligned=aligned)
        host = split.tile_items_host(dict(qo_indptr=qo, kv_indptr=kv, kv_len=kv_len.to(torch.int32)), ps,
                             num_indices=num_indices, num_ctas=ctas, min_tiles=min_tiles, aligned=aligned)
        n = int(dev["m_ptr"][-1])
        assert host["kv_len"] == L.tolist() and host["batch_size"] == [B], trial
        assert host["qo_indptr"] == qo.tolist() and host["kv_indptr"] == kv.tolist(), trial
        for key in ("cta_ptr", "m_ptr"):
            assert host[key] == dev[key].tolist(), (trial, key)
        for key in ("item_req", "item_t0", "item_t1"):
            assert host[key] == dev[key][:n].tolist(), (trial, key)
            assert not dev[key][n:].any(), (trial, key)  # the device pads with 0, as the host staging does
        assert dev["m_list"].tolist() == list(range(ctas + B))
        # and it is a real schedule: every tile of every request exactly once, in order
        tiles = [-(-x // split.TILE) for x in host["kv_len"]]
        for b in range(B):
            spans = [(host["item_t0"][i], host["item_t1"][i]) for i in range(host["m_ptr"][b], host["m_ptr"][b + 1])]
            assert spans and spans[0][0] == 0 and spans[-1][1] == tiles[b], (trial, b)
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), (trial, b)


def test_device_only_merge_sizes_cover_a_balanced_batch():
    """Plans whose lengths live only on the device size the split merge for a balanced batch (about slots / B + 1
    partials per request, ``split.merge_sizes``) instead of a fixed 64 (which cost ~85 us of H128
    B64 L8k on the H200). Any size is correct (the merge loops: tested above for BLOCK_P 2..64); this checks the
    size is not below the real longest list of the schedule for batches of equal lengths, and equals the host-known
    sizing when the guess is the real count."""
    for slots in (1, 7, 66, 132):
        for B in (1, 2, 3, 8, 31, 64, 65, 128, 300):
            for L in (1, 63, 64, 65, 1000, 8192, 32768):
                if B * L > 4_000_000:
                    continue
                pages = -(-L // 64)
                kv = list(range(0, (B + 1) * pages, pages))
                host = dict(qo_indptr=torch.arange(B + 1, dtype=torch.int32),
                            kv_indptr=torch.tensor(kv, dtype=torch.int32),
                            kv_len=torch.full((B,), L, dtype=torch.int32))
                for min_tiles in (1, 4):
                    h = split.tile_items_host(host, 64, num_indices=B * pages, num_ctas=slots, min_tiles=min_tiles)
                    real = max(b - a for a, b in zip(h["m_ptr"], h["m_ptr"][1:]))
                    guess_bp, guess_bc = split.merge_sizes(None, B, slots, 16, 132)
                    real_bp, _ = split.merge_sizes(real, B, slots, 16, 132)
                    cap_bp, _ = split.merge_sizes(min(real, 128), B, slots, 16, 132)
                    assert guess_bp >= cap_bp, (slots, B, L, min_tiles, real, guess_bp)
    # the guess for the side-by-side shapes is what a host-sized plan picks there (uniform lengths)
    assert split.merge_sizes(None, 64, 132, 16, 132) == split.merge_sizes(3, 64, 132, 16, 132) == (4, 512)
    assert split.merge_sizes(None, 64, 66, 128, 132)[1] == 512
    assert split.merge_sizes(None, 1, 132, 16, 132) == split.merge_sizes(128, 1, 132, 16, 132) == (128, 64)   # B1 L32k
    assert split.merge_sizes(5, 64, 132, 16, 132) == split.merge_sizes(5, 64, 132, 16, 132)
