"""Many-heads (64 / 128 heads) Hopper decode prototype: 64 heads on the MMA's M side, the FP8 latent converted
ONCE per tile into a 16-bit shared-memory operand that both products read (design: design.md beside this file).

Lab code (issue 27, first step): not imported by src/, not collected by CI. Self-contained on purpose: it imports
nothing from fp8mla's kernels, so a move of the product's Gluon kernel cannot break it.

One CTA per (request, KV split, 64-head group); 12 warps in three roles (warp specialization):

- converter (default partition, 4 warps): walks the CTA's tiles (page 64: one tile = one page), issues the TMA
  boxes of the FP8 tile into an NS-stage ring (nine 64 x 64-byte boxes: eight of c_kv, one of k_pe), and converts
  each landed tile into the fp16 tile ``k16`` [64 tokens, 576] (nine [64, 64] chunks, 128-byte swizzle), rows past
  kv_len written as 0 (an unused slot may hold NaN, and 0 x NaN in P.V would poison the output);
- two consumer warpgroups, cid 0 / 1 (the same code): consumer cid computes the scores of the tile's tokens
  [32 cid, 32 cid + 32) for all 64 heads (S [64, 32] = Q [64, 576] . K^T, both from shared memory), the two
  consumers exchange their row maxima (shared memory + a two-party mbarrier), each writes its half of P [64, 64]
  (fp16) to shared memory, and consumer cid accumulates O [64 heads, 256 dims cid] += P . V (V = the first 512
  columns of ``k16``). Softmax in fp32 with exp2; the running maximum is the same in both consumers, the row sums
  are per consumer (its tokens) and added at the end.

The ``conv2`` build (16 warps) adds a second converter warpgroup (``_converter_b``: chunks 4-7) beside the first
(chunks 8, 0-3 and the TMA), each with its own fence + barrier + arrive per round (design.md, "conv2: prediction").

Numerics (the product's default): FP8 e4m3 -> fp16 is exact; Q x (per-tensor scale) x f (f a power of two per
head, the largest |q| near 2^14) rounded once to fp16; fp16 MMAs accumulate in fp32; P in fp16; the scores are
multiplied by sm_scale x log2(e) / f per row, the output by ckv_scale.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

try:  # Gluon ships inside triton >= 3.4; written against triton 3.6's API (the H200's), compiles under 3.9 too
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared,
                                                                 warpgroup_mma, warpgroup_mma_wait)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # the partition's warps only
    GLUON_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon here"
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

D_CKV, D_KPE, PAGE_SIZE, HEADS_PER_CTA = 512, 64, 64, 64   # host ints; the kernels' constexpr twins below
# c_kv dims, k_pe dims, page = tile tokens, heads per CTA; NCH: 64-column chunks of a 576-wide row (8 c_kv + 1 k_pe)
DC, DK, PAGE, TILE, HG, NCH = (tl.constexpr(v) for v in (512, 64, 64, 64, 64, 9))
SMEM_LIMIT = 232448


def smem_bytes(ns: int) -> int:
    """Shared memory of the build: Q 72 KB, the fp16 tile 72 KB, NS FP8 stages of 36 KB, P 8 KB, exchange, barriers
    (conv2's NS stage_free ones counted for every build)."""
    return 64 * 576 * 2 + 64 * 576 * 2 + ns * 64 * 576 + 64 * 64 * 2 + 4 * 64 * 4 + 8 * (ns + 9 + 5 + 9 + ns)


if gluon is not None:

    @gluon.jit
    def _opaque_zero(i):
        # 0, computed from the loop counter in a way the compiler cannot fold: it keeps the shared-memory
        # descriptors of the 52 MMAs per tile inside the loop (hoisted, triton 3.6 keeps all of them live as
        # 64-bit values and spills ~900 B)
        return gl.inline_asm_elementwise("{ .reg .b32 z; and.b32 z, $1, 0; mov.b32 $0, z; }", "=r,r", [i],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, CA: gl.constexpr, CB: gl.constexpr,
                       MASK: gl.constexpr, cl: gl.constexpr):
        # the release builds' converter round: chunk CA (and CB >= 0 with it), each after its own free barrier
        # (released by the consumer that read it last), FP8 stage -> fp16 tile, one fence + barrier + arrive;
        # MASK: the request's last tile, rows past kv_len become 0 (they may hold NaN)
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
    def _conv2_rounds(stage, k16, k16_ready, k16_free, s, z, i, keep, FIRST: gl.constexpr, C0: gl.constexpr,
                      MASK: gl.constexpr, CHUNKS: gl.constexpr, cl: gl.constexpr):
        # one conv2 converter's tile: chunk FIRST alone (A: 8; B: none, -1), then chunks C0 .. C0 + 3 in the
        # order one consumer releases them, CHUNKS (1 or 2) per fence + barrier + arrive round
        if FIRST >= 0:
            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, FIRST, -1, MASK, cl)
        if CHUNKS == 2:
            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, C0, C0 + 1, MASK, cl)
            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, C0 + 2, C0 + 3, MASK, cl)
        else:
            for c in gl.static_range(4):
                _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, C0 + c, -1, MASK, cl)

    @gluon.jit
    def _converter(kv_desc, kpe_desc, kv_indptr, kv_indices, kv_len, stage, k16, ready8, k16_ready, k16_free,
                   stage_free, b, t0, n, NS: gl.constexpr, RELEASE: gl.constexpr, PAIR: gl.constexpr,
                   CONV2: gl.constexpr):
        # CONV2 > 0 (chunks per round): this is converter A (chunks 8, 0-3, and the TMA); _converter_b does 4-7
        # one thread's 16 contiguous bytes per load (LDS.128 over the 64-byte swizzled box)
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, cl))
        L = gl.load(kv_len + b)
        pbase = gl.load(kv_indptr + b)
        # prologue: the first NS tiles in flight
        for i in gl.static_range(NS):
            if i < n:
                page = gl.load(kv_indices + pbase + t0 + i)
                bar = ready8.index(i)
                mbarrier.expect(bar, TILE * 576)
                for c in gl.static_range(NCH - 1):
                    _tma_load(kv_desc, [page * PAGE, c * 64], bar, stage.index(i * NCH + c))
                _tma_load(kpe_desc, [page * PAGE, 0], bar, stage.index(i * NCH + NCH - 1))
        for i in range(n):
            s = i % NS
            valid = gl.minimum(L - (t0 + i) * TILE, TILE)
            keep = (rows < valid)[:, None]
            mbarrier.wait(ready8.index(s), (i // NS) & 1)
            z = _opaque_zero(i)   # the store addresses stay in the loop (24 registers here)
            if not RELEASE:   # the fp16 tile is free once both consumers finished tile i - 1 (scores and P.V)
                mbarrier.wait(k16_free, (i & 1) ^ 1, pred=i > 0)
                # chunk by chunk, each announced on its own barrier: the consumers' score MMAs of chunk c start
                # while chunk c + 1 is converted
                if valid < TILE:   # the request's last tile: rows past kv_len become 0 (they may hold NaN)
                    for c in gl.static_range(NCH):
                        x = stage.index(s * NCH + c).load(cl).to(gl.float16)
                        k16.index(z + c).store(gl.where(keep, x, 0.0))
                        fence_async_shared()   # generic-proxy stores before the consumers' wgmma (async proxy) reads
                        _cta_barrier()         # every converter warp has stored its part of the chunk
                        mbarrier.arrive(k16_ready.index(c), count=1)
                else:              # a full tile: no select per element
                    for c in gl.static_range(NCH):
                        k16.index(z + c).store(stage.index(s * NCH + c).load(cl).to(gl.float16))
                        fence_async_shared()
                        _cta_barrier()
                        mbarrier.arrive(k16_ready.index(c), count=1)
            else:
                # RELEASE: chunk 8 first (free once the owner's scores of tile i - 1 are done), then 0, 4, 1, 5,
                # ... as the two consumers' P.V MMAs release them; PAIR: rounds (8), (0, 4), (1, 5), (2, 6), (3, 7)
                if valid < TILE:
                    if CONV2 > 0:   # the chunks consumer 0 releases, in its order, after chunk 8
                        _conv2_rounds(stage, k16, k16_ready, k16_free, s, z, i, keep, 8, 0, True, CONV2, cl)
                    elif PAIR:
                        _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, 8, -1, True, cl)
                        for r in gl.static_range(4):
                            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, r, r + 4, True, cl)
                    else:
                        for c in gl.static_range(NCH):
                            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep,
                                           ((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4, -1, True, cl)
                else:
                    if CONV2 > 0:
                        _conv2_rounds(stage, k16, k16_ready, k16_free, s, z, i, keep, 8, 0, False, CONV2, cl)
                    elif PAIR:
                        _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, 8, -1, False, cl)
                        for r in gl.static_range(4):
                            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep, r, r + 4, False, cl)
                    else:
                        for c in gl.static_range(NCH):
                            _convert_round(stage, k16, k16_ready, k16_free, s, z, i, keep,
                                           ((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4, -1, False, cl)
            if i + NS < n:         # the stage is free again: the tile NS ahead goes into it
                if CONV2 > 0:      # ... once converter B has read its chunks of it too
                    mbarrier.wait(stage_free.index(s), (i // NS) & 1)
                page = gl.load(kv_indices + pbase + t0 + i + NS)
                bar = ready8.index(s)
                mbarrier.expect(bar, TILE * 576)
                for c in gl.static_range(NCH - 1):
                    _tma_load(kv_desc, [page * PAGE, c * 64], bar, stage.index(s * NCH + c))
                _tma_load(kpe_desc, [page * PAGE, 0], bar, stage.index(s * NCH + NCH - 1))

    @gluon.jit
    def _converter_b(kv_len, stage, k16, ready8, k16_ready, k16_free, stage_free, b, t0, n, NS: gl.constexpr,
                     CONV2: gl.constexpr):
        # the conv2 build's second converter warpgroup: chunks 4-7 (the ones consumer 1 releases), CONV2 per round
        # ((4, 5), (6, 7) or 4, 5, 6, 7), each round with its own fence + partition barrier + arrive, in parallel
        # with converter A's; then it hands the FP8 stage back to converter A (stage_free), which alone refills it
        cl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, cl))
        L = gl.load(kv_len + b)
        for i in range(n):
            s = i % NS
            valid = gl.minimum(L - (t0 + i) * TILE, TILE)
            keep = (rows < valid)[:, None]
            mbarrier.wait(ready8.index(s), (i // NS) & 1)
            z = _opaque_zero(i)
            if valid < TILE:
                _conv2_rounds(stage, k16, k16_ready, k16_free, s, z, i, keep, -1, 4, True, CONV2, cl)
            else:
                _conv2_rounds(stage, k16, k16_ready, k16_free, s, z, i, keep, -1, 4, False, CONV2, cl)
            # the last round's partition barrier came after every warp's loads of the stage
            mbarrier.arrive(stage_free.index(s), count=1)

    @gluon.jit
    def _consumer(cid: gl.constexpr, q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem,
                  xm, k16_ready, k16_free, x_bar, p_bar, q_bar, b, split, hg, t0, n, H, ckv_scale, kpe_scale,
                  sm_scale_log2, NSPLIT, DIRECT: gl.constexpr, OWNER: gl.constexpr, RELEASE: gl.constexpr):
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)

        # -- Q: per-head power-of-two range factor f, then Q x scale x f in fp16 (consumer cid stores its chunks) --
        hq = gl.arange(0, HG, layout=gl.SliceLayout(1, ql))
        cq = gl.arange(0, 64, layout=gl.SliceLayout(0, ql))
        head = hg * HG + hq
        qn_row = q_nope + (b * H + head).to(gl.int64) * DC
        qp_row = q_pe + (b * H + head).to(gl.int64) * DK
        amax = gl.zeros([HG], gl.float32, gl.SliceLayout(1, ql))
        for c in gl.static_range(NCH - 1):
            x = gl.load(qn_row[:, None] + c * 64 + cq[None, :])
            amax = gl.maximum(amax, gl.max(gl.abs(x.to(gl.float32)), axis=1))
        amax = amax * ckv_scale
        xp = gl.load(qp_row[:, None] + cq[None, :])
        amax = gl.maximum(amax, gl.max(gl.abs(xp.to(gl.float32)), axis=1) * kpe_scale)
        f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
        for c in gl.static_range(NCH):
            if c % 2 == cid:
                if c < NCH - 1:
                    x = gl.load(qn_row[:, None] + c * 64 + cq[None, :])
                    q_smem.index(c).store((x.to(gl.float32) * (f * ckv_scale)[:, None]).to(gl.float16))
                else:
                    q_smem.index(c).store((xp.to(gl.float32) * (f * kpe_scale)[:, None]).to(gl.float16))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(q_bar, count=1)
        row_scale = gl.convert_layout(sm_scale_log2 / f, row_s)
        tok = gl.arange(0, 32, layout=gl.SliceLayout(0, s_l)) + cid * 32
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
            valid = L - (t0 + i) * TILE
            z = _opaque_zero(i)
            if OWNER:
                # -- alternating owners: consumer i % 2 computes the whole S [64 heads, 64 tokens] (m64n64 MMAs:
                # Q read once per 64 tokens, not twice) and the softmax; it hands P and the new maximum over --
                if (i % 2) == cid:
                    sc = gl.zeros([HG, 64], gl.float32, o_l)
                    for c in gl.static_range(NCH):   # RELEASE: in the converter's order 8, 0, 4, 1, 5, ...
                        cc = c + RELEASE * (((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4 - c)
                        mbarrier.wait(k16_ready.index(cc), ph)
                        sc = warpgroup_mma(q_smem.index(z + cc), k16.index(z + cc).permute((1, 0)), sc, is_async=True)
                    sc = warpgroup_mma_wait(0, deps=(sc,))
                    if RELEASE:   # chunk 8 (k_pe) is read by the scores only: the next tile's goes in now
                        _cta_barrier()
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
            else:
                # -- scores of this consumer's 32 tokens: S [64 heads, 32] over the nine 64-column chunks, each MMA
                # issued as its chunk lands --
                sc = gl.zeros([HG, 32], gl.float32, s_l)
                for c in gl.static_range(NCH):
                    mbarrier.wait(k16_ready.index(c), ph)
                    sc = warpgroup_mma(q_smem.index(z + c), k16.index(z + c).slice(cid * 32, 32, dim=0).permute((1, 0)), sc,
                                       is_async=True)
                sc = warpgroup_mma_wait(0, deps=(sc,))
                sc = gl.where((tok < valid)[None, :], sc * row_scale[:, None], float("-inf"))
                # -- the two consumers' row maxima meet in shared memory (two-party barrier x_bar) --
                m_loc = gl.max(sc, axis=1)
                xm.index(cid).store(m_loc)
                _cta_barrier()
                mbarrier.arrive(x_bar, count=1)
                mbarrier.wait(x_bar, ph)
                m_other = xm.index(1 - cid).load(row_s)
                m_new = gl.maximum(m_i, gl.maximum(m_loc, m_other))   # finite: every tile has a valid token
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                m_i = m_new
                # -- P to shared memory (the buffer is free: tile i's chunks came after both consumers' P.V of i - 1) --
                p_smem.index(cid).store(p.to(gl.float16))
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(p_bar, count=1)
                mbarrier.wait(p_bar, ph)
            # -- O [64 heads, 256 dims of this consumer] += P [64, 64 tokens] . V [64 tokens, 256] --
            a2 = gl.convert_layout(alpha, row_o)[:, None]
            if OWNER:
                o0 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 0), o0 * a2, is_async=True)
                o1 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 1), o1 * a2, is_async=True)
                o2 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 2), o2 * a2, is_async=True)
                o3 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 3), o3 * a2, is_async=True)
                if RELEASE:   # each chunk back to the converter as its MMA completes (wait depth 3, 2, 1, 0)
                    o0 = warpgroup_mma_wait(3, deps=(o0,))
                    _cta_barrier()
                    mbarrier.arrive(k16_free.index(4 * cid + 0), count=1)
                    o1 = warpgroup_mma_wait(2, deps=(o1,))
                    _cta_barrier()
                    mbarrier.arrive(k16_free.index(4 * cid + 1), count=1)
                    o2 = warpgroup_mma_wait(1, deps=(o2,))
                    _cta_barrier()
                    mbarrier.arrive(k16_free.index(4 * cid + 2), count=1)
            else:
                o0 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 0).slice(0, 32, dim=0), o0 * a2, is_async=True)
                o0 = warpgroup_mma(p_smem.index(z + 1), k16.index(z + 4 * cid + 0).slice(32, 32, dim=0), o0, is_async=True)
                o1 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 1).slice(0, 32, dim=0), o1 * a2, is_async=True)
                o1 = warpgroup_mma(p_smem.index(z + 1), k16.index(z + 4 * cid + 1).slice(32, 32, dim=0), o1, is_async=True)
                o2 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 2).slice(0, 32, dim=0), o2 * a2, is_async=True)
                o2 = warpgroup_mma(p_smem.index(z + 1), k16.index(z + 4 * cid + 2).slice(32, 32, dim=0), o2, is_async=True)
                o3 = warpgroup_mma(p_smem.index(z), k16.index(z + 4 * cid + 3).slice(0, 32, dim=0), o3 * a2, is_async=True)
                o3 = warpgroup_mma(p_smem.index(z + 1), k16.index(z + 4 * cid + 3).slice(32, 32, dim=0), o3, is_async=True)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            _cta_barrier()
            if RELEASE:
                mbarrier.arrive(k16_free.index(4 * cid + 3), count=1)
            else:
                mbarrier.arrive(k16_free, count=1)

        # -- end: the row sums of both consumers' tokens, then this consumer's 256 columns --
        xm.index(2 + cid).store(l_i)
        _cta_barrier()
        mbarrier.arrive(x_bar, count=1)
        if OWNER:   # x_bar's first phase (no row-max exchange in the loop)
            mbarrier.wait(x_bar, 0)
        else:       # its phase n
            mbarrier.wait(x_bar, n & 1)
        l_tot = l_i + xm.index(3 - cid).load(row_s)
        ok = l_tot > 0
        lse = gl.where(ok, m_i + gl.log2(gl.where(ok, l_tot, 1.0)), float("-inf"))
        inv = gl.convert_layout(gl.where(ok, ckv_scale / gl.where(ok, l_tot, 1.0), 0.0), row_o)[:, None]
        hr = gl.arange(0, HG, layout=row_o)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
        hh = hg * HG + hr
        if DIRECT:   # the CTA has the whole request: final out (query dtype) and lse
            base = out + (b * H + hh).to(gl.int64)[:, None] * DC + cid * 256 + cols[None, :]
            gl.store(base + 0, (o0 * inv).to(out.dtype.element_ty))
            gl.store(base + 64, (o1 * inv).to(out.dtype.element_ty))
            gl.store(base + 128, (o2 * inv).to(out.dtype.element_ty))
            gl.store(base + 192, (o3 * inv).to(out.dtype.element_ty))
            if cid == 0:
                gl.store(lse_out + b * H + hg * HG + hrow, lse)
        else:        # a partial [B, NSPLIT, H, 512] fp32 + lse [B, NSPLIT, H], merged by _merge_kernel
            prow = (b * NSPLIT + split) * H
            base = part_o + (prow + hh).to(gl.int64)[:, None] * DC + cid * 256 + cols[None, :]
            gl.store(base + 0, o0 * inv)
            gl.store(base + 64, o1 * inv)
            gl.store(base + 128, o2 * inv)
            gl.store(base + 192, o3 * inv)
            if cid == 0:
                gl.store(part_lse + prow + hg * HG + hrow, lse)

    @gluon.jit
    def _consumer0(q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm, k16_ready,
                   k16_free, x_bar, p_bar, q_bar, b, split, hg, t0, n, H, ckv_scale, kpe_scale, sm_scale_log2,
                   NSPLIT, DIRECT: gl.constexpr, OWNER: gl.constexpr, RELEASE: gl.constexpr):
        _consumer(0, q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm, k16_ready,
                  k16_free, x_bar, p_bar, q_bar, b, split, hg, t0, n, H, ckv_scale, kpe_scale, sm_scale_log2,
                  NSPLIT, DIRECT, OWNER, RELEASE)

    @gluon.jit
    def _consumer1(q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm, k16_ready,
                   k16_free, x_bar, p_bar, q_bar, b, split, hg, t0, n, H, ckv_scale, kpe_scale, sm_scale_log2,
                   NSPLIT, DIRECT: gl.constexpr, OWNER: gl.constexpr, RELEASE: gl.constexpr):
        _consumer(1, q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm, k16_ready,
                  k16_free, x_bar, p_bar, q_bar, b, split, hg, t0, n, H, ckv_scale, kpe_scale, sm_scale_log2,
                  NSPLIT, DIRECT, OWNER, RELEASE)

    @gluon.jit
    def many_heads_kernel(kv_desc, kpe_desc, q_nope, q_pe, kv_indptr, kv_indices, kv_len, out, lse_out, part_o,
                          part_lse, H, ckv_scale, kpe_scale, sm_scale_log2, NSPLIT,
                          NS: gl.constexpr, REGS: gl.constexpr, DIRECT: gl.constexpr, OWNER: gl.constexpr,
                          RELEASE: gl.constexpr, PAIR: gl.constexpr, CONV2: gl.constexpr):
        pid = gl.program_id(0)
        hg = gl.program_id(1)
        b = pid // NSPLIT
        split = pid % NSPLIT
        L = gl.load(kv_len + b)
        n_tiles = (L + TILE - 1) // TILE
        per = (n_tiles + NSPLIT - 1) // NSPLIT
        t0 = split * per
        n = gl.maximum(gl.minimum(t0 + per, n_tiles) - t0, 0)

        st_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        h_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        p_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        stage = gl.allocate_shared_memory(gl.float8e4nv, [NS * NCH, TILE, 64], st_l)
        k16 = gl.allocate_shared_memory(gl.float16, [NCH, TILE, 64], h_l)
        q_smem = gl.allocate_shared_memory(gl.float16, [NCH, HG, 64], h_l)
        if OWNER:   # P [64 heads, 64 tokens], written by the tile's owner
            p_smem = gl.allocate_shared_memory(gl.float16, [1, HG, 64], h_l)
        else:       # P's two 32-token halves, one per consumer
            p_smem = gl.allocate_shared_memory(gl.float16, [2, HG, 32], p_l)
        xm = gl.allocate_shared_memory(gl.float32, [4, HG], gl.SwizzledSharedLayout(1, 1, 1, [0]))   # [slot, head]: a 1-D layout per slot
        ready8 = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        k16_ready = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())   # one per chunk
        bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(ready8.index(i), count=1)
        for c in gl.static_range(NCH):
            mbarrier.init(k16_ready.index(c), count=1)   # the converter, once per tile
        mbarrier.init(bars.index(1), count=2)   # k16_free: both consumers
        mbarrier.init(bars.index(2), count=2)   # x_bar: the row-max exchange
        mbarrier.init(bars.index(3), count=1 if OWNER else 2)   # p_bar: P complete (its owner / both halves)
        mbarrier.init(bars.index(4), count=2)   # q_bar: Q complete
        if RELEASE:   # one free barrier per chunk: 8 by the tile's owner, 0-3 by consumer 0, 4-7 by consumer 1
            k16_free = gl.allocate_shared_memory(gl.int64, [NCH, 1], mbarrier.MBarrierLayout())
            for c in gl.static_range(NCH):
                mbarrier.init(k16_free.index(c), count=1)
        else:
            k16_free = bars.index(1)
        if CONV2 > 0:   # converter B's "done reading FP8 stage s" (converter A waits on it before the TMA refills s)
            stage_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NS):
                mbarrier.init(stage_free.index(i), count=1)
        else:
            stage_free = ready8   # unused
        fence_async_shared()
        if CONV2 > 0:
            # 16 warps: 2 x 128 x REGS (consumers) + 2 x 128 x (256 - REGS) (converters) = 64K registers; the
            # default partition (converter A) gets what the workers leave, the same 256 - REGS
            gl.warp_specialize([
                (_converter, (kv_desc, kpe_desc, kv_indptr, kv_indices, kv_len, stage, k16, ready8, k16_ready,
                              k16_free, stage_free, b, t0, n, NS, RELEASE, PAIR, CONV2)),
                (_consumer0, (q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm,
                              k16_ready, k16_free, bars.index(2), bars.index(3), bars.index(4), b, split, hg,
                              t0, n, H, ckv_scale, kpe_scale, sm_scale_log2, NSPLIT, DIRECT, OWNER, RELEASE)),
                (_consumer1, (q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm,
                              k16_ready, k16_free, bars.index(2), bars.index(3), bars.index(4), b, split, hg,
                              t0, n, H, ckv_scale, kpe_scale, sm_scale_log2, NSPLIT, DIRECT, OWNER, RELEASE)),
                (_converter_b, (kv_len, stage, k16, ready8, k16_ready, k16_free, stage_free, b, t0, n, NS, CONV2)),
            ], [4, 4, 4], [REGS, REGS, 256 - REGS])
        else:
            gl.warp_specialize([
                (_converter, (kv_desc, kpe_desc, kv_indptr, kv_indices, kv_len, stage, k16, ready8, k16_ready,
                              k16_free, stage_free, b, t0, n, NS, RELEASE, PAIR, CONV2)),
                (_consumer0, (q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm,
                              k16_ready, k16_free, bars.index(2), bars.index(3), bars.index(4), b, split, hg,
                              t0, n, H, ckv_scale, kpe_scale, sm_scale_log2, NSPLIT, DIRECT, OWNER, RELEASE)),
                (_consumer1, (q_nope, q_pe, kv_len, out, lse_out, part_o, part_lse, q_smem, k16, p_smem, xm,
                              k16_ready, k16_free, bars.index(2), bars.index(3), bars.index(4), b, split, hg,
                              t0, n, H, ckv_scale, kpe_scale, sm_scale_log2, NSPLIT, DIRECT, OWNER, RELEASE)),
            ], [4, 4], [REGS, REGS])


@triton.jit
def _merge_kernel(out, lse_out, part_o, part_lse, H, NSPLIT, BLOCK_S: tl.constexpr):
    """One (request, head) per program, over its NSPLIT partials in BLOCK_S chunks (fixed order: reruns are
    bit-identical): m = max lse; out = sum 2^(lse - m) o / sum 2^(lse - m), lse = m + log2(sum); all partials
    empty (lse -inf): out 0, lse -inf."""
    r = tl.program_id(0)           # b * H + h
    b = r // H
    h = r % H
    s0 = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, DC)
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
    for c in range(0, NSPLIT, BLOCK_S):
        s = c + s0
        lse = tl.load(part_lse + (b * NSPLIT + s) * H + h, mask=s < NSPLIT, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([DC], dtype=tl.float32)
    wsum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    for c in range(0, NSPLIT, BLOCK_S):
        s = c + s0
        lse = tl.load(part_lse + (b * NSPLIT + s) * H + h, mask=s < NSPLIT, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.exp2(lse - m_use), 0.0)
        o = tl.load(part_o + ((b * NSPLIT + s) * H + h).to(tl.int64)[:, None] * DC + cols[None, :],
                    mask=(w > 0)[:, None], other=0.0)
        acc += tl.sum(o * w[:, None], axis=0)
        wsum += tl.sum(w, axis=0)
    ok = wsum > 0
    tl.store(out + r.to(tl.int64) * DC + cols,
             tl.where(ok, acc / tl.where(ok, wsum, 1.0), 0.0).to(out.dtype.element_ty))
    tl.store(lse_out + r, tl.where(ok, m_use + tl.log2(tl.where(ok, wsum, 1.0)), float("-inf")))


def pick_splits(batch: int, num_heads: int, max_tiles: int, n_sm: int = 132) -> int:
    """KV splits per request: enough CTAs to cover the SMs once (at least 4 tiles per split)."""
    groups = batch * (num_heads // HEADS_PER_CTA)
    s = max(1, n_sm // max(groups, 1))
    return max(1, min(s, max(1, max_tiles // 4)))


def check_args(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len):
    """Refuse what the prototype does not take, naming the argument, what it takes and what came."""
    import torch
    if q_nope.dim() != 3 or q_nope.shape[2] != D_CKV:
        raise ValueError(f"q_nope: expected [batch, heads, {D_CKV}], got {tuple(q_nope.shape)}")
    B, H, _ = q_nope.shape
    if H not in (64, 128):
        raise ValueError(f"q_nope: the prototype takes 64 or 128 heads, got {H}")
    if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
        raise ValueError(f"q_nope / q_pe: expected torch.bfloat16, got {q_nope.dtype} / {q_pe.dtype}")
    if tuple(q_pe.shape) != (B, H, D_KPE):
        raise ValueError(f"q_pe: expected {(B, H, D_KPE)}, got {tuple(q_pe.shape)}")
    if not (q_nope.is_contiguous() and q_pe.is_contiguous()):
        raise ValueError("q_nope / q_pe: expected contiguous tensors")
    if ckv_cache.dtype != torch.float8_e4m3fn or kpe_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"ckv_cache / kpe_cache: expected torch.float8_e4m3fn, got {ckv_cache.dtype} / "
                         f"{kpe_cache.dtype}")
    if ckv_cache.dim() != 3 or ckv_cache.shape[1:] != (PAGE_SIZE, D_CKV):
        raise ValueError(f"ckv_cache: expected [pages, {PAGE_SIZE}, {D_CKV}], got {tuple(ckv_cache.shape)}")
    if kpe_cache.shape != (ckv_cache.shape[0], PAGE_SIZE, D_KPE):
        raise ValueError(f"kpe_cache: expected {(ckv_cache.shape[0], PAGE_SIZE, D_KPE)}, got {tuple(kpe_cache.shape)}")
    if ckv_cache.stride(2) != 1 or kpe_cache.stride(2) != 1 or ckv_cache.stride(1) % 16 or \
            kpe_cache.stride(1) % 16 or ckv_cache.stride(0) != PAGE_SIZE * ckv_cache.stride(1) or \
            kpe_cache.stride(0) != PAGE_SIZE * kpe_cache.stride(1):
        raise ValueError("ckv_cache / kpe_cache: expected rows of one pool (contiguous last dim, 16-byte aligned "
                         f"row stride, page stride = {PAGE_SIZE} rows), got strides {ckv_cache.stride()} / "
                         f"{kpe_cache.stride()}")
    for name, t, n in (("kv_indptr", kv_indptr, B + 1), ("kv_len", kv_len, B)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name}: expected int32 [{n}], got {t.dtype} {tuple(t.shape)}")
    if kv_indices.dtype != torch.int32 or kv_indices.dim() != 1:
        raise ValueError(f"kv_indices: expected int32 [n], got {kv_indices.dtype} {tuple(kv_indices.shape)}")
    return B, H


def kv_descriptors(ckv_cache, kpe_cache):
    """TMA descriptors over the pool rows, boxes of 64 rows x 64 bytes (eight per c_kv row, one for k_pe)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P = ckv_cache.shape[0]
    lay = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    kv = TensorDescriptor(ckv_cache, [P * PAGE_SIZE, D_CKV], [ckv_cache.stride(1), 1], [PAGE_SIZE, 64], lay)
    kpe = TensorDescriptor(kpe_cache, [P * PAGE_SIZE, D_KPE], [kpe_cache.stride(1), 1], [PAGE_SIZE, 64], lay)
    return kv, kpe


def decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len, *, sm_scale: float,
           ckv_scale: float = 1.0, kpe_scale: float = 1.0, num_splits: int | None = None, max_kv_len: int | None = None,
           ns: int = 2, regs: int = 240, owner: bool = False, release: bool = False, pair: bool = False,
           conv2: bool = False, conv2_chunks: int = 2, out=None, lse=None, part=None, descs=None):
    """The prototype's launcher. q_nope [B, H, 512] / q_pe [B, H, 64] bf16 (one query per request, H 64 or 128);
    ckv_cache [P, 64, 512] / kpe_cache [P, 64, 64] float8_e4m3fn views of one [P, 64, 576] pool; kv_indptr [B+1],
    kv_indices (page ids), kv_len [B] int32. Returns (out [B, H, 512] bf16, lse [B, H] fp32, base 2).
    ``max_kv_len`` (host int) sizes the splits without a device read; pass it, with ``out``/``lse``/``part``/
    ``descs``, to capture the call in a CUDA graph. ``owner``: the alternating-owner build (consumer i % 2 computes
    tile i's whole score tile and softmax) instead of the token split. ``release`` (needs ``owner``): each 16-bit
    chunk goes back to the converter on its own barrier as its last reader finishes, so the next tile's conversion
    runs under this tile's softmax and P.V. ``pair`` (needs ``release``): the converter stores two chunks per fence +
    barrier round (5 rounds a tile instead of 9); ``regs=232`` gives the converter 40 registers for it. ``conv2``
    (needs ``pair``): two converter warpgroups in parallel, A: (8), (0, 1), (2, 3) and the TMA, B: (4, 5), (6, 7),
    each with its own fence + barrier + arrive per round; ``conv2_chunks=1``: one chunk per round (A: 8, 0, 1, 2, 3;
    B: 4, 5, 6, 7); 16 warps, so ``regs`` (consumers) leaves 256 - regs to each converter (208 / 48)."""
    import torch
    B, H = check_args(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len)
    if gluon is None:
        raise RuntimeError(f"gluon is not importable: {GLUON_IMPORT_ERROR}")
    if release and not owner:
        raise ValueError("release: the per-chunk release needs owner=True, got owner=False")
    if pair and not release:
        raise ValueError("pair: two chunks per converter round needs release=True, got release=False")
    if conv2 and not pair:
        raise ValueError("conv2: the two-converter build is built on pair=True, got pair=False")
    if conv2 and conv2_chunks not in (1, 2):
        raise ValueError(f"conv2_chunks: expected 1 or 2 chunks per converter round, got {conv2_chunks}")
    if conv2 and not (160 <= regs <= 232 and regs % 8 == 0):
        raise ValueError(f"regs: conv2 needs a multiple of 8 in [160, 232] (256 - regs >= 24 per converter), "
                         f"got {regs}")
    if smem_bytes(ns) > SMEM_LIMIT:
        raise ValueError(f"ns: {ns} stages need {smem_bytes(ns)} B of shared memory, over {SMEM_LIMIT}")
    if max_kv_len is None:
        max_kv_len = int(kv_len.max().item()) if B else 0
    if num_splits is None:
        num_splits = pick_splits(B, H, triton.cdiv(max_kv_len, PAGE_SIZE))
    dev = q_nope.device
    if out is None:
        out = torch.empty(B, H, D_CKV, dtype=q_nope.dtype, device=dev)
    if lse is None:
        lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    direct = num_splits == 1
    if direct:
        part_o, part_lse = out, lse   # unused placeholders
    else:
        if part is None:
            part = (torch.empty(B, num_splits, H, D_CKV, dtype=torch.float32, device=dev),
                    torch.empty(B, num_splits, H, dtype=torch.float32, device=dev))
        part_o, part_lse = part
    kv_desc, kpe_desc = descs if descs is not None else kv_descriptors(ckv_cache, kpe_cache)
    sm_scale_log2 = float(sm_scale) * 1.4426950408889634   # exp2 softmax: scores in log2 units
    if B:
        many_heads_kernel[(B * num_splits, H // HEADS_PER_CTA)](
            kv_desc, kpe_desc, q_nope, q_pe, kv_indptr, kv_indices, kv_len, out, lse, part_o, part_lse, H,
            float(ckv_scale), float(kpe_scale), sm_scale_log2, num_splits,
            NS=ns, REGS=regs, DIRECT=direct, OWNER=bool(owner), RELEASE=bool(release), PAIR=bool(pair),
            CONV2=int(conv2_chunks) if conv2 else 0, num_warps=4)
        if not direct:
            _merge_kernel[(B * H,)](out, lse, part_o, part_lse, H, num_splits,
                                    BLOCK_S=16, num_warps=4)
    return out, lse


KERNEL_SIGNATURE = {
    "kv_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "kpe_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "q_nope": "*bf16", "q_pe": "*bf16", "kv_indptr": "*i32", "kv_indices": "*i32", "kv_len": "*i32",
    "out": "*bf16", "lse_out": "*fp32", "part_o": "*fp32", "part_lse": "*fp32", "H": "i32",
    "ckv_scale": "fp32", "kpe_scale": "fp32", "sm_scale_log2": "fp32", "NSPLIT": "i32",
    "NS": "constexpr", "REGS": "constexpr", "DIRECT": "constexpr", "OWNER": "constexpr", "RELEASE": "constexpr",
    "PAIR": "constexpr", "CONV2": "constexpr"}


def compile_report(num_splits: int = 2, ns: int = 2, regs: int = 240, owner: bool = False, release: bool = False,
                   pair: bool = False, conv2: bool = False, conv2_chunks: int = 2, sass_path=None) -> dict:
    """Compile the prototype for sm_90a with triton's own ptxas (no GPU) and read its SASS."""
    from triton.experimental.gluon._runtime import GluonASTSource
    if gluon is None:
        raise RuntimeError(f"gluon is not importable: {GLUON_IMPORT_ERROR}")
    fn = many_heads_kernel
    names = fn.arg_names
    consts = {"NS": ns, "REGS": regs, "DIRECT": num_splits == 1, "OWNER": bool(owner), "RELEASE": bool(release),
              "PAIR": bool(pair), "CONV2": int(conv2_chunks) if conv2 else 0}
    src = GluonASTSource(fn=fn, signature=KERNEL_SIGNATURE,
                         constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names)
                                if KERNEL_SIGNATURE[nm].startswith("*") or nm == "H"})
    return sass_report(src, sass_path)


def sass_report(src, sass_path=None) -> dict:
    """triton.compile for sm_90a, ptxas -v and cuobjdump: registers, spills, shared memory, op counts, and per
    warp-specialized partition (split at USETMAXREG) the HGMMA / STL / LDL / LDS.U8 between its first and last
    HGMMA (the tile loop)."""
    import collections
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(k.asm["ptx"])
        v = ""
        for exe in ("ptxas", "ptxas-blackwell"):   # later wheels ship an older "ptxas" beside the one they use
            if not os.path.exists(os.path.join(bindir, exe)):
                continue
            res = subprocess.run([os.path.join(bindir, exe), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"],
                                 capture_output=True, text=True)
            v = res.stderr
            if res.returncode == 0:
                break
        cub = os.path.join(d, "k.cubin")
        open(cub, "wb").write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", cub],
                              capture_output=True, text=True).stdout
    if sass_path:
        open(sass_path, "w").write(sass)
    ops = collections.Counter()
    seq = []
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        ops[m.group(1)] += 1
        seq.append(m.group(1))
    parts, cur = [], []
    for op in seq + ["USETMAXREG"]:
        if op.startswith("USETMAXREG"):
            if cur:
                h = [i for i, o in enumerate(cur) if o.startswith("HGMMA")]
                body = cur[h[0]:h[-1] + 1] if h else cur
                parts.append({"ops": len(cur), "HGMMA": len(h), "STL": sum(o.startswith("STL") for o in cur),
                              "LDL": sum(o.startswith("LDL") for o in cur),
                              "loop_LDL": sum(o.startswith("LDL") for o in body) if h else None,
                              "LDS.U8": sum(o.startswith("LDS.U8") for o in cur),
                              "F2FP": sum(o.startswith("F2FP") for o in cur)})
            cur = [op]
        else:
            cur.append(op)
    spills = [tuple(map(int, x)) for x in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)]
    return {"regs": [int(r) for r in re.findall(r"Used (\d+) registers", v)], "spills": spills,
            "smem": k.metadata.shared, "ptxas": v, "ops": dict(ops), "partitions": parts,
            "serialized_wgmma": "C7512" in v, "triton": triton.__version__}


if __name__ == "__main__":
    import json
    import sys
    r = compile_report(num_splits=int(sys.argv[1]) if len(sys.argv) > 1 else 2,
                       sass_path=sys.argv[2] if len(sys.argv) > 2 else None)
    r.pop("ptxas")
    hg = {k: v for k, v in r["ops"].items() if k.startswith(("HGMMA", "F2FP", "LDS", "STS", "LDSM", "STL", "LDL",
                                                             "USETMAXREG", "SYNCS", "UTMALDG"))}
    r["ops"] = hg
    print(json.dumps(r, indent=1))
