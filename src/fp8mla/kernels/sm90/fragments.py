"""Operand fragments of the Hopper decode kernel: FP8 rows to fp16 (and e4m3) MMA operands in relabelled k / token
orders, the V^T chunks of P.V, the score products of the group-scale build, the tail sanitizer, the heads-on-M
consumers' P.V with chunk release (Gluon)."""
from __future__ import annotations

from .config import gluon

if gluon is not None:
    from .config import (GROUPS_C, P8_SCALE_C, _NEW_REINTERPRET, _cp_async, _cta_barrier, _tma_load, async_copy,
                         fence_async_shared, gl, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    @gluon.jit
    def _opaque_zero(i):
        # 0, computed from the loop counter in a way the compiler cannot fold: it keeps the shared-memory
        # descriptors of a heads-on-M tile's 52 MMAs inside the loop (hoisted, triton 3.6 keeps all of them live as
        # 64-bit values and spills ~900 B)
        return gl.inline_asm_elementwise("{ .reg .b32 z; and.b32 z, $1, 0; mov.b32 $0, z; }", "=r,r", [i],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _chunk_order(c: gl.constexpr):
        # the heads-on-M owner's c-th score chunk: 8, 0, 4, 1, 5, 2, 6, 3, 7 (k_pe first, converted first by
        # converter A; then A's and B's chunks in turn, the order the two converters' rounds finish in)
        return ((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4

    @gluon.jit
    def _pv_halves_release(p_smem, k16, k16_free, z, cid: gl.constexpr, o0, o1, o2, o3, a2):
        # The heads-on-M consumers' P.V (dense and sparse builds): O [64 heads, 256 dims of consumer cid] += P [64,
        # 64 tokens] . V over its four 64-column chunks of the 16-bit tile, the accumulators rescaled by a2 first;
        # each chunk handed back to its converter (k16_free) as its MMA completes (wait depth 3, 2, 1, 0), after a
        # partition barrier so every warp of the warpgroup has finished reading it.
        o0 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 0), o0 * a2, is_async=True)
        o1 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 1), o1 * a2, is_async=True)
        o2 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 2), o2 * a2, is_async=True)
        o3 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 3), o3 * a2, is_async=True)
        o0 = warpgroup_mma_wait(3, deps=(o0,))
        _cta_barrier()
        mbarrier.arrive(k16_free.index(4 * cid + 0), count=1)
        o1 = warpgroup_mma_wait(2, deps=(o1,))
        _cta_barrier()
        mbarrier.arrive(k16_free.index(4 * cid + 1), count=1)
        o2 = warpgroup_mma_wait(1, deps=(o2,))
        _cta_barrier()
        mbarrier.arrive(k16_free.index(4 * cid + 2), count=1)
        o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
        _cta_barrier()
        mbarrier.arrive(k16_free.index(4 * cid + 3), count=1)
        return o0, o1, o2, o3

    @gluon.jit
    def _relabel_k(x):
        # [R, 128]: physical column p = 32t + 4blk + 2jhi + jlo -> logical k = 16blk + 8jhi + 2t + jlo, so that
        # each thread's wgmma A-fragment bytes are 16 contiguous bytes in shared memory (one LDS.128).
        R: gl.constexpr = x.shape[0]
        y = gl.reshape(x, [R, 4, 8, 2, 2])
        y = gl.permute(y, (0, 2, 3, 1, 4))
        return gl.reshape(y, [R, 128])

    @gluon.jit
    def _relabel_k64(x):
        R: gl.constexpr = x.shape[0]
        y = gl.reshape(x, [R, 4, 4, 2, 2])
        y = gl.permute(y, (0, 2, 3, 1, 4))
        return gl.reshape(y, [R, 64])

    @gluon.jit
    def _fp8_pairs_to_f16(x):
        # x: int16 = (dim 2dp, dim 2dp+1) of one token, two tokens per 32-bit register ->
        # (fp16 of dim 2dp, fp16 of dim 2dp+1), exact.
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t;"
            " cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _v_pairs(kbuf, slab, half: gl.constexpr, L16: gl.constexpr, kv16_l: gl.constexpr):
        # one 64-dim half of a 128-column slab as int16 (dim 2dp, dim 2dp+1) pairs, [64 tokens, 32 pairs] in L16
        # (ldmatrix.trans): the V^T source of both P.V paths (_vt_chunk's fp16, _vt_chunk8's e4m3)
        if _NEW_REINTERPRET:
            x16 = kbuf.index(slab).reinterpret(gl.int16, [64, 64], kv16_l)
        else:
            x16 = kbuf.index(slab)._reinterpret(gl.int16, [64, 64], kv16_l)
        return x16.slice(half * 32, 32, dim=1).load(L16)

    @gluon.jit
    def _vt_chunk(kbuf, slab, half: gl.constexpr, a_l: gl.constexpr, L16: gl.constexpr,
                  kv16_l: gl.constexpr):
        # V^T fragment of 64 dims x 64 tokens; row m holds dim 2(8(m>>4) + (m&7)) + ((m>>3)&1) of the chunk.
        x = _v_pairs(kbuf, slab, half, L16, kv16_l)
        lo, hi = _fp8_pairs_to_f16(x)
        v = gl.join(lo, hi)
        v = gl.reshape(v, [64, 4, 8, 2])
        v = gl.permute(v, (1, 3, 2, 0))
        v = gl.reshape(v, [64, 64])
        return gl.convert_layout(v, a_l, assert_trivial=True)

    @gluon.jit
    def _pv_slab(kbuf, slab, bP, a2, oa, ob, a_l: gl.constexpr, L16: gl.constexpr, kv16_l: gl.constexpr):
        # O^T chunks (oa, ob) = the two 64-dim halves of one 128-column slab: each rescaled by a2 and added V^T.P^T,
        # one chunk left in flight while the next one's V^T is converted (wait(1))
        va = _vt_chunk(kbuf, slab, 0, a_l, L16, kv16_l)
        oa = warpgroup_mma(va, bP, oa * a2, is_async=True)
        oa, va = warpgroup_mma_wait(1, deps=(oa, va))
        vb = _vt_chunk(kbuf, slab, 1, a_l, L16, kv16_l)
        ob = warpgroup_mma(vb, bP, ob * a2, is_async=True)
        ob, vb = warpgroup_mma_wait(1, deps=(ob, vb))
        return oa, ob

    @gluon.jit
    def _fp8_quads(x):
        # x: int16 = (dim 2dp, dim 2dp+1) of one token, four per call in L16's register order = tokens
        # (t, t+1, t+8, t+9) of one dim pair -> the e4m3 bytes of dim 2dp at those four tokens, and of dim 2dp+1
        # (an e4m3 wgmma A register holds 4 k-consecutive bytes of one row): two byte permutes, no conversion.
        return gl.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x6420; prmt.b32 $1, $2, $3, 0x7531;",
            "=r,=r,r,r", [x], dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)

    @gluon.jit
    def _relabel_tok8(x):
        # [64 tokens, N] -> rows in the e4m3 P.V's k order: row k holds token t with bits
        # (t5 t4 t2 t1 t3 t0) = k's bits (k5 .. k0), the order _fp8_quads leaves the V^T bytes in
        N: gl.constexpr = x.shape[1]
        y = gl.reshape(x, [2, 2, 2, 2, 2, 2, N])
        y = gl.permute(y, (0, 1, 3, 4, 2, 5, 6))
        return gl.reshape(y, [64, N])

    @gluon.jit
    def _vt_chunk8(kbuf, slab, half: gl.constexpr, a8_l: gl.constexpr, L16: gl.constexpr,
                   kv16_l: gl.constexpr):
        # e4m3 V^T fragment of 64 dims x 64 tokens for the FP8 P.V (fp8_math): rows as _vt_chunk's (row m holds
        # dim 2(8(m>>4) + (m&7)) + ((m>>3)&1)), k in _relabel_tok8's token order; bytes moved, never converted.
        x = _v_pairs(kbuf, slab, half, L16, kv16_l)
        lo, hi = _fp8_quads(x)
        v = gl.join(lo, hi)                                  # [64 tokens, 32 dim pairs, 2]
        v = gl.reshape(v, [2, 2, 2, 2, 2, 2, 4, 8, 2])       # (t5 t4 t3 t2 t1 t0, dp hi, dp lo, d)
        v = gl.permute(v, (6, 8, 7, 0, 1, 3, 4, 2, 5))       # m = (dp hi, d, dp lo), k = (t5 t4 t2 t1 t3 t0)
        v = gl.reshape(v, [64, 64])
        return gl.convert_layout(v, a8_l, assert_trivial=True)

    @gluon.jit
    def _pv_slab8(kbuf, slab, bP8, a2, oa, ob, a8_l: gl.constexpr, L16: gl.constexpr, kv16_l: gl.constexpr):
        # _pv_slab with e4m3 x e4m3 wgmma (k 32): V^T bytes from _vt_chunk8, P^T e4m3 in shared memory. (The
        # wait takes no 8-bit operands (triton 3.6-3.9: "Unexpected bitwidth in WGMMAWaitGroupOp"), so the A
        # fragments are not in deps; ptxas keeps a wgmma's A registers until its group is waited on, as for the
        # fp16 fragments of _pv_slab, which leave the wait while their group may still be in flight.)
        va = _vt_chunk8(kbuf, slab, 0, a8_l, L16, kv16_l)
        oa = warpgroup_mma(va, bP8, oa * a2, is_async=True)
        oa = warpgroup_mma_wait(1, deps=(oa,))
        vb = _vt_chunk8(kbuf, slab, 1, a8_l, L16, kv16_l)
        ob = warpgroup_mma(vb, bP8, ob * a2, is_async=True)
        ob = warpgroup_mma_wait(1, deps=(ob,))
        return oa, ob

    @gluon.jit
    def _sanitize_tail(kbuf, pbuf, s, valid):
        # Zero the rows >= valid of stage s (a request's last, partial tile): they may hold NaN.
        kv8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        zl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, zl))
        c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, zl))
        c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, zl))
        keep = (r[:, None] < valid) & (c128[None, :] >= 0)
        keep64 = (r[:, None] < valid) & (c64[None, :] >= 0)
        for c in gl.static_range(4):
            if _NEW_REINTERPRET:
                buf = kbuf.index(s * 4 + c).reinterpret(gl.int8, [64, 128], kv8)
            else:
                buf = kbuf.index(s * 4 + c)._reinterpret(gl.int8, [64, 128], kv8)
            x = buf.load(zl)
            buf.store(gl.where(keep, x, gl.zeros_like(x)))
        if _NEW_REINTERPRET:
            pb = pbuf.index(s).reinterpret(gl.int8, [64, 64], kpe8)
        else:
            pb = pbuf.index(s)._reinterpret(gl.int8, [64, 64], kpe8)
        x = pb.load(zl)
        pb.store(gl.where(keep64, x, gl.zeros_like(x)))
        fence_async_shared()   # generic-proxy writes before the next TMA write into this stage
        _cta_barrier()

    @gluon.jit
    def _per_item(x, it):
        # x, unchanged, but opaque to the compiler's loop-invariant code motion (it depends on the item index):
        # at 128 O registers, index vectors and store addresses hoisted out of the item loop spill.
        return gl.inline_asm_elementwise("{ .reg .b32 z; and.b32 z, $2, 0; add.s32 $0, $1, z; }", "=r,r,r",
                                         [x, gl.zeros_like(x) + it], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _k_slab(kbuf, slab, ld_l: gl.constexpr, a_l: gl.constexpr):
        # one 128-column K slab as the score MMA's A operand: LDS.128 in the relabelled k order, exact fp16
        a16 = _relabel_k(kbuf.index(slab).load(ld_l).to(gl.float16))
        return gl.convert_layout(a16, a_l, assert_trivial=True)

    @gluon.jit
    def _group_col(x, ci, c: gl.constexpr, row_l: gl.constexpr):
        # column c of the tile's [64, 4] group scales: a [64] token vector in the MMA's row layout (x holds, per
        # thread, the 4 scales of the same 2 token rows the thread holds in the accumulators)
        return gl.convert_layout(gl.sum(gl.where(ci[None, :] == c, x, 0.0), axis=1), row_l)

    @gluon.jit
    def _group_max(mx, ci, c: gl.constexpr):
        # group c's largest scale in the tile (the P normalization; 1 when the group has none above 0)
        m = gl.sum(gl.where(ci == c, mx, 0.0), axis=0)
        return gl.where(m > 0, m, 1.0)

    @gluon.jit
    def _scores_group(kbuf, pbuf, s, q_smem, my_qpe, cid: gl.constexpr, sg, ld_l: gl.constexpr,
                      ld64_l: gl.constexpr, a_l: gl.constexpr, mma: gl.constexpr, HPW: gl.constexpr):
        # S^T with per-token group scales: one fp32 product per 128-column slab (= one scale group) times the
        # slab's [64] token scales, plus the unscaled k_pe product (its per-tensor scale is folded into Q, as in
        # the default path). One product at a time: the consumers of the default kernel already use ~237 of their
        # 240 registers, and overlapping the next slab's conversion with the previous product (a second A operand
        # and accumulator live) spilled ~280 B more at H16 (sm_90a, triton 3.6). sg: the 4 groups' [64] token scales.
        sg0, sg1, sg2, sg3 = sg
        z = gl.zeros([64, HPW], gl.float32, mma)
        ap = gl.convert_layout(_relabel_k64(pbuf.index(s).load(ld64_l).to(gl.float16)), a_l, assert_trivial=True)
        sT = warpgroup_mma(ap, my_qpe.permute((1, 0)), z, is_async=True)
        sT, ap = warpgroup_mma_wait(0, deps=(sT, ap))
        sT = _add_slab_score(sT, kbuf, s * 4 + 0, q_smem.index(cid * 4 + 0), sg0, z, ld_l, a_l)
        sT = _add_slab_score(sT, kbuf, s * 4 + 1, q_smem.index(cid * 4 + 1), sg1, z, ld_l, a_l)
        sT = _add_slab_score(sT, kbuf, s * 4 + 2, q_smem.index(cid * 4 + 2), sg2, z, ld_l, a_l)
        return _add_slab_score(sT, kbuf, s * 4 + 3, q_smem.index(cid * 4 + 3), sg3, z, ld_l, a_l)

    @gluon.jit
    def _add_slab_score(sT, kbuf, slab, qT, sg, z, ld_l: gl.constexpr, a_l: gl.constexpr):
        # sT + (slab's K . Q^T) x the slab's [64] token scales, the product alone in flight
        a = _k_slab(kbuf, slab, ld_l, a_l)
        x = warpgroup_mma(a, qT.permute((1, 0)), z, is_async=True)
        x, a = warpgroup_mma_wait(0, deps=(x, a))
        return sT + x * sg[:, None]
