"""The partitions of the Hopper DeepSeek V4 kernel (host side: ``v4.py``): shared-KV sparse MQA over two index
segments (window, compressed rows) of ``fp8_v4`` / ``fp8_v41`` / ``bf16`` pools, with per-head sinks.

One CTA per (query token, 64-head group, split), 16 warps, the sparse build's heads-on-M scheme
(``sparse_partitions.py``) with one K = V row of 512 values a token, eight 64-column chunks:

- two converter warpgroups (A: the default partition, chunks 0-3; B: chunks 4-7) gather their chunks of each
  64-entry tile with cp.async (no TMA: every entry is its own address) into a raw stage, in the register layout
  they read it back with (each thread reads only the bytes it copied itself), plus the tile's ue8m0 scale words
  (4-byte copies, read by all threads of the converter after a partition barrier). A tile's copies are one
  commit group, issued when the previous tile's chunks have been converted, so a copy has one tile period to
  land. Each chunk is dequantized ONCE into a bf16 NVMMA slab: e4m3 x 2^(e - 127) is exact in bf16 (4
  significant bits, fp32's exponent range), ``fp8_v4``'s RoPE chunk (7) and every ``bf16`` chunk are copied as
  they are. Masked entries (-1, outside the pool, at or past the segment's length) are masked copies: zeros.
- two consumer warpgroups: consumer i % 2 owns tile i's scores S [64 heads, 64 tokens] = sum of 8 bf16 products
  (32 wgmma) and its softmax (the entry mask read from the index rows itself: -inf where not valid); it writes P
  (bf16) and the running max for the other consumer; each accumulates half of O (256 dims, V = the same slabs,
  RoPE columns included) and releases each chunk as its P.V completes (``fragments._pv_halves_release``).

Segments: tiles never mix segments. The window's ``w_topk`` entries fill tiles ``[0, ceil(w_topk / 64))``, the
compressed rows' the tiles after, so a tile's 64 entries come from one pool (its base pointers and geometry are
scalars of the tile). A split walks a contiguous range of these tiles.

Sinks: without splits the epilogue adds ``exp2(sink x log2 e - m)`` to the row sum (both consumers: they share m
and the summed l); with splits, split 0 also writes the sink as one more partial (o = 0, lse = sink x log2 e) and
the split merge combines them, as the portable kernel (``kernels/v4_attention.py``).

Numerics: bf16 queries (no rescale: the product is bf16 x bf16), bf16 K = V, P rounded to bf16, fp32 accumulation
and softmax (exp2). Why bf16 and not the sparse build's fp16 with a per-token scale: V covers the RoPE columns,
which are bf16 in ``fp8_v4`` and not bounded by the NoPE scales, so a per-token fp16 scale could overflow.
"""
from __future__ import annotations

from .config import GLUON_IMPORT_ERROR, SMEM_LIMIT, TILE, gluon  # noqa: F401 - (re-exported for v4.py)

NCH = 8             # 64-column chunks of a 512-value row
REGS = 208          # consumers' setmaxnreg; the converters get 256 - REGS
NUM_WARPS = 4       # the default partition (converter A); the three others add 4 warps each: 16 in all
FMT_BF16, FMT_V4, FMT_V41 = 0, 1, 2


def smem_bytes(fmt: int) -> int:
    """Shared memory of one CTA: Q (8 bf16 slabs), the bf16 K = V tile (8 slabs), P, the raw stage (e4m3 and
    bf16 pieces), two scale regions [4, 64] words, xm [4, 64], 19 barriers (the buffers a format leaves unused,
    fp8_v41's bf16 piece and bf16's e4m3 piece and scale regions, are not allocated by the compiler)."""
    slab = 64 * 64 * 2
    raw = {FMT_BF16: 8 * slab, FMT_V4: 8 * 64 * 64 + slab, FMT_V41: 8 * 64 * 64}[fmt]
    scales = 0 if fmt == FMT_BF16 else 2 * 4 * 64 * 4
    return 8 * slab + 8 * slab + slab + raw + scales + 4 * 64 * 4 + 19 * 8


if gluon is not None:
    from .config import _cp_async, _cta_barrier, async_copy, fence_async_shared, gl, mbarrier
    from .config import warpgroup_mma, warpgroup_mma_wait
    from .fragments import _opaque_zero, _pv_halves_release
    NCH = gl.constexpr(NCH)   # a global read inside a jit function must be a constexpr

    # A segment, as the partitions take it: (p8, p16, p32, stride_q, page, num_slots, idx, sidx, end): the pool's
    # e4m3 / bf16 / int32 bases (the same bytes), its page stride in 16-byte units, page size and slot count, the
    # index rows, their row stride and the token's entries (v4_attention_kernel). segs: (the window's tiles, the
    # window segment, the compressed segment).

    @gluon.jit
    def _seg_valid(e, t64, segment):
        # the mask of entries e of token t64's index row in one segment (the same rule as _seg_rows')
        _p8, _p16, _p32, _stride_q, _page, num_slots, idx_rows, sidx, end = segment
        idx = gl.load(idx_rows + t64 * sidx + e, mask=e < end, other=-1)
        return (idx >= 0) & (idx < num_slots)

    @gluon.jit
    def _seg_rows(e, t64, segment, FMT: gl.constexpr):
        # (valid, data row in 32-bit words, scale row in words) of entries e of token t64's index row in one segment;
        # -1, a slot outside the pool and entries at or past the segment's end are not valid
        _p8, _p16, _p32, stride_q, page, num_slots, idx_rows, sidx, end = segment
        row_ptr = idx_rows + t64 * sidx
        idx = gl.load(row_ptr + e, mask=e < end, other=-1)
        ok = (idx >= 0) & (idx < num_slots)
        safe = gl.where(ok, idx, 0)
        pg = (safe // page).to(gl.int64) * stride_q * 4   # (stride_q: 16-byte units, so the copies stay 16-byte)
        off = (safe % page).to(gl.int64)
        if FMT == 0:
            row = pg + off * 256
            srow = row
        elif FMT == 1:
            row = pg + off * 144
            srow = pg + page * 144 + off * 2     # the page's scale rows follow its data rows (8 bytes each)
        else:
            row = pg + off * 132
            srow = row + 128                     # bytes [512, 528) of the record
        return ok, row, srow

    @gluon.jit
    def _tile_rows(ti, r, t64, segs, FMT: gl.constexpr):
        # entries r of tile ti of the token's row: the window's tiles first, then the compressed rows'
        w_tiles, window, compressed = segs
        if ti < w_tiles:
            ok, row, srow = _seg_rows(ti * 64 + r, t64, window, FMT)
            seg = 0
        else:
            ok, row, srow = _seg_rows((ti - w_tiles) * 64 + r, t64, compressed, FMT)
            seg = 1
        return ok, row, srow, seg

    @gluon.jit
    def _copy_tile(raw, segs, rows, C0: gl.constexpr, FMT: gl.constexpr, cl: gl.constexpr, kl: gl.constexpr):
        # chunks C0 .. C0 + 3 of the tile's 64 rows (and their scale words), one commit group; raw: the converter's
        # raw stage (raw8, raw16, raw_s); rows: _tile_rows' (valid, row, scale row, segment 0 / 1)
        raw8, raw16, raw_s = raw
        _w_tiles, window, compressed = segs
        ok, row, srow, seg = rows
        if seg == 0:   # (a segment's first three: its bases)
            p8 = window[0]
            p16 = window[1]
            p32 = window[2]
        else:
            p8 = compressed[0]
            p16 = compressed[1]
            p32 = compressed[2]
        cols8 = gl.arange(0, 64, layout=gl.SliceLayout(0, cl))
        cols16 = gl.arange(0, 64, layout=gl.SliceLayout(0, kl))
        ok16 = gl.convert_layout(ok, gl.SliceLayout(1, kl))
        row16 = gl.convert_layout(row, gl.SliceLayout(1, kl)) * 2
        for c in gl.static_range(C0, C0 + 4):
            if FMT == 0:
                _cp_async(raw16.index(c), p16 + row16[:, None] + c * 64 + cols16[None, :], mask=ok16[:, None])
            elif FMT == 1 and c == 7:   # fp8_v4's RoPE: 64 bf16 at bytes [448, 576) of the data row
                _cp_async(raw16.index(0), p16 + row16[:, None] + 224 + cols16[None, :], mask=ok16[:, None])
            else:
                _cp_async(raw8.index(c), p8 + (row * 4)[:, None] + c * 64 + cols8[None, :], mask=ok[:, None])
        if FMT == 1:   # one word of 4 scale bytes: chunks 0-3 (A) or 4-6 (B)
            _cp_async(raw_s.index(0), p32 + srow + C0 // 4, mask=ok)
        elif FMT == 2:  # two words: bytes 2c, 2c + 1 of chunks C0 .. C0 + 3
            _cp_async(raw_s.index(0), p32 + srow + C0 // 2, mask=ok)
            _cp_async(raw_s.index(1), p32 + srow + C0 // 2 + 1, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _scale_of(word, b: gl.constexpr):
        # 2^(e - 127) of byte b of the scale words (e = 0, a masked row: 0)
        e = (word >> (8 * b)) & 0xFF
        return (e << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _converter(C0: gl.constexpr, raw, ring, item, segs, FMT: gl.constexpr):
        # chunks C0 .. C0 + 3 of every tile (A: C0 = 0, the default partition; B: C0 = 4). raw: its raw stage (raw8,
        # raw16, raw_s); ring: the bf16 tile and its chunks' barriers (k16, k16_ready, k16_free); item: the CTA's
        # (t64, h0, sp, t0, n); segs: the segments (above _seg_valid)
        raw8, raw16, raw_s = raw
        k16, k16_ready, k16_free = ring
        t64, _h0, _sp, t0, n = item
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])   # 16 e4m3 bytes a thread, 2 rows
        kl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])    # 16 bf16 bytes a thread
        rl: gl.constexpr = gl.SliceLayout(1, cl)
        r = gl.arange(0, 64, layout=rl)
        ok, row, srow, seg = _tile_rows(t0, r, t64, segs, FMT)
        _copy_tile(raw, segs, (ok, row, srow, seg), C0, FMT, cl, kl)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, cl))
        for i in range(n):
            z = _opaque_zero(i)
            # the next tile's rows: their index loads run while this tile converts
            ok, row, srow, seg = _tile_rows(t0 + i + 1, r, t64, segs, FMT)
            ok = ok & (i + 1 < n)
            async_copy.wait_group(0)
            _cta_barrier()   # the scale words were copied by other threads of the partition
            if FMT == 1:
                s_w0 = raw_s.index(0).load(rl)
            elif FMT == 2:
                s_w0 = raw_s.index(0).load(rl)
                s_w1 = raw_s.index(1).load(rl)
            for c in gl.static_range(C0, C0 + 4):
                mbarrier.wait(k16_free.index(c), (i & 1) ^ 1, pred=i > 0)
                if FMT == 0:
                    k16.index(z + c).store(raw16.index(c).load(kl))
                elif FMT == 1 and c == 7:
                    k16.index(z + c).store(raw16.index(0).load(kl))
                elif FMT == 1:
                    s = _scale_of(s_w0, c % 4)
                    x = raw8.index(c).load(cl).to(gl.float32) * s[:, None]
                    k16.index(z + c).store(x.to(gl.bfloat16))
                else:   # fp8_v41: columns [0, 32) scaled by byte 2c, [32, 64) by byte 2c + 1
                    if c - C0 < 2:
                        s_lo = _scale_of(s_w0, (2 * c) % 4)
                        s_hi = _scale_of(s_w0, (2 * c + 1) % 4)
                    else:
                        s_lo = _scale_of(s_w1, (2 * c) % 4)
                        s_hi = _scale_of(s_w1, (2 * c + 1) % 4)
                    s2 = gl.where((cols < 32)[None, :], s_lo[:, None], s_hi[:, None])
                    x = raw8.index(c).load(cl).to(gl.float32) * s2
                    k16.index(z + c).store(x.to(gl.bfloat16))
                fence_async_shared()
                _cta_barrier()   # (the last one also: every thread has read the scale words before the refill)
                mbarrier.arrive(k16_ready.index(c), count=1)
            _copy_tile(raw, segs, (ok, row, srow, seg), C0, FMT, cl, kl)
        async_copy.wait_group(0)

    @gluon.jit
    def _tile_valid(ti, t64, segs, col_l: gl.constexpr):
        # the owner's entry mask of tile ti (the same rule as the converters' copies)
        w_tiles, window, compressed = segs
        r = gl.arange(0, 64, layout=col_l)
        if ti < w_tiles:
            ok = _seg_valid(ti * 64 + r, t64, window)
        else:
            ok = _seg_valid((ti - w_tiles) * 64 + r, t64, compressed)
        return ok

    @gluon.jit
    def _consumer(cid: gl.constexpr, queries, outputs, tiles, ring, item, segs, problem, HAS_SINK: gl.constexpr,
                  SPLIT: gl.constexpr):
        # queries: (q, stride_q_t, stride_q_h); outputs: (out, lse_out, part_o, part_lse and their strides: o_t, o_h,
        # lse_t, lse_h, po_i, po_h, pl_i); tiles: (q_smem, p_smem, xm, x_bar, p_bar, q_bar); ring, item: as the
        # converters'; segs: the segments (above _seg_valid); problem: (H, num_splits, num_parts, sinks,
        # sm_scale_log2, lse_scale)
        q, stride_q_t, stride_q_h = queries
        (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_i, stride_po_h,
         stride_pl_i) = outputs
        q_smem, p_smem, xm, x_bar, p_bar, q_bar = tiles
        k16, k16_ready, k16_free = ring
        t64, h0, sp, t0, n = item
        H, num_splits, num_parts, sinks, sm_scale_log2, lse_scale = problem
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        col_o: gl.constexpr = gl.SliceLayout(0, o_l)

        # -- Q: bf16 as it comes, this consumer's four chunks (c % 2 == cid); padded heads are zero rows --
        hq = gl.arange(0, 64, layout=gl.SliceLayout(1, ql))
        cq = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
        head = h0 + hq
        q_ok = (head < H)[:, None] & (cq >= 0)[None, :]
        q_row = q + t64 * stride_q_t + head.to(gl.int64) * stride_q_h
        for c in gl.static_range(NCH):
            if c % 2 == cid:
                q_smem.index(c).store(gl.load(q_row[:, None] + c * 64 + cq[None, :], mask=q_ok, other=0.0))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(q_bar, count=1)

        o0 = gl.zeros([64, 64], gl.float32, o_l)
        o1 = gl.zeros([64, 64], gl.float32, o_l)
        o2 = gl.zeros([64, 64], gl.float32, o_l)
        o3 = gl.zeros([64, 64], gl.float32, o_l)
        m_i = gl.full([64], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([64], gl.float32, row_s)
        mbarrier.wait(q_bar, 0)
        for i in range(n):
            ph = i & 1
            z = _opaque_zero(i)
            if (i % 2) == cid:
                ok = _tile_valid(t0 + i, t64, segs, col_o)
                sc = gl.zeros([64, 64], gl.float32, o_l)
                for k in gl.static_range(NCH):   # chunks 0, 4, 1, 5, ...: A's and B's in turn
                    mbarrier.wait(k16_ready.index((k % 2) * 4 + k // 2), ph)
                    sc = warpgroup_mma(q_smem.index(z + (k % 2) * 4 + k // 2),
                                       k16.index(z + (k % 2) * 4 + k // 2).permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                sc = gl.where(ok[None, :], sc * sm_scale_log2, float("-inf"))
                m_new = gl.maximum(m_i, gl.convert_layout(gl.max(sc, axis=1), row_s))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                p = gl.exp2(sc - gl.convert_layout(m_use, row_o)[:, None])
                alpha = gl.exp2(m_i - m_use)
                l_i = l_i * alpha + gl.convert_layout(gl.sum(p, axis=1), row_s)
                p_smem.index(z).store(p.to(gl.bfloat16))
                xm.index(0).store(m_new)
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(p_bar, count=1)
            else:
                mbarrier.wait(p_bar, ph)
                for c in gl.static_range(4):
                    mbarrier.wait(k16_ready.index(4 * cid + c), ph)
                m_new = xm.index(0).load(row_s)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_use)
                l_i = l_i * alpha
            m_i = m_new
            a2 = gl.convert_layout(alpha, row_o)[:, None]
            o0, o1, o2, o3 = _pv_halves_release(p_smem, k16, k16_free, z, cid, o0, o1, o2, o3, a2)

        # -- end: both consumers' row sums, the sink; no valid entry and no sink: l == 0 -> out 0, lse -inf --
        xm.index(2 + cid).store(l_i)
        _cta_barrier()
        mbarrier.arrive(x_bar, count=1)
        mbarrier.wait(x_bar, 0)
        l_tot = l_i + xm.index(3 - cid).load(row_s)
        hl = h0 + gl.arange(0, 64, layout=row_s)
        a_s = gl.full([64], 1.0, gl.float32, row_s)
        if HAS_SINK and not SPLIT:
            sk = gl.load(sinks + hl, mask=hl < H, other=0.0) * 1.4426950408889634
            m2 = gl.maximum(m_i, sk)
            m_use = gl.where(m2 == float("-inf"), 0.0, m2)
            a_s = gl.exp2(m_i - m_use)
            l_tot = l_tot * a_s + gl.exp2(sk - m_use)
            m_i = m2
        empty = l_tot == 0
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_tot)))
        inv = gl.convert_layout(gl.where(empty, 0.0, a_s / gl.where(empty, 1.0, l_tot)), row_o)[:, None]
        hr = gl.arange(0, 64, layout=row_o)
        cols = gl.arange(0, 64, layout=col_o)
        hh = h0 + hr
        st_ok = (hh < H)[:, None] & (cols >= 0)[None, :]
        if SPLIT:
            item = t64 * num_parts + sp
            pb = part_o + item * stride_po_i + hh.to(gl.int64)[:, None] * stride_po_h + cid * 256 + cols[None, :]
            gl.store(pb + 0, o0 * inv, mask=st_ok)
            gl.store(pb + 64, o1 * inv, mask=st_ok)
            gl.store(pb + 128, o2 * inv, mask=st_ok)
            gl.store(pb + 192, o3 * inv, mask=st_ok)
            if cid == 0:
                gl.store(part_lse + item * stride_pl_i + hl, lse, mask=hl < H)
            if HAS_SINK:
                if sp == 0:   # the sink as one more partial: weight exp(sink), value 0
                    sitem = t64 * num_parts + num_splits
                    sb = part_o + sitem * stride_po_i + hh.to(gl.int64)[:, None] * stride_po_h + cid * 256 + \
                        cols[None, :]
                    zero = gl.zeros([64, 64], gl.float32, o_l)
                    for c in gl.static_range(4):
                        gl.store(sb + c * 64, zero, mask=st_ok)
                    if cid == 0:
                        sk = gl.load(sinks + hl, mask=hl < H, other=0.0) * 1.4426950408889634
                        gl.store(part_lse + sitem * stride_pl_i + hl, sk, mask=hl < H)
        else:
            ty: gl.constexpr = out.dtype.element_ty
            ob = out + t64 * stride_o_t + hh.to(gl.int64)[:, None] * stride_o_h + cid * 256 + cols[None, :]
            gl.store(ob + 0, (o0 * inv).to(ty), mask=st_ok)
            gl.store(ob + 64, (o1 * inv).to(ty), mask=st_ok)
            gl.store(ob + 128, (o2 * inv).to(ty), mask=st_ok)
            gl.store(ob + 192, (o3 * inv).to(ty), mask=st_ok)
            if cid == 0:
                gl.store(lse_out + t64 * stride_lse_t + hl * stride_lse_h, lse * lse_scale, mask=hl < H)

    @gluon.jit
    def v4_attention_kernel(tensors, window, compressed, scalars, strides, FMT: gl.constexpr,
                            HAS_W_LEN: gl.constexpr, HAS_C_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
                            SPLIT: gl.constexpr, REGS: gl.constexpr):
        # The host's bundles (v4.py), in the order of the kernel's parameters (triton launches a tuple as its leaves,
        # each specialized on its own): tensors: (q, out, lse_out, part_o, part_lse, sinks); window / compressed:
        # (e4m3, bf16, int32 bases, page stride in 16-byte units, page size, slots, index rows, their row stride,
        # topk, lengths; c_topk 0: no compressed rows); scalars: (sm_scale_log2, lse_scale, H, chunk: tiles a split
        # walks, num_splits, num_parts, num_groups, w_tiles, total_tiles); strides: q's (t, h), out's (t, h), lse's
        # (t, h), part_o's (item, h), part_lse's (item).
        q, out, lse_out, part_o, part_lse, sinks = tensors
        w8, w16, w32, w_stride, w_page, w_slots, w_idx, w_sidx, w_topk, w_len = window
        c8, c16, c32, c_stride, c_page, c_slots, c_idx, c_sidx, c_topk, c_len = compressed
        sm_scale_log2, lse_scale, H, chunk, num_splits, num_parts, num_groups, w_tiles, total_tiles = scalars
        (stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_i, stride_po_h,
         stride_pl_i) = strides
        t = gl.program_id(0) // num_groups
        h0 = (gl.program_id(0) % num_groups) * 64
        sp = gl.program_id(1)
        t64 = t.to(gl.int64)
        t0 = sp * chunk
        n = gl.maximum(gl.minimum(t0 + chunk, total_tiles) - t0, 0)
        w_end = w_topk
        if HAS_W_LEN:
            w_end = gl.minimum(gl.maximum(gl.load(w_len + t), 0), w_topk)
        c_end = c_topk
        if HAS_C_LEN:
            c_end = gl.minimum(gl.maximum(gl.load(c_len + t), 0), c_topk)

        h_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        raw_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        N8: gl.constexpr = 1 if FMT == 0 else 8
        N16: gl.constexpr = 8 if FMT == 0 else 1
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], h_l)
        k16 = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], h_l)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], h_l)
        raw8 = gl.allocate_shared_memory(gl.float8e4nv, [N8, 64, 64], raw_l)
        raw16 = gl.allocate_shared_memory(gl.bfloat16, [N16, 64, 64], raw_l)
        raw_sa = gl.allocate_shared_memory(gl.int32, [4, 64], vec_l)
        raw_sb = gl.allocate_shared_memory(gl.int32, [4, 64], vec_l)
        xm = gl.allocate_shared_memory(gl.float32, [4, 64], vec_l)
        k16_ready = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())
        k16_free = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NCH):
            mbarrier.init(k16_ready.index(c), count=1)
            mbarrier.init(k16_free.index(c), count=1)
        mbarrier.init(bars.index(0), count=2)   # x_bar: the row sums at the end
        mbarrier.init(bars.index(1), count=1)   # p_bar: P complete (its owner)
        mbarrier.init(bars.index(2), count=2)   # q_bar: Q complete
        fence_async_shared()
        # the partitions' bundles (an entry the launch specialized to a constant, such as lse's head stride 1, is a
        # runtime constant from here on: the same code, the compiler folds it)
        item = (t64, h0, sp, t0, n)
        segs = (w_tiles, (w8, w16, w32, w_stride, w_page, w_slots, w_idx, w_sidx, w_end),
                (c8, c16, c32, c_stride, c_page, c_slots, c_idx, c_sidx, c_end))
        ring = (k16, k16_ready, k16_free)
        queries = (q, stride_q_t, stride_q_h)
        outputs = (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_i,
                   stride_po_h, stride_pl_i)
        tiles = (q_smem, p_smem, xm, bars.index(0), bars.index(1), bars.index(2))
        problem = (H, num_splits, num_parts, sinks, sm_scale_log2, lse_scale)
        gl.warp_specialize([
            (_converter, (0, (raw8, raw16, raw_sa), ring, item, segs, FMT)),
            (_consumer, (0, queries, outputs, tiles, ring, item, segs, problem, HAS_SINK, SPLIT)),
            (_consumer, (1, queries, outputs, tiles, ring, item, segs, problem, HAS_SINK, SPLIT)),
            (_converter, (4, (raw8, raw16, raw_sb), ring, item, segs, FMT)),
        ], [4, 4, 4], [REGS, REGS, 256 - REGS])
