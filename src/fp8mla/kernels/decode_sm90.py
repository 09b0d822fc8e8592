"""Hopper (sm_90) MLA decode in Gluon: BF16/FP16 queries x FP8 e4m3 paged KV, warp-specialized, split-KV.

Design (../shared/DECODE_V2.md, "swap-AB with register operands"): one persistent CTA per SM, 12 warps.
  * producer (default partition, 4 warps): walks the CTA's work items, reads each tile's page id and issues
    TMA copies of one 64-token tile (4 boxes [64 x 128 B] of c_kv + 1 box [64 x 64 B] of k_pe) into an
    NS-stage ring guarded by ready/empty mbarriers.
  * two consumer warpgroups (worker partitions): take alternate tiles of the ring. Tokens are the MMA's M
    side (64), heads its N side (16, padded):
        S^T [64, 16] = K [64, 576] . Q^T        K: LDS.128 of FP8 in a relabelled k order, one packed cvt to
                                                fp16 in registers (Q^T stored in smem in the same k order)
        O^T [512, 16] += V^T [512, 64] . P^T     V^T: the stage read as int16 pairs with ldmatrix.trans, split
                                                with PRMT and converted (cvt.rn.f16x2.e4m3x2), output dims
                                                relabelled (undone in the epilogue)
    fp16 MMAs with fp32 accumulation, online softmax in fp32 (exp2). The per-tensor scales and a power-of-two
    range factor are folded into Q before its fp16 rounding (as the Triton kernel does), so FP8 -> fp16 is
    exact and Q keeps fp16 precision without overflow.
  * each consumer writes its own normalized partial (o, lse base 2) per work item; a small Triton kernel merges
    a request's partials by log-sum-exp in a fixed order (bit-identical reruns).

Work items come from the plan (``schedule``): the concatenated 64-token tiles of all requests are cut into one
range per CTA, either request-aligned pieces (``aligned_pieces``: one item per CTA, where that balances) or
contiguous ranges (FlashMLA-style), a range split at request boundaries into items ``(request, first tile, end
tile)``. Every device array the kernels read is sized at plan time; ``run`` only
launches (CUDA-graph safe).

Tail tiles (kv_len not a multiple of 64): the consumer zeroes the stage's rows past kv_len in shared memory
before using it (unused slots may hold NaN, and 0 x NaN in P.V would poison the output), then masks the scores.

Wide-heads variant (``WIDE``, H 17..128; ``head_config``): a CTA owns a head group of 2 x HPW heads (HPW = 16 for
H <= 32, else 32; 16 at every H in the group-scale build) and BOTH consumers take every tile, each for its own HPW
heads (S^T [64, HPW], O^T [512, HPW]; at HPW 32 that is 128 fp32 registers), so there is no cross-consumer softmax
state and no exchange; a stage is released after both consumers arrive. H > 2 x HPW: NHG = ceil(H / (2 x HPW))
CTAs per schedule slot, adjacent in the grid, so
the later reads of a tile should hit L2. Each consumer writes its own normalized partial (padded heads: zero Q
rows, never written).

Page size 1 (``_producer_page1``): the producer copies each tile's 64 arbitrary pool rows with 16-byte cp.async
into the same swizzled stages the TMA boxes fill (the consumers are unchanged) and each producer thread arrives on
the stage's ``ready`` barrier (128 arrivals at page 1, one expect-tx arrival otherwise).

Multi-token decode (``MTP`` constexpr, 1 causal / 2 not; MTP / speculative, qo_len 1..8, ``mtp_config``): the
(query token, head) pairs of a request are rows, "virtual heads" Hv = max_qo x H <= 512, on the wide variant: row
r is token r // H, head r % H (Q from q[qo_indptr[b] + r // H, r % H]; out/lse and the merge likewise; the
partials are indexed by row); rows >= qo_len x H of a request are padding (zero Q, never written). The request's
qo_len is read from qo_indptr on the device. Causal (aligned to the end, as the Triton kernel): token i sees kv
positions < lim = min(L - qo_len + i + 1, L), a per-row limit that replaces the tail mask in the tiles some row
does not see whole (the last one or two of a request; computed there, not kept across the loop); a row may see
nothing of
a tile, an item or the whole request (kv_len < qo_len), so the softmax subtracts 0 where the running max is -inf
(alpha and P exactly 0, not NaN) and an empty row's output is written as 0 by a select. NaN: slots past kv_len are
zeroed as for one query; a NaN stored in a token of the request that a row causally does not see still meets
P = 0 in the P.V MMA (0 x NaN = NaN) and makes that row NaN, as in the Triton kernel (a NaN in a used token is bad
input; the rows that see it are NaN either way). MTP = 0 compiles the one-query kernels unchanged (same SASS).

FP8 tensor-core math (``fp8_math``, opt-in: ``QK8`` = 2 e4m3 terms of Q with ``PV8``; ``QKC`` one score
accumulator per 128-column chunk at H <= 16): S^T = K.Q^T runs as e4m3 x e4m3 wgmma with both operands in shared
memory, K straight from the stage, Q x f (f a power of two, largest |q| of a head near 2^8) split into a hi and a lo
term; O^T += V^T.P^T as e4m3 x e4m3 wgmma with V^T's bytes moved from the stage and P x 2^8 in e4m3. The per-tensor
scales multiply the two score parts (c_kv, k_pe) instead of Q. Error budget rel L2 <= 2e-2 (the default: 3e-3).

Per-token group scales (``GROUP``; format fp8_e4m3_group, one fp32 scale per token and 128 c_kv columns): the producer brings each tile's
[64, 4] scales into the stage with its rows (a TMA box of 16-byte rows per page, or one cp.async per row at page 1,
counted in the same ``ready`` barrier). The consumer reads them in the accumulator's row layout; rows past kv_len read
0. Scores: one fp32 product per 128-column slab (= one group) times the tokens' scales, plus the k_pe product (its
per-tensor scale folded into Q). P.V: one P^T per group, P x scale / the group's largest scale in the tile (<= 1, so
fp16 keeps its precision whatever the scales' magnitude), and each group's two O^T chunks are kept in units of that
maximum (rescaled by alpha x f_old / f_new with the online softmax, multiplied back at the end of the item): the
Triton kernel's KV_GROUP numerics; the stored values still convert exactly to fp16 and never meet their scale
element-wise. The group build has 16 rows per consumer at any head count (``GROUP_MAX_HPW``; H > 32: ceil(H / 32)
head-group CTAs per schedule slot): at 32 per consumer its consumers spill ~1.4 KB (triton 3.6) or serialize their
wgmma (3.9).

Supported here: H <= 128, qo_len 1 (1..8 with MTP, max_qo x H <= 512), pages of 1, 16, 32 or a multiple of 64,
FP8 e4m3 with per-tensor (or, with GROUP, per-token group) scales, c_kv 512 + k_pe 64. Anything else:
``supports`` says no and the caller falls back to the Triton kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # Gluon ships inside triton >= 3.4; the kernel is written against triton 3.6's API
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared,
                                                                 warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    GLUON_IMPORT_ERROR = None
    # page 1 (cp.async): triton 3.6 names the copy async_copy_global_to_shared; later versions async_load (same
    # arguments; there the old name still exists but raises)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # ... and shared_memory_descriptor._reinterpret became reinterpret
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    # ... and thread_barrier became barrier
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon here"
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

TILE = 64          # tokens per tile (the MMA's M)
HP = 16            # heads per CTA (the MMA's N), padded
DC, DK = 512, 64
ROW_BYTES = DC + DK
GROUPS = 4         # per-token group scales: one per 128 c_kv columns (fmt fp8_e4m3_group), one per K slab
GROUP_MAX_HPW = 16  # group scales: heads (rows) per consumer of the build (H > 32: more head-group CTAs per slot)
STAGE_BYTES = TILE * ROW_BYTES
SMEM_LIMIT = 232448  # dynamic shared memory per block on sm_90
P8_SCALE = 256.0     # fp8_math: P (<= 1) x this in e4m3 (max 448); P >= 2^-14 stays a normal e4m3 number


def smem_bytes(ns: int, hpw: int = HP, wide: bool = False, qk8: int = 0, group: bool = False) -> int:
    """Shared memory of one CTA: the ring, two Q^T copies (fp16, or ``qk8`` e4m3 terms each plus an unused
    fp16 chunk), two P^T tiles, the consumers' exchange buffer (o, m, l in fp32; a 64-row token in the wide
    variant, which has no exchange), barriers (estimate, +1 KB slack). ``group``: per-token group scales, a
    [64, 4] fp32 scale tile per ring stage and four P^T tiles per consumer (one per group)."""
    xr = 64 if wide else DC
    q = 2 * hpw * (DC + DK) * 2 if not qk8 else 2 * hpw * (qk8 * (DC + DK) + (128 + DK) * 2)
    g = ns * TILE * GROUPS * 4 + 2 * (GROUPS - 1) * hpw * TILE * 2 if group else 0
    return ns * STAGE_BYTES + q + 2 * hpw * TILE * 2 + xr * hpw * 4 + 2 * hpw * 4 + 1024 + g


MAX_WIDE_HEADS = 128


def ring_depth(ns: int, hpw: int = HP, wide: bool = False, qk8: int = 0, group: bool = False) -> int:
    """The ring depth a plan asking for ``ns`` stages gets. Any depth is safe: the alternating-tile kernel (H <= 16,
    not ``wide``) gives each consumer its own ready barrier per stage at an odd depth (with one barrier per stage,
    a stage's consecutive phases belong to alternating consumers and a parity wait can pass a phase early: kernel
    log 25, confirmed on the H200). An odd request at H <= 16 still becomes the next even depth where that fits
    shared memory (4 for the default 3: the configuration timed since), else it stays odd where it fits (the group
    build's 3, and the FP8-scores variant's, where 4 does not), else the even depth below."""
    if wide or ns % 2 == 0:
        return ns
    for d in (ns + 1, ns, ns - 1):   # the even depth above, the odd one asked for, the even one below
        if d >= 2 and smem_bytes(d, hpw, wide, qk8, group) <= SMEM_LIMIT:
            return d
    return 2


def ready_barrier(gg: int, ns: int, wide: bool = False) -> tuple[int, int]:
    """(ready barrier, wait parity) of ring position ``gg``, as the kernel computes them (producer and consumers):
    one barrier per stage (``gg % ns``, parity ``(gg // ns) & 1``), except for an odd ring of the alternating-tile
    kernel, where position gg's consumer (gg % 2) has its own barrier per stage (``(gg % 2) * ns + gg % ns``,
    parity ``(gg // (2 ns)) & 1``): every phase of a barrier is then one consumer's, in order (kernel log 29). The
    kernel writes the same formulas inline (Gluon); this is their reference for the CPU protocol test."""
    if wide or ns % 2 == 0:
        return gg % ns, (gg // ns) & 1
    return (gg % 2) * ns + gg % ns, (gg // (2 * ns)) & 1


def head_config(num_heads: int, max_hpw: int = 32) -> tuple[int, int, bool]:
    """(hpw, nhg, wide) for ``num_heads``: H <= 16 -> the alternating-tile kernel (16 heads, one CTA per slot);
    17..32 -> wide with 16 heads per consumer (one head group of 32); 33..128 -> wide with 32 heads per consumer,
    ceil(H / 64) head groups of 64 (H = 128: two CTAs per schedule slot). ``max_hpw`` 16 (the group-scale build,
    ``GROUP_MAX_HPW``): 16 heads per consumer at any H, ceil(H / 32) head groups (H = 128: four CTAs per slot)."""
    if num_heads < 1 or num_heads > MAX_WIDE_HEADS:
        raise ValueError(f"num_heads: expected 1..{MAX_WIDE_HEADS}, got {num_heads}")
    if num_heads <= HP:
        return HP, 1, False
    hpw = 16 if num_heads <= 32 or max_hpw < 32 else 32
    return hpw, -(-num_heads // (2 * hpw)), True


MAX_MTP_QO = 8       # multi-token decode: query tokens per request
MAX_MTP_ROWS = 512   # virtual heads max_qo * H (H16 up to qo 8, H128 up to qo 4)


def mtp_config(num_heads: int, max_qo: int, max_hpw: int = 32) -> tuple[int, int, bool]:
    """(hpw, nhg, wide) of multi-token decode (max_qo >= 2): rows r = query token r // H, head r % H of a request
    ("virtual heads" Hv = max_qo * H) on the wide variant: 16 rows per consumer for Hv <= 32 (or ``max_hpw`` 16),
    else 32, and ceil(Hv / (2 hpw)) row-group CTAs per schedule slot."""
    if num_heads < 1 or max_qo < 2 or max_qo > MAX_MTP_QO or max_qo * num_heads > MAX_MTP_ROWS:
        raise ValueError(f"num_heads, max_qo: expected 2 <= max_qo <= {MAX_MTP_QO} and max_qo * num_heads <= "
                         f"{MAX_MTP_ROWS}, got num_heads {num_heads}, max_qo {max_qo}")
    hv = max_qo * num_heads
    hpw = 16 if hv <= 32 or max_hpw < 32 else 32
    return hpw, -(-hv // (2 * hpw)), True


def row_config(num_heads: int, max_qo: int = 1, max_hpw: int = 32) -> tuple[int, int, bool]:
    """``head_config`` for one query token per request, ``mtp_config`` for more."""
    return head_config(num_heads, max_hpw) if max_qo <= 1 else mtp_config(num_heads, max_qo, max_hpw)


def padded_heads(num_heads: int, max_qo: int = 1, max_hpw: int = 32) -> int:
    """Rows per work item of the partial buffers (part_o [items, rows, 512], part_lse [items, rows])."""
    hpw, nhg, wide = row_config(num_heads, max_qo, max_hpw)
    return 2 * hpw * nhg if wide else HP


def mtp_row(r: int, num_heads: int) -> tuple[int, int]:
    """(query token, head) of row r of a request in multi-token decode (the kernel's and the merge's mapping)."""
    return r // num_heads, r % num_heads


def mtp_visible(kv_len: int, qo_len: int, i: int, causal: bool) -> int:
    """kv positions [0, n) that query token i of a request sees: causal aligns the queries to the end
    (token i sees positions <= kv_len - qo_len + i, none when that is negative), else all kv_len."""
    return max(0, min(kv_len, kv_len - qo_len + i + 1)) if causal else kv_len


if gluon is not None:
    GROUPS_C = gl.constexpr(GROUPS)
    P8_SCALE_C = gl.constexpr(P8_SCALE)

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
    def _producer_page1(ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices, kv_indptr, kv_len,
                        cta_ptr, item_req, item_t0, item_t1, kbuf, pbuf, ready, empty, NHG: gl.constexpr,
                        NS: gl.constexpr, WIDE: gl.constexpr, sbuf=None, sc_ptr=None,
                        stride_sc_row=None, GROUP: gl.constexpr = False):
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
        # load (kernel log 28: page 1 at 2.3 TB/s against page 64's 3.0; the producer has 24 registers: its
        # item-loop state spills, a few reloads per tile).
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
                s = g % NS
                mbarrier.wait(empty.index(s), ((g // NS) & 1) ^ 1, pred=g >= NS)
                if ready.shape[0] == NS:
                    bar = ready.index(s)
                else:   # an odd ring of the alternating kernel: tile g's consumer (g % 2) has its own barriers
                    bar = ready.index((g % 2) * NS + s)
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
    def _producer(kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices,
                  kv_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1, kbuf, pbuf, ready, empty,
                  NHG: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr, WIDE: gl.constexpr,
                  sbuf=None, sc_desc=None, sc_ptr=None, stride_sc_row=None, GROUP: gl.constexpr = False):
        # the default partition: page 1 copies rows with cp.async, every other page size boxes with TMA
        if PAGE == 1:
            _producer_page1(ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices, kv_indptr,
                            kv_len, cta_ptr, item_req, item_t0, item_t1, kbuf, pbuf, ready, empty, NHG, NS,
                            WIDE, sbuf, sc_ptr, stride_sc_row, GROUP)
        else:
            _producer_tma(kv_desc, kpe_desc, kv_indices, kv_indptr, kv_len, cta_ptr, item_req, item_t0,
                          item_t1, kbuf, pbuf, ready, empty, NHG, NS, PAGE, WIDE, sbuf, sc_desc, GROUP)

    @gluon.jit
    def _producer_tma(kv_desc, kpe_desc, kv_indices, kv_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                      kbuf, pbuf, ready, empty, NHG: gl.constexpr, NS: gl.constexpr, PAGE: gl.constexpr,
                      WIDE: gl.constexpr, sbuf=None, sc_desc=None, GROUP: gl.constexpr = False):
        # Page ids come 16 table entries at a time (one per lane, extracted with warp shuffles): one load latency
        # per 16 entries instead of one per tile (a scalar load per tile capped the issue rate near one tile
        # per load latency). Pages of 16/32 tokens: a tile is 4/2 pages, each its own row boxes.
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
                s = g % NS
                mbarrier.wait(empty.index(s), ((g // NS) & 1) ^ 1, pred=g >= NS)
                if ready.shape[0] == NS:
                    bar = ready.index(s)
                else:   # an odd ring of the alternating kernel: tile g's consumer (g % 2) has its own barriers
                    bar = ready.index((g % 2) * NS + s)
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

    @gluon.jit
    def _per_item(x, it):
        # x, unchanged, but opaque to the compiler's loop-invariant code motion (it depends on the item index):
        # at 128 O registers, index vectors and store addresses hoisted out of the item loop spill.
        return gl.inline_asm_elementwise("{ .reg .b32 z; and.b32 z, $2, 0; add.s32 $0, $1, z; }", "=r,r,r",
                                         [x, gl.zeros_like(x) + it], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _store_item(o0, o1, o2, o3, o4, o5, o6, o7, m_use, l_i, ckv_scale, it, t0, t1, L, qtok, h0, H,
                    mma: gl.constexpr, HPW: gl.constexpr, part_o, part_lse, out, lse_out, stride_po_i, stride_po_r, stride_pl_i, stride_o_t,
                    stride_o_h, stride_lse_t, nrows, MTP: gl.constexpr):
        # One consumer's normalized (o, lse base 2) for heads h0 + hcol: the final out/lse when the item is the
        # whole request, else the item's fp32 partial (the merge kernel combines a request's partials).
        # An empty state (l = 0) writes o = 0, lse = -inf.
        tok_r = _per_item(gl.arange(0, 64, layout=gl.SliceLayout(1, mma)), it)
        hcol = _per_item(gl.arange(0, HPW, layout=gl.SliceLayout(0, mma)), it)
        dim_m = 2 * (8 * (tok_r >> 4) + (tok_r & 7)) + ((tok_r >> 3) & 1)   # the PV's relabelled output dims
        seen = l_i > 0
        l_safe = gl.where(seen, l_i, 1.0)
        inv = gl.where(seen, ckv_scale / l_safe, 0.0)[None, :]
        lse = gl.where(seen, m_use + gl.log2(l_safe), float("-inf"))
        heads = hcol + h0
        if MTP:
            # rows r = token i * H + head; an empty row (l = 0) may hold 0 x NaN from a causally hidden token:
            # written as 0 by a select, not by the multiply
            seen2 = seen[None, :]
            o0 = gl.where(seen2, o0, 0.0)
            o1 = gl.where(seen2, o1, 0.0)
            o2 = gl.where(seen2, o2, 0.0)
            o3 = gl.where(seen2, o3, 0.0)
            o4 = gl.where(seen2, o4, 0.0)
            o5 = gl.where(seen2, o5, 0.0)
            o6 = gl.where(seen2, o6, 0.0)
            o7 = gl.where(seen2, o7, 0.0)
            row_ok = heads < nrows
            otok = qtok + heads // H
            ohead = heads % H
        else:
            row_ok = heads < H
            otok = qtok
            ohead = heads
        out_mask = row_ok[None, :] & (dim_m[:, None] >= 0)
        if (t0 == 0) & (t1 == (L + 63) // 64):
            ty = out.dtype.element_ty
            if MTP:
                ob = out + otok[None, :] * stride_o_t + ohead[None, :] * stride_o_h + dim_m[:, None]
            else:
                ob = out + qtok * stride_o_t + heads[None, :] * stride_o_h + dim_m[:, None]
            gl.store(ob + 0 * 64, (o0 * inv).to(ty), mask=out_mask)
            gl.store(ob + 1 * 64, (o1 * inv).to(ty), mask=out_mask)
            gl.store(ob + 2 * 64, (o2 * inv).to(ty), mask=out_mask)
            gl.store(ob + 3 * 64, (o3 * inv).to(ty), mask=out_mask)
            gl.store(ob + 4 * 64, (o4 * inv).to(ty), mask=out_mask)
            gl.store(ob + 5 * 64, (o5 * inv).to(ty), mask=out_mask)
            gl.store(ob + 6 * 64, (o6 * inv).to(ty), mask=out_mask)
            gl.store(ob + 7 * 64, (o7 * inv).to(ty), mask=out_mask)
            gl.store(lse_out + otok * stride_lse_t + ohead, lse, mask=row_ok)
        else:
            pidx = it.to(gl.int64)
            base = part_o + pidx * stride_po_i + heads[None, :] * stride_po_r + dim_m[:, None]
            gl.store(base + 0 * 64, o0 * inv, mask=out_mask)
            gl.store(base + 1 * 64, o1 * inv, mask=out_mask)
            gl.store(base + 2 * 64, o2 * inv, mask=out_mask)
            gl.store(base + 3 * 64, o3 * inv, mask=out_mask)
            gl.store(base + 4 * 64, o4 * inv, mask=out_mask)
            gl.store(base + 5 * 64, o5 * inv, mask=out_mask)
            gl.store(base + 6 * 64, o6 * inv, mask=out_mask)
            gl.store(base + 7 * 64, o7 * inv, mask=out_mask)
            gl.store(part_lse + pidx * stride_pl_i + heads, lse, mask=row_ok)

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
    def _scores_group(kbuf, pbuf, s, q_smem, my_qpe, cid: gl.constexpr, sg0, sg1, sg2, sg3, ld_l: gl.constexpr,
                      ld64_l: gl.constexpr, a_l: gl.constexpr, mma: gl.constexpr, HPW: gl.constexpr):
        # S^T with per-token group scales: one fp32 product per 128-column slab (= one scale group) times the
        # slab's [64] token scales, plus the unscaled k_pe product (its per-tensor scale is folded into Q, as in
        # the default path). One product at a time: the consumers of the default kernel already use ~237 of their
        # 240 registers, and overlapping the next slab's conversion with the previous product (a second A operand
        # and accumulator live) spilled ~280 B more at H16 (sm_90a, triton 3.6).
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

    @gluon.jit
    def _consumer(cid: gl.constexpr, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem,
                  q_nope, q_pe, scales, qo_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                  part_o, part_lse, out, lse_out, xo, xml, xbar, sm_scale_log2, H, NHG: gl.constexpr,
                  stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                  NS, HPW: gl.constexpr, WIDE: gl.constexpr, MTP: gl.constexpr, q8_smem=None, qpe8_smem=None,
                  QK8: gl.constexpr = 0, QKC: gl.constexpr = False, sbuf=None, GROUP: gl.constexpr = False,
                  PV8: gl.constexpr = False):
        # HPW: heads per consumer warpgroup (the MMA's N). WIDE = False (H <= 16): the two consumers take
        # alternate tiles for the same 16 heads and merge at the end of each item. WIDE = True (H > 16): both
        # consumers take every tile, each for its own HPW heads (head group pid % NHG of 2 * HPW heads), with no
        # exchange at all: each writes its own normalized partial.
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HPW, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        mma8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HPW, 32])
        a8_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma8, k_width=4)
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
                qn_row = q_nope + qtok * stride_qn_t + hq * stride_qn_h
                qp_row = q_pe + qtok * stride_qp_t + hq * stride_qp_h
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
            else:   # (the order of these lines is the measured kernel's: moved, they reschedule its SASS)
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
                l_i = gl.zeros([HPW], gl.float32, gl.SliceLayout(0, mma))
            else:
                l_acc = gl.zeros([64, HPW], gl.float32, mma)
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
                s = gg % NS
                if ready.shape[0] == empty.shape[0]:
                    mbarrier.wait(ready.index(s), (gg // NS) & 1)
                else:
                    # an odd ring of the alternating kernel (H <= 16): stage s's consecutive phases would belong
                    # to alternating consumers, and a parity wait could pass a phase early (kernel log 25); each
                    # consumer has its own ready barrier per stage, whose k-th phase is its tile gg = x + 2 NS k
                    mbarrier.wait(ready.index((gg % 2) * NS + s), (gg // (2 * NS)) & 1)
                valid = L - (t0 + j) * 64
                if valid < 64:
                    # WIDE: both consumers zero the same rows; every write stores either the row's own value
                    # or 0, so the overlap is benign and the stage ends up the same either way.
                    _sanitize_tail(kbuf, pbuf, s, valid)
                if GROUP:
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
                    sT = _scores_group(kbuf, pbuf, s, q_smem, my_qpe, cid, sg0, sg1, sg2, sg3, ld_l, ld64_l,
                                       a_l, mma, HPW)
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
                # -- online softmax over the tile's tokens (axis 0), log2 domain ----------------------------
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
                    l_i = l_i * alpha + gl.sum(p, axis=0)
                else:
                    l_acc = l_acc * alpha[None, :] + p
                m_i = m_new
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
                # -- O^T += V^T . P^T, 8 chunks of 64 dims; one chunk group stays in flight behind the next
                # chunk's conversion --------------------------------------------------------------------
                if GROUP:   # each group's two 64-dim chunks against its own P^T, rescaled by f_old / f_new
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
                elif PV8:
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
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
                mbarrier.arrive(empty.index(s), count=1)   # after the partition's barrier: every warp is done
            # -- this consumer's normalized partial of the item (empty: o = 0, lse = -inf) ------------------
            if GROUP:   # back from units of f_g (before the exchange: the two consumers' units differ)
                o0 = o0 * f0
                o1 = o1 * f0
                o2 = o2 * f1
                o3 = o3 * f1
                o4 = o4 * f2
                o5 = o5 * f2
                o6 = o6 * f3
                o7 = o7 * f3
            if WIDE:
                m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
                _store_item(o0, o1, o2, o3, o4, o5, o6, o7, m_use, l_i, o_scale, it, t0, t1, L, qtok, h0,
                            H, mma, HPW, part_o, part_lse, out, lse_out, stride_po_i, stride_po_r, stride_pl_i,
                            stride_o_t, stride_o_h, stride_lse_t, nrows, MTP)
            else:
                l_i = gl.sum(l_acc, axis=0)
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
                    _store_item(o0, o1, o2, o3, o4, o5, o6, o7, m_use, l_i, o_scale, it, t0, t1, L, qtok, h0,
                                H, mma, HPW, part_o, part_lse, out, lse_out, stride_po_i, stride_po_r,
                                stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, nrows, MTP)
            g += n

    @gluon.jit
    def _consumer0(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                   cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, sm_scale_log2, H,
                   NHG: gl.constexpr, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                   stride_o_t, stride_o_h, stride_lse_t,
                   NS, HPW: gl.constexpr, WIDE: gl.constexpr, MTP: gl.constexpr, q8_smem=None, qpe8_smem=None,
                   QK8: gl.constexpr = 0, QKC: gl.constexpr = False, sbuf=None, GROUP: gl.constexpr = False,
                   PV8: gl.constexpr = False):
        _consumer(0, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                  cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, sm_scale_log2, H,
                  NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                  stride_o_t, stride_o_h, stride_lse_t, NS, HPW, WIDE, MTP, q8_smem, qpe8_smem, QK8, QKC, sbuf,
                  GROUP, PV8)

    @gluon.jit
    def _consumer1(kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                   cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, sm_scale_log2, H,
                   NHG: gl.constexpr, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                   stride_o_t, stride_o_h, stride_lse_t,
                   NS, HPW: gl.constexpr, WIDE: gl.constexpr, MTP: gl.constexpr, q8_smem=None, qpe8_smem=None,
                   QK8: gl.constexpr = 0, QKC: gl.constexpr = False, sbuf=None, GROUP: gl.constexpr = False,
                   PV8: gl.constexpr = False):
        _consumer(1, kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr, kv_len,
                  cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml, xbar, sm_scale_log2, H,
                  NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_po_i, stride_po_r, stride_pl_i,
                  stride_o_t, stride_o_h, stride_lse_t, NS, HPW, WIDE, MTP, q8_smem, qpe8_smem, QK8, QKC, sbuf,
                  GROUP, PV8)

    @gluon.jit
    def mla_decode_sm90_kernel(kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows,
                               q_nope, q_pe, scales, qo_indptr, kv_indptr, kv_indices, kv_len,
                               cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, OUT, LSE_OUT, sm_scale_log2, H,
                               stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                               stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t,
                               PAGE: gl.constexpr, NS: gl.constexpr, REGS: gl.constexpr,
                               HPW: gl.constexpr = 16, WIDE: gl.constexpr = False, NHG: gl.constexpr = 1,
                               MTP: gl.constexpr = 0, QK8: gl.constexpr = 0, QKC: gl.constexpr = False,
                               sc_desc=None, sc_ptr=None, stride_sc_row=None, GROUP: gl.constexpr = False,
                               PV8: gl.constexpr = False):
        # WIDE: launched with NHG CTAs per schedule slot (head groups of 2 * HPW heads; slot = pid // NHG), so the
        # CTAs that read the same tiles are adjacent in the grid and the later reads hit L2.
        # A kernel launched as this one's programmatic dependent may start now (it must wait, griddepcontrol.wait,
        # before reading what this grid writes). Nothing is launched that way today; kept as measured (taking it out
        # moves every build's SASS).
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r,r", [gl.program_id(0)],
                                  dtype=gl.int32, is_pure=False, pack=1)
        kv_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        kpe_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS * 4, 64, 128], kv_l)
        pbuf = gl.allocate_shared_memory(gl.float8e4nv, [NS, 64, 64], kpe_l)
        if QK8:   # Q^T as QK8 e4m3 terms per consumer (the fp16 copies stay, one chunk each: unused)
            q8_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
            q8_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QK8 * 4, HPW, 128], q8_l)
            qpe8_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * QK8, HPW, 64], kpe_l)
            q_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 128], q_l)
        else:
            q_smem = gl.allocate_shared_memory(gl.float16, [8, HPW, 128], q_l)
        qpe_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 64], q_l)
        if not QK8:   # placeholders (never read: the partitions' argument lists take no None)
            q8_smem = q_smem
            qpe8_smem = qpe_smem
        if GROUP:   # four P^T tiles per consumer (one per scale group)
            pT_smem = gl.allocate_shared_memory(gl.float16, [2 * GROUPS_C, HPW, 64], q_l)
        elif PV8:   # fp8_math: P^T in e4m3 (64-byte rows, k-major for the e4m3 wgmma)
            pT_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, HPW, 64], kpe_l)
        else:
            pT_smem = gl.allocate_shared_memory(gl.float16, [2, HPW, 64], q_l)
        # ready: one barrier per stage, or (an odd ring of the alternating kernel) one per stage and consumer
        RB: gl.constexpr = 2 * NS if NS % 2 == 1 and not WIDE else NS
        ready = gl.allocate_shared_memory(gl.int64, [RB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        # consumer 1 hands its (o, m, l) of each item to consumer 0 through these (full / empty barriers);
        # WIDE has no exchange (a token allocation keeps one argument list)
        x_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XR: gl.constexpr = 64 if WIDE else 8 * 64
        xo = gl.allocate_shared_memory(gl.float32, [XR, HPW], x_l)
        xml = gl.allocate_shared_memory(gl.float32, [2 * HPW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ECNT: gl.constexpr = 2 if WIDE else 1     # WIDE: a stage is free once both consumers are done with it
        RCNT: gl.constexpr = 128 if PAGE == 1 else 1   # page 1: one cp.async arrival per producer thread
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=RCNT)
            mbarrier.init(empty.index(i), count=ECNT)
            if RB != NS:
                mbarrier.init(ready.index(NS + i), count=RCNT)
        mbarrier.init(xbar.index(0), count=1)
        mbarrier.init(xbar.index(1), count=1)
        if GROUP:   # each ring stage's [64 tokens, 4] fp32 group scales (TMA boxes of 16-byte rows, or cp.async)
            sc_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            sbuf = gl.allocate_shared_memory(gl.float32, [NS, 64, GROUPS_C], sc_sl)
        fence_async_shared()
        out = OUT
        lse_out = LSE_OUT
        # A tuple assigned to a variable turns its constexprs into runtime values; HPW and WIDE must stay
        # constexpr (layouts, static branches), so the consumers' argument tuples are written out in the call.
        # NS reaches the consumers as a runtime value, as it always has (the H16 kernel measured on the H200 was
        # built that way; making it constexpr there is a separate, unmeasured change).
        zero = gl.program_id(0) * 0   # (not gl.to_tensor: keep to APIs triton 3.6 has for sure)
        ns_t = zero + NS
        if not GROUP:   # placeholders (never read): a partition's argument list takes no None
            sbuf = pbuf
            sc_desc = kpe_desc
            sc_ptr = kpe_ptr
            stride_sc_row = stride_kpe_row
        gl.warp_specialize([
            (_producer, (kv_desc, kpe_desc, ckv_ptr, kpe_ptr, stride_kv_row, stride_kpe_row, num_rows, kv_indices,
                         kv_indptr, kv_len, cta_ptr, item_req, item_t0, item_t1,
                         kbuf, pbuf, ready, empty, NHG, NS, PAGE, WIDE, sbuf, sc_desc, sc_ptr,
                         stride_sc_row, GROUP)),
            (_consumer0, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                          kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml,
                          xbar, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                          stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, ns_t,
                          HPW, WIDE, MTP, q8_smem, qpe8_smem, QK8, QKC, sbuf, GROUP, PV8)),
            (_consumer1, (kbuf, pbuf, ready, empty, q_smem, qpe_smem, pT_smem, q_nope, q_pe, scales, qo_indptr,
                          kv_len, cta_ptr, item_req, item_t0, item_t1, part_o, part_lse, out, lse_out, xo, xml,
                          xbar, sm_scale_log2, H, NHG, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                          stride_po_i, stride_po_r, stride_pl_i, stride_o_t, stride_o_h, stride_lse_t, ns_t,
                          HPW, WIDE, MTP, q8_smem, qpe8_smem, QK8, QKC, sbuf, GROUP, PV8)),
        ], [4, 4], [REGS, REGS])


@triton.jit
def _merge_load_tl(part_o, part_lse, p, v, r, rok, offs_c, m_use, stride_po_i, stride_po_r, stride_pl_i):
    # partial p (none where v is false): its weight exp2(lse - m_use) per row and its rows [ROWS, BLOCK_C], both
    # loads issued together (an empty partial is o = 0, lse = -inf: weight 0 times 0; its rows are read)
    lse_i = tl.load(part_lse + p * stride_pl_i + r, mask=rok & v, other=float("-inf"))
    w = tl.exp2(lse_i - m_use)
    o = tl.load(part_o + p * stride_po_i + r[:, None] * stride_po_r + offs_c[None, :],
                mask=(rok & v)[:, None] & (offs_c >= 0)[None, :], other=0.0)
    return w, o


@triton.jit
def _merge_step_tl(acc, wsum, w, o, v):
    # one partial into the sums, in list order: acc = fma(o, w, acc) (explicit: no contraction choice left to the
    # compiler), wsum += w; entries past the list (v false) leave both untouched (a select, not a +0)
    acc = tl.where(v[:, None], tl.fma(o, w[:, None] + tl.zeros_like(acc), acc), acc)
    wsum = tl.where(v, wsum + w, wsum)
    return acc, wsum


SEQ_PARTS = 16   # requests with at most this many partials: the fixed sequential merge


@triton.jit
def _merge_parts_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H,
                        stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr = 1, min_parts=2,
                        SEQ: tl.constexpr = 16):
    """out/lse of request b, rows pid 1 * ROWS + [0, ROWS) (row = query token * H + head), columns of block pid 2:
    a log-sum-exp merge of the request's partials m_list[m_ptr[b]:m_ptr[b+1]] when it has at least ``min_parts``
    (>= 2; fewer: written by the decode kernel itself). Deterministic either way:

    * at most SEQ partials: one sequential formula: m =
      max lse (exact in any order), m_use = m or 0 when all are empty, then in list order w = exp2(lse - m_use),
      acc = fma(o, w, acc), wsum += w; out = acc / wsum, lse = m_use + log2(wsum) (wsum 0: out 0, lse -inf);
      partials read 4 at a time.
    * more: BLOCK_P partials per step (one round trip to memory each), an online merge across the steps (the
      original formula: many partials are merged in few round trips, B1 L32k's 132 splits in one)."""
    b = tl.program_id(0)
    if b >= tl.load(batch_size):
        return
    q0 = tl.load(qo_indptr + b)
    nrows = (tl.load(qo_indptr + b + 1) - q0) * H
    r0 = tl.program_id(1) * ROWS
    if r0 >= nrows:
        return
    i0 = tl.load(m_ptr + b)
    i1 = tl.load(m_ptr + b + 1)
    if i1 - i0 < tl.maximum(min_parts, 2):
        return
    r = r0 + tl.arange(0, ROWS)
    rok = r < nrows
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    if i1 - i0 <= SEQ:
        # the first step's list entries (clamped into the list) before the max pass, later ones a step ahead: each
        # step's loads go out together
        pa = tl.load(m_list + i0).to(tl.int64)
        pb = tl.load(m_list + tl.minimum(i0 + 1, i1 - 1)).to(tl.int64)
        pc = tl.load(m_list + tl.minimum(i0 + 2, i1 - 1)).to(tl.int64)
        pd = tl.load(m_list + tl.minimum(i0 + 3, i1 - 1)).to(tl.int64)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for i in range(i0, i1, BLOCK_P):
            idx = i + tl.arange(0, BLOCK_P)
            ok = idx < i1
            p = tl.load(m_list + idx, mask=ok, other=0).to(tl.int64)
            lse2 = tl.load(part_lse + p[:, None] * stride_pl_i + r[None, :], mask=ok[:, None] & rok[None, :],
                           other=float("-inf"))
            m = tl.maximum(m, tl.max(lse2, axis=0))
        m_use = tl.where(m == float("-inf"), 0.0, m)   # all empty: weights 0, not NaN
        acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
        wsum = tl.zeros([ROWS], tl.float32)
        for i in range(i0, i1, 4):
            na = tl.load(m_list + tl.minimum(i + 4, i1 - 1)).to(tl.int64)
            nb = tl.load(m_list + tl.minimum(i + 5, i1 - 1)).to(tl.int64)
            nc = tl.load(m_list + tl.minimum(i + 6, i1 - 1)).to(tl.int64)
            nd = tl.load(m_list + tl.minimum(i + 7, i1 - 1)).to(tl.int64)
            rz = r * 0   # (row vectors of the step's validity: the interpreter takes no scalar masks)
            v0 = (rz + i) < i1
            v1 = (rz + i + 1) < i1
            v2 = (rz + i + 2) < i1
            v3 = (rz + i + 3) < i1
            w0, o0 = _merge_load_tl(part_o, part_lse, pa, v0, r, rok, offs_c, m_use, stride_po_i, stride_po_r,
                                    stride_pl_i)
            w1, o1 = _merge_load_tl(part_o, part_lse, pb, v1, r, rok, offs_c, m_use, stride_po_i, stride_po_r,
                                    stride_pl_i)
            w2, o2 = _merge_load_tl(part_o, part_lse, pc, v2, r, rok, offs_c, m_use, stride_po_i, stride_po_r,
                                    stride_pl_i)
            w3, o3 = _merge_load_tl(part_o, part_lse, pd, v3, r, rok, offs_c, m_use, stride_po_i, stride_po_r,
                                    stride_pl_i)
            acc, wsum = _merge_step_tl(acc, wsum, w0, o0, v0)
            acc, wsum = _merge_step_tl(acc, wsum, w1, o1, v1)
            acc, wsum = _merge_step_tl(acc, wsum, w2, o2, v2)
            acc, wsum = _merge_step_tl(acc, wsum, w3, o3, v3)
            pa = na
            pb = nb
            pc = nc
            pd = nd
    else:
        m_use = tl.full([ROWS], float("-inf"), tl.float32)   # the running max (0 where all empty so far)
        m_run = tl.full([ROWS], float("-inf"), tl.float32)
        acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
        wsum = tl.zeros([ROWS], tl.float32)
        for i in range(i0, i1, BLOCK_P):
            idx = i + tl.arange(0, BLOCK_P)
            ok = idx < i1
            p = tl.load(m_list + idx, mask=ok, other=0).to(tl.int64)
            lse_i = tl.load(part_lse + p[:, None] * stride_pl_i + r[None, :], mask=ok[:, None] & rok[None, :],
                            other=float("-inf"))
            m_new = tl.maximum(m_run, tl.max(lse_i, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            keep = tl.exp2(m_run - m_use)
            w = tl.exp2(lse_i - m_use[None, :])
            # (not masked by w > 0: the rows' loads go out with the lse loads instead of one latency after them;
            # a listed partial is always written, an empty one as o = 0, lse = -inf, weight 0)
            o = tl.load(part_o + p[:, None, None] * stride_po_i + r[None, :, None] * stride_po_r
                        + offs_c[None, None, :], mask=(ok[:, None] & rok[None, :])[:, :, None], other=0.0)
            acc = acc * keep[:, None] + tl.sum(w[:, :, None] * o, axis=0)
            wsum = wsum * keep + tl.sum(w, axis=0)
            m_run = m_new
    seen = wsum > 0
    den = tl.where(seen, wsum, 1.0)
    o = acc / den[:, None]
    tok = (q0 + r // H).to(tl.int64)
    head = r % H
    tl.store(out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_c[None, :],
             o.to(out.dtype.element_ty), mask=rok[:, None] & (offs_c >= 0)[None, :])
    if tl.program_id(2) == 0:
        tl.store(lse_out + tok * stride_lse_t + head, tl.where(seen, m_use + tl.log2(den), float("-inf")), mask=rok)


def merge_blocks(max_parts: int, batch: int = 0, rows: int = 16, n_sm: int = 132) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the merge for requests of up to ``max_parts`` partials. More than SEQ_PARTS: the
    chunked path's sizes (all of a request's partials in one step when they fit 256, BLOCK_P x BLOCK_C <= 8192,
    one row per program). Else BLOCK_P covers the list (the max pass) and BLOCK_C is the widest column block
    (128..512) that still gives >= 2 programs per SM with ``merge_tile``'s rows when ``batch`` (the real batch, if
    known) is given; any value is correct for any later plan (both paths loop)."""
    bp = min(256, max(2, 1 << (max(1, max_parts) - 1).bit_length()))
    if max_parts > SEQ_PARTS:
        return bp, min(DC, max(32, 8192 // bp))
    c = DC
    while c > 128 and batch and batch * -(-rows // max(1, 1024 // c)) * (DC // c) < 2 * n_sm:
        c //= 2
    return bp, c


def merge_tile(block_c: int) -> int:
    """Rows per merge program for column block ``block_c``: 1024 fp32 per program when the columns are the
    sequential path's (>= 128: 8 per thread, 4 partials in flight), one row for the chunked path's narrow blocks
    (its step already loads BLOCK_P x BLOCK_C)."""
    return max(1, 1024 // block_c) if block_c >= 128 else 1


# The request-aligned schedule (``aligned_pieces``) may give a CTA this many tiles more than the contiguous cut's
# largest share: a CTA that runs two items (the contiguous cut splits requests at CTA boundaries) pays a second
# Q prologue, first-load latency and partial write-out, about a tile's time (kernel log 27).
ALIGNED_SLACK = 1


def aligned_pieces(tiles: list[int], num_ctas: int, min_tiles: int) -> list[int] | None:
    """Pieces per request for the request-aligned schedule, or None where the contiguous cut is used.

    Request b gets ``k_b = max(1, min(n_b * num_ctas // T, n_b // min_tiles))`` CTAs (its share of the CTAs,
    rounded down; a split request's pieces have at least ``min_tiles`` tiles, a request of one piece is whole
    whatever its size; an empty request one CTA for its empty item), each piece ``[j * n_b // k_b, (j + 1) * n_b
    // k_b)`` its own CTA: one work item per CTA, and a request whose share is one CTA is not split at all (no
    partial, no merge). Taken when the pieces fit ``num_ctas`` and the largest piece is at most ``ALIGNED_SLACK``
    tiles over the contiguous cut's share ``ceil(T / G)``, which splits requests wherever CTA boundaries fall
    (CTAs then run two or more items). The equal-length shapes of the benchmarks fit (B8 L8k on 132 CTAs: 16 pieces
    of 8 tiles per request, where the contiguous cut gives 7.76 tiles per CTA across request boundaries); equal
    lengths whose share rounds badly do not (17 requests of 128 tiles on 132 CTAs: 7 pieces of 19 against a share of
    17), nor do more non-empty requests than CTAs. An empty request (a padding row of a CUDA-graph bucket) takes
    no CTA: its empty item runs in the CTA of the next piece (the last CTA after the last piece; ``aligned_lists``).
    ``schedule_device`` computes the same on the device, ``gluon.schedule_host`` on the host."""
    B, T = len(tiles), sum(tiles)
    if B == 0 or sum(1 for n in tiles if n) > num_ctas:
        return None
    G = min(max(-(-T // min_tiles), 1), num_ctas)
    share = -(-T // G)
    ks, most = [], 0
    for n in tiles:
        kb = max(1, min(n * num_ctas // T if T else 0, n // min_tiles))
        ks.append(kb)
        most = max(most, -(-n // kb))
    if sum(kb for kb, n in zip(ks, tiles) if n) > num_ctas or most > share + ALIGNED_SLACK:
        return None
    return ks


def aligned_lists(tiles: list[int], ks: list[int], num_ctas: int) -> tuple[dict, int]:
    """The request-aligned cut's work items as lists (``gluon.schedule_host``'s arrays) and its grid: request b's
    ``ks[b]`` pieces in order, each its own CTA; an empty request's one empty item in the CTA of the next piece
    (the last piece's CTA at the end, CTA 0 when every request is empty). ``cta_ptr`` has ``num_ctas + 1``
    entries (CTAs past the grid: empty ranges)."""
    req, t0s, t1s, m_ptr, cta = [], [], [], [0], []
    c = 0   # pieces placed so far = the next piece's CTA
    for b, (n, kb) in enumerate(zip(tiles, ks)):
        if n == 0:
            req.append(b)
            t0s.append(0)
            t1s.append(0)
            cta.append(c)
        else:
            for j in range(kb):
                req.append(b)
                t0s.append(j * n // kb)
                t1s.append((j + 1) * n // kb)
                cta.append(c)
                c += 1
        m_ptr.append(len(req))
    last = max(c - 1, 0)
    ptr, i = [], 0
    for x in range(num_ctas + 1):   # CTA x's first item: the first with a CTA >= x
        while i < len(cta) and min(cta[i], last) < x:
            i += 1
        ptr.append(i)
    return dict(cta_ptr=ptr, item_req=req, item_t0=t0s, item_t1=t1s, m_ptr=m_ptr), max(c, 1)


def schedule(kv_lens: list[int], num_ctas: int, min_tiles_per_cta: int = 4, aligned: bool = True):
    """Cut the concatenated 64-token tiles of all requests into per-CTA ranges: request-aligned pieces, one item
    per CTA (``aligned_pieces``, when ``aligned`` and they fit), else contiguous per-CTA ranges.

    Returns ``(grid, cta_ptr, items, m_ptr, m_list)``: CTA c runs items ``cta_ptr[c]:cta_ptr[c+1]``; an item is
    ``(request, first tile, end tile)``; item i writes partial i (both consumers' states merged in shared
    memory), or the final out/lse when it is the whole request;
    request b merges partials ``m_list[m_ptr[b]:m_ptr[b+1]]`` (when it has two or more). A request with kv_len 0
    gets one empty item, which writes 0 and lse = -inf.
    """
    tiles = [-(-L // TILE) for L in kv_lens]
    ks = aligned_pieces(tiles, num_ctas, max(1, min_tiles_per_cta)) if aligned else None
    if ks is not None:
        a, grid = aligned_lists(tiles, ks, num_ctas)
        items = list(zip(a["item_req"], a["item_t0"], a["item_t1"]))
        return grid, a["cta_ptr"][: grid + 1], items, a["m_ptr"], list(range(len(items)))
    T = sum(tiles)
    grid = max(1, min(num_ctas, -(-T // max(1, min_tiles_per_cta))))
    bounds = [(c * T) // grid for c in range(grid + 1)]   # CTA c owns global tiles [bounds[c], bounds[c+1])
    items, cta_ptr, per_req = [], [0], [[] for _ in kv_lens]
    c = pos = 0
    for b, n in enumerate(tiles):
        if n == 0:
            per_req[b].append(len(items))
            items.append((b, 0, 0))
            continue
        t = 0
        while t < n:
            while pos >= bounds[c + 1]:
                cta_ptr.append(len(items))
                c += 1
            take = min(n - t, bounds[c + 1] - pos)
            per_req[b].append(len(items))
            items.append((b, t, t + take))
            t += take
            pos += take
    while len(cta_ptr) <= grid:
        cta_ptr.append(len(items))
    m_ptr, m_list = [0], []
    for lst in per_req:
        m_list += lst
        m_ptr.append(len(m_list))
    return grid, cta_ptr, items, m_ptr, m_list


def schedule_device(kv_len, num_ctas: int, min_tiles_per_cta: int, out: dict | None = None,
                    aligned: bool = True) -> dict:
    """``schedule`` computed with torch ops on ``kv_len``'s device: no host read, no sync (CUDA-graph re-plans).
    Both cuts are CTA boundaries in the concatenated tiles, and one item generator turns either into work items:
    the contiguous cut's ``c * T // G``, or (``aligned``, where ``aligned_pieces`` takes it: chosen element-wise,
    no host read) the starts of the request-aligned pieces with G = their count; an empty request's item falls in
    the CTA of the next tile either way (the last CTA at the end).

    Same cut as ``schedule`` (CTA c owns global tiles [c*T//G, (c+1)*T//G), G = min(num_ctas, ceil(T/min))),
    but the launch grid is always ``num_ctas`` (CTAs past G get empty ranges) and the arrays have fixed sizes:
    ``cta_ptr [num_ctas + 1]``, items ``[num_ctas + B]`` (padding past the real count is never read),
    ``m_ptr [B + 1]`` = 2 x the request's first item (its partials are consecutive), ``m_list`` = identity.
    ``out``: preallocated int32 buffers to write into (graph mode); returns the dict of arrays.
    """
    import torch
    dev = kv_len.device
    B = kv_len.numel()
    cap = num_ctas + B
    i64 = dict(dtype=torch.int64, device=dev)
    tiles = (kv_len.to(torch.int64) + (TILE - 1)) // TILE
    req_end = torch.cumsum(tiles, 0)
    req_start = req_end - tiles
    T = req_end[-1:] if B else torch.zeros(1, **i64)
    G = torch.clamp((T + (min_tiles_per_cta - 1)) // min_tiles_per_cta, 1, num_ctas)
    c = torch.arange(num_ctas + 1, **i64)
    bound = torch.where(c <= G, (c * T) // G, T)
    if aligned and B > 0:   # the request-aligned cut's boundaries, where aligned_pieces takes it
        kb = torch.clamp(torch.minimum(tiles * num_ctas // torch.clamp(T, min=1), tiles // min_tiles_per_cta), min=1)
        kc = torch.where(tiles > 0, kb, 0)        # CTAs a request takes (an empty one: none)
        pc = torch.cumsum(kc, 0)
        P = pc[-1:]
        take = (P <= num_ctas) & (((tiles + kb - 1) // kb).amax().reshape(1) <= (T + G - 1) // G + ALIGNED_SLACK)
        ab = torch.clamp(torch.searchsorted(pc, c, right=True), max=B - 1)   # CTA c's piece: request, index
        aj = c - (pc - kc)[ab]
        al = torch.where(c < P, req_start[ab] + aj * tiles[ab] // torch.clamp(kc[ab], min=1), T)
        bound = torch.where(take, al, bound)
        G = torch.where(take, torch.clamp(P, min=1), G)
    c_first = torch.clamp(torch.searchsorted(bound, req_start, right=True) - 1, min=0)
    c_first = torch.minimum(c_first, G - 1)
    c_last = torch.searchsorted(bound, torch.clamp(req_end - 1, min=0), right=True) - 1
    c_last = torch.maximum(torch.minimum(c_last, G - 1), c_first)
    n_it = c_last - c_first + 1
    it_end = torch.cumsum(n_it, 0)
    it_start = it_end - n_it
    i = torch.arange(cap, **i64)
    b = torch.clamp(torch.searchsorted(it_end, i, right=True), max=max(B - 1, 0))
    valid = i < (it_end[-1:] if B else torch.zeros(1, **i64))
    if B:
        cc = c_first[b] + (i - it_start[b])
        cc = torch.clamp(cc, max=num_ctas - 1)
        t0 = torch.maximum(req_start[b], bound[cc]) - req_start[b]
        t1 = torch.minimum(req_end[b], bound[cc + 1]) - req_start[b]
        t1 = torch.maximum(t1, t0)
        item_cta = torch.where(valid, cc, num_ctas)
    else:
        t0 = t1 = torch.zeros(cap, **i64)
        item_cta = torch.full((cap,), num_ctas, **i64)
    cta_ptr = torch.searchsorted(item_cta, c)
    zero = torch.zeros(1, **i64)
    res = dict(cta_ptr=cta_ptr, item_req=torch.where(valid, b, 0), item_t0=torch.where(valid, t0, 0),
               item_t1=torch.where(valid, t1, 0), m_ptr=torch.cat([zero, it_end]), m_list=torch.arange(cap, **i64))
    if out is None:
        return {key: v.to(torch.int32) for key, v in res.items()}
    for key, v in res.items():
        out[key][: v.numel()].copy_(v)
    # the slots past num_ctas, empty: a kernel launched with more slots (a per-tensor and a group plan of one
    # CUDA-graph wrapper share these buffers, the group one with fewer slots at H > 32) reads no stale items there
    last = res["cta_ptr"][-1:]
    out["cta_ptr"][last.numel() + num_ctas:].copy_(last.expand(out["cta_ptr"].numel() - num_ctas - 1))
    return out


def kv_descriptors(ckv_cache, kpe_cache):
    """TMA descriptors over the pool rows: c_kv boxes [64 x 128 B], k_pe boxes [64 x 64 B]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P, page, _ = ckv_cache.shape
    kv_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    kpe_l = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    rows = min(64, page)   # pages of 16/32 tokens: one box per page
    kv = TensorDescriptor(ckv_cache, [P * page, DC], [ckv_cache.stride(1), 1], [rows, 128], kv_l)
    kpe = TensorDescriptor(kpe_cache, [P * page, DK], [kpe_cache.stride(1), 1], [rows, 64], kpe_l)
    return kv, kpe


def scale_descriptor(ckv_scale_arr):
    """TMA descriptor over the per-token group scales ``[P, page, 4]`` fp32 (fmt ``fp8_e4m3_group``), as rows of
    16 bytes (one per pool row, like the c_kv boxes): boxes [min(64, page) x 4]. The rows must be one pool with
    16-byte aligned strides (``scale_rows_ok``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    P, page, g = ckv_scale_arr.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(ckv_scale_arr, [P * page, g], [ckv_scale_arr.stride(1), 1], [min(64, page), g], layout)


def scale_rows_ok(ckv_scale_arr) -> bool:
    """The group scales as TMA reads them: [P, page, 4] fp32, a contiguous last dimension, rows of one pool (page
    stride = page x row stride) with 16-byte aligned row stride and base."""
    import torch
    a = ckv_scale_arr
    return (a.dim() == 3 and a.shape[2] == GROUPS and a.dtype == torch.float32 and a.stride(2) == 1
            and a.stride(0) == a.shape[1] * a.stride(1) and a.stride(1) % 4 == 0 and a.data_ptr() % 16 == 0)


FP8_MATH_TERMS = 2   # fp8_math: Q as hi + lo e4m3 terms (exact for bf16 queries)


def launch(kv_desc, kpe_desc, q_nope, q_pe, scales, t: dict, out, lse, *, grid: int, grid_batch: int,
           max_rows: int, num_heads: int, sm_scale: float, page_size: int, ns: int = 4, regs: int = 240,
           merge_p: int = 32, merge_c: int = 128, max_qo: int = 1, causal: bool = True, scale_desc=None,
           fp8_math: bool = False):
    """Decode kernel + merge. ``t``: the plan's device arrays (qo_indptr, kv_indptr, kv_indices, kv_len, cta_ptr,
    item_req, item_t0, item_t1, part_o [items, padded_heads(H), 512] fp32, part_lse [items, padded_heads(H)],
    m_ptr, m_list, batch_size [1]). ``lse`` is written base 2. ``grid``: CTAs launched; for H > 16 (the wide
    variant) it is slots x nhg, the schedule (``cta_ptr``) having ``grid // nhg`` slots. ``max_qo`` >= 2: the
    multi-token variant (``mtp_config``; each request's qo_len is read from qo_indptr on the device, up to
    max_qo; ``causal`` aligns its queries to the end); ``max_rows`` is then max_qo x num_heads.

    ``ns``: the ring depth, any; at an odd depth the alternating-tile kernel (H <= 16) has one ready barrier per
    stage and consumer (``ring_depth``).

    ``scale_desc`` (``scale_descriptor``): per-token group scales (format ``fp8_e4m3_group``; ``scales`` then holds
    (1, kpe_scale)): the producer brings each tile's [64, 4] scales with its rows, the scores are one fp32 product
    per 128-column group times the tokens' scales, and P.V takes P x scale / the group's tile maximum per group
    (the Triton kernel's KV_GROUP numerics).

    ``fp8_math`` (opt-in): S = K.Q^T and O^T += V^T.P^T as e4m3 x e4m3 wgmma: Q as ``FP8_MATH_TERMS`` e4m3 terms, K
    and V^T's bytes straight from the stage (no conversion), P x 2^8 rounded to e4m3 (``P8_SCALE``), the row sums
    kept from the unrounded P. Error budget rel L2 <= 2e-2, not the default 3e-3. Per-tensor scales only."""
    LOG2E = 1.4426950408889634
    max_hpw = GROUP_MAX_HPW if scale_desc is not None else 32   # the group build: 16 rows per consumer at any H
    hpw, nhg, wide = row_config(num_heads, max_qo, max_hpw)
    mtp = 0 if max_qo <= 1 else (1 if causal else 2)
    if grid % nhg:
        raise ValueError(f"grid: {nhg} head groups need a multiple of {nhg} CTAs, got {grid}")
    qk8 = FP8_MATH_TERMS if fp8_math else 0
    if fp8_math:
        if scale_desc is not None:
            raise ValueError("fp8_math: the e4m3 math runs with per-tensor scales (no scale_desc)")
        if smem_bytes(ns, hpw, wide, qk8) > SMEM_LIMIT:
            raise ValueError(f"fp8_math: its Q terms at {num_heads} heads and {ns} stages need "
                             f"{smem_bytes(ns, hpw, wide, qk8)} B of shared memory, above {SMEM_LIMIT}")
    if scale_desc is not None:
        if scale_desc.block_shape != [min(64, page_size), GROUPS]:
            raise ValueError(f"scale_desc: expected boxes [{min(64, page_size)}, {GROUPS}] (scale_descriptor of a "
                             f"[P, {page_size}, {GROUPS}] array), got {scale_desc.block_shape}")
        if smem_bytes(ns, hpw, wide, group=True) > SMEM_LIMIT:
            raise ValueError(f"scale_desc: group scales at {num_heads} heads and {ns} stages need "
                             f"{smem_bytes(ns, hpw, wide, group=True)} B of shared memory, above {SMEM_LIMIT}")
    po, pl = t["part_o"], t["part_lse"]
    rows = padded_heads(num_heads, max_qo, max_hpw)
    if po.shape[1] < rows or pl.shape[1] < rows:
        raise ValueError(f"part_o/part_lse: need {rows} head rows per item, got "
                         f"{po.shape[1]}/{pl.shape[1]}")
    # page 1 copies rows with cp.async from the pools the descriptors cover (rows of page_size 1: row = page id)
    mla_decode_sm90_kernel[(grid,)](
        kv_desc, kpe_desc, kv_desc.base, kpe_desc.base, kv_desc.strides[0], kpe_desc.strides[0], kv_desc.shape[0],
        q_nope, q_pe, scales, t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"],
        t["cta_ptr"], t["item_req"], t["item_t0"], t["item_t1"], po, pl, out, lse, sm_scale * LOG2E, num_heads,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), po.stride(0), po.stride(1),
        pl.stride(0), out.stride(0), out.stride(1), lse.stride(0), PAGE=page_size, NS=ns, REGS=regs,
        HPW=hpw, WIDE=wide, NHG=nhg, **({"MTP": mtp} if mtp else {}),
        **({"QK8": qk8, "PV8": True} if fp8_math else {}),
        **({"QKC": True} if fp8_math and max_qo == 1 and not wide else {}),
        **({"sc_desc": scale_desc, "sc_ptr": scale_desc.base, "stride_sc_row": scale_desc.strides[0], "GROUP": True}
           if scale_desc is not None else {}),
        num_warps=4)
    launch_merge(out, lse, t, grid_batch=grid_batch, max_rows=max_rows, num_heads=num_heads, merge_p=merge_p,
                 merge_c=merge_c)


def launch_merge(out, lse, t: dict, *, grid_batch: int, max_rows: int, num_heads: int, merge_p: int, merge_c: int,
                 min_parts: int = 2) -> None:
    """The split merge (``_merge_parts_kernel``) of the partials a decode launch wrote into ``t["part_o"]`` /
    ``t["part_lse"]`` (rows = query token x num_heads + head, lse base 2): every request of at least
    ``min_parts`` partials."""
    po, pl = t["part_o"], t["part_lse"]
    # (the chunked path's step holds BLOCK_P x ROWS x BLOCK_C: kept <= 8192 fp32, as the one-row merge had it)
    rows_blk = min(merge_tile(merge_c), triton.next_power_of_2(max_rows), max(1, 8192 // (merge_p * merge_c)))
    _merge_parts_kernel[(grid_batch, triton.cdiv(max_rows, rows_blk), DC // merge_c)](
        out, lse, po, pl, t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], num_heads,
        out.stride(0), out.stride(1), lse.stride(0), po.stride(0), po.stride(1), pl.stride(0),
        BLOCK_P=merge_p, BLOCK_C=merge_c, ROWS=rows_blk, min_parts=min_parts, SEQ=SEQ_PARTS, num_warps=4)


# --------------------------------------------------------------------------------------------------------------
# Compile without a GPU (CI and the CPU side of development): registers, spills, shared memory, SASS mix
# --------------------------------------------------------------------------------------------------------------
KERNEL_SIGNATURE = {
    "kv_desc": "tensordesc<fp8e4nv[64, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)>",
    "kpe_desc": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "ckv_ptr": "*fp8e4nv", "kpe_ptr": "*fp8e4nv", "stride_kv_row": "i32", "stride_kpe_row": "i32",
    "num_rows": "i32",
    "q_nope": "*bf16", "q_pe": "*bf16", "scales": "*fp32", "qo_indptr": "*i32", "kv_indptr": "*i32",
    "kv_indices": "*i32", "kv_len": "*i32", "cta_ptr": "*i32", "item_req": "*i32", "item_t0": "*i32",
    "item_t1": "*i32", "part_o": "*fp32", "part_lse": "*fp32", "OUT": "*bf16", "LSE_OUT": "*fp32",
    "sm_scale_log2": "fp32", "H": "i32", "stride_o_t": "i32", "stride_o_h": "i32", "stride_lse_t": "i32",
    "stride_qn_t": "i32", "stride_qn_h": "i32", "stride_qp_t": "i32", "stride_qp_h": "i32",
    "stride_po_i": "i32", "stride_po_r": "i32", "stride_pl_i": "i32",
    "PAGE": "constexpr", "NS": "constexpr", "REGS": "constexpr", "HPW": "constexpr",
    "WIDE": "constexpr", "NHG": "constexpr", "MTP": "constexpr", "QK8": "constexpr", "QKC": "constexpr",
    # group scales (compile_report(group=True)); constexpr None / False otherwise
    "sc_desc": "tensordesc<fp32[64, 4],NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)>",
    "sc_ptr": "*fp32", "stride_sc_row": "i32", "GROUP": "constexpr", "PV8": "constexpr"}


# Integer arguments the JIT sees divisible by 16 in a real launch with contiguous [tokens, H, dim] tensors and
# H % 16 == 0 (triton specializes such ints): the strides and H itself.
_INT_DIV16 = ("H", "stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_po_i", "stride_po_r",
              "stride_pl_i", "stride_o_t", "stride_o_h", "stride_lse_t")


def compile_report(page: int = 64, ns: int = 4, regs: int = 240, q_dtype: str = "bf16", sass_path=None,
                   heads: int = 16, aligned_ints: bool = False, max_qo: int = 1, causal: bool = True,
                   group: bool = False, fp8_math: bool = False) -> dict:
    """Compile the decode kernel for sm_90a with triton's own ptxas (no GPU needed) and count SASS ops.
    ``heads`` picks the variant (``head_config``: 16 -> the H16 kernel, 32 -> wide HPW 16, 128 -> wide HPW 32;
    with ``group``, HPW 16 at every H: 128 -> 4 head groups).
    ``aligned_ints``: mark the strides and H divisible by 16, as the JIT specializes them at H = 16/32/64/128 with
    contiguous tensors (then Q is read with 16-byte loads); False compiles the unspecialized worst case.
    ``max_qo`` >= 2: the multi-token variant (``mtp_config``), causal or not. ``group``: with per-token group
    scales (``GROUP``). ``fp8_math``: the e4m3 build (``QK8`` terms, ``PV8``; ``QKC`` at H <= 16 one query)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    if gluon is None:
        raise RuntimeError(f"gluon is not importable: {GLUON_IMPORT_ERROR}")
    fn = mla_decode_sm90_kernel
    names = fn.arg_names
    sig = dict(KERNEL_SIGNATURE, q_nope=f"*{q_dtype}", q_pe=f"*{q_dtype}", OUT=f"*{q_dtype}")
    rows = min(64, page)
    sig["kv_desc"] = sig["kv_desc"].replace("[64, 128]", f"[{rows}, 128]")
    sig["kpe_desc"] = sig["kpe_desc"].replace("[64, 64]", f"[{rows}, 64]")
    sig["sc_desc"] = sig["sc_desc"].replace("[64, 4]", f"[{rows}, 4]")
    hpw, nhg, wide = row_config(heads, max_qo, GROUP_MAX_HPW if group else 32)
    consts = {"PAGE": page, "NS": ns, "REGS": regs, "HPW": hpw, "WIDE": wide, "NHG": nhg}
    consts["MTP"] = 0 if max_qo <= 1 else (1 if causal else 2)
    consts["QK8"] = FP8_MATH_TERMS if fp8_math else 0
    consts["QKC"] = bool(fp8_math and max_qo <= 1 and not wide)
    consts["GROUP"] = bool(group)
    consts["PV8"] = bool(fp8_math)
    if not group:
        for n in ("sc_desc", "sc_ptr", "stride_sc_row"):
            sig[n] = "constexpr"
            consts[n] = None
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                                if sig[n].startswith("*") or (aligned_ints and n in _INT_DIV16)
                                or n in ("stride_kv_row", "stride_kpe_row")})
    return sass_report(src, sass_path)


def sass_report(src, sass_path=None) -> dict:
    """Compile a Gluon kernel source (``GluonASTSource``) for sm_90a with triton's own ptxas (no GPU) and read its
    SASS: ``regs``, ``spills`` ((store, load) bytes per function), ``smem``, ``ptxas`` (its -v output), ``ops``
    (SASS op counts), ``loops`` (per warp-specialized partition, the HGMMA, STL, LDL and LDS.U8 between its first
    and last HGMMA: the tile loop) and ``serialized_wgmma`` (ptxas C7512); ``sass_path``: also write the SASS
    there."""
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
        for exe in ("ptxas", "ptxas-blackwell"):   # later wheels ship an older "ptxas" beside the one they use
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
    # (addresses have 4 or more hex digits: the kernel is past 0x10000 bytes, so {4} alone missed the 2nd consumer)
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass):
        ops[m.group(1)] += 1
        seq.append(m.group(1))
    # the tile loops: from the first to the last HGMMA of each partition (partitions start at USETMAXREG)
    loops, cur = [], []
    for op in seq + ["USETMAXREG"]:
        if op.startswith("USETMAXREG"):
            h = [i for i, o in enumerate(cur) if o.startswith("HGMMA")]
            if h:
                body = cur[h[0]:h[-1] + 1]
                loops.append({"HGMMA": len(h), "STL": sum(o.startswith("STL") for o in body),
                              "LDL": sum(o.startswith("LDL") for o in body),
                              "LDS.U8": sum(o == "LDS.U8" for o in body)})
            cur = []
        cur.append(op)
    spills = [tuple(map(int, x)) for x in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)]
    return {"regs": [int(r) for r in re.findall(r"Used (\d+) registers", v)], "spills": spills,
            "smem": k.metadata.shared, "ptxas": v, "ops": dict(ops), "loops": loops,
            "serialized_wgmma": "C7512" in v or "serialized" in v.lower()}
