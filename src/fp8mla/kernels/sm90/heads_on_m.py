"""The heads-on-M Hopper decode build (33..128 heads, one query per request, FP8 e4m3 per-tensor scales, pages of
a multiple of 64): 64 heads on the MMA's M side, the FP8 tile converted ONCE per tile into a 16-bit shared-memory
operand that both products read (design and measurements: lab/many_heads/design.md, "run 2", "conv2: prediction"
and "run 3").

One CTA per (work item, 64-head group), not persistent: the items are the product's schedule (``schedule``; with
host lengths launched longest first, ``m_list`` mapping each request's partials for the merge), CTA
``pid`` runs item ``pid // NHG`` for heads ``64 (pid % NHG) + [0, 64)`` (the head groups of an item adjacent in
the grid, as the wide build's, so a tile's second read should hit L2); CTAs past the schedule's item count
(``m_ptr[batch_size]``: CUDA graphs launch the buffers' fixed capacity) exit at once. 16 warps in four roles:

- two converter warpgroups, A (the default partition) and B, convert each landed FP8 tile into the fp16 tile
  ``k16`` [64 tokens, 576] (nine [64, 64] chunks), rows past kv_len written as 0 (an unused slot may hold NaN, and
  0 x NaN in P.V would poison the output). A also issues the TMA boxes of each tile (eight 64 x 64-byte boxes of
  c_kv, one of k_pe) into a 2-stage ring. The chunks are split by who releases them: A converts chunk 8 (k_pe, freed
  by the owner's scores), then (0, 1), (2, 3) (freed by consumer 0's P.V); B converts (4, 5), (6, 7) (consumer 1's),
  each chunk after its own free barrier, each round with its own fence + partition barrier + arrive. Two converters
  because one converter's rounds are a latency chain (load, convert, store, fence, barrier) that the next tile's
  scores wait on; split in two, the rounds of A and B overlap. B then hands the FP8 stage back on ``stage_free``
  (its last round's barrier follows all its loads), and A waits on that before the TMA refills the stage.
- two consumer warpgroups, cid 0 / 1, alternating owners: consumer i % 2 computes tile i's whole score tile
  S [64 heads, 64 tokens] = Q . K^T (chunks in the order 8, 0, 4, 1, 5, 2, 6, 3, 7), the softmax, writes P (fp16)
  and the new row maximum to shared memory; both then accumulate O [64 heads, 256 dims of cid] += P . V, releasing
  each V chunk to its converter as its MMA completes (chunk 8, k_pe, is released by the owner after its scores).

Numerics (the product's default): FP8 e4m3 -> fp16 is exact; Q x (per-tensor scale) x f (f a power of two per head,
the largest |q x scale| near 2^14) rounded once to fp16; fp16 MMAs accumulate in fp32; P in fp16; exp2 softmax with
the scores scaled by sm_scale x log2(e) / f per row, the output by ckv_scale. The protocol (barrier order, chunk
order, releases, ``stage_free``) is the prototype's ``conv2`` build's, modelled by tests/test_barrier_protocols.py.
"""
from __future__ import annotations

from .config import DC, DK, LOG2E, MH_HEADS, SMEM_LIMIT, TILE, gluon, mh_smem_bytes
from .merge import launch_merge

HEADS_PER_CTA = MH_HEADS   # (the consumers' setmaxnreg, MH_REGS = 208, leaves each converter 48 registers)
NCHUNKS = 9                # 64-column chunks of a 576-wide row (8 c_kv + 1 k_pe)


if gluon is not None:
    from .config import _cta_barrier, _tma_load, fence_async_shared, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from .fragments import _chunk_order, _opaque_zero, _pv_halves_release

    TILE_C, HG, NCH = (gl.constexpr(v) for v in (TILE, HEADS_PER_CTA, NCHUNKS))

    @gluon.jit
    def _convert_round(ring, s, z, i, keep, CA: gl.constexpr, CB: gl.constexpr, MASK: gl.constexpr,
                       cl: gl.constexpr):
        # one converter round: chunk CA (and CB >= 0 with it), each after its own free barrier (released by the
        # consumer that read it last), FP8 stage -> fp16 tile, one fence + barrier + arrive; MASK: the request's
        # last tile, rows past kv_len become 0 (they may hold NaN)
        stage, k16, ready8, k16_ready, k16_free, stage_free = ring
        mbarrier.wait(k16_free.index(CA), (i & 1) ^ 1, pred=i > 0)
        xa = stage.index(s * NCH + CA).load(cl).to(gl.float16)
        if MASK:
            xa = gl.where(keep, xa, 0.0)
        k16.index(z + CA).store(xa)
        if CB >= 0:
            mbarrier.wait(k16_free.index(CB), (i & 1) ^ 1, pred=i > 0)
            xb = stage.index(s * NCH + CB).load(cl).to(gl.float16)
            if MASK:
                xb = gl.where(keep, xb, 0.0)
            k16.index(z + CB).store(xb)
        fence_async_shared()   # generic-proxy stores before the consumers' wgmma (async proxy) reads
        _cta_barrier()         # every converter warp has stored its part of the chunk(s)
        mbarrier.arrive(k16_ready.index(CA), count=1)
        if CB >= 0:
            mbarrier.arrive(k16_ready.index(CB), count=1)

    @gluon.jit
    def _load_tile(kv_desc, kpe_desc, kv_indices, pbase, t, bar, stage, s, PAGE: gl.constexpr):
        # tile t of the request (64 tokens) lies in page kv_indices[pbase + t * 64 // PAGE] at row (t * 64) % PAGE
        page = gl.load(kv_indices + pbase + (t * TILE_C) // PAGE)
        row = page * PAGE + (t * TILE_C) % PAGE
        mbarrier.expect(bar, TILE_C * 576)
        for c in gl.static_range(NCH - 1):
            _tma_load(kv_desc, [row, c * 64], bar, stage.index(s * NCH + c))
        _tma_load(kpe_desc, [row, 0], bar, stage.index(s * NCH + NCH - 1))

    @gluon.jit
    def _convert_tile(ring, s, z, i, keep, FIRST: gl.constexpr, C0: gl.constexpr, MASK: gl.constexpr,
                      cl: gl.constexpr):
        # one converter's share of a tile: chunk FIRST alone (A: 8, the first the owner's scores need; B: none, -1),
        # then the pairs (C0, C0 + 1), (C0 + 2, C0 + 3) in the order one consumer's P.V releases them
        if FIRST >= 0:
            _convert_round(ring, s, z, i, keep, FIRST, -1, MASK, cl)
        _convert_round(ring, s, z, i, keep, C0, C0 + 1, MASK, cl)
        _convert_round(ring, s, z, i, keep, C0 + 2, C0 + 3, MASK, cl)

    @gluon.jit
    def _converter(descs, pages, ring, item, NS: gl.constexpr, PAGE: gl.constexpr):
        # converter A: the TMA of every tile, and its chunks 8, 0-3 (the ones the owner and consumer 0 release).
        # descs: (kv_desc, kpe_desc); pages: (kv_indptr, kv_indices, kv_len); ring: (stage, k16, ready8, k16_ready,
        # k16_free, stage_free); item: the CTA's work item (heads_on_m_kernel)
        kv_desc, kpe_desc = descs
        kv_indptr, kv_indices, kv_len = pages
        stage, k16, ready8, k16_ready, k16_free, stage_free = ring
        b, it, qtok, has_q, whole, hg, t0, n = item
        # one thread's 16 contiguous bytes per load (LDS.128 over the 64-byte swizzled box)
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, TILE_C, layout=gl.SliceLayout(1, cl))
        L = gl.load(kv_len + b)
        pbase = gl.load(kv_indptr + b)
        # prologue: the first NS tiles in flight
        for i in gl.static_range(NS):
            if i < n:
                _load_tile(kv_desc, kpe_desc, kv_indices, pbase, t0 + i, ready8.index(i), stage, i, PAGE)
        for i in range(n):
            s = i % NS
            valid = gl.minimum(L - (t0 + i) * TILE_C, TILE_C)
            keep = (rows < valid)[:, None]
            mbarrier.wait(ready8.index(s), (i // NS) & 1)
            z = _opaque_zero(i)   # the store addresses stay in the loop
            if valid < TILE_C:
                _convert_tile(ring, s, z, i, keep, 8, 0, True, cl)
            else:   # a full tile: no select per element
                _convert_tile(ring, s, z, i, keep, 8, 0, False, cl)
            if i + NS < n:   # the tile NS ahead goes into stage s once converter B has read its chunks of it too
                mbarrier.wait(stage_free.index(s), (i // NS) & 1)
                _load_tile(kv_desc, kpe_desc, kv_indices, pbase, t0 + i + NS, ready8.index(s), stage, s, PAGE)

    @gluon.jit
    def _converter_b(pages, ring, item, NS: gl.constexpr):
        # converter B: chunks 4-7 (the ones consumer 1 releases), beside converter A; then stage s back to A, which
        # alone refills it. Its last round's partition barrier follows every B warp's loads of the stage.
        kv_indptr, kv_indices, kv_len = pages
        stage, k16, ready8, k16_ready, k16_free, stage_free = ring
        b, it, qtok, has_q, whole, hg, t0, n = item
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, TILE_C, layout=gl.SliceLayout(1, cl))
        L = gl.load(kv_len + b)
        for i in range(n):
            s = i % NS
            valid = gl.minimum(L - (t0 + i) * TILE_C, TILE_C)
            keep = (rows < valid)[:, None]
            mbarrier.wait(ready8.index(s), (i // NS) & 1)
            z = _opaque_zero(i)
            if valid < TILE_C:
                _convert_tile(ring, s, z, i, keep, -1, 4, True, cl)
            else:
                _convert_tile(ring, s, z, i, keep, -1, 4, False, cl)
            mbarrier.arrive(stage_free.index(s), count=1)

    @gluon.jit
    def _consumer(cid: gl.constexpr, queries, outputs, pages, tiles, item, problem):
        # queries, outputs, pages: the bundles the wide build's partitions take (kernel.py); tiles: (q_smem, k16,
        # p_smem, xm, k16_ready, k16_free, x_bar, p_bar, q_bar); item: the CTA's work item; problem: (H,
        # sm_scale_log2, scales)
        q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h = queries
        (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
         stride_pl_i) = outputs
        kv_indptr, kv_indices, kv_len = pages
        q_smem, k16, p_smem, xm, k16_ready, k16_free, x_bar, p_bar, q_bar = tiles
        b, it, qtok, has_q, whole, hg, t0, n = item
        H, sm_scale_log2, scales = problem
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        ckv_scale = gl.load(scales)
        kpe_scale = gl.load(scales + 1)

        # -- Q: per-head power-of-two range factor f, then Q x scale x f in fp16 (consumer cid stores its chunks);
        # heads past H are zero rows (scores 0, never stored) --
        hq = gl.arange(0, HG, layout=gl.SliceLayout(1, ql))
        cq = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
        head = hg * HG + hq
        q_ok = (head < H)[:, None] & (cq >= 0)[None, :]
        qn_row = q_nope + qtok * stride_qn_t + head.to(gl.int64) * stride_qn_h
        qp_row = q_pe + qtok * stride_qp_t + head.to(gl.int64) * stride_qp_h
        amax = gl.zeros([HG], gl.float32, gl.SliceLayout(1, ql))
        for c in gl.static_range(NCH - 1):
            x = gl.load(qn_row[:, None] + c * 64 + cq[None, :], mask=q_ok, other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), axis=1))
        amax = amax * ckv_scale
        xp = gl.load(qp_row[:, None] + cq[None, :], mask=q_ok, other=0.0)
        amax = gl.maximum(amax, gl.max(gl.abs(xp.to(gl.float32)), axis=1) * kpe_scale)
        f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
        for c in gl.static_range(NCH):
            if c % 2 == cid:
                if c < NCH - 1:
                    x = gl.load(qn_row[:, None] + c * 64 + cq[None, :], mask=q_ok, other=0.0)
                    q_smem.index(c).store((x.to(gl.float32) * (f * ckv_scale)[:, None]).to(gl.float16))
                else:
                    q_smem.index(c).store((xp.to(gl.float32) * (f * kpe_scale)[:, None]).to(gl.float16))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(q_bar, count=1)
        tok64 = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
        row_scale_o = gl.convert_layout(sm_scale_log2 / f, row_o)
        hrow = gl.arange(0, HG, layout=row_s)
        L = gl.load(kv_len + b)

        o0 = gl.zeros([HG, 64], gl.float32, o_l)
        o1 = gl.zeros([HG, 64], gl.float32, o_l)
        o2 = gl.zeros([HG, 64], gl.float32, o_l)
        o3 = gl.zeros([HG, 64], gl.float32, o_l)
        m_i = gl.full([HG], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([HG], gl.float32, row_s)
        mbarrier.wait(q_bar, 0)
        for i in range(n):
            ph = i & 1
            valid = L - (t0 + i) * TILE_C
            z = _opaque_zero(i)
            # -- alternating owners: consumer i % 2 computes the whole S [64 heads, 64 tokens] and the softmax;
            # it hands P and the new maximum over --
            if (i % 2) == cid:
                sc = gl.zeros([HG, 64], gl.float32, o_l)
                for c in gl.static_range(NCH):   # in the order 8, 0, 4, 1, 5, ... (both converters' first chunks)
                    cc = _chunk_order(c)
                    mbarrier.wait(k16_ready.index(cc), ph)
                    sc = warpgroup_mma(q_smem.index(z + cc), k16.index(z + cc).permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                _cta_barrier()   # chunk 8 (k_pe) is read by the scores only: the next tile's goes in now
                mbarrier.arrive(k16_free.index(NCH - 1), count=1)
                sc = gl.where((tok64 < valid)[None, :], sc * row_scale_o[:, None], float("-inf"))
                m_new = gl.maximum(m_i, gl.convert_layout(gl.max(sc, axis=1), row_s))
                p = gl.exp2(sc - gl.convert_layout(m_new, row_o)[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.convert_layout(gl.sum(p, axis=1), row_s)
                p_smem.index(z).store(p.to(gl.float16))
                xm.index(0).store(m_new)
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(p_bar, count=1)
            else:
                mbarrier.wait(p_bar, ph)
                for c in gl.static_range(4):   # (implied by p_bar; cheap: already complete)
                    mbarrier.wait(k16_ready.index(4 * cid + c), ph)
                m_new = xm.index(0).load(row_s)
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha
            m_i = m_new
            # -- O [64 heads, 256 dims of this consumer] += P [64, 64 tokens] . V [64 tokens, 256]; each chunk back
            # to its converter as its MMA completes (wait depth 3, 2, 1, 0) --
            a2 = gl.convert_layout(alpha, row_o)[:, None]
            o0, o1, o2, o3 = _pv_halves_release(p_smem, k16, k16_free, z, cid, o0, o1, o2, o3, a2)

        # -- end: the row sums of both consumers (x_bar's first phase: no row-max exchange in the loop), then this
        # consumer's 256 columns: the final out/lse when the item is the whole request, else its fp32 partial. An
        # empty item (no tiles) has l = 0: o = 0, lse = -inf --
        xm.index(2 + cid).store(l_i)
        _cta_barrier()
        mbarrier.arrive(x_bar, count=1)
        mbarrier.wait(x_bar, 0)
        l_tot = l_i + xm.index(3 - cid).load(row_s)
        ok = l_tot > 0
        lse = gl.where(ok, m_i + gl.log2(gl.where(ok, l_tot, 1.0)), float("-inf"))
        inv = gl.convert_layout(gl.where(ok, ckv_scale / gl.where(ok, l_tot, 1.0), 0.0), row_o)[:, None]
        hr = gl.arange(0, HG, layout=row_o)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
        hh = hg * HG + hr
        st_ok = (hh < H)[:, None] & (cols >= 0)[None, :]
        hl = hg * HG + hrow
        if whole:
            ty = out.dtype.element_ty
            ob = out + qtok * stride_o_t + hh.to(gl.int64)[:, None] * stride_o_h + cid * 256 + cols[None, :]
            m2 = st_ok & has_q
            gl.store(ob + 0, (o0 * inv).to(ty), mask=m2)
            gl.store(ob + 64, (o1 * inv).to(ty), mask=m2)
            gl.store(ob + 128, (o2 * inv).to(ty), mask=m2)
            gl.store(ob + 192, (o3 * inv).to(ty), mask=m2)
            if cid == 0:
                gl.store(lse_out + qtok * stride_lse_t + hl, lse, mask=(hl < H) & has_q)
        else:
            pb = part_o + it.to(gl.int64) * stride_po_i + hh.to(gl.int64)[:, None] * stride_po_r + cid * 256 \
                + cols[None, :]
            gl.store(pb + 0, o0 * inv, mask=st_ok)
            gl.store(pb + 64, o1 * inv, mask=st_ok)
            gl.store(pb + 128, o2 * inv, mask=st_ok)
            gl.store(pb + 192, o3 * inv, mask=st_ok)
            if cid == 0:
                gl.store(part_lse + it.to(gl.int64) * stride_pl_i + hl, lse, mask=hl < H)

    @gluon.jit
    def heads_on_m_kernel(kv_desc, kpe_desc, requests, pages, work, results, scalars,
                          PAGE: gl.constexpr, NS: gl.constexpr, REGS: gl.constexpr, NHG: gl.constexpr):
        # Runtime values in bundles (``launch_heads_on_m`` builds them), leaves in the order of the PTX parameters the
        # SASS record holds (devtools.sass.MH_KERNEL_BUNDLES): triton flattens a tuple argument leaf by leaf into the
        # PTX parameters and specializes each leaf as it would a parameter, so the kernel compiles as with flat
        # parameters. The TMA descriptors stay parameters of their own: triton 3.6's launcher converts a descriptor only
        # at the top level.
        q_nope, q_pe, scales, qo_indptr = requests
        kv_indptr, kv_indices, kv_len = pages
        m_ptr, batch_size, item_req, item_t0, item_t1 = work
        part_o, part_lse, OUT, LSE_OUT = results
        (sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
         stride_o_t, stride_o_h, stride_lse_t) = scalars
        pid = gl.program_id(0)
        it = pid // NHG
        hg = pid % NHG
        # the schedule's item count (the end of the last request's items; any cut, any slot count: a CUDA-graph
        # wrapper's group plan shares these buffers with fewer slots); the grid may be the buffers' fixed capacity
        if it >= gl.load(m_ptr + gl.load(batch_size)):
            return
        b = gl.load(item_req + it)
        t0 = gl.load(item_t0 + it)
        t1 = gl.load(item_t1 + it)
        L = gl.load(kv_len + b)
        n = gl.maximum(t1 - t0, 0)
        whole = (t0 == 0) & (t1 == (L + TILE_C - 1) // TILE_C)
        q0 = gl.load(qo_indptr + b)
        has_q = gl.load(qo_indptr + b + 1) > q0   # a request without queries: nothing is written
        qtok = q0.to(gl.int64)

        st_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        h_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        stage = gl.allocate_shared_memory(gl.float8e4nv, [NS * NCH, TILE_C, 64], st_l)
        k16 = gl.allocate_shared_memory(gl.float16, [NCH, TILE_C, 64], h_l)
        q_smem = gl.allocate_shared_memory(gl.float16, [NCH, HG, 64], h_l)
        p_smem = gl.allocate_shared_memory(gl.float16, [1, HG, 64], h_l)   # P [64 heads, 64 tokens], by the owner
        # [slot, head]: the owner's row maximum (slot 0), the consumers' row sums at the end (slots 2, 3)
        xm = gl.allocate_shared_memory(gl.float32, [4, HG], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready8 = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        k16_ready = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())   # one per chunk
        bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready8.index(i), count=1)
        for c in gl.static_range(NCH):
            mbarrier.init(k16_ready.index(c), count=1)   # its converter, once per tile
        mbarrier.init(bars.index(0), count=2)   # x_bar: the row sums at the end
        mbarrier.init(bars.index(1), count=1)   # p_bar: P complete (its owner)
        mbarrier.init(bars.index(2), count=2)   # q_bar: Q complete
        # one free barrier per chunk: 8 by the tile's owner, 0-3 by consumer 0, 4-7 by consumer 1
        k16_free = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NCH):
            mbarrier.init(k16_free.index(c), count=1)
        # converter B's "done reading FP8 stage s" (converter A waits on it before the TMA refills stage s)
        stage_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(stage_free.index(i), count=1)
        fence_async_shared()
        # 16 warps: 2 x 128 x REGS (consumers) + 2 x 128 x (256 - REGS) (converters) = 64K registers; the default
        # partition (converter A) gets what the workers leave, the same 256 - REGS
        # the partitions' runtime values in bundles (the wide build's queries, outputs and pages among them)
        queries = (q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h)
        outputs = (OUT, LSE_OUT, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
                   stride_pl_i)
        pages = (kv_indptr, kv_indices, kv_len)
        ring = (stage, k16, ready8, k16_ready, k16_free, stage_free)
        tiles = (q_smem, k16, p_smem, xm, k16_ready, k16_free, bars.index(0), bars.index(1), bars.index(2))
        item = (b, it, qtok, has_q, whole, hg, t0, n)
        problem = (H, sm_scale_log2, scales)
        gl.warp_specialize([
            (_converter, ((kv_desc, kpe_desc), pages, ring, item, NS, PAGE)),
            (_consumer, (0, queries, outputs, pages, tiles, item, problem)),
            (_consumer, (1, queries, outputs, pages, tiles, item, problem)),
            (_converter_b, (pages, ring, item, NS)),
        ], [4, 4, 4], [REGS, REGS, 256 - REGS])


def mh_kv_descriptors(ckv_cache, kpe_cache):
    """TMA descriptors of the heads-on-M build over the pool rows: boxes of 64 rows x 64 bytes (eight per c_kv
    row, one for k_pe), 64-byte swizzle (the converters' 16-byte loads)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P, page, _ = ckv_cache.shape
    lay = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    kv = TensorDescriptor(ckv_cache, [P * page, DC], [ckv_cache.stride(1), 1], [TILE, 64], lay)
    kpe = TensorDescriptor(kpe_cache, [P * page, DK], [kpe_cache.stride(1), 1], [TILE, 64], lay)
    return kv, kpe


def launch_heads_on_m(build, kv_desc, kpe_desc, q_nope, q_pe, scales, t: dict, out, lse, *, n_items: int,
                      grid_batch: int, num_heads: int, sm_scale: float, merge_p: int = 32,
                      merge_c: int = 128) -> None:
    """The heads-on-M build's kernel + the split merge. ``build``: an ``Sm90Build`` with ``heads_on_m`` (page size
    a multiple of 64, ``nhg`` = ceil(H / 64)). ``kv_desc`` / ``kpe_desc``: ``mh_kv_descriptors`` of the pool.
    q_nope [tokens, H, 512] / q_pe [tokens, H, 64] bf16 or fp16 (one query per request), ``scales`` [2] fp32
    (ckv_scale, kpe_scale) on the device. ``t``: the plan's arrays (as ``launch``): qo_indptr, kv_indptr,
    kv_indices, kv_len (clamped), item_req / item_t0 / item_t1, part_o [items, 64 nhg, 512] / part_lse [items,
    64 nhg] fp32, m_ptr [B + 1] (m_ptr[batch_size]: the item count), m_list, batch_size [1]. ``n_items``: the items
    launched (the real count, or a cap: CTAs past the count exit).
    out [tokens, H, 512] (query dtype), lse [tokens, H] fp32 written base 2."""
    b = build
    if not b.heads_on_m or b.page_size % TILE:
        raise ValueError(f"build: expected a heads-on-M build with a page size multiple of {TILE}, got {b}")
    if b.nhg * HEADS_PER_CTA < num_heads:
        raise ValueError(f"num_heads: the build's {b.nhg} head groups take {b.nhg * HEADS_PER_CTA}, got {num_heads}")
    if mh_smem_bytes(b.stages) > SMEM_LIMIT:
        raise ValueError(f"build: {b.stages} stages need {mh_smem_bytes(b.stages)} B of shared memory, "
                         f"above {SMEM_LIMIT}")
    for name, d in (("kv_desc", kv_desc), ("kpe_desc", kpe_desc)):
        if list(d.block_shape) != [TILE, 64]:
            raise ValueError(f"{name}: expected boxes [{TILE}, 64] (mh_kv_descriptors), got {d.block_shape}")
    po, pl = t["part_o"], t["part_lse"]
    rows = HEADS_PER_CTA * b.nhg
    if po.shape[1] < rows or pl.shape[1] < rows:
        raise ValueError(f"part_o/part_lse: need {rows} head rows per item, got {po.shape[1]}/{pl.shape[1]}")
    if n_items > 0:
        # the kernel's bundles (heads_on_m_kernel: the order of each tuple is the order its unpacking reads)
        requests = (q_nope, q_pe, scales, t["qo_indptr"])
        pages = (t["kv_indptr"], t["kv_indices"], t["kv_len"])
        work = (t["m_ptr"], t["batch_size"], t["item_req"], t["item_t0"], t["item_t1"])
        results = (po, pl, out, lse)
        scalars = (sm_scale * LOG2E, num_heads, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
                   po.stride(0), po.stride(1), pl.stride(0), out.stride(0), out.stride(1), lse.stride(0))
        heads_on_m_kernel[(n_items * b.nhg,)](kv_desc, kpe_desc, requests, pages, work, results, scalars,
                                              **b.kernel_constexprs(), num_warps=4)
    launch_merge(out, lse, t, grid_batch=grid_batch, max_rows=num_heads, num_heads=num_heads, merge_p=merge_p,
                 merge_c=merge_c)
