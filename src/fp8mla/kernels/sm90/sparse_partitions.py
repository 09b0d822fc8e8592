"""The partitions of the Hopper sparse (DSA) decode kernel over ``fp8_ds_mla`` records (host side: ``sparse.py``).

One CTA per (query token, 64-head group, split); grid axis 0 = token * groups + group, so the two head groups of
an H128 token are adjacent and the second gathers its records from L2. 16 warps in four roles (``setmaxnreg``
``REGS`` for the consumers, 256 - ``REGS`` for the converters), the dense heads-on-M scheme (``heads_on_m.py``):

- converter A (the default partition: chunk 8 = k_pe and c_kv chunks 0-3) and converter B (chunks 4-7) gather
  their own chunks of each 64-entry tile (no TMA: every record is its own address) with 16-byte cp.async into a
  raw stage, in the SAME register layout they later read it with: each thread reads back only bytes it copied
  itself, so its own ``wait_group`` is enough and the chunk bytes need no barrier. Each converter also copies the
  4 group scales of the tile's 64 records (4-byte cp.async into a [4, 64] fp32 region of its own, read by all its
  threads after one partition barrier). Rounds: A (8), (0, 1), (2, 3); B (4, 5), (6, 7), one scale group per
  c_kv round. A round waits for its chunks' free barriers and its copy group, converts, stores into the 16-bit
  tile, fences, arrives ready, and only then issues the NEXT tile's copies into the pieces it has just read (one
  commit group per round, so ``wait_group(rounds - 1)`` finds the group a round needs complete, and every piece
  has a whole tile period to arrive). Masked entries (-1, out of the pool, past the split) are masked copies,
  which zero-fill: no select per element.
- per-token scale: T_t = the power of two >= the token's largest group scale (exponent bits, exact). The K row is
  stored as fp16(e4m3) x fp16(s_g / T_t) (<= 448), k_pe as bf16(k_pe / T_t) (exact), so each record stays with
  the threads that copied it (no cross-warp tile maximum). A writes T_t (0 = entry not valid) into the 2-deep
  shared vector ``tv`` for the tile's owner.
- two consumer warpgroups: consumer i % 2 owns tile i's scores S [64 heads, 64 tokens] (chunks 8, 0, 4, 1, 5, 2,
  6, 3, 7; k_pe a bf16 product) and softmax. It scales column t by T_t (0: -inf) and keeps F, the running largest
  T_t (the output's unit), in the exponent: p / F = exp2(s - (m + log2 F)), P' = (p / F) x T_t <= 1 in fp16, l
  and O in units of 1 / F, so the epilogue is O / l and lse = m + log2 F + log2 l with no cross-warp reduction
  (F is a row maximum of the broadcast T vector). The owner hands m and F to the other consumer through ``xm``;
  both accumulate half of O (256 dims) and release each V chunk as its MMA completes.

Why two ``tv`` slots: A writes ``tv[i % 2]`` after ``k16_free[8]`` of tile i - 1; the owner of tile i - 2 (same
slot) read it before its P.V of tile i - 2, which the frees of tile i - 1's chunks need, which tile i - 1's scores
need, which ``k16_free[8]`` of tile i - 1 follows. One slot would not do: the owner reads tv after releasing chunk
8. The scale regions are read by all of a converter's threads after its round's first partition barrier and
refilled only after the second.

Numerics: Q_nope x f in fp16 (f a power of two per head, largest |q| near 2^14), q_pe x f in bf16 (exact); fp32
accumulation; exp2 softmax; rel L2 vs float64 ~1.7e-3 (the bf16 output rounding alone 1.66e-3). Any topk >= 1:
the last tile of a split is masked per entry.
"""
from __future__ import annotations

from .config import GLUON_IMPORT_ERROR, SMEM_LIMIT, TILE, gluon  # noqa: F401 - (re-exported for sparse.py)

NCH = 9             # chunks of a tile: 8 c_kv (fp16) + k_pe (bf16)
REGS = 208          # consumers' setmaxnreg; the converters get 256 - REGS
NUM_WARPS = 4       # the default partition (converter A); the three others add 4 warps each: 16 in all


def smem_bytes() -> int:
    """Shared memory of one CTA: Q (8 fp16 + 1 bf16 slabs), the 16-bit tile (8 fp16 + 1 bf16), P, the raw stage
    (8 e4m3 pieces + bf16 k_pe), two scale regions, tv [2, 64], xm [4, 64], 21 barriers."""
    slab = 64 * 64 * 2
    return 9 * slab + 9 * slab + slab + (8 * 64 * 64 + 64 * 128) + 2 * 4 * 64 * 4 + 2 * 64 * 4 + 4 * 64 * 4 + 21 * 8


if gluon is not None:
    from .config import (_cp_async, _cta_barrier, async_copy, fence_async_shared, gl, mbarrier, warpgroup_mma,
                         warpgroup_mma_wait)
    from .fragments import _chunk_order, _opaque_zero, _pv_halves_release
    NCH = gl.constexpr(NCH)   # a global read inside a jit function must be a constexpr

    @gluon.jit
    def _idx(indices, idx_row, j, j1, rl: gl.constexpr):
        """Entries j .. j + 63 of the index row (-1 past the split's end)."""
        e = j + gl.arange(0, 64, layout=rl)
        return gl.load(indices + idx_row + e, mask=e < j1, other=-1)

    @gluon.jit
    def _pow2_ceil(x):
        # the power of two >= x > 0 (exact: exponent bits; x = 0 -> 1)
        b = x.to(gl.int32, bitcast=True)
        t = ((b + 0x007FFFFF) & 0x7F800000).to(gl.float32, bitcast=True)
        return gl.where(x > 0, t, 1.0)

    @gluon.jit
    def _inv_pow2(t):
        # 1 / t for a normal power of two t (exact)
        return (0x7F000000 - t.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _m_eff(m, f):
        # m + log2 F (F a power of two; F = 0: nothing valid yet, log2 taken as 0). A row that has seen nothing
        # keeps m = -inf: its old value gives alpha = 0, and the new one is taken as 0 (no NaN from -inf - -inf)
        fb = gl.where(f > 0, f, 1.0).to(gl.int32, bitcast=True)
        return m + ((fb >> 23) - 127).to(gl.float32)

    @gluon.jit
    def _copy_scales(raw_s, sa_ptr, idx, num_slots, sl: gl.constexpr):
        # the 4 group scales of each of the 64 records -> raw_s [4, 64] fp32 (4-byte copies; masked rows
        # zero-filled; sl covers 64 rows with 128 threads, so two threads copy each value: the same bytes)
        ok = (idx >= 0) & (idx < num_slots)
        rec = gl.where(ok, idx, 0).to(gl.int64) * 164
        for g in gl.static_range(4):
            _cp_async(raw_s.index(g), sa_ptr + rec + g, mask=ok)

    @gluon.jit
    def _copy_ckv(raw_c, ckv_ptr, idx, num_slots, C: gl.constexpr, cl: gl.constexpr):
        ok = (idx >= 0) & (idx < num_slots)
        rec = gl.where(ok, idx, 0).to(gl.int64)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, cl))
        _cp_async(raw_c.index(C), ckv_ptr + rec[:, None] * 656 + C * 64 + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def _copy_kpe(raw_k, kpe_ptr, idx, num_slots, kl: gl.constexpr):
        ok = (idx >= 0) & (idx < num_slots)
        rec = gl.where(ok, idx, 0).to(gl.int64)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, kl))
        _cp_async(raw_k, kpe_ptr + rec[:, None] * 328 + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def _ratios(raw_s, G0: gl.constexpr, rl: gl.constexpr):
        # (T_t, s_G0 / T_t, s_(G0+1) / T_t) of the 64 rows, in the row layout rl
        s0 = raw_s.index(0).load(rl)
        s1 = raw_s.index(1).load(rl)
        s2 = raw_s.index(2).load(rl)
        s3 = raw_s.index(3).load(rl)
        t = _pow2_ceil(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)))
        it = _inv_pow2(t)
        if G0 == 0:
            return t, s0 * it, s1 * it
        else:
            return t, s2 * it, s3 * it

    @gluon.jit
    def _conv_ckv(raw_c, k16, z, C: gl.constexpr, r16, cl: gl.constexpr):
        # e4m3 -> fp16 (exact) x fp16(s_g / T_t) -> slab C of the 16-bit tile
        x = raw_c.index(C).load(cl).to(gl.float16)
        k16.index(z + C).store(x * r16[:, None])

    @gluon.jit
    def _round_ckv(records, raw, ring, idx_n, z, i, r16, C: gl.constexpr, NG: gl.constexpr, cl: gl.constexpr):
        # one c_kv round: chunks C, C + 1 (one scale group) of tile i, then tile i + 1's copies of them
        ckv_ptr, sa_ptr, kpe_ptr, indices, num_slots = records
        raw_c, raw_k, raw_s = raw
        k16, kpe16, tv, k16_ready, k16_free = ring
        mbarrier.wait(k16_free.index(C), (i & 1) ^ 1, pred=i > 0)
        mbarrier.wait(k16_free.index(C + 1), (i & 1) ^ 1, pred=i > 0)
        async_copy.wait_group(NG - 1)
        _conv_ckv(raw_c, k16, z, C, r16, cl)
        _conv_ckv(raw_c, k16, z, C + 1, r16, cl)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(k16_ready.index(C), count=1)
        mbarrier.arrive(k16_ready.index(C + 1), count=1)
        _copy_ckv(raw_c, ckv_ptr, idx_n, num_slots, C, cl)
        _copy_ckv(raw_c, ckv_ptr, idx_n, num_slots, C + 1, cl)
        async_copy.commit_group()

    @gluon.jit
    def _converter_a(records, raw, ring, item):
        # chunk 8 (k_pe) and c_kv chunks 0-3; T_t for the owner. records: the pool's three views, the index rows
        # and the slot count; raw: this converter's raw stage (raw_c, raw_k, raw_s); ring: the 16-bit tile, tv and
        # the chunk barriers; item: the CTA's (token, head group, split) (sparse_mla_kernel)
        ckv_ptr, sa_ptr, kpe_ptr, indices, num_slots = records
        raw_c, raw_k, raw_s = raw
        k16, kpe16, tv, k16_ready, k16_free = ring
        t64, h0, sp, idx_row, j0, j1, n = item
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])   # 16 e4m3 bytes a thread, 2 rows
        kl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])    # 16 bf16 bytes, same rows as cl
        sl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        rl: gl.constexpr = gl.SliceLayout(1, cl)
        krl: gl.constexpr = gl.SliceLayout(1, kl)
        # prologue: tile 0's copies, one group per round (8 + scales), (0, 1), (2, 3)
        idx_c = _idx(indices, idx_row, j0, j1, rl)
        _copy_kpe(raw_k, kpe_ptr, gl.convert_layout(idx_c, krl), num_slots, kl)
        _copy_scales(raw_s, sa_ptr, _idx(indices, idx_row, j0, j1, sl), num_slots, sl)
        async_copy.commit_group()
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 0, cl)
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 1, cl)
        async_copy.commit_group()
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 2, cl)
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 3, cl)
        async_copy.commit_group()
        idx_n = _idx(indices, idx_row, j0 + 64, j1, rl)
        idx_sn = _idx(indices, idx_row, j0 + 64, j1, sl)
        for i in range(n):
            j = j0 + i * 64
            z = _opaque_zero(i)
            # index rows two tiles ahead (the scale copies' too): their latency hides under this tile
            idx_nn = _idx(indices, idx_row, j + 128, j1, rl)
            idx_snn = _idx(indices, idx_row, j + 128, j1, sl)
            # -- round (8): scales -> T_t, k_pe / T_t (bf16, exact), tv for the owner --
            mbarrier.wait(k16_free.index(8), (i & 1) ^ 1, pred=i > 0)
            async_copy.wait_group(2)
            _cta_barrier()   # the scale region was copied by other threads
            t, r0, r1 = _ratios(raw_s, 0, rl)
            ok_c = (idx_c >= 0) & (idx_c < num_slots)
            tv.index(i % 2).store(gl.where(ok_c, t, 0.0))
            it = gl.convert_layout(_inv_pow2(t), krl)
            kp = raw_k.load(kl).to(gl.float32) * it[:, None]
            kpe16.index(z).store(kp.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()   # also: every thread has read the scale region before it is refilled
            mbarrier.arrive(k16_ready.index(8), count=1)
            _copy_kpe(raw_k, kpe_ptr, gl.convert_layout(idx_n, krl), num_slots, kl)
            _copy_scales(raw_s, sa_ptr, idx_sn, num_slots, sl)
            async_copy.commit_group()
            r0h = r0.to(gl.float16)
            r1h = r1.to(gl.float16)
            # -- rounds (0, 1) and (2, 3): scale groups 0 and 1 --
            _round_ckv(records, raw, ring, idx_n, z, i, r0h, 0, 3, cl)
            _round_ckv(records, raw, ring, idx_n, z, i, r1h, 2, 3, cl)
            idx_c = idx_n
            idx_n = idx_nn
            idx_sn = idx_snn
        async_copy.wait_group(0)

    @gluon.jit
    def _converter_b(records, raw, ring, item):
        # c_kv chunks 4-7 (scale groups 2, 3), with its own copy of the scales (raw's raw_s; raw_k unused)
        ckv_ptr, sa_ptr, kpe_ptr, indices, num_slots = records
        raw_c, raw_k, raw_s = raw
        k16, kpe16, tv, k16_ready, k16_free = ring
        t64, h0, sp, idx_row, j0, j1, n = item
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        sl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        rl: gl.constexpr = gl.SliceLayout(1, cl)
        idx_c = _idx(indices, idx_row, j0, j1, rl)
        _copy_scales(raw_s, sa_ptr, _idx(indices, idx_row, j0, j1, sl), num_slots, sl)
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 4, cl)
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 5, cl)
        async_copy.commit_group()
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 6, cl)
        _copy_ckv(raw_c, ckv_ptr, idx_c, num_slots, 7, cl)
        async_copy.commit_group()
        idx_n = _idx(indices, idx_row, j0 + 64, j1, rl)
        idx_sn = _idx(indices, idx_row, j0 + 64, j1, sl)
        for i in range(n):
            j = j0 + i * 64
            z = _opaque_zero(i)
            idx_nn = _idx(indices, idx_row, j + 128, j1, rl)
            idx_snn = _idx(indices, idx_row, j + 128, j1, sl)
            # -- round (4, 5) with the scales (group 2), then the next tile's scales --
            mbarrier.wait(k16_free.index(4), (i & 1) ^ 1, pred=i > 0)
            mbarrier.wait(k16_free.index(5), (i & 1) ^ 1, pred=i > 0)
            async_copy.wait_group(1)
            _cta_barrier()   # the scale region was copied by other threads
            t, r2, r3 = _ratios(raw_s, 2, rl)
            r2h = r2.to(gl.float16)
            r3h = r3.to(gl.float16)
            _conv_ckv(raw_c, k16, z, 4, r2h, cl)
            _conv_ckv(raw_c, k16, z, 5, r2h, cl)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(k16_ready.index(4), count=1)
            mbarrier.arrive(k16_ready.index(5), count=1)
            _copy_scales(raw_s, sa_ptr, idx_sn, num_slots, sl)
            _copy_ckv(raw_c, ckv_ptr, idx_n, num_slots, 4, cl)
            _copy_ckv(raw_c, ckv_ptr, idx_n, num_slots, 5, cl)
            async_copy.commit_group()
            # -- round (6, 7): group 3 --
            _round_ckv(records, raw, ring, idx_n, z, i, r3h, 6, 2, cl)
            idx_c = idx_n
            idx_n = idx_nn
            idx_sn = idx_snn
        async_copy.wait_group(0)

    @gluon.jit
    def _consumer(cid: gl.constexpr, queries, outputs, tiles, item, problem, SPLIT: gl.constexpr):
        # queries, outputs: the bundles of the dense builds (kernel.py); tiles: (q_smem, qpe_smem, k16, kpe16,
        # p_smem, xm, tv, k16_ready, k16_free, x_bar, p_bar, q_bar); item: as the converters'; problem: (H,
        # num_splits, sm_scale_log2, lse_scale, stride_lse_h)
        q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h = queries
        (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_h,
         stride_pl_i) = outputs
        q_smem, qpe_smem, k16, kpe16, p_smem, xm, tv, k16_ready, k16_free, x_bar, p_bar, q_bar = tiles
        t64, h0, sp, idx_row, j0, j1, n = item
        H, num_splits, sm_scale_log2, lse_scale, stride_lse_h = problem
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        col_o: gl.constexpr = gl.SliceLayout(0, o_l)

        # -- Q: per-head power of two f (largest |q_nope|, |q_pe| near 2^14); q_nope x f fp16, q_pe x f bf16 --
        hq = gl.arange(0, 64, layout=gl.SliceLayout(1, ql))
        cq = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
        head = h0 + hq
        q_ok = (head < H)[:, None] & (cq >= 0)[None, :]
        qn_row = q_nope + t64 * stride_qn_t + head.to(gl.int64) * stride_qn_h
        qp_row = q_pe + t64 * stride_qp_t + head.to(gl.int64) * stride_qp_h
        amax = gl.zeros([64], gl.float32, gl.SliceLayout(1, ql))
        for c in gl.static_range(8):
            x = gl.load(qn_row[:, None] + c * 64 + cq[None, :], mask=q_ok, other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), axis=1))
        xp = gl.load(qp_row[:, None] + cq[None, :], mask=q_ok, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(xp), axis=1))
        f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
        for c in gl.static_range(NCH):
            if c % 2 == cid:
                if c < NCH - 1:
                    x = gl.load(qn_row[:, None] + c * 64 + cq[None, :], mask=q_ok, other=0.0)
                    q_smem.index(c).store((x.to(gl.float32) * f[:, None]).to(gl.float16))
                else:
                    qpe_smem.index(0).store((xp * f[:, None]).to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(q_bar, count=1)
        row_scale_o = gl.convert_layout(sm_scale_log2 / f, row_o)

        o0 = gl.zeros([64, 64], gl.float32, o_l)
        o1 = gl.zeros([64, 64], gl.float32, o_l)
        o2 = gl.zeros([64, 64], gl.float32, o_l)
        o3 = gl.zeros([64, 64], gl.float32, o_l)
        m_i = gl.full([64], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([64], gl.float32, row_s)
        big_f = gl.zeros([64], gl.float32, row_s)   # per row: the running largest T_t (0: none yet)
        mbarrier.wait(q_bar, 0)
        for i in range(n):
            ph = i & 1
            z = _opaque_zero(i)
            if (i % 2) == cid:
                sc = gl.zeros([64, 64], gl.float32, o_l)
                for c in gl.static_range(NCH):
                    cc = _chunk_order(c)
                    mbarrier.wait(k16_ready.index(cc), ph)
                    if c == 0:   # chunk order 8, 0, 4, ...: the first is k_pe (bf16)
                        sc = warpgroup_mma(qpe_smem.index(z), kpe16.index(z).permute((1, 0)), sc, is_async=True)
                    else:
                        sc = warpgroup_mma(q_smem.index(z + cc), k16.index(z + cc).permute((1, 0)), sc,
                                           is_async=True)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                _cta_barrier()
                mbarrier.arrive(k16_free.index(NCH - 1), count=1)
                # -- per-token scales: column t x T_t (0: not valid, -inf); F (per row: the running largest
                # T_t, the same in every row) is folded into the exponent: p / F = exp2(s - (m + log2 F)), so
                # P' = (p / F) x T_t <= 1 in fp16 and l, O are kept in units of 1 / F --
                tq = tv.index(i % 2).load(col_o)
                sc = gl.where((tq > 0)[None, :], sc * row_scale_o[:, None] * tq[None, :], float("-inf"))
                _, tb = gl.broadcast(sc, tq[None, :])
                f_new = gl.maximum(big_f, gl.convert_layout(gl.max(tb, axis=1), row_s))
                m_new = gl.maximum(m_i, gl.convert_layout(gl.max(sc, axis=1), row_s))
                m_e = _m_eff(gl.where(m_new == float("-inf"), 0.0, m_new), f_new)
                p = gl.exp2(sc - gl.convert_layout(m_e, row_o)[:, None])
                alpha = gl.exp2(_m_eff(m_i, big_f) - m_e)
                l_i = l_i * alpha + gl.convert_layout(gl.sum(p, axis=1), row_s)
                p_smem.index(z).store((p * tq[None, :]).to(gl.float16))
                xm.index(0).store(m_new)
                xm.index(1).store(f_new)
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(p_bar, count=1)
            else:
                mbarrier.wait(p_bar, ph)
                for c in gl.static_range(4):
                    mbarrier.wait(k16_ready.index(4 * cid + c), ph)
                m_new = xm.index(0).load(row_s)
                f_new = xm.index(1).load(row_s)
                m_e = _m_eff(gl.where(m_new == float("-inf"), 0.0, m_new), f_new)
                alpha = gl.exp2(_m_eff(m_i, big_f) - m_e)
                l_i = l_i * alpha
            m_i = m_new
            big_f = f_new
            a2 = gl.convert_layout(alpha, row_o)[:, None]
            o0, o1, o2, o3 = _pv_halves_release(p_smem, k16, k16_free, z, cid, o0, o1, o2, o3, a2)

        # -- end: both consumers' row sums; no valid entry: l == 0 -> out 0, lse -inf (NaN stays NaN) --
        xm.index(2 + cid).store(l_i)
        _cta_barrier()
        mbarrier.arrive(x_bar, count=1)
        mbarrier.wait(x_bar, 0)
        l_tot = l_i + xm.index(3 - cid).load(row_s)
        empty = l_tot == 0
        lse = gl.where(empty, float("-inf"), _m_eff(m_i, big_f) + gl.log2(gl.where(empty, 1.0, l_tot)))
        inv = gl.convert_layout(gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_tot)), row_o)[:, None]
        hr = gl.arange(0, 64, layout=row_o)
        cols = gl.arange(0, 64, layout=col_o)
        hh = h0 + hr
        st_ok = (hh < H)[:, None] & (cols >= 0)[None, :]
        hl = h0 + gl.arange(0, 64, layout=row_s)
        if SPLIT:
            item = t64 * num_splits + sp
            pb = part_o + item * stride_po_i + hh.to(gl.int64)[:, None] * stride_po_h + cid * 256 + cols[None, :]
            gl.store(pb + 0, o0 * inv, mask=st_ok)
            gl.store(pb + 64, o1 * inv, mask=st_ok)
            gl.store(pb + 128, o2 * inv, mask=st_ok)
            gl.store(pb + 192, o3 * inv, mask=st_ok)
            if cid == 0:
                gl.store(part_lse + item * stride_pl_i + hl, lse, mask=hl < H)
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
    def sparse_mla_kernel(inputs, results, sizes, strides, SPLIT: gl.constexpr, REGS: gl.constexpr):
        # Runtime values in bundles (``sparse.sparse_mla`` builds them), leaves in the order of the PTX parameters the
        # SASS record holds (devtools.sass.SPARSE_BUNDLES): triton flattens a tuple argument leaf by leaf into the PTX
        # parameters and specializes each leaf as it would a parameter (stride_lse_h == 1 a constexpr), so the kernel
        # compiles as with flat parameters.
        q_nope, q_pe, ckv_ptr, sa_ptr, kpe_ptr, indices = inputs
        out, lse_out, part_o, part_lse = results
        sm_scale_log2, lse_scale, H, num_slots, topk, chunk, num_splits, num_groups = sizes
        (stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_idx_t, stride_o_t, stride_o_h, stride_lse_t,
         stride_lse_h, stride_po_i, stride_po_h, stride_pl_i) = strides
        t = gl.program_id(0) // num_groups
        h0 = (gl.program_id(0) % num_groups) * 64
        sp = gl.program_id(1)
        t64 = t.to(gl.int64)
        idx_row = t64 * stride_idx_t
        j0 = sp * chunk
        j1 = gl.minimum(j0 + chunk, topk)
        n = gl.maximum((j1 - j0 + 63) // 64, 0)

        h_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        raw_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        q_smem = gl.allocate_shared_memory(gl.float16, [8, 64, 64], h_l)
        qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], h_l)
        k16 = gl.allocate_shared_memory(gl.float16, [8, 64, 64], h_l)
        kpe16 = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], h_l)
        p_smem = gl.allocate_shared_memory(gl.float16, [1, 64, 64], h_l)
        raw_c = gl.allocate_shared_memory(gl.float8e4nv, [8, 64, 64], raw_l)
        raw_k = gl.allocate_shared_memory(gl.bfloat16, [64, 64], raw_l)
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        raw_sa = gl.allocate_shared_memory(gl.float32, [4, 64], vec_l)
        raw_sb = gl.allocate_shared_memory(gl.float32, [4, 64], vec_l)
        tv = gl.allocate_shared_memory(gl.float32, [2, 64], vec_l)
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
        # the partitions' runtime values in bundles (queries and outputs as the dense builds')
        queries = (q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h)
        outputs = (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_h,
                   stride_pl_i)
        records = (ckv_ptr, sa_ptr, kpe_ptr, indices, num_slots)
        ring = (k16, kpe16, tv, k16_ready, k16_free)
        tiles = (q_smem, qpe_smem, k16, kpe16, p_smem, xm, tv, k16_ready, k16_free, bars.index(0), bars.index(1),
                 bars.index(2))
        item = (t64, h0, sp, idx_row, j0, j1, n)
        problem = (H, num_splits, sm_scale_log2, lse_scale, stride_lse_h)
        gl.warp_specialize([
            (_converter_a, (records, (raw_c, raw_k, raw_sa), ring, item)),
            (_consumer, (0, queries, outputs, tiles, item, problem, SPLIT)),
            (_consumer, (1, queries, outputs, tiles, item, problem, SPLIT)),
            (_converter_b, (records, (raw_c, raw_k, raw_sb), ring, item)),
        ], [4, 4, 4], [REGS, REGS, 256 - REGS])

