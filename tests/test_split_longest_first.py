"""The heads-on-M build's host schedule (``kernels.split.tile_items_host(longest_first=True)``): one CTA per
work item, the items launched longest first, the request-aligned cut only where it is balanced (else the
contiguous cut), and ``m_list`` mapping each request's partials to the items' new places (the split merge reads
them through it; the merge itself takes any ``m_list``: tests/test_split_merge.py). Pure Python on the CPU:
the schedule's lists, and the plan arrays ``gluon.build`` stages (the kernel is never launched)."""
from __future__ import annotations

import pytest
import torch

from fp8mla.kernels import split as k
from fp8mla.kernels.split import tiles as hs


def host_of(lens):
    B = len(lens)
    tiles = [-(-n // k.TILE) for n in lens]
    kvp = [0]
    for t in tiles:
        kvp.append(kvp[-1] + t)
    return dict(lists=(list(range(B + 1)), kvp, list(lens))), tiles


def cases():
    g = torch.Generator().manual_seed(11)
    out = [([8192] * 64, 66), ([2048] * 128, 66), ([32768], 132), ([0, 0, 5], 7), ([1], 1), ([8192] * 5 + [0] * 3, 132)]
    for trial in range(60):
        B = int(torch.randint(1, [8, 64, 150][trial % 3], (1,), generator=g))
        lens = torch.randint(0, [700, 16384, 40000][trial % 3], (B,), generator=g)
        lens[torch.rand(B, generator=g) < 0.1] = 0
        out.append((lens.tolist(), [132, 66, 7, 1][trial % 4]))
    return out


@pytest.mark.parametrize("min_tiles", [1, 8])
def test_longest_first_is_a_reordered_real_schedule(min_tiles):
    for lens, ctas in cases():
        host, tiles = host_of(lens)
        hs._LAST_ITEMS = None
        h = hs.tile_items_host(host, k.TILE, num_indices=sum(tiles), num_ctas=ctas, min_tiles=min_tiles,
                             longest_first=True)
        req, t0, t1, m_ptr, m_list = (h[key] for key in ("item_req", "item_t0", "item_t1", "m_ptr", "m_list"))
        n = len(req)
        sizes = [b - a for a, b in zip(t0, t1)]
        assert n == m_ptr[-1] and sorted(m_list) == list(range(n)), (lens, ctas)
        assert all(x >= y for x, y in zip(sizes, sizes[1:])), (lens, ctas, sizes)   # longest first
        for b in range(len(lens)):   # through m_list: request b's items, contiguous, in order, all its tiles
            spans = [(t0[p], t1[p]) for p in m_list[m_ptr[b]: m_ptr[b + 1]]]
            assert all(req[p] == b for p in m_list[m_ptr[b]: m_ptr[b + 1]]), (lens, b)
            assert spans and spans[0][0] == 0 and spans[-1][1] == tiles[b], (lens, ctas, b, spans)
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), (lens, b, spans)
        # the pieces are at most the contiguous cut's share, or the balanced aligned cut's
        T = sum(tiles)
        G = min(max(-(-T // min_tiles), 1), ctas)
        share = -(-T // G)
        slack = max(k.ALIGNED_SLACK, k.ONE_WAVE_SLACK, share // k.BALANCE)
        assert max(sizes, default=0) <= share + slack, (lens, ctas)
        # and the same items as the unordered schedule of the same cut
        hs._LAST_ITEMS = None
        plain = hs.tile_items_host(host, k.TILE, num_indices=T, num_ctas=ctas, min_tiles=min_tiles, slack=slack)
        assert sorted(zip(req, t0, t1)) == sorted(zip(plain["item_req"], plain["item_t0"], plain["item_t1"]))
        assert plain["m_list"] == list(range(len(plain["item_req"])))


def test_spread_lengths_leave_the_unbalanced_aligned_cut():
    """The measured case (H128 slots, 64 requests of 512..16k tokens): the unbounded aligned cut's longest piece is
    ~1.5x the share (1.21x the wide build's time on the H200, 2026-12-02); the longest-first schedule's pieces are
    at most a share, and equal lengths keep their one-piece-per-request aligned cut (no partials)."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(512, 16385, (64,), generator=g).tolist()
    host, tiles = host_of(lens)
    share = -(-sum(tiles) // 66)
    hs._LAST_ITEMS = None
    old = hs.tile_items_host(host, k.TILE, num_indices=sum(tiles), num_ctas=66, min_tiles=8, slack=k.UNBOUNDED_SLACK)
    hs._LAST_ITEMS = None
    new = hs.tile_items_host(host, k.TILE, num_indices=sum(tiles), num_ctas=66, min_tiles=8, longest_first=True)
    longest = lambda h: max(b - a for a, b in zip(h["item_t0"], h["item_t1"]))  # noqa: E731
    assert longest(new) <= share < longest(old)
    host, tiles = host_of([8192] * 64)
    hs._LAST_ITEMS = None
    eq = hs.tile_items_host(host, k.TILE, num_indices=sum(tiles), num_ctas=66, min_tiles=8, longest_first=True)
    assert eq["item_req"] == list(range(64)) and eq["m_list"] == list(range(64))
    assert all(a == 0 and b == 128 for a, b in zip(eq["item_t0"], eq["item_t1"]))   # whole requests


def test_heads_on_m_plans_stage_the_longest_first_items(monkeypatch):
    """gluon.build for a heads-on-M plan with host lengths (on CPU tensors, never launched), plain and into a CUDA-
    graph wrapper's buffers (m_list among the staged arrays), stages the longest-first items and their m_list; the
    device-only-lengths plan of the same batch schedules the very same arrays on the device."""
    from fp8mla.backends import AttentionSpec, gluon as gb
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    monkeypatch.setattr("fp8mla.runtime.gluon_usable", lambda device: True)
    monkeypatch.setattr(gb, "num_sms", lambda device: 132)
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(512, 16385, (64,), generator=g).to(torch.int32)
    W = -(-int(lens.max()) // 64)
    bt = torch.randint(0, 20000, (64, W), generator=g, dtype=torch.int32)
    host_lay = PagedLayout.from_block_table(bt, lens, 64)
    dev_lay = PagedLayout(host_lay.qo_indptr, host_lay.kv_indptr, host_lay.kv_indices, host_lay.kv_len, 64,
                          torch.device("cpu"), host_lay.qo_lens)
    for graph in (False, True):
        spec = AttentionSpec(128, 512, 64, 64, True, 192 ** -0.5, torch.bfloat16, get_format("fp8_e4m3"),
                             torch.device("cpu"), graph)
        opts = dict(heads_on_m=True, **(dict(max_batch_size=64, max_kv_indices=bt.numel()) if graph else {}))
        staged = {}
        for lay in (host_lay, dev_lay):
            hs._LAST_ITEMS = None
            p = gb.build(lay, spec, opts)
            assert p.build.heads_on_m
            n = int(p.t["m_ptr"][64])
            sizes = (p.t["item_t1"][:n] - p.t["item_t0"][:n]).tolist()
            m_list = p.t["m_list"][:n].tolist()
            staged[lay is dev_lay] = [p.t[key][:n].tolist() for key in ("item_req", "item_t0", "item_t1", "m_list")]
            if lay is dev_lay:
                assert staged[True] == staged[False], graph
                continue
            assert sizes == sorted(sizes, reverse=True) and sorted(m_list) == list(range(n)), graph
            assert m_list != list(range(n)), graph   # spread lengths: the order did change
            req = p.t["item_req"][:n].tolist()
            m_ptr = p.t["m_ptr"].tolist()
            assert all(req[m_list[j]] == b for b in range(64) for j in range(m_ptr[b], m_ptr[b + 1])), graph
            assert p.n_items == (n if not graph else 66 + 64)


@pytest.mark.parametrize("min_tiles", [1, 8])
def test_device_longest_first_equals_the_host_schedule(min_tiles):
    """``tile_items_device(longest_first=True)`` (torch ops: CUDA-graph plans and device-only lengths) gives the host
    schedule's items in the host's order, its m_ptr and its m_list, on the same random and edge lengths; padding past
    the item count stays at the end."""
    for lens, ctas in cases():
        host, tiles = host_of(lens)
        hs._LAST_ITEMS = None
        h = hs.tile_items_host(host, k.TILE, num_indices=sum(tiles), num_ctas=ctas, min_tiles=min_tiles,
                             longest_first=True)
        d = k.tile_items_device(torch.tensor(lens, dtype=torch.int32), ctas, min_tiles, longest_first=True)
        n = h["m_ptr"][-1]
        assert d["m_ptr"].tolist() == h["m_ptr"], (lens, ctas)
        for key in ("item_req", "item_t0", "item_t1", "m_list"):
            assert d[key][:n].tolist() == h[key][:n], (lens, ctas, key)
        assert (d["item_t1"][n:] == d["item_t0"][n:]).all(), (lens, ctas)   # the padding: empty, after the items


def test_device_longest_first_into_graph_buffers():
    """The same schedule written into larger preallocated buffers (a CUDA-graph wrapper's) equals the returned one."""
    lens = torch.tensor([5000, 1, 0, 64, 3000, 17, 900, 1], dtype=torch.int32)
    want = k.tile_items_device(lens, 66, 1, longest_first=True)
    out = {key: torch.full((v.numel() + 8,), -7, dtype=torch.int32) for key, v in want.items()}
    k.tile_items_device(lens, 66, 1, out=out, longest_first=True)
    for key, v in want.items():
        assert out[key][: v.numel()].tolist() == v.tolist(), key
