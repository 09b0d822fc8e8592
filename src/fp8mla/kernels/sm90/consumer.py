"""The consumer partition (both consumers; the id is a constexpr): per work item, Q to shared memory (scales and a
power of two folded in), then per tile S^T = K.Q^T, the online softmax and O^T += V^T.P^T; at the end of an item
the exchange (H <= 16) and the normalized partial. The loop over items and tiles is here, each phase in
``phases.py`` (Gluon)."""
from __future__ import annotations

from .config import gluon

if gluon is not None:
    from .config import P8_SCALE_C, gl, warpgroup_mma_wait
    from .fragments import _per_item, _sanitize_tail
    from .phases import (BLK, _finish, _load_q, _pv, _pv_group, _scores, _softmax, _stage_p, _tile_scales,
                         acc_layout)
    from .ring import ring_release, ring_wait

    @gluon.jit
    def _consumer(cid: gl.constexpr, ring, qbufs, xch, queries, outputs, pages, work, problem, variant):
        # ring: (kbuf, pbuf, sbuf, ready, empty); qbufs: this CTA's Q^T and P^T tiles (q_smem, qpe_smem, pT_smem,
        # q8_smem, qpe8_smem); xch: the exchange (xo, xml, xbar); queries, outputs: the bundles of kernel.py;
        # pages: (kv_indptr, kv_indices, kv_len); work: (cta_ptr, item_req, item_t0, item_t1); problem: (H,
        # sm_scale_log2, scales, qo_indptr, NS as a runtime value). variant: the build's constexprs, a tuple of
        # constexprs only (read into annotated names, so they stay constexpr).
        NHG: gl.constexpr = variant[0]
        HPW: gl.constexpr = variant[1]
        WIDE: gl.constexpr = variant[2]
        MTP: gl.constexpr = variant[3]
        QK8: gl.constexpr = variant[4]
        QKC: gl.constexpr = variant[5]
        GROUP: gl.constexpr = variant[6]
        PV8: gl.constexpr = variant[7]
        kbuf, pbuf, sbuf, ready, empty = ring
        q_smem, qpe_smem, pT_smem, q8_smem, qpe8_smem = qbufs
        xo, xml, xbar = xch
        q_nope, q_pe, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h = queries
        (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
         stride_pl_i) = outputs
        kv_indptr, kv_indices, kv_len = pages
        cta_ptr, item_req, item_t0, item_t1 = work
        H, sm_scale_log2, scales, qo_indptr, NS = problem
        # HPW: heads per consumer warpgroup (the MMA's N). WIDE = False (H <= 16): the two consumers take
        # alternate tiles for the same 16 heads and merge at the end of each item. WIDE = True (H > 16): both
        # consumers take every tile, each for its own HPW heads (head group pid % NHG of 2 * HPW heads), with no
        # exchange at all: each writes its own normalized partial.
        mma: gl.constexpr = acc_layout(HPW, 16)
        blk: gl.constexpr = BLK
        STEP: gl.constexpr = 1 if WIDE else 2

        pid = gl.program_id(0)
        if WIDE:
            slot = pid // NHG
            h0 = (pid % NHG) * (2 * HPW) + cid * HPW    # this consumer's first head
        else:
            slot = pid
            h0 = pid * 0
        i0 = gl.load(cta_ptr + slot)
        i1 = gl.load(cta_ptr + slot + 1)
        ckv_scale = gl.load(scales)
        kpe_scale = gl.load(scales + 1)
        o_scale = ckv_scale   # the outputs' factor: V's scale (and, fp8_math, 1 / P's e4m3 scale)
        if PV8:
            o_scale = ckv_scale * (1.0 / P8_SCALE_C)
        my_qpe = qpe_smem.index(cid)
        my_p = pT_smem.index(cid)
        bP = my_p.permute((1, 0))
        hq = gl.arange(0, HPW, layout=gl.SliceLayout(1, blk)) + h0
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
            # -- Q^T for this request: scales and a per-head power of two folded in, fp16, k relabelled -----
            # (padded heads: Q rows of zeros, scores 0, outputs never written)
            if WIDE:   # per-item index vectors: hoisted out of the item loop they spill (see _per_item)
                hq = _per_item(gl.arange(0, HPW, layout=gl.SliceLayout(1, blk)), it) + h0
                h_ok = hq < H
            if MTP:
                # multi-token decode: "heads" are rows r = token i * H + head (virtual heads; always WIDE); rows
                # >= qo_len * H of this request are padding (zero Q, never written)
                qo = gl.load(qo_indptr + b + 1) - gl.load(qo_indptr + b)
                nrows = qo * H
                h_ok = hq < nrows
                qn_row = q_nope + (qtok + hq // H) * stride_qn_t + (hq % H) * stride_qn_h
                qp_row = q_pe + (qtok + hq // H) * stride_qp_t + (hq % H) * stride_qp_h
            else:
                nrows = H
                qo = H   # (read by the multi-token softmax only)
                qn_row = q_nope + qtok * stride_qn_t + hq * stride_qn_h
                qp_row = q_pe + qtok * stride_qp_t + hq * stride_qp_h
            f = _load_q(cid, (q_smem, my_qpe, q8_smem, qpe8_smem), (qn_row, qp_row, h_ok), (cq, cp),
                        (ckv_scale, kpe_scale), HPW, QK8)
            row_scale = gl.convert_layout(sm_scale_log2 / f, gl.SliceLayout(0, mma))
            tok_r = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
            hcol = gl.arange(0, HPW, layout=gl.SliceLayout(0, mma))

            o0 = gl.zeros([64, HPW], gl.float32, mma)
            o1 = gl.zeros([64, HPW], gl.float32, mma)
            o2 = gl.zeros([64, HPW], gl.float32, mma)
            o3 = gl.zeros([64, HPW], gl.float32, mma)
            o4 = gl.zeros([64, HPW], gl.float32, mma)
            o5 = gl.zeros([64, HPW], gl.float32, mma)
            o6 = gl.zeros([64, HPW], gl.float32, mma)
            o7 = gl.zeros([64, HPW], gl.float32, mma)
            m_i = gl.full([HPW], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
            # H16: row sums stay per thread (no cross-warp reduction per tile), reduced once in the epilogue.
            # WIDE: reduced every tile (a [64, 32] per-thread sum would cost 16 of the 240 registers)
            if WIDE:
                l_run = gl.zeros([HPW], gl.float32, gl.SliceLayout(0, mma))
            else:
                l_run = gl.zeros([64, HPW], gl.float32, mma)
            if GROUP:
                # group g's O^T chunks (2g, 2g + 1) are kept in units of f_g, the scale maximum of the group's
                # last tile (P carries scale / maximum <= 1): rescaled by alpha x f_old / f_new with each tile
                f0 = sm_scale_log2 * 0.0 + 1.0
                f1 = f0
                f2 = f0
                f3 = f0
            n = t1 - t0
            if WIDE:
                j0 = n * 0                # every ring position
            else:
                j0 = (cid + g) % 2        # this consumer takes the ring positions g + j with (g + j) % 2 == cid
            for j in range(j0, n, STEP):
                gg = g + j
                s = ring_wait(ring, gg, NS)
                valid = L - (t0 + j) * 64
                if valid < 64:
                    # WIDE: both consumers zero the same rows; every write stores either the row's own value
                    # or 0, so the overlap is benign and the stage ends up the same either way.
                    _sanitize_tail(kbuf, pbuf, s, valid)
                if GROUP:   # the tile's token scales and each group's largest
                    sg, gm = _tile_scales(sbuf, s, valid, HPW)
                else:       # (placeholders: read by the group build only)
                    sg = valid
                    gm = valid
                sT = _scores(cid, (kbuf, pbuf), s, (q_smem, my_qpe, q8_smem, qpe8_smem), sg, (ckv_scale, kpe_scale),
                             HPW, WIDE, QK8, QKC, GROUP)
                p, alpha, m_i, l_run = _softmax(sT, m_i, l_run, row_scale, (t0, j, gg, valid, L),
                                                (tok_r, hcol, h0, H, qo), HPW, MTP, WIDE)
                _stage_p(cid, p, (pT_smem, my_p), sg, gm, GROUP, PV8)
                if GROUP:
                    o0, o1, o2, o3, o4, o5, o6, o7 = _pv_group(cid, kbuf, s, pT_smem, alpha,
                                                               (o0, o1, o2, o3, o4, o5, o6, o7), (f0, f1, f2, f3),
                                                               gm, HPW)
                    f0, f1, f2, f3 = gm
                else:
                    o0, o1, o2, o3, o4, o5, o6, o7 = _pv(kbuf, s, bP, alpha, (o0, o1, o2, o3, o4, o5, o6, o7), HPW,
                                                         PV8)
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
                ring_release(ring, s)
            if GROUP:   # back from units of f_g (before the exchange: the two consumers' units differ)
                o0 = o0 * f0
                o1 = o1 * f0
                o2 = o2 * f1
                o3 = o3 * f1
                o4 = o4 * f2
                o5 = o5 * f2
                o6 = o6 * f3
                o7 = o7 * f3
            _finish(cid, (o0, o1, o2, o3, o4, o5, o6, o7), (m_i, l_run, o_scale), xch, (it, i0, t0, t1, L, qtok),
                    (h0, H, nrows), outputs, HPW, WIDE, MTP)
            g += n
