"""Hopper (sm_90) MLA decode at 33..128 heads, the dims-split variant (../shared/DECODE_V2.md section 3, "H128").

Same grid, schedule, producer, ring and partial format as ``decode_sm90``'s wide variant (a CTA owns a head group
of 64 heads, NHG = ceil(H / 64) CTAs per schedule slot; ``part_o[item, head, 512]``, ``part_lse``; the adapter is
unchanged; the merge is decode_sm90's, ``launch_merge``), but the two consumer warpgroups share the work of a
tile differently:

  * QK + softmax alternate by tile parity: consumer (ring position % 2) computes S^T [64 tok, 64 heads] = K . Q^T
    for the tile (N = 64, 36 m64n64k16; K converted FP8 -> fp16 once per tile, by that consumer only) and the
    online softmax of all 64 heads. The running max (and row sum) is a chain across tiles, handed over through a
    shared-memory slot and an mbarrier ("P ready"); the owner issues its QK before waiting for the previous tile's
    max, so one consumer's QK overlaps the other's softmax (FlashMLA's "seesaw").
  * the owner writes P^T (fp16 [64 heads, 64 tok]), alpha (the per-head rescale), m and l of the tile into slot
    (ring position % 2) and arrives on its "P ready" barrier.
  * BOTH consumers then do the P.V of the tile on their own half of the dims: consumer d owns O^T [256 dims (256d..),
    64 heads] fp32 (4 x 32 = 128 registers), converts only its half of V (4 chunks of 64 dims x 64 tokens,
    16 m64n64k16) and rescales its O by the slot's alpha first.
  * a consumer's loop runs over the tiles it owns: QK(j), wait P(j-1), softmax(j), publish P(j), PV(j-1), PV(j);
    a trailing tile owned by the other consumer is done after the loop. A stage is released after both PVs
    (empty barrier, 2 arrivals); slot s is written only by consumer s and reused only after the other consumer's PV
    of its previous use ("P free", 1 arrival).
  * m and l live in the slots (a per-thread [64]-head vector costs 16 registers; O takes 128): the owner of a tile
    reads the previous tile's m, l from the other slot; at the end of an item both read the last tile's m, l, write
    their half of the dims (out directly when the item is the whole request, else the fp32 partial); consumer 0
    writes lse.
  * Q (64 heads x 576, fp16, 72 KB) is shared: each consumer loads 32 heads; two rendezvous barriers per item (both
    done with the previous item's QKs; both halves of Q stored) keep it consistent. The per-head score scale goes
    to shared memory with it (read by each softmax).

Shared memory at NS = 3: ring 108 KB, Q^T 72 KB, two P^T slots 16 KB, stats 1.8 KB (NS = 4 does not fit).
Tail tiles: the owner zeroes the stage's rows >= valid before its QK (NaN in unused slots), masks the scores;
the other consumer reads that stage's V only after "P ready". Items of 0 tiles: o = 0, lse = -inf.
Compile (sm_90a, setmaxnreg 240/24, ``compile_report``): no C7512; 84 HGMMA m64n64k16 per consumer (QK 36, P.V 16
at three call sites: 36 + 32 per own tile pair step); spills 16 B (triton 3.9) / 4 B (3.6, the H200's) at page 64,
none between a consumer's first and last HGMMA; LDS.U8 1 (outside the loops); 203.7 KB shared memory. Two changes got
it there from 308 B with ~30 reloads per tile: the softmax stores m before computing P and l after (shorter live
ranges), and the Q^T descriptors are indexed through an opaque zero per tile (``_zero_of``; hoisted, they spilled).
Scope: one query per request, 33..128 heads, the producer's page sizes (1, 16, 32, multiples of 64), FP8 e4m3 with
per-tensor scales, bf16/fp16 queries. Not MTP.
"""
from __future__ import annotations

from fp8mla.kernels import decode_sm90 as base
from fp8mla.kernels.decode_sm90 import DC, DK, TILE, STAGE_BYTES, SMEM_LIMIT, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, fence_async_shared, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from fp8mla.kernels.decode_sm90 import (_relabel_k, _relabel_k64, _vt_chunk, _sanitize_tail, _producer, _per_item,
                              _cta_barrier)

HG = 64            # heads per CTA (the MMA's N)
NS_DEFAULT = 3
MIN_HEADS = 33     # 1..32 heads: the wide kernel's 16-head consumers fit better
MAX_HEADS = 128


def smem_bytes(ns: int) -> int:
    """Ring + Q^T (64 heads x 576 fp16) + two P^T slots + stats (8 x 64 fp32) + barriers/reduction slack."""
    return ns * STAGE_BYTES + HG * (DC + DK) * 2 + 2 * HG * TILE * 2 + 8 * HG * 4 + 2048


def nhg(num_heads: int) -> int:
    """CTAs per schedule slot (head groups of 64)."""
    if num_heads < MIN_HEADS or num_heads > MAX_HEADS:
        raise ValueError(f"num_heads: the dims-split kernel takes {MIN_HEADS}..{MAX_HEADS}, got {num_heads}")
    return -(-num_heads // HG)


def padded_heads(num_heads: int) -> int:
    """Head rows per item of part_o / part_lse (the same as decode_sm90.padded_heads for H 33..128)."""
    return HG * nhg(num_heads)


if gluon is not None:

    @gluon.jit
    def _stat(stat, k: gl.constexpr):
        # row k of the stats buffer: slot s holds alpha (3s), m (3s + 1), l (3s + 2); (static
        # offsets: slices of shared memory take constant starts; the per-head score scale is in rsc)
        return stat.slice(k * 64, 64)

    @gluon.jit
    def _zero_of(x):
        # 0, opaque to loop-invariant code motion (it depends on x): the QK's shared-memory descriptors of Q^T,
        # hoisted out of the tile loop, are 36 64-bit values that spill (triton 3.6); recomputed per tile instead
        return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _consumer_split(cid: gl.constexpr, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready,
                        pfree, qsync, q_nope, q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0,
                        item_t1, part_o, part_lse, out, lse_out, sm_scale_log2, H, NHG: gl.constexpr,
                        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                        stride_o_t, stride_o_h, stride_lse_t, NS: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 64, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        ld_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
            lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 128])
        ld64_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 64])
        L16: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32])
        kv16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        OTHER: gl.constexpr = 1 - cid

        pid = gl.program_id(0)
        slot = pid // NHG
        hg0 = (pid % NHG) * 64                 # the CTA's first head
        i0 = gl.load(cta_ptr + slot)
        i1 = gl.load(cta_ptr + slot + 1)
        ckv_scale = gl.load(scales)
        kpe_scale = gl.load(scales + 1)
        cq = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
        cp = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        my_p = pT_smem.index(cid)
        other_p = pT_smem.index(OTHER)
        g = 0
        for it in range(i0, i1):
            b = gl.load(item_req + it)
            t0 = gl.load(item_t0 + it)
            t1 = gl.load(item_t1 + it)
            L = gl.load(kv_len + b)
            qtok = gl.load(qo_indptr + b).to(gl.int64)
            n = t1 - t0
            ph = (it - i0) & 1
            # -- rendezvous 1: both consumers are past the previous item (its QKs read Q^T) -------------------
            mbarrier.arrive(qsync.index(0), count=1)
            mbarrier.wait(qsync.index(0), ph)
            # -- this consumer's 32 heads of Q^T: scales and a per-head power of two folded in, fp16, k relabelled
            hq = _per_item(gl.arange(0, 32, layout=gl.SliceLayout(1, blk)), it) + (hg0 + 32 * cid)
            h_ok = hq < H
            qn_row = q_nope + qtok * stride_qn_t + hq * stride_qn_h
            qp_row = q_pe + qtok * stride_qp_t + hq * stride_qp_h
            amax = gl.zeros([32], gl.float32, gl.SliceLayout(1, blk))
            for c in gl.static_range(4):
                x = gl.load(qn_row[:, None] + c * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
                amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), axis=1))
            amax = amax * ckv_scale
            xp = gl.load(qp_row[:, None] + cp[None, :], mask=h_ok[:, None], other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(xp.to(gl.float32)), axis=1) * kpe_scale)
            f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
            fn = f * ckv_scale
            for c in gl.static_range(4):
                x = gl.load(qn_row[:, None] + c * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
                q16 = (x.to(gl.float32) * fn[:, None]).to(gl.float16)
                q_smem.index(c).slice(32 * cid, 32, dim=0).store(_relabel_k(q16))
            qp16 = (xp.to(gl.float32) * (f * kpe_scale)[:, None]).to(gl.float16)
            qpe_smem.slice(32 * cid, 32, dim=0).store(_relabel_k64(qp16))
            rsc.slice(32 * cid, 32).store(sm_scale_log2 / f)
            fence_async_shared()
            _cta_barrier()
            # -- rendezvous 2: both halves of Q^T (and the score scales) are stored ---------------------------
            mbarrier.arrive(qsync.index(1), count=1)
            mbarrier.wait(qsync.index(1), ph)

            tok_r = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
            o0 = gl.zeros([64, 64], gl.float32, mma)
            o1 = gl.zeros([64, 64], gl.float32, mma)
            o2 = gl.zeros([64, 64], gl.float32, mma)
            o3 = gl.zeros([64, 64], gl.float32, mma)
            j0 = (cid + g) % 2            # this consumer owns ring positions g + j with (g + j) % 2 == cid
            for j in range(j0, n, 2):
                gg = g + j
                s = gg % NS
                mbarrier.wait(ready.index(s), (gg // NS) & 1)
                valid = L - (t0 + j) * 64
                if valid < 64:
                    _sanitize_tail(kbuf, pbuf, s, valid)
                # -- S^T = K . Q^T (64 tokens x 64 heads), one K chunk in flight ---------------------------------
                sT = gl.zeros([64, 64], gl.float32, mma)
                qz = _zero_of(gg)
                for c in gl.static_range(4):
                    a16 = _relabel_k(kbuf.index(s * 4 + c).load(ld_l).to(gl.float16))
                    a16 = gl.convert_layout(a16, a_l, assert_trivial=True)
                    sT = warpgroup_mma(a16, q_smem.index(qz + c).permute((1, 0)), sT, is_async=True)
                    sT, a16 = warpgroup_mma_wait(0, deps=(sT, a16))
                ap = _relabel_k64(pbuf.index(s).load(ld64_l).to(gl.float16))
                ap = gl.convert_layout(ap, a_l, assert_trivial=True)
                sT = warpgroup_mma(ap, qpe_smem.permute((1, 0)), sT, is_async=True)
                sT = warpgroup_mma_wait(0, deps=(sT,))
                # -- the previous tile's m and l (the other consumer's slot; -inf / 0 at the item's first tile) ---
                mbarrier.wait(pready.index(OTHER), ((gg - 1) // 2) & 1, pred=j > 0)
                m_prev = gl.where(j > 0, _stat(stat, OTHER * 3 + 1).load(col_l), float("-inf"))
                # -- online softmax over the tile's tokens (axis 0), log2 domain --------------------------------
                sT = sT * rsc.load(col_l)[None, :]
                sT = gl.where(tok_r[:, None] < valid, sT, float("-inf"))
                m_new = gl.maximum(m_prev, gl.max(sT, axis=0))
                alpha = gl.exp2(m_prev - m_new)
                # my slot is free once the other consumer's PV of its previous use is done
                mbarrier.wait(pfree.index(cid), ((gg // 2) - 1) & 1, pred=gg >= 2)
                _stat(stat, cid * 3 + 1).store(m_new)
                p = gl.exp2(sT - m_new[None, :])
                my_p.store(gl.permute(p.to(gl.float16), (1, 0)))
                l_prev = gl.where(j > 0, _stat(stat, OTHER * 3 + 2).load(col_l), 0.0)
                _stat(stat, cid * 3).store(alpha)
                _stat(stat, cid * 3 + 2).store(l_prev * alpha + gl.sum(p, axis=0))
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(pready.index(cid), count=1)
                # -- P.V of the previous tile (the other consumer's) and of this one, this consumer's dims ---------
                if j > 0:
                    sp = (gg - 1) % NS
                    mbarrier.wait(ready.index(sp), ((gg - 1) // NS) & 1)
                    o0, o1, o2, o3 = _pv(cid, kbuf, sp, other_p, _stat(stat, OTHER * 3), o0, o1, o2, o3,
                                         a_l, L16, kv16_l, col_l)
                    _cta_barrier()
                    mbarrier.arrive(empty.index(sp), count=1)
                    mbarrier.arrive(pfree.index(OTHER), count=1)
                o0, o1, o2, o3 = _pv(cid, kbuf, s, my_p, _stat(stat, cid * 3), o0, o1, o2, o3, a_l, L16, kv16_l,
                                     col_l)
                _cta_barrier()
                mbarrier.arrive(empty.index(s), count=1)
            # -- the item's last tile when the other consumer owns it: its P.V here ------------------------------
            gl_last = g + n - 1
            trailing = (n > 0) & ((gl_last % 2) != cid)
            if trailing:
                sl = gl_last % NS
                mbarrier.wait(pready.index(OTHER), (gl_last // 2) & 1)
                mbarrier.wait(ready.index(sl), (gl_last // NS) & 1)
                o0, o1, o2, o3 = _pv(cid, kbuf, sl, other_p, _stat(stat, OTHER * 3), o0, o1, o2, o3, a_l, L16,
                                     kv16_l, col_l)
                _cta_barrier()
                mbarrier.arrive(empty.index(sl), count=1)
            # -- final m, l: the last tile's slot (read before that slot is handed back) ------------------------
            # (n = 0: nothing was computed, the reads are discarded)
            m_fin = gl.where(trailing, _stat(stat, OTHER * 3 + 1).load(col_l), _stat(stat, cid * 3 + 1).load(col_l))
            l_fin = gl.where(trailing, _stat(stat, OTHER * 3 + 2).load(col_l), _stat(stat, cid * 3 + 2).load(col_l))
            m_fin = gl.where(n > 0, m_fin, float("-inf"))
            l_fin = gl.where(n > 0, l_fin, 0.0)
            if trailing:
                _cta_barrier()
                mbarrier.arrive(pfree.index(OTHER), count=1)
            m_use = gl.where(m_fin == float("-inf"), 0.0, m_fin)
            _store_half(cid, o0, o1, o2, o3, m_use, l_fin, ckv_scale, it, t0, t1, L, qtok, hg0, H, mma,
                        part_o, part_lse, out, lse_out, stride_po_i, stride_po_r, stride_pl_i, stride_o_t,
                        stride_o_h, stride_lse_t)
            g += n

    @gluon.jit
    def _pv(cid: gl.constexpr, kbuf, s, pT, alpha_row, o0, o1, o2, o3, a_l: gl.constexpr, L16: gl.constexpr,
            kv16_l: gl.constexpr, col_l: gl.constexpr):
        # O^T [256 dims of this consumer, 64 heads] = O^T * alpha + V^T . P^T for the tile in stage s (P^T in pT):
        # this consumer's dims are boxes 2 cid and 2 cid + 1 of the stage, 64 dims per half box.
        a2 = alpha_row.load(col_l)[None, :]
        bP = pT.permute((1, 0))
        v0 = _vt_chunk(kbuf, s * 4 + 2 * cid, 0, a_l, L16, kv16_l)
        o0 = warpgroup_mma(v0, bP, o0 * a2, is_async=True)
        o0, v0 = warpgroup_mma_wait(1, deps=(o0, v0))
        v1 = _vt_chunk(kbuf, s * 4 + 2 * cid, 1, a_l, L16, kv16_l)
        o1 = warpgroup_mma(v1, bP, o1 * a2, is_async=True)
        o1, v1 = warpgroup_mma_wait(1, deps=(o1, v1))
        v2 = _vt_chunk(kbuf, s * 4 + 2 * cid + 1, 0, a_l, L16, kv16_l)
        o2 = warpgroup_mma(v2, bP, o2 * a2, is_async=True)
        o2, v2 = warpgroup_mma_wait(1, deps=(o2, v2))
        v3 = _vt_chunk(kbuf, s * 4 + 2 * cid + 1, 1, a_l, L16, kv16_l)
        o3 = warpgroup_mma(v3, bP, o3 * a2, is_async=True)
        o3, v3 = warpgroup_mma_wait(1, deps=(o3, v3))
        return warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))

    @gluon.jit
    def _store_half(cid: gl.constexpr, o0, o1, o2, o3, m_use, l_i, ckv_scale, it, t0, t1, L, qtok, hg0, H,
                    mma: gl.constexpr, part_o, part_lse, out, lse_out, stride_po_i, stride_po_r, stride_pl_i,
                    stride_o_t, stride_o_h, stride_lse_t):
        # This consumer's dims [256 cid, 256 cid + 256) of the item's normalized output for the CTA's 64 heads:
        # the final out (and lse, consumer 0) when the item is the whole request, else the fp32 partial.
        # An empty state (l = 0) writes o = 0, lse = -inf.
        tok_r = _per_item(gl.arange(0, 64, layout=gl.SliceLayout(1, mma)), it)
        hcol = _per_item(gl.arange(0, 64, layout=gl.SliceLayout(0, mma)), it)
        dim_m = 2 * (8 * (tok_r >> 4) + (tok_r & 7)) + ((tok_r >> 3) & 1) + 256 * cid   # the PV's relabelled dims
        seen = l_i > 0
        l_safe = gl.where(seen, l_i, 1.0)
        inv = gl.where(seen, ckv_scale / l_safe, 0.0)[None, :]
        lse = gl.where(seen, m_use + gl.log2(l_safe), float("-inf"))
        heads = hcol + hg0
        row_ok = heads < H
        out_mask = row_ok[None, :] & (dim_m[:, None] >= 0)
        if (t0 == 0) & (t1 == (L + 63) // 64):
            ty = out.dtype.element_ty
            ob = out + qtok * stride_o_t + heads[None, :] * stride_o_h + dim_m[:, None]
            gl.store(ob + 0 * 64, (o0 * inv).to(ty), mask=out_mask)
            gl.store(ob + 1 * 64, (o1 * inv).to(ty), mask=out_mask)
            gl.store(ob + 2 * 64, (o2 * inv).to(ty), mask=out_mask)
            gl.store(ob + 3 * 64, (o3 * inv).to(ty), mask=out_mask)
            if cid == 0:
                gl.store(lse_out + qtok * stride_lse_t + heads, lse, mask=row_ok)
        else:
            pidx = it.to(gl.int64)
            pb = part_o + pidx * stride_po_i + heads[None, :] * stride_po_r + dim_m[:, None]
            gl.store(pb + 0 * 64, o0 * inv, mask=out_mask)
            gl.store(pb + 1 * 64, o1 * inv, mask=out_mask)
            gl.store(pb + 2 * 64, o2 * inv, mask=out_mask)
            gl.store(pb + 3 * 64, o3 * inv, mask=out_mask)
            if cid == 0:
                gl.store(part_lse + pidx * stride_pl_i + heads, lse, mask=row_ok)

    @gluon.jit
    def _split_consumer0(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync, q_nope,
                         q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out,
                         lse_out, sm_scale_log2, H, NHG: gl.constexpr, stride_qn_t, stride_qn_h, stride_qp_t,
                         stride_qp_h, stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                         NS: gl.constexpr):
        _consumer_split(0, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync, q_nope,
                        q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out,
                        lse_out, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                        stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS)

    @gluon.jit
    def _split_consumer1(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync, q_nope,
                         q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out,
                         lse_out, sm_scale_log2, H, NHG: gl.constexpr, stride_qn_t, stride_qn_h, stride_qp_t,
                         stride_qp_h, stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                         NS: gl.constexpr):
        _consumer_split(1, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync, q_nope,
                        q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out,
                        lse_out, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                        stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS)

    @gluon.jit
    def mla_decode_sm90_split_kernel(kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows,
                                     q_nope, q_pe, scales, qo_indptr, kv_indptr, kv_indices, kv_len,
                                     cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, OUT, LSE_OUT,
                                     sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                                     stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                                     PAGE: gl.constexpr, NS: gl.constexpr, REGS: gl.constexpr,
                                     MODE: gl.constexpr = 0, NHG: gl.constexpr = 2):
        # NHG CTAs per schedule slot (head groups of 64; slot = pid // NHG), adjacent in the grid: the later reads
        # of a tile should hit L2. MODE 2: the producer's timing probe (no HBM traffic).
        kv_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS * 4, 64, 128], kv_l)
        pbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS, 64, 64], kpe_l)
        q_smem = gl.allocate_shared_memory(gl.float16, [4, 64, 128], q_l)
        qpe_smem = gl.allocate_shared_memory(gl.float16, [64, 64], q_l)
        pT_smem = gl.allocate_shared_memory(gl.float16, [2, 64, 64], q_l)
        stat = gl.allocate_shared_memory(gl.float32, [8 * 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        rsc = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        qsync = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        RCNT: gl.constexpr = 128 if PAGE == 1 else 1   # page 1: one cp.async arrival per producer thread
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=RCNT)
            mbarrier.init(empty.index(i), count=2)     # both consumers' P.V read every stage
        for i in gl.static_range(2):
            mbarrier.init(pready.index(i), count=1)    # the slot's owner published P, alpha, m, l
            mbarrier.init(pfree.index(i), count=1)     # the other consumer's P.V of the slot is done
            mbarrier.init(qsync.index(i), count=2)     # per-item rendezvous of the two consumers
        fence_async_shared()
        out = OUT
        lse_out = LSE_OUT
        gl.warp_specialize([
            (_producer, (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices,
                         kv_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                         kbuf, pbuf, ready, empty, NHG, NS, PAGE, MODE, True)),
            (_split_consumer0, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync,
                                q_nope, q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o,
                                part_lse, out, lse_out, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h,
                                stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i, stride_o_t,
                                stride_o_h, stride_lse_t, NS)),
            (_split_consumer1, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, stat, rsc, pready, pfree, qsync,
                                q_nope, q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, part_o,
                                part_lse, out, lse_out, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h,
                                stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i, stride_o_t,
                                stride_o_h, stride_lse_t, NS)),
        ], [4, 4], [REGS, REGS])


def launch(kv_desc, kpe_desc, q_nope, q_pe, scales, t: dict, out, lse, *, grid: int, grid_batch: int,
           num_heads: int, sm_scale: float, page_size: int, ns: int = NS_DEFAULT, regs: int = 240,
           merge_p: int = 32, merge_c: int = 128, mode: int = 0, merge: bool = True, **_ignored):
    """``decode_sm90.launch`` for the dims-split kernel (same plan arrays ``t``, grid = slots x nhg, lse base 2);
    one query per request. Unknown keywords of the wide launch (max_rows, max_qo, causal) are accepted only with
    their one-query values."""
    LOG2E = 1.4426950408889634
    if _ignored.get("max_qo", 1) != 1:
        raise ValueError(f"max_qo: the dims-split kernel takes one query per request, got {_ignored['max_qo']}")
    g = nhg(num_heads)
    if grid % g:
        raise ValueError(f"grid: {g} head groups need a multiple of {g} CTAs, got {grid}")
    if smem_bytes(ns) > SMEM_LIMIT or ns < 2:
        raise ValueError(f"ns: the dims-split kernel's ring takes 2..3 stages, got {ns}")
    po, pl = t["part_o"], t["part_lse"]
    rows = padded_heads(num_heads)
    if po.shape[1] < rows or pl.shape[1] < rows:
        raise ValueError(f"part_o/part_lse: need {rows} head rows per item, got {po.shape[1]}/{pl.shape[1]}")
    mla_decode_sm90_split_kernel[(grid,)](
        kv_desc, kpe_desc, kv_desc.base, kpe_desc.base, kv_desc.strides[0], kpe_desc.strides[0], kv_desc.shape[0],
        q_nope, q_pe, scales, t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"],
        t["cta_ptr"], t["item_req"], t["item_t0"], t["item_t1"], po, pl, out, lse, sm_scale * LOG2E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), po.stride(0), po.stride(1),
        pl.stride(0), out.stride(0), out.stride(1), lse.stride(0), PAGE=page_size, NS=ns, REGS=regs, MODE=mode,
        NHG=g, num_warps=4)
    if not merge:
        return
    if DC % merge_c or merge_p & (merge_p - 1):
        raise ValueError(f"merge_p, merge_c: powers of two with merge_c dividing {DC}, got {merge_p}, {merge_c}")
    base.launch_merge(out, lse, t, grid_batch=grid_batch, max_rows=num_heads, num_heads=num_heads, merge_p=merge_p,
                      merge_c=merge_c)


# --------------------------------------------------------------------------------------------------------------
# Compile without a GPU: registers, spills, shared memory, SASS mix (decode_sm90.compile_report's method)
# --------------------------------------------------------------------------------------------------------------
def compile_report(page: int = 64, ns: int = NS_DEFAULT, regs: int = 240, q_dtype: str = "bf16", sass_path=None,
                   heads: int = 128, aligned_ints: bool = False) -> dict:
    """Compile the dims-split kernel for sm_90a with triton's ptxas (no GPU) and count SASS ops (``ops``), plus
    ``loops``: per consumer partition, the HGMMA, STL, LDL and LDS.U8 between its first and last HGMMA (the tile
    loop: 36 QK + 16 P.V at each of three call sites)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    if gluon is None:
        raise RuntimeError(f"gluon is not importable: {base.GLUON_IMPORT_ERROR}")
    fn = mla_decode_sm90_split_kernel
    names = fn.arg_names
    sig = {k: v for k, v in base.KERNEL_SIGNATURE.items() if k in names}
    sig.update(q_nope=f"*{q_dtype}", q_pe=f"*{q_dtype}", OUT=f"*{q_dtype}")
    rows = min(64, page)
    sig["kv_desc"] = sig["kv_desc"].replace("[64, 128]", f"[{rows}, 128]")
    sig["kpe_desc"] = sig["kpe_desc"].replace("[64, 64]", f"[{rows}, 64]")
    consts = {"PAGE": page, "NS": ns, "REGS": regs, "MODE": 0, "NHG": nhg(heads)}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                                if sig[n].startswith("*") or (aligned_ints and n in base._INT_DIV16)
                                or n in ("stride_kv_row", "stride_kpe_row")})
    return base.sass_report(src, sass_path)
