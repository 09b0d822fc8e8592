"""The producer partition: walks the CTA's work items and fills the ring, by TMA row boxes (pages of 16, 32 or a
multiple of 64) or 16-byte cp.async rows (page 1), with each tile's group scales in the group build (Gluon)."""
from __future__ import annotations

from .config import gluon

if gluon is not None:
    from .config import (GROUPS_C, P8_SCALE_C, _NEW_REINTERPRET, _cp_async, _cta_barrier, _tma_load, async_copy,
                         fence_async_shared, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from .ring import ring_acquire

    @gluon.jit
    def _producer_page1(pool, pages, work, ring, NHG: gl.constexpr, NS: gl.constexpr, WIDE: gl.constexpr,
                        GROUP: gl.constexpr):
        # Page 1 (SGLang's default): a tile's 64 rows are 64 arbitrary pool rows (page id = row), too small for TMA
        # boxes. The 128 producer threads copy with 16-byte cp.async, 4 threads per row (a warp instruction covers 8
        # rows x 64 B: half the cache lines per instruction of 2 threads per row), rows r and r + 32 per thread
        # (same swizzle phase: one shared-memory offset per column), 4 copies per 128-column box and 2 of k_pe
        # (18 per thread and tile), into the same swizzled stages the TMA path fills, then
        # arrives on the stage's ready barrier when its copies land (cp.async.mbarrier.arrive.noinc; the barrier
        # counts 128 arrivals at PAGE 1, one expect-tx arrival otherwise). Rows past kv_len and page ids outside
        # [0, num_rows) are never read: their copies are masked, which writes zeros (as TMA zero-fills out-of-range
        # rows). Page ids are loaded two tiles ahead (tile t + 2's while tile t's copies are issued): their load
        # feeds the copies' addresses, and under a full memory system its latency (~2-4K cycles) is longer than
        # the two consumers take per tile (~2.1K per SM), so one tile ahead left the producer waiting on each
        # load (page 1 ran at 2.3 TB/s against page 64's 3.0; the producer has 24 registers: its
        # item-loop state spills, a few reloads per tile).
        (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, sc_desc, sc_ptr,
         stride_sc_row) = pool
        kv_indptr, kv_indices, kv_len = pages
        cta_ptr, item_req, item_t0, item_t1 = work
        kbuf, pbuf, sbuf, ready, empty = ring
        cpl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rr = gl.arange(0, 64, layout=gl.SliceLayout(1, cpl))
        ccol = gl.arange(0, 128, layout=gl.SliceLayout(0, cpl))
        pcol = gl.arange(0, 64, layout=gl.SliceLayout(0, cpl))
        pid = gl.program_id(0)
        if WIDE:
            slot = pid // NHG
        else:
            slot = pid
        i0 = gl.load(cta_ptr + slot)
        i1 = gl.load(cta_ptr + slot + 1)
        g = 0
        for it in range(i0, i1):
            b = gl.load(item_req + it)
            t0 = gl.load(item_t0 + it)
            t1 = gl.load(item_t1 + it)
            pbase = gl.load(kv_indptr + b)
            L = gl.load(kv_len + b)
            tok = t0 * 64 + rr
            nxt = gl.load(kv_indices + pbase + tok, mask=(tok < L) & (t0 < t1), other=-1)
            tok = tok + 64
            nxt2 = gl.load(kv_indices + pbase + tok, mask=(tok < L) & (t0 + 1 < t1), other=-1)
            for t in range(t0, t1):
                ids = nxt
                nxt = nxt2
                tok = (t + 2) * 64 + rr
                nxt2 = gl.load(kv_indices + pbase + tok, mask=(tok < L) & (t + 2 < t1), other=-1)
                s, bar = ring_acquire(ring, g, NS)
                ok = ((ids >= 0) & (ids < num_rows))[:, None]
                row = ids.to(gl.int64)
                krow = ckv_ptr + row * stride_kv_row
                for c in gl.static_range(4):
                    _cp_async(kbuf.index(s * 4 + c), krow[:, None] + (c * 128 + ccol)[None, :], mask=ok,
                              eviction_policy="evict_first")
                _cp_async(pbuf.index(s), (kpe_ptr + row * stride_kpe_row)[:, None] + pcol[None, :], mask=ok,
                          eviction_policy="evict_first")
                if GROUP:   # the rows' group scales (16 B each; the 4 column lanes of a row copy the same)
                    scol = gl.arange(0, GROUPS_C, layout=gl.SliceLayout(0, cpl))
                    _cp_async(sbuf.index(s), (sc_ptr + row * stride_sc_row)[:, None] + scol[None, :], mask=ok,
                              eviction_policy="evict_first")
                async_copy.mbarrier_arrive(bar, increment_count=False)
                g += 1

    @gluon.jit
    def _producer(pool, pages, work, ring, NHG: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr,
                  WIDE: gl.constexpr, GROUP: gl.constexpr):
        # the default partition: page 1 copies rows with cp.async, every other page size boxes with TMA.
        # pool: the KV pool and its group scales, pages: (kv_indptr, kv_indices, kv_len), work: the CTA's work
        # items (cta_ptr, item_req, item_t0, item_t1), ring: (kbuf, pbuf, sbuf, ready, empty)
        if PAGE == 1:
            _producer_page1(pool, pages, work, ring, NHG, NS, WIDE, GROUP)
        else:
            _producer_tma(pool, pages, work, ring, NHG, NS, PAGE, WIDE, GROUP)

    @gluon.jit
    def _producer_tma(pool, pages, work, ring, NHG: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr,
                      WIDE: gl.constexpr, GROUP: gl.constexpr):
        # Page ids come 16 table entries at a time (one per lane, extracted with warp shuffles): one load latency
        # per 16 entries instead of one per tile (a scalar load per tile capped the issue rate near one tile
        # per load latency). Pages of 16/32 tokens: a tile is 4/2 pages, each its own row boxes.
        (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, sc_desc, sc_ptr,
         stride_sc_row) = pool
        kv_indptr, kv_indices, kv_len = pages
        cta_ptr, item_req, item_t0, item_t1 = work
        kbuf, pbuf, sbuf, ready, empty = ring
        EPT: gl.constexpr = 64 // PAGE if PAGE < 64 else 1      # table entries per 64-token tile
        TPC: gl.constexpr = 16 // EPT                            # tiles per chunk of 16 entries
        ROWS: gl.constexpr = PAGE if PAGE < 64 else 64
        idl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ar = gl.arange(0, 16, layout=idl)
        pid = gl.program_id(0)
        if WIDE:
            slot = pid // NHG    # the NHG head-group CTAs of one slot read the same tiles
        else:
            slot = pid
        i0 = gl.load(cta_ptr + slot)
        i1 = gl.load(cta_ptr + slot + 1)
        g = 0
        for it in range(i0, i1):
            b = gl.load(item_req + it)
            t0 = gl.load(item_t0 + it)
            t1 = gl.load(item_t1 + it)
            pbase = gl.load(kv_indptr + b)
            n_pages = (gl.load(kv_len + b) + PAGE - 1) // PAGE
            ids = gl.zeros([16], gl.int32, idl)
            for t in range(t0, t1):
                k = (t - t0) % TPC
                if k == 0:
                    if PAGE < 64:
                        ee = t * EPT + ar
                        ids = gl.load(kv_indices + pbase + ee, mask=ee < n_pages, other=0)
                    else:
                        tt = t + ar
                        ids = gl.load(kv_indices + pbase + (tt * 64) // PAGE, mask=tt < t1, other=0)
                s, bar = ring_acquire(ring, g, NS)
                if GROUP:   # + the tile's [64, 4] fp32 group scales, one box per page as the rows
                    mbarrier.expect(bar, 64 * 576 + 64 * GROUPS_C * 4)
                else:
                    mbarrier.expect(bar, 64 * 576)
                for r in gl.static_range(EPT):
                    page = gl.sum(gl.where(ar == k * EPT + r, ids, 0), axis=0)
                    if PAGE < 64:
                        row = page * PAGE
                    else:
                        row = page * PAGE + (t * 64) % PAGE
                    for c in gl.static_range(4):
                        _tma_load(kv_desc, [row, c * 128], bar,
                                                        kbuf.index(s * 4 + c).slice(r * ROWS, ROWS, dim=0))
                    _tma_load(kpe_desc, [row, 0], bar,
                                                    pbuf.index(s).slice(r * ROWS, ROWS, dim=0))
                    if GROUP:
                        _tma_load(sc_desc, [row, 0], bar, sbuf.index(s).slice(r * ROWS, ROWS, dim=0))
                g += 1
