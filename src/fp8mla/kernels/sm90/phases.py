"""The phases of the consumer partition (``consumer._consumer``), one Gluon function each: Q^T of a request into
shared memory, the group scales of a tile, the scores S^T = K.Q^T, the online softmax, P^T into shared memory,
O^T += V^T.P^T (fp16, e4m3 and group-scale variants) and the end of an item (the exchange at H <= 16 and the
normalized partial). Runtime values come in bundles (tuples, unpacked here); constexprs on their own."""
from __future__ import annotations

from .config import gluon

if gluon is not None:
    from .config import GROUPS_C, P8_SCALE_C, _cta_barrier, fence_async_shared, gl, mbarrier, warpgroup_mma, \
        warpgroup_mma_wait
    from .fragments import (_group_col, _group_max, _per_item, _pv_slab, _pv_slab8, _relabel_k, _relabel_k64,
                            _relabel_tok8, _scores_group)
    from .merge import _store_item

    @gluon.constexpr_function
    def acc_layout(hpw, k):
        """The wgmma accumulator [64 tokens, hpw rows] (k: the instruction's k, 16 for fp16, 32 for e4m3)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, hpw, k])

    @gluon.constexpr_function
    def a_layout(hpw, k):
        """The wgmma A operand in registers over ``acc_layout(hpw, k)``."""
        return gl.DotOperandLayout(operand_index=0, parent=acc_layout(hpw, k), k_width=k // 8)

    # one 128-column K slab (and the 64-column k_pe) as LDS.128 rows; the V^T pairs (ldmatrix.trans); the 16-bit
    # view of a stage; Q's global loads
    LD = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 128]))
    LD64 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 64]))
    L16 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32]))
    KV16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    BLK = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _load_q(cid: gl.constexpr, qt, rows, cols, qscale, HPW: gl.constexpr, QK8: gl.constexpr):
        # Q^T of one request into this consumer's tiles; returns the per-head power of two f folded in.
        # qt: (q_smem, this consumer's q_pe tile, q8_smem, qpe8_smem); rows: (qn_row, qp_row, h_ok): Q's row
        # pointers and which rows are real (padded rows: Q of zeros, scores 0, outputs never written); cols: (cq,
        # cp): the column offsets of a 128-column chunk and of q_pe; qscale: (ckv_scale, kpe_scale)
        q_smem, my_qpe, q8_smem, qpe8_smem = qt
        qn_row, qp_row, h_ok = rows
        cq, cp = cols
        ckv_scale, kpe_scale = qscale
        blk: gl.constexpr = BLK
        amax = gl.zeros([HPW], gl.float32, gl.SliceLayout(1, blk))
        # one pass: Q's four row chunks and q_pe loaded together and kept in registers for the conversion (the
        # O accumulators are not live yet), rather than q_pe one load latency after the maximum and the chunks
        # loaded again
        x0 = gl.load(qn_row[:, None] + 0 * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
        x1 = gl.load(qn_row[:, None] + 1 * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
        x2 = gl.load(qn_row[:, None] + 2 * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
        x3 = gl.load(qn_row[:, None] + 3 * 128 + cq[None, :], mask=h_ok[:, None], other=0.0)
        xp = gl.load(qp_row[:, None] + cp[None, :], mask=h_ok[:, None], other=0.0)
        amax = gl.maximum(gl.maximum(gl.max(gl.abs(x0.to(gl.float32)), axis=1),
                                     gl.max(gl.abs(x1.to(gl.float32)), axis=1)),
                          gl.maximum(gl.max(gl.abs(x2.to(gl.float32)), axis=1),
                                     gl.max(gl.abs(x3.to(gl.float32)), axis=1)))
        if QK8:
            # FP8 scores (QK8 e4m3 terms of Q, K straight from the stage): Q x f, f a power of two with the
            # largest |q| of a head near 2^8 (e4m3 max 448), split into QK8 e4m3 terms hi + mid (+ lo) whose
            # sum is q x f to 8 (12) significant bits: exact for bf16 queries at 2 terms, fp16 needs 3, for the
            # entries within ~2^9 of the head's largest (smaller ones reach e4m3's subnormals: error <= ~2^-17
            # of the largest). The scales stay out of Q (applied to the two score parts).
            amax = gl.maximum(amax, gl.max(gl.abs(xp.to(gl.float32)), axis=1))
            f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(256.0 / amax))), 1.0)
            for c in gl.static_range(4):
                if c == 0:
                    x = x0
                elif c == 1:
                    x = x1
                elif c == 2:
                    x = x2
                else:
                    x = x3
                r = x.to(gl.float32) * f[:, None]
                for term in gl.static_range(QK8):
                    t8 = r.to(gl.float8e4nv)
                    q8_smem.index((cid * QK8 + term) * 4 + c).store(t8)
                    r = r - t8.to(gl.float32)
            rp = xp.to(gl.float32) * f[:, None]
            for term in gl.static_range(QK8):
                t8 = rp.to(gl.float8e4nv)
                qpe8_smem.index(cid * QK8 + term).store(t8)
                rp = rp - t8.to(gl.float32)
        else:   # (keep this order: moved, these lines reschedule the SASS the golden record holds)
            amax = amax * ckv_scale
            amax = gl.maximum(amax, gl.max(gl.abs(xp.to(gl.float32)), axis=1) * kpe_scale)
            # largest |q| lands near 2^14: far from fp16's 65504, small entries stay normal
            f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
            fn = f * ckv_scale
            for c in gl.static_range(4):
                if c == 0:
                    x = x0
                elif c == 1:
                    x = x1
                elif c == 2:
                    x = x2
                else:
                    x = x3
                q16 = (x.to(gl.float32) * fn[:, None]).to(gl.float16)
                q_smem.index(cid * 4 + c).store(_relabel_k(q16))
            qp16 = (xp.to(gl.float32) * (f * kpe_scale)[:, None]).to(gl.float16)
            my_qpe.store(_relabel_k64(qp16))
        fence_async_shared()
        return f

    @gluon.jit
    def _tile_scales(sbuf, s, valid, HPW: gl.constexpr):
        # the group build's scales of the tile in stage s: ((s_g per token row) for the 4 groups, (the group's
        # largest scale in the tile) for the 4 groups)
        mma: gl.constexpr = acc_layout(HPW, 16)
        # the tile's [64 tokens, 4 groups] fp32 scales, each thread the rows of its accumulator
        # rows; rows past kv_len hold whatever the page holds (maybe NaN): 0 (their P is 0)
        sc_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, GROUPS_C])
        srow = gl.arange(0, 64, layout=gl.SliceLayout(1, sc_l))
        sci = gl.arange(0, GROUPS_C, layout=gl.SliceLayout(0, sc_l))
        xs = sbuf.index(s).load(sc_l)
        xs = gl.where((srow[:, None] < valid) & (sci[None, :] >= 0), xs, 0.0)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        sg0 = _group_col(xs, sci, 0, row_l)
        sg1 = _group_col(xs, sci, 1, row_l)
        sg2 = _group_col(xs, sci, 2, row_l)
        sg3 = _group_col(xs, sci, 3, row_l)
        mx = gl.max(xs, axis=0)   # one cross-warp reduction for the 4 groups
        gm0 = _group_max(mx, sci, 0)
        gm1 = _group_max(mx, sci, 1)
        gm2 = _group_max(mx, sci, 2)
        gm3 = _group_max(mx, sci, 3)
        return (sg0, sg1, sg2, sg3), (gm0, gm1, gm2, gm3)

    @gluon.jit
    def _scores(cid: gl.constexpr, kv, s, qt, sg, qscale, HPW: gl.constexpr, WIDE: gl.constexpr,
                QK8: gl.constexpr, QKC: gl.constexpr, GROUP: gl.constexpr):
        # S^T [64 tokens, HPW rows] of the tile in stage s (fp32, in the fp16 accumulator layout). kv: (kbuf,
        # pbuf); qt: as _load_q's; sg: the group build's token scales (_tile_scales); qscale: (ckv_scale,
        # kpe_scale)
        kbuf, pbuf = kv
        q_smem, my_qpe, q8_smem, qpe8_smem = qt
        ckv_scale, kpe_scale = qscale
        mma: gl.constexpr = acc_layout(HPW, 16)
        mma8: gl.constexpr = acc_layout(HPW, 32)
        a_l: gl.constexpr = a_layout(HPW, 16)
        ld_l: gl.constexpr = LD
        ld64_l: gl.constexpr = LD64
        # -- S^T = K . Q^T ------------------------------------------------------------------------
        if QK8:
            # e4m3 x e4m3 wgmma, both operands in shared memory (K-major): no K conversion at all.
            # The stage is now read by the async proxy: at page 1 cp.async (generic proxy) wrote it
            fence_async_shared()
            sp = gl.zeros([64, HPW], gl.float32, mma8)
            if QKC:   # one accumulator per 128-column chunk: 5 independent chains, summed after
                s0 = gl.zeros([64, HPW], gl.float32, mma8)
                s1 = gl.zeros([64, HPW], gl.float32, mma8)
                s2 = gl.zeros([64, HPW], gl.float32, mma8)
                s3 = gl.zeros([64, HPW], gl.float32, mma8)
                for term in gl.static_range(QK8):
                    s0 = warpgroup_mma(kbuf.index(s * 4 + 0),
                                       q8_smem.index((cid * QK8 + term) * 4 + 0).permute((1, 0)), s0,
                                       is_async=True)
                for term in gl.static_range(QK8):
                    s1 = warpgroup_mma(kbuf.index(s * 4 + 1),
                                       q8_smem.index((cid * QK8 + term) * 4 + 1).permute((1, 0)), s1,
                                       is_async=True)
                for term in gl.static_range(QK8):
                    s2 = warpgroup_mma(kbuf.index(s * 4 + 2),
                                       q8_smem.index((cid * QK8 + term) * 4 + 2).permute((1, 0)), s2,
                                       is_async=True)
                for term in gl.static_range(QK8):
                    s3 = warpgroup_mma(kbuf.index(s * 4 + 3),
                                       q8_smem.index((cid * QK8 + term) * 4 + 3).permute((1, 0)), s3,
                                       is_async=True)
                for term in gl.static_range(QK8):
                    sp = warpgroup_mma(pbuf.index(s), qpe8_smem.index(cid * QK8 + term).permute((1, 0)),
                                       sp, is_async=True)
                s0, s1, s2, s3, sp = warpgroup_mma_wait(0, deps=(s0, s1, s2, s3, sp))
                sn = (s0 + s1) + (s2 + s3)
            else:
                sn = gl.zeros([64, HPW], gl.float32, mma8)
                for c in gl.static_range(4):
                    for term in gl.static_range(QK8):
                        sn = warpgroup_mma(kbuf.index(s * 4 + c),
                                           q8_smem.index((cid * QK8 + term) * 4 + c).permute((1, 0)),
                                           sn, is_async=True)
                for term in gl.static_range(QK8):
                    sp = warpgroup_mma(pbuf.index(s), qpe8_smem.index(cid * QK8 + term).permute((1, 0)),
                                       sp, is_async=True)
                sn, sp = warpgroup_mma_wait(0, deps=(sn, sp))
            # (an e4m3 wgmma's instruction k is 32: same accumulator registers, another layout name)
            sT = gl.convert_layout(sn * ckv_scale + sp * kpe_scale, mma, assert_trivial=True)
        elif GROUP:
            sT = _scores_group(kbuf, pbuf, s, q_smem, my_qpe, cid, sg, ld_l, ld64_l, a_l, mma, HPW)
        else:
            sT = gl.zeros([64, HPW], gl.float32, mma)
            for c in gl.static_range(4):
                a16 = _relabel_k(kbuf.index(s * 4 + c).load(ld_l).to(gl.float16))
                a16 = gl.convert_layout(a16, a_l, assert_trivial=True)
                sT = warpgroup_mma(a16, q_smem.index(cid * 4 + c).permute((1, 0)), sT, is_async=True)
                if WIDE:   # one K chunk at a time: 4 chunks of K in flight spill at 128 O registers
                    sT, a16 = warpgroup_mma_wait(0, deps=(sT, a16))
                else:
                    sT, a16 = warpgroup_mma_wait(1, deps=(sT, a16))
            ap = _relabel_k64(pbuf.index(s).load(ld64_l).to(gl.float16))
            ap = gl.convert_layout(ap, a_l, assert_trivial=True)
            sT = warpgroup_mma(ap, my_qpe.permute((1, 0)), sT, is_async=True)
            sT = warpgroup_mma_wait(0, deps=(sT,))
        return sT

    @gluon.jit
    def _softmax(sT, m_i, l_run, row_scale, tile, rows, HPW: gl.constexpr, MTP: gl.constexpr,
                 WIDE: gl.constexpr):
        # one tile of the online softmax over the tokens (axis 0), log2 domain: returns (P, alpha, the new row
        # maximum, the new row sums: per row (WIDE) or per thread [64, HPW]). tile: (t0, j, gg, valid, L): the item's
        # first tile, this tile's index in the item and in the ring, its valid tokens, kv_len; rows: (tok_r, hcol,
        # h0, H, qo): the accumulator's token and row indices, the first row, the heads, the request's qo_len
        t0, j, gg, valid, L = tile
        tok_r, hcol, h0, H, qo = rows
        mma: gl.constexpr = acc_layout(HPW, 16)
        sT = sT * row_scale[None, :]
        if MTP == 1:
            if (t0 + j + 1) * 64 > L - qo + 1:
                # a tile that some row does not see whole. Causal, aligned to the end: token i sees kv
                # positions < min(L - qo + i + 1, L) (padding rows: L), which also masks the rows past
                # kv_len. Computed here, not per item: a per-row vector live across the tile loop
                # spills at 128 O registers.
                hrow = _per_item(gl.arange(0, HPW, layout=gl.SliceLayout(0, mma)), gg) + h0
                lim = gl.minimum(L - qo + hrow // H + 1, L) - (t0 + j) * 64
                sT = gl.where(tok_r[:, None] < lim[None, :], sT, float("-inf"))
            else:   # every row sees the whole tile (valid = 64 here)
                sT = gl.where((tok_r[:, None] < valid) & (hcol[None, :] >= 0), sT, float("-inf"))
        else:
            sT = gl.where((tok_r[:, None] < valid) & (hcol[None, :] >= 0), sT, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sT, axis=0))
        if MTP == 1:
            # a row can see no token of a tile (or of a whole item) so far: max -inf. Subtract 0 then,
            # so alpha and P are exactly 0, not NaN (-inf - -inf)
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_sub)
            p = gl.exp2(sT - m_sub[None, :])
        else:
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sT - m_new[None, :])
        if WIDE:
            l_run = l_run * alpha + gl.sum(p, axis=0)
        else:
            l_run = l_run * alpha[None, :] + p
        return p, alpha, m_new, l_run

    @gluon.jit
    def _stage_p(cid: gl.constexpr, p, pt, sg, gm, GROUP: gl.constexpr, PV8: gl.constexpr):
        # P^T into shared memory for the P.V: fp16, or (GROUP) one per group, or (PV8) e4m3. pt: (pT_smem, this
        # consumer's P^T tile); sg, gm: _tile_scales'
        pT_smem, my_p = pt
        if GROUP:
            sg0, sg1, sg2, sg3 = sg
            gm0, gm1, gm2, gm3 = gm
        if GROUP:   # one P^T per group: P x scale / the group's tile maximum (<= 1 in fp16)
            pT_smem.index(cid * 4 + 0).store(gl.permute((p * (sg0 / gm0)[:, None]).to(gl.float16),
                                                        (1, 0)))
            pT_smem.index(cid * 4 + 1).store(gl.permute((p * (sg1 / gm1)[:, None]).to(gl.float16),
                                                        (1, 0)))
            pT_smem.index(cid * 4 + 2).store(gl.permute((p * (sg2 / gm2)[:, None]).to(gl.float16),
                                                        (1, 0)))
            pT_smem.index(cid * 4 + 3).store(gl.permute((p * (sg3 / gm3)[:, None]).to(gl.float16),
                                                        (1, 0)))
        elif PV8:   # fp8_math: P x 2^8 in e4m3 (<= 256 of 448), rows in the e4m3 P.V's token order
            my_p.store(gl.permute(_relabel_tok8((p * P8_SCALE_C).to(gl.float8e4nv)), (1, 0)))
        else:
            my_p.store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()

    @gluon.jit
    def _pv_group(cid: gl.constexpr, kbuf, s, pT_smem, alpha, acc, fs, gm, HPW: gl.constexpr):
        # the group build's O^T += V^T.P^T: each group's two 64-dim chunks against its own P^T, rescaled by
        # f_old / f_new (fs: the groups' units so far; the new ones are gm)
        o0, o1, o2, o3, o4, o5, o6, o7 = acc
        f0, f1, f2, f3 = fs
        gm0, gm1, gm2, gm3 = gm
        mma: gl.constexpr = acc_layout(HPW, 16)
        a_l: gl.constexpr = a_layout(HPW, 16)
        kv16_l: gl.constexpr = KV16
        o0, o1 = _pv_slab(kbuf, s * 4 + 0, pT_smem.index(cid * 4 + 0).permute((1, 0)),
                          (alpha * (f0 / gm0))[None, :], o0, o1, a_l, L16, kv16_l)
        o2, o3 = _pv_slab(kbuf, s * 4 + 1, pT_smem.index(cid * 4 + 1).permute((1, 0)),
                          (alpha * (f1 / gm1))[None, :], o2, o3, a_l, L16, kv16_l)
        o4, o5 = _pv_slab(kbuf, s * 4 + 2, pT_smem.index(cid * 4 + 2).permute((1, 0)),
                          (alpha * (f2 / gm2))[None, :], o4, o5, a_l, L16, kv16_l)
        o6, o7 = _pv_slab(kbuf, s * 4 + 3, pT_smem.index(cid * 4 + 3).permute((1, 0)),
                          (alpha * (f3 / gm3))[None, :], o6, o7, a_l, L16, kv16_l)
        f0 = gm0
        f1 = gm1
        f2 = gm2
        f3 = gm3
        return o0, o1, o2, o3, o4, o5, o6, o7

    @gluon.jit
    def _pv(kbuf, s, bP, alpha, acc, HPW: gl.constexpr, PV8: gl.constexpr):
        # O^T += V^T.P^T, 8 chunks of 64 dims, one chunk group in flight behind the next chunk's conversion: fp16
        # operands, or (PV8, fp8_math) e4m3 x e4m3 wgmma. bP: this consumer's P^T tile, transposed
        o0, o1, o2, o3, o4, o5, o6, o7 = acc
        mma: gl.constexpr = acc_layout(HPW, 16)
        mma8: gl.constexpr = acc_layout(HPW, 32)
        a_l: gl.constexpr = a_layout(HPW, 16)
        a8_l: gl.constexpr = a_layout(HPW, 32)
        kv16_l: gl.constexpr = KV16
        if PV8:
            # fp8_math: e4m3 x e4m3 wgmma (V^T bytes straight from the stage, P^T e4m3), accumulators
            # under the k-32 layout name (same registers), back after the tile's last wait
            a2 = gl.convert_layout(alpha, gl.SliceLayout(0, mma8), assert_trivial=True)[None, :]
            q0, q1 = _pv_slab8(kbuf, s * 4 + 0, bP, a2, gl.convert_layout(o0, mma8, assert_trivial=True),
                               gl.convert_layout(o1, mma8, assert_trivial=True), a8_l, L16, kv16_l)
            q2, q3 = _pv_slab8(kbuf, s * 4 + 1, bP, a2, gl.convert_layout(o2, mma8, assert_trivial=True),
                               gl.convert_layout(o3, mma8, assert_trivial=True), a8_l, L16, kv16_l)
            q4, q5 = _pv_slab8(kbuf, s * 4 + 2, bP, a2, gl.convert_layout(o4, mma8, assert_trivial=True),
                               gl.convert_layout(o5, mma8, assert_trivial=True), a8_l, L16, kv16_l)
            q6, q7 = _pv_slab8(kbuf, s * 4 + 3, bP, a2, gl.convert_layout(o6, mma8, assert_trivial=True),
                               gl.convert_layout(o7, mma8, assert_trivial=True), a8_l, L16, kv16_l)
            q0, q1, q2, q3, q4, q5, q6, q7 = warpgroup_mma_wait(0, deps=(q0, q1, q2, q3, q4, q5, q6, q7))
            o0 = gl.convert_layout(q0, mma, assert_trivial=True)
            o1 = gl.convert_layout(q1, mma, assert_trivial=True)
            o2 = gl.convert_layout(q2, mma, assert_trivial=True)
            o3 = gl.convert_layout(q3, mma, assert_trivial=True)
            o4 = gl.convert_layout(q4, mma, assert_trivial=True)
            o5 = gl.convert_layout(q5, mma, assert_trivial=True)
            o6 = gl.convert_layout(q6, mma, assert_trivial=True)
            o7 = gl.convert_layout(q7, mma, assert_trivial=True)
        else:
            a2 = alpha[None, :]
            o0, o1 = _pv_slab(kbuf, s * 4 + 0, bP, a2, o0, o1, a_l, L16, kv16_l)
            o2, o3 = _pv_slab(kbuf, s * 4 + 1, bP, a2, o2, o3, a_l, L16, kv16_l)
            o4, o5 = _pv_slab(kbuf, s * 4 + 2, bP, a2, o4, o5, a_l, L16, kv16_l)
            o6, o7 = _pv_slab(kbuf, s * 4 + 3, bP, a2, o6, o7, a_l, L16, kv16_l)
        return o0, o1, o2, o3, o4, o5, o6, o7

    @gluon.jit
    def _finish(cid: gl.constexpr, acc, stats, xch, item, rows, outputs, HPW: gl.constexpr, WIDE: gl.constexpr,
                MTP: gl.constexpr):
        # the end of an item: this consumer's normalized partial (WIDE), or (H <= 16) consumer 1 hands its raw
        # state to consumer 0, which merges both and writes the item's result (empty: o = 0, lse = -inf).
        # stats: (m_i, the row sums as _softmax keeps them, the outputs' factor); xch: (xo, xml, xbar); item: (it,
        # i0, t0, t1, L, qtok); rows: (h0, H, nrows)
        o0, o1, o2, o3, o4, o5, o6, o7 = acc
        m_i, l_run, o_scale = stats
        xo, xml, xbar = xch
        it, i0, t0, t1, L, qtok = item
        h0, H, nrows = rows
        mma: gl.constexpr = acc_layout(HPW, 16)
        if WIDE:
            m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
            l_i = l_run
            _store_item((o0, o1, o2, o3, o4, o5, o6, o7), m_use, l_i, o_scale, (it, t0, t1, L, qtok),
                        (h0, H, nrows), outputs, mma, HPW, MTP)
        else:
            l_i = gl.sum(l_run, axis=0)
            if cid == 1:
                # hand the raw state to consumer 0 (which merges it and writes the item's result)
                mbarrier.wait(xbar.index(1), ((it - i0) & 1) ^ 1, pred=it > i0)
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
                _store_item((o0, o1, o2, o3, o4, o5, o6, o7), m_use, l_i, o_scale, (it, t0, t1, L, qtok),
                            (h0, H, nrows), outputs, mma, HPW, MTP)
