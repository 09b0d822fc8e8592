"""Hopper (sm_90) MLA decode at <= 16 heads, the software-pipelined consumer (issue 11; ``decode_sm90``'s H16 path
with each consumer's QK of its next tile issued before the softmax of its current one). Not run on a GPU yet: H200
checks and timings in ``scripts/decode_pipe_device.py``; off in the gluon backend (``GLUON_PIPELINED``).

Same grid, schedule, producer, ring, partial format and merge as ``decode_sm90``'s H16 kernel (``WIDE = False``:
one CTA per schedule slot, two consumer warpgroups take ALTERNATE 64-token tiles of the ring, S^T [64 tok, 16 heads]
= K . Q^T by swap-AB RS wgmma, O^T [512, 16] += V^T . P^T, consumer 1 hands its state to consumer 0 at the end of
an item). What changes is the order inside a consumer (``decode_sm90`` measured it latency-bound: kernel log 2/6):

    prologue   wait ready(j0), QK(j0), wait
    per own tile j with a next own tile j + 2 (same item):
        wait ready(j + 2), QK(j + 2) issued (async; its chunk-3 and k_pe MMAs left in flight)
        softmax of S(j) (complete) -> P^T to shared memory        <- runs under QK(j + 2) on the tensor core
        P.V of tile j (its first wait also completes QK(j + 2)), release stage j
    last own tile: softmax + P.V, release

Per tile the ops and their order are those of ``decode_sm90._consumer`` (QK chunks 0..3 then k_pe into a zero
accumulator, the same softmax, the same P.V chunks): partials and outputs are bit-identical to it.

Ring: a consumer holds two stages (tile j for V, tile j + 2 for K), the two consumers four. The release of tile t
needs ready(t + 2), which needs the release of t + 2 - NS: NS >= 3 is deadlock-free (NS 2 deadlocks; the protocol
is emulated in tests/test_decode_sm90_pipe.py), and the wait for ready(j + 2) at the start of consumer c's
iteration has latency slack of: NS 3: none (it needs the OTHER consumer's current tile released: the consumers
serialize), NS 4: none (it needs this consumer's previous tile, released just before: a full HBM latency per
tile), NS 5: about half a consumer iteration (the other consumer's previous tile; decode_sm90 at NS 3 has the same
slack). So the default is NS = 5, which does not fit next
to the 32 KB shared-memory exchange buffer (5 x 36 KB + Q^T 36 KB + P^T 4 KB + 32 KB > 227 KB): with
``XG`` (default for NS >= 5) consumer 1 hands its raw O^T to consumer 0 through the item's own fp32 partial slot
``part_o[item]`` in global memory (16 rows x 512 = exactly O^T; every item has a slot; the same threads write and
read the same addresses: plain LDG after a CTA barrier and an mbarrier release/acquire, no .nc path), and consumer 0 then writes the item's final
partial (or out) over it. m and l still go through shared memory. NS <= 4 keeps the shared-memory exchange.

Softmax max (``RED``, default on): the column max over the tile's 64 tokens spans the 4 warps of a consumer.
triton's reduction does it in two shared-memory round trips (partials, then the reduced value broadcast) with two
barriers, and loads the partials with a predicate into a register that ptxas then spills (1 LDL + 1 STL per tile,
in decode_sm90 too). ``_colmax`` writes each warp's 16 column maxima once, one barrier, and every thread reads the
4 x 4 values of its own MMA columns (a layout whose slice is the MMA's: the convert is free). A max is exact in any
order: the same m as gl.max. Still on the chain (P needs the tile's max); FlashMLA-style per-warp maxima with a
later fix-up would change the rounding of P (not bit-identical) and were not tried.

Wait depths (``DEPTH`` = 10 x QK + P.V MMA chunks kept in flight while the next chunk is converted; default 11,
decode_sm90's): 12, 21 and 22 are variants for the device script to time (same ops and order: bit-identical).
Under triton 3.6: 12 no spill code between the HGMMAs; 21 / 22 236 B of spill, none in the steady-state loop.

Compile (sm_90a, triton's ptxas, page 64, NS 5; ``compile_report``): triton 3.6 (the H200's) 168 registers at
launch (setmaxnreg 240 / 24 as decode_sm90), 48 B spill stores / 44 B loads, none between a consumer's first and
last HGMMA (pages 1/16, NS 3/4 likewise; RED off: 1 LDL + 1 STL per tile as decode_sm90); 68 HGMMA 64x16x16 per
steady-state iteration (QK 36 + P.V 32), LDS.U8 only outside the loops (1), no C7512; 226.5 KB shared memory.
triton 3.9: 348 B of spill, ~9 reloads per steady iteration (hoisted loop invariants; not the H200's compiler).

Scope: one query per request, 1..16 heads, the producer's page sizes (1, 16, 32, multiples of 64), FP8 e4m3 with
per-tensor scales, bf16/fp16 queries (``decode_sm90.supports`` minus MTP / wide). MODE 2 (producer timing probe:
no HBM traffic) as in decode_sm90; MODE 1 is refused. The merge is decode_sm90's (``launch_merge``); the fused
merge of decode_sm90 is not part of this kernel: ``launch`` ignores ``fused_merge`` and always runs the merge kernel.
"""
from __future__ import annotations

from fp8mla.kernels import decode_sm90 as base
from fp8mla.kernels.decode_sm90 import DC, DK, HP, TILE, STAGE_BYTES, SMEM_LIMIT, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, fence_async_shared, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from fp8mla.kernels.decode_sm90 import (_relabel_k, _relabel_k64, _vt_chunk, _sanitize_tail, _producer, _per_item,
                              _cta_barrier, _store_item)

NS_DEFAULT = 5
MAX_HEADS = HP


def smem_bytes(ns: int, global_exchange: bool | None = None) -> int:
    """Ring + two Q^T copies + two P^T tiles + the exchange (O^T fp32 [512, 16] in shared memory unless
    ``global_exchange``, default ns >= 5) + m/l + barriers (+1 KB slack)."""
    xg = ns >= 5 if global_exchange is None else global_exchange
    xo = 16 * HP * 4 if xg else DC * HP * 4
    return ns * STAGE_BYTES + 2 * HP * (DC + DK) * 2 + 2 * HP * TILE * 2 + xo + 2 * HP * 4 + 1024


if gluon is not None:

    @gluon.jit
    def _qk_issue(kbuf, pbuf, s, q_smem, my_qpe, cid: gl.constexpr, ld_l: gl.constexpr, ld64_l: gl.constexpr,
                  a_l: gl.constexpr, mma: gl.constexpr, QKW: gl.constexpr):
        # S^T = K . Q^T of stage s: decode_sm90's chunks in its order (0..3, then k_pe) into a zero accumulator;
        # returns with the last MMAs still in flight (QKW 1: chunk 3 and k_pe; QKW 2: chunks 2, 3 and k_pe; their
        # register operands returned so they stay live until the wait that completes them: the first wait of the
        # P.V that follows). QKW: K chunks in flight while the next one is converted (decode_sm90: 1).
        sT = gl.zeros([64, 16], gl.float32, mma)
        if QKW == 1:
            for c in gl.static_range(4):
                a16 = _relabel_k(kbuf.index(s * 4 + c).load(ld_l).to(gl.float16))
                a16 = gl.convert_layout(a16, a_l, assert_trivial=True)
                sT = warpgroup_mma(a16, q_smem.index(cid * 4 + c).permute((1, 0)), sT, is_async=True)
                sT, a16 = warpgroup_mma_wait(1, deps=(sT, a16))
            a3 = a16
            a2 = a16
        else:
            a0 = gl.convert_layout(_relabel_k(kbuf.index(s * 4 + 0).load(ld_l).to(gl.float16)), a_l,
                                   assert_trivial=True)
            sT = warpgroup_mma(a0, q_smem.index(cid * 4 + 0).permute((1, 0)), sT, is_async=True)
            a1 = gl.convert_layout(_relabel_k(kbuf.index(s * 4 + 1).load(ld_l).to(gl.float16)), a_l,
                                   assert_trivial=True)
            sT = warpgroup_mma(a1, q_smem.index(cid * 4 + 1).permute((1, 0)), sT, is_async=True)
            a2 = gl.convert_layout(_relabel_k(kbuf.index(s * 4 + 2).load(ld_l).to(gl.float16)), a_l,
                                   assert_trivial=True)
            sT = warpgroup_mma(a2, q_smem.index(cid * 4 + 2).permute((1, 0)), sT, is_async=True)
            sT, a2, a1, a0 = warpgroup_mma_wait(2, deps=(sT, a2, a1, a0))      # chunk 0 done
            a3 = gl.convert_layout(_relabel_k(kbuf.index(s * 4 + 3).load(ld_l).to(gl.float16)), a_l,
                                   assert_trivial=True)
            sT = warpgroup_mma(a3, q_smem.index(cid * 4 + 3).permute((1, 0)), sT, is_async=True)
            sT, a3, a2, a1 = warpgroup_mma_wait(2, deps=(sT, a3, a2, a1))      # chunk 1 done
        ap = _relabel_k64(pbuf.index(s).load(ld64_l).to(gl.float16))
        ap = gl.convert_layout(ap, a_l, assert_trivial=True)
        sT = warpgroup_mma(ap, my_qpe.permute((1, 0)), sT, is_async=True)
        return sT, a3, a2, ap

    @gluon.jit
    def _colmax(sT, red, mma: gl.constexpr):
        # max over the 64 tokens (axis 0, across the 4 warps) of S^T [64, 16]: each warp's 16 column maxima
        # (in-warp: its 16 rows) to shared memory [4, 16], one barrier, every thread reads the 4 warps' values of
        # its own 4 MMA columns and reduces them.
        # Exact (a max), so the same value as gl.max(sT, axis=0); triton's own cross-warp reduction loads the
        # partials with a predicate into a register it then spills (1 LDL + 1 STL per tile under triton 3.6).
        all_l: gl.constexpr = gl.BlockedLayout([4, 2], [8, 4], [4, 1], [1, 0])   # a thread: its mma columns
        pw = gl.max(gl.reshape(sT, [4, 16, 16]), axis=1)
        red.store(pw)
        _cta_barrier()
        mx = gl.max(red.load(all_l), axis=0)
        return gl.convert_layout(mx, gl.SliceLayout(0, mma))

    @gluon.jit
    def _softmax_tile(sT, row_scale, valid, m_i, l_acc, my_p, red, mma: gl.constexpr, RED: gl.constexpr):
        # decode_sm90's online softmax over the tile's tokens (axis 0), log2 domain; P^T to shared memory
        tok_r = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        hcol = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
        sT = sT * row_scale[None, :]
        sT = gl.where((tok_r[:, None] < valid) & (hcol[None, :] >= 0), sT, float("-inf"))
        if RED:
            m_new = gl.maximum(m_i, _colmax(sT, red, mma))
        else:
            m_new = gl.maximum(m_i, gl.max(sT, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sT - m_new[None, :])
        l_acc = l_acc * alpha[None, :] + p
        my_p.store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()
        return alpha, m_new, l_acc

    @gluon.jit
    def _pv_wait(o, v, vp, PVW: gl.constexpr):
        # after chunk k's P.V MMA: PVW chunks may stay in flight (decode_sm90: 1); vp, chunk k - 1's operand,
        # stays live while its MMA may be in flight
        if PVW == 1:
            o, v = warpgroup_mma_wait(1, deps=(o, v))
        else:
            o, v, vp = warpgroup_mma_wait(2, deps=(o, v, vp))
        return o, v, vp

    @gluon.jit
    def _pv_tile(kbuf, s, bP, alpha, o0, o1, o2, o3, o4, o5, o6, o7, sTn, a3n, a2n, apn, NEXT: gl.constexpr,
                 a_l: gl.constexpr, L16: gl.constexpr, kv16_l: gl.constexpr, PVW: gl.constexpr):
        # O^T += V^T . P^T in decode_sm90's 8 chunks of 64 dims. NEXT: the next tile's QK is in flight (issued
        # before this P.V): the first wait completes it (sTn valid after it; its operands a3n, a2n, apn kept live).
        a2 = alpha[None, :]
        v0 = _vt_chunk(kbuf, s * 4 + 0, 0, a_l, L16, kv16_l)
        o0 = warpgroup_mma(v0, bP, o0 * a2, is_async=True)
        if NEXT:
            o0, v0, sTn, a3n, a2n, apn = warpgroup_mma_wait(1, deps=(o0, v0, sTn, a3n, a2n, apn))
        else:
            o0, v0 = warpgroup_mma_wait(1, deps=(o0, v0))
        v1 = _vt_chunk(kbuf, s * 4 + 0, 1, a_l, L16, kv16_l)
        o1 = warpgroup_mma(v1, bP, o1 * a2, is_async=True)
        o1, v1, v0 = _pv_wait(o1, v1, v0, PVW)
        v2 = _vt_chunk(kbuf, s * 4 + 1, 0, a_l, L16, kv16_l)
        o2 = warpgroup_mma(v2, bP, o2 * a2, is_async=True)
        o2, v2, v1 = _pv_wait(o2, v2, v1, PVW)
        v3 = _vt_chunk(kbuf, s * 4 + 1, 1, a_l, L16, kv16_l)
        o3 = warpgroup_mma(v3, bP, o3 * a2, is_async=True)
        o3, v3, v2 = _pv_wait(o3, v3, v2, PVW)
        v4 = _vt_chunk(kbuf, s * 4 + 2, 0, a_l, L16, kv16_l)
        o4 = warpgroup_mma(v4, bP, o4 * a2, is_async=True)
        o4, v4, v3 = _pv_wait(o4, v4, v3, PVW)
        v5 = _vt_chunk(kbuf, s * 4 + 2, 1, a_l, L16, kv16_l)
        o5 = warpgroup_mma(v5, bP, o5 * a2, is_async=True)
        o5, v5, v4 = _pv_wait(o5, v5, v4, PVW)
        v6 = _vt_chunk(kbuf, s * 4 + 3, 0, a_l, L16, kv16_l)
        o6 = warpgroup_mma(v6, bP, o6 * a2, is_async=True)
        o6, v6, v5 = _pv_wait(o6, v6, v5, PVW)
        v7 = _vt_chunk(kbuf, s * 4 + 3, 1, a_l, L16, kv16_l)
        o7 = warpgroup_mma(v7, bP, o7 * a2, is_async=True)
        o7, v7, v6 = _pv_wait(o7, v7, v6, PVW)
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
        return o0, o1, o2, o3, o4, o5, o6, o7, sTn

    @gluon.jit
    def _consumer_pipe(cid: gl.constexpr, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem,
                       q_nope, q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                       part_o, part_lse, out, lse_out, xo, xml, xbar, red_smem, sm_scale_log2, H,
                       stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                       stride_o_t, stride_o_h, stride_lse_t, NS: gl.constexpr, XG: gl.constexpr,
                       RED: gl.constexpr, DEPTH: gl.constexpr):
        HPW: gl.constexpr = 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HPW, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
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

        pid = gl.program_id(0)
        i0 = gl.load(cta_ptr + pid)
        i1 = gl.load(cta_ptr + pid + 1)
        ckv_scale = gl.load(scales)
        kpe_scale = gl.load(scales + 1)
        my_qpe = qpe_smem.index(cid)
        my_p = pT_smem.index(cid)
        my_red = red_smem.index(cid)
        bP = my_p.permute((1, 0))
        hq = gl.arange(0, HPW, layout=gl.SliceLayout(1, blk))
        h_ok = hq < H
        cq = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
        cp = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        g = 0
        for it in range(i0, i1):
            b = gl.load(item_req + it)
            t0 = gl.load(item_t0 + it)
            t1 = gl.load(item_t1 + it)
            L = gl.load(kv_len + b)
            qtok = gl.load(qo_indptr + b).to(gl.int64)
            # -- Q^T for this request (decode_sm90's, unchanged) ------------------------------------------------
            qn_row = q_nope + qtok * stride_qn_t + hq * stride_qn_h
            qp_row = q_pe + qtok * stride_qp_t + hq * stride_qp_h
            amax = gl.zeros([HPW], gl.float32, gl.SliceLayout(1, blk))
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
                q_smem.index(cid * 4 + c).store(_relabel_k(q16))
            qp16 = (xp.to(gl.float32) * (f * kpe_scale)[:, None]).to(gl.float16)
            my_qpe.store(_relabel_k64(qp16))
            fence_async_shared()
            row_scale = gl.convert_layout(sm_scale_log2 / f, gl.SliceLayout(0, mma))

            o0 = gl.zeros([64, HPW], gl.float32, mma)
            o1 = gl.zeros([64, HPW], gl.float32, mma)
            o2 = gl.zeros([64, HPW], gl.float32, mma)
            o3 = gl.zeros([64, HPW], gl.float32, mma)
            o4 = gl.zeros([64, HPW], gl.float32, mma)
            o5 = gl.zeros([64, HPW], gl.float32, mma)
            o6 = gl.zeros([64, HPW], gl.float32, mma)
            o7 = gl.zeros([64, HPW], gl.float32, mma)
            m_i = gl.full([HPW], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
            l_acc = gl.zeros([64, HPW], gl.float32, mma)
            n = t1 - t0
            j0 = (cid + g) % 2          # this consumer takes the ring positions g + j with (g + j) % 2 == cid
            # -- prologue: S of the first own tile, complete -----------------------------------------------------
            sT = gl.zeros([64, HPW], gl.float32, mma)
            if j0 < n:
                gg = g + j0
                s = gg % NS
                if NS % 2 == 1:   # position gg's own barrier (its consumer is gg % 2): decode_sm90.ready_barrier
                    mbarrier.wait(ready.index((gg % 2) * NS + s), (gg // (2 * NS)) & 1)
                else:
                    mbarrier.wait(ready.index(s), (gg // NS) & 1)
                valid = L - (t0 + j0) * 64
                if valid < 64:
                    _sanitize_tail(kbuf, pbuf, s, valid)
                sT, a3, a2, ap = _qk_issue(kbuf, pbuf, s, q_smem, my_qpe, cid, ld_l, ld64_l, a_l, mma, DEPTH // 10)
                sT, a3, a2, ap = warpgroup_mma_wait(0, deps=(sT, a3, a2, ap))
            # -- steady state: QK(j + 2) in flight under softmax(j) --------------------------------------------
            for j in range(j0, n - 2, 2):
                gg = g + j
                s = gg % NS
                gn = gg + 2
                sn = gn % NS
                if NS % 2 == 1:
                    mbarrier.wait(ready.index((gn % 2) * NS + sn), (gn // (2 * NS)) & 1)
                else:
                    mbarrier.wait(ready.index(sn), (gn // NS) & 1)
                vn = L - (t0 + j + 2) * 64
                if vn < 64:
                    _sanitize_tail(kbuf, pbuf, sn, vn)
                sTn, a3n, a2n, apn = _qk_issue(kbuf, pbuf, sn, q_smem, my_qpe, cid, ld_l, ld64_l, a_l, mma,
                                               DEPTH // 10)
                alpha, m_i, l_acc = _softmax_tile(sT, row_scale, L - (t0 + j) * 64, m_i, l_acc, my_p, my_red, mma,
                                                  RED)
                o0, o1, o2, o3, o4, o5, o6, o7, sT = _pv_tile(kbuf, s, bP, alpha, o0, o1, o2, o3, o4, o5, o6, o7,
                                                              sTn, a3n, a2n, apn, True, a_l, L16, kv16_l,
                                                              DEPTH % 10)
                mbarrier.arrive(empty.index(s), count=1)   # after the partition's barrier: every warp is done
            # -- the last own tile ---------------------------------------------------------------------------
            if j0 < n:
                jl = j0 + ((n - 1 - j0) // 2) * 2
                gg = g + jl
                s = gg % NS
                alpha, m_i, l_acc = _softmax_tile(sT, row_scale, L - (t0 + jl) * 64, m_i, l_acc, my_p, my_red, mma,
                                                  RED)
                o0, o1, o2, o3, o4, o5, o6, o7, sT = _pv_tile(kbuf, s, bP, alpha, o0, o1, o2, o3, o4, o5, o6, o7,
                                                              sT, sT, sT, sT, False, a_l, L16, kv16_l,
                                                              DEPTH % 10)
                mbarrier.arrive(empty.index(s), count=1)
            # -- end of item: consumer 1 hands (o, m, l) to consumer 0, which writes the item's result ----------
            l_i = gl.sum(l_acc, axis=0)
            if XG:   # O^T through the item's own partial slot (written over by consumer 0's final partial)
                tok_x = _per_item(gl.arange(0, 64, layout=gl.SliceLayout(1, mma)), it)
                hcol_x = _per_item(gl.arange(0, HPW, layout=gl.SliceLayout(0, mma)), it)
                dim_x = 2 * (8 * (tok_x >> 4) + (tok_x & 7)) + ((tok_x >> 3) & 1)
                xg = part_o + it.to(gl.int64) * stride_po_i + hcol_x[None, :] * stride_po_r + dim_x[:, None]
            if cid == 1:
                mbarrier.wait(xbar.index(1), ((it - i0) & 1) ^ 1, pred=it > i0)
                if XG:
                    gl.store(xg + 0 * 64, o0)
                    gl.store(xg + 1 * 64, o1)
                    gl.store(xg + 2 * 64, o2)
                    gl.store(xg + 3 * 64, o3)
                    gl.store(xg + 4 * 64, o4)
                    gl.store(xg + 5 * 64, o5)
                    gl.store(xg + 6 * 64, o6)
                    gl.store(xg + 7 * 64, o7)
                else:
                    xo.slice(0 * 64, 64).store(o0)
                    xo.slice(1 * 64, 64).store(o1)
                    xo.slice(2 * 64, 64).store(o2)
                    xo.slice(3 * 64, 64).store(o3)
                    xo.slice(4 * 64, 64).store(o4)
                    xo.slice(5 * 64, 64).store(o5)
                    xo.slice(6 * 64, 64).store(o6)
                    xo.slice(7 * 64, 64).store(o7)
                xml.slice(0, HPW).store(m_i)
                xml.slice(HPW, HPW).store(l_i)
                _cta_barrier()
                mbarrier.arrive(xbar.index(0), count=1)
            else:
                mbarrier.wait(xbar.index(0), (it - i0) & 1)
                m1 = xml.slice(0, HPW).load(gl.SliceLayout(0, mma))
                l1 = xml.slice(HPW, HPW).load(gl.SliceLayout(0, mma))
                m_new = gl.maximum(m_i, m1)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                a0 = gl.exp2(m_i - m_use)[None, :]
                a1 = gl.exp2(m1 - m_use)[None, :]
                if XG:
                    o0 = o0 * a0 + gl.load(xg + 0 * 64) * a1
                    o1 = o1 * a0 + gl.load(xg + 1 * 64) * a1
                    o2 = o2 * a0 + gl.load(xg + 2 * 64) * a1
                    o3 = o3 * a0 + gl.load(xg + 3 * 64) * a1
                    o4 = o4 * a0 + gl.load(xg + 4 * 64) * a1
                    o5 = o5 * a0 + gl.load(xg + 5 * 64) * a1
                    o6 = o6 * a0 + gl.load(xg + 6 * 64) * a1
                    o7 = o7 * a0 + gl.load(xg + 7 * 64) * a1
                else:
                    o0 = o0 * a0 + xo.slice(0 * 64, 64).load(mma) * a1
                    o1 = o1 * a0 + xo.slice(1 * 64, 64).load(mma) * a1
                    o2 = o2 * a0 + xo.slice(2 * 64, 64).load(mma) * a1
                    o3 = o3 * a0 + xo.slice(3 * 64, 64).load(mma) * a1
                    o4 = o4 * a0 + xo.slice(4 * 64, 64).load(mma) * a1
                    o5 = o5 * a0 + xo.slice(5 * 64, 64).load(mma) * a1
                    o6 = o6 * a0 + xo.slice(6 * 64, 64).load(mma) * a1
                    o7 = o7 * a0 + xo.slice(7 * 64, 64).load(mma) * a1
                l_i = l_i * gl.exp2(m_i - m_use) + l1 * gl.exp2(m1 - m_use)
                m_i = m_new
                _cta_barrier()
                mbarrier.arrive(xbar.index(1), count=1)   # the exchange buffers are free again
                _store_item(o0, o1, o2, o3, o4, o5, o6, o7, m_use, l_i, ckv_scale, it, t0, t1, L, qtok, 0, H, mma,
                            16, part_o, part_lse, out, lse_out, stride_po_i, stride_po_r, stride_pl_i, stride_o_t,
                            stride_o_h, stride_lse_t, H, 0)
            g += n

    @gluon.jit
    def _pipe_consumer0(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                        cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, red_smem,
                        sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i,
                        stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS: gl.constexpr,
                        XG: gl.constexpr, RED: gl.constexpr, DEPTH: gl.constexpr):
        _consumer_pipe(0, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                       kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar,
                       red_smem, sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i,
                       stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS, XG, RED, DEPTH)

    @gluon.jit
    def _pipe_consumer1(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                        cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, red_smem,
                        sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i,
                        stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS: gl.constexpr,
                        XG: gl.constexpr, RED: gl.constexpr, DEPTH: gl.constexpr):
        _consumer_pipe(1, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                       kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar,
                       red_smem, sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i,
                       stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS, XG, RED, DEPTH)

    @gluon.jit
    def mla_decode_sm90_pipe_kernel(kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows,
                                    q_nope, q_pe, scales, qo_indptr, kv_indptr, kv_indices, kv_len,
                                    cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, OUT, LSE_OUT,
                                    sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                                    stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                                    PAGE: gl.constexpr, NS: gl.constexpr, REGS: gl.constexpr,
                                    MODE: gl.constexpr = 0, XG: gl.constexpr = True, RED: gl.constexpr = True,
                                    DEPTH: gl.constexpr = 11):
        # One CTA per schedule slot (16 heads). MODE 2: the producer's timing probe (no HBM traffic).
        kv_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS * 4, 64, 128], kv_l)
        pbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS, 64, 64], kpe_l)
        q_smem = gl.allocate_shared_memory(gl.float16, [8, 16, 128], q_l)
        qpe_smem = gl.allocate_shared_memory(gl.float16, [2, 16, 64], q_l)
        pT_smem = gl.allocate_shared_memory(gl.float16, [2, 16, 64], q_l)
        # an odd ring (the default NS 5): one ready barrier per stage and consumer, as decode_sm90's (kernel log 29;
        # the shared producer picks them by the array's size)
        RB: gl.constexpr = 2 * NS if NS % 2 == 1 else NS
        ready = gl.allocate_shared_memory(gl.int64, [RB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        x_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XR: gl.constexpr = 16 if XG else 8 * 64     # XG: O^T goes through global memory (a token allocation)
        xo = gl.allocate_shared_memory(gl.float32, [XR, 16], x_l)
        xml = gl.allocate_shared_memory(gl.float32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # RED: the softmax's cross-warp column max through these ([4 warps, 16 heads] per consumer, _colmax)
        red_smem = gl.allocate_shared_memory(gl.float32, [2, 4, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        RCNT: gl.constexpr = 128 if PAGE == 1 else 1   # page 1: one cp.async arrival per producer thread
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=RCNT)
            mbarrier.init(empty.index(i), count=1)
            if RB != NS:
                mbarrier.init(ready.index(NS + i), count=RCNT)
        mbarrier.init(xbar.index(0), count=1)
        mbarrier.init(xbar.index(1), count=1)
        fence_async_shared()
        out = OUT
        lse_out = LSE_OUT
        gl.warp_specialize([
            (_producer, (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices,
                         kv_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                         kbuf, pbuf, ready, empty, 1, NS, PAGE, MODE, False)),
            (_pipe_consumer0, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                               kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml,
                               xbar, red_smem, sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                               stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS, XG,
                               RED, DEPTH)),
            (_pipe_consumer1, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                               kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml,
                               xbar, red_smem, sm_scale_log2, H, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                               stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, NS, XG,
                               RED, DEPTH)),
        ], [4, 4], [REGS, REGS])


def _check_ns(ns: int, global_exchange: bool | None) -> bool:
    xg = ns >= 5 if global_exchange is None else bool(global_exchange)
    if ns < 3 or smem_bytes(ns, xg) > SMEM_LIMIT:
        raise ValueError(f"ns: the pipelined kernel's ring takes 3..{5 if xg else 4} stages (a consumer holds two: "
                         f"ns 2 would deadlock; {'global' if xg else 'shared-memory'} exchange), got {ns} "
                         f"({smem_bytes(ns, xg)} B of shared memory, limit {SMEM_LIMIT})")
    return xg


def launch(kv_desc, kpe_desc, q_nope, q_pe, scales, t: dict, out, lse, *, grid: int, grid_batch: int,
           num_heads: int, sm_scale: float, page_size: int, ns: int = NS_DEFAULT, regs: int = 240,
           merge_p: int = 32, merge_c: int = 128, mode: int = 0, merge: bool = True,
           global_exchange: bool | None = None, red: bool = True, depth: int = 11, **_ignored):
    """``decode_sm90.launch`` for the pipelined H <= 16 kernel (same plan arrays ``t``, grid = slots, partial
    format, lse base 2). One query per request: of the wide launch's keywords, ``max_rows`` is ignored, ``max_qo``
    must be 1, ``causal`` is ignored, ``fused_merge`` / ``fuse_max`` are ignored (the merge kernel runs for every
    split request). ``global_exchange``: consumer 1's O^T through ``part_o[item]`` (default: ns >= 5, where the
    shared-memory buffer does not fit)."""
    LOG2E = 1.4426950408889634
    if _ignored.get("max_qo", 1) != 1:
        raise ValueError(f"max_qo: the pipelined kernel takes one query per request, got {_ignored['max_qo']}")
    if not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"num_heads: the pipelined kernel takes 1..{MAX_HEADS}, got {num_heads}")
    if mode not in (0, 2):
        raise ValueError(f"mode: 0 (normal) or 2 (producer timing probe), got {mode}")
    xg = _check_ns(ns, global_exchange)
    po, pl = t["part_o"], t["part_lse"]
    if po.shape[1] < HP or pl.shape[1] < HP:
        raise ValueError(f"part_o/part_lse: need {HP} head rows per item, got {po.shape[1]}/{pl.shape[1]}")
    import torch
    if xg and (po.dtype != torch.float32 or po.shape[2] != DC or po.stride(2) != 1):
        raise ValueError(f"part_o: the global exchange needs fp32 [items, >= {HP}, {DC}] rows, got "
                         f"{po.dtype} {tuple(po.shape)} strides {po.stride()}")
    mla_decode_sm90_pipe_kernel[(grid,)](
        kv_desc, kpe_desc, kv_desc.base, kpe_desc.base, kv_desc.strides[0], kpe_desc.strides[0], kv_desc.shape[0],
        q_nope, q_pe, scales, t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"],
        t["cta_ptr"], t["item_req"], t["item_t0"], t["item_t1"], po, pl, out, lse, sm_scale * LOG2E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), po.stride(0), po.stride(1),
        pl.stride(0), out.stride(0), out.stride(1), lse.stride(0), PAGE=page_size, NS=ns, REGS=regs, MODE=mode,
        XG=xg, RED=red, DEPTH=depth, num_warps=4)
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
                   aligned_ints: bool = False, global_exchange: bool | None = None, heads: int = 16,
                   red: bool = True, depth: int = 11) -> dict:
    """Compile the pipelined kernel for sm_90a with triton's ptxas (no GPU) and count SASS ops (``ops``), plus
    ``loops``: per consumer partition, the HGMMA, STL, LDL and LDS.U8 between its first and last HGMMA (the
    prologue QK, the steady-state loop and the last tile: 36 + 68 + 32 HGMMA m64n16k16)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    if gluon is None:
        raise RuntimeError(f"gluon is not importable: {base.GLUON_IMPORT_ERROR}")
    if heads != 16:
        raise ValueError(f"heads: the pipelined kernel is the 16-head (padded) kernel, got {heads}")
    xg = _check_ns(ns, global_exchange)
    fn = mla_decode_sm90_pipe_kernel
    names = fn.arg_names
    sig = {k: v for k, v in base.KERNEL_SIGNATURE.items() if k in names}
    sig.update(q_nope=f"*{q_dtype}", q_pe=f"*{q_dtype}", OUT=f"*{q_dtype}")
    rows = min(64, page)
    sig["kv_desc"] = sig["kv_desc"].replace("[64, 128]", f"[{rows}, 128]")
    sig["kpe_desc"] = sig["kpe_desc"].replace("[64, 64]", f"[{rows}, 64]")
    consts = {"PAGE": page, "NS": ns, "REGS": regs, "MODE": 0, "XG": xg, "RED": red, "DEPTH": depth}
    for k in consts:
        sig[k] = "constexpr"
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                                if sig[n].startswith("*") or (aligned_ints and n in base._INT_DIV16)
                                or n in ("stride_kv_row", "stride_kpe_row")})
    return base.sass_report(src, sass_path)


def launch_for_plan(*args, ns: int = NS_DEFAULT, **kw):
    """``launch`` as the gluon backend calls it (``GluonPlan.run``, switch ``GLUON_PIPELINED``): the plan's ``ns``
    (its ``num_stages`` option, sized for decode_sm90's ring) is replaced by this kernel's own NS_DEFAULT, which
    the pipelined consumers need for load slack (see the module docstring)."""
    return launch(*args, ns=NS_DEFAULT, **kw)
