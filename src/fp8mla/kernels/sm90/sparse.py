"""Hopper (sm_90a) sparse MLA decode in Gluon over ``fp8_ds_mla`` records: BF16 queries, wgmma for both products.

One CTA owns (query token, head group of 64, split); 8 warps = two warpgroups that share the wgmma N side
(``warps_per_cta [4, 2]``: each warpgroup owns half of the score columns and half of every output chunk, so the
64 x 512 fp32 output is 128 registers a thread). Heads are the MMA's M side, padded to 64 rows: H = 8 / 16 runs
one 64-row group with zero query rows (never written). Several query tokens cannot share a tile here, because each
token gathers its own index row, so the rows of one tile would need different K.

Per 64-entry tile of the token's index row (slot ids ``page * page_size + offset``; -1 and ids outside the pool
are never read and score -inf):
  * gather: 16-byte pieces of the selected 656-byte records (e4m3 c_kv, 4 fp32 scales, bf16 k_pe); each e4m3
    value times (its 128-channel group scale / the tile scale T) converts ONCE to fp16 into eight [64, 64]
    NVMMA-swizzled slabs, the shared operand of both products; k_pe is stored as it is (bf16 slab).
    T is a power of two >= the tile's largest scale, so the converted values are <= 448 and the fp16 rounding
    is relative to the tile's largest value (bf16 K would double the output error: ~2.7e-3 rel. L2 in a torch
    model of the arithmetic against 1.7e-3 this way, the bf16 output rounding being 1.66e-3).
  * S [64 heads, 64 tokens] = (Q_nope x f) . K^T + (Q_pe x f / T) . k_pe^T, one fp32 accumulator: Q_nope in fp16
    scaled per head by a power of two f (largest |q_nope|, |q_pe| near 2^14, exact), q_pe in bf16 (x f / T: exact); the
    scores are S x T / f x sm_scale x log2 e
  * online softmax in fp32 with exp2; P x T / F (F the running largest T, the output's unit; <= 1) in fp16
  * O_c [64, 64] += P . V_c for the eight 64-column chunks (V = the c_kv slabs), rescaled by alpha x F_old / F.

This first build is a pipelined single partition, not warp-specialized. ``GATHER`` picks how the records arrive
(``GATHERS``): by default ("async") every thread cp.asyncs 16-byte pieces of the NEXT tile's records into a raw
e4m3/bf16 stage while the current tile's MMAs and softmax run, and reads the stage back for the conversion at the
top of the next tile; "regs" loads a tile into registers at its top (no overlap inside the CTA); "prefetch"
loads the next tile into registers during the MMAs (spills ~500 B on triton 3.9). Why single-partition: it is the
smallest kernel whose numerics and masking can be checked on the GPU against the Triton twin; a producer
warpgroup (gather + conversion into a ring of converted slabs, consumers doing only MMAs) is the next step once
this one is verified and measured.

Splits: with few tokens an index row is cut over ``num_splits`` CTAs, each writing a normalized partial (o, lse
base 2) that ``kernels/sparse_decode._merge_splits_kernel`` combines by log-sum-exp in split order.

Numerics: bf16 queries only (an fp16 query is refused: ``supports``); fp16 K, V and P as above, fp32
accumulation. A tile whose largest scale is more than ~2^10 below the running F gets P in fp16 subnormals (fewer
bits; such a tile's values are that much smaller than the largest tile's). The record pool must be contiguous over
pages (slot s is record s).
"""
from __future__ import annotations

import triton

try:  # Gluon ships inside triton >= 3.4; written against triton 3.6's API (3.9's names where they differ)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    # triton 3.6 names cp.async async_copy_global_to_shared; later versions async_load (same arguments; there the
    # old name still exists but raises)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon here"
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

# backend="auto" keeps the Triton kernel until the H200 A/B says otherwise (the coordinator flips this).
AUTO_SELECT = False

REC_BYTES = 656        # fp8_ds_mla record: 512 e4m3 | 4 fp32 scales | 64 bf16 k_pe
DC, DK = 512, 64
HEAD_GROUP = 64        # heads per CTA (the wgmma M side)
TILE = 64              # index entries per tile
NUM_WARPS = 8
MAX_HEADS = 128
# How a tile's records reach shared memory (the GATHER constexpr): "regs" loads them into registers at the top of
# the tile; "prefetch" loads the next tile's into registers during this tile's MMAs (spills); "async" copies the
# next tile's into a raw stage with cp.async during this tile's MMAs, then reads the stage back for conversion.
GATHERS = {"regs": 0, "prefetch": 1, "async": 2}
DEFAULT_GATHER = "async"
LAST_COMPILED = None


def supports(num_heads: int, fmt_name: str, q_dtype_name: str, topk: int) -> tuple[bool, str]:
    """(ok, why not) for a plan on this build."""
    if fmt_name != "fp8_ds_mla":
        return False, f"kv_data_type: the gluon sparse build reads fp8_ds_mla records, got {fmt_name!r}"
    if q_dtype_name != "bfloat16":
        return False, f"q_data_type: the gluon sparse build takes bfloat16 queries, got {q_dtype_name}"
    if not 1 <= num_heads <= MAX_HEADS:
        return False, f"num_heads: the gluon sparse build takes 1..{MAX_HEADS}, got {num_heads}"
    if topk % TILE:
        return False, f"topk: the gluon sparse build needs a multiple of {TILE}, got {topk}"
    return True, ""


def smem_bytes(gather: str = DEFAULT_GATHER) -> int:
    """Shared memory of one CTA: Q (8 fp16 slabs of q_nope, 2 bf16 of q_pe), K (8 fp16 + 1 bf16), P (1 slab);
    "async" adds the raw stage (64 records' e4m3 c_kv and bf16 k_pe)."""
    slab = 64 * 64 * 2
    return 20 * slab + (64 * (512 + 128) if gather == "async" else 0)


if gluon is not None:

    @gluon.jit
    def _tile_rows(indices, idx_row, j, j1, num_slots, ld: gl.constexpr):
        """Entries ``j .. j + 63`` of the index row: (valid, record number); -1 / out-of-pool / past-the-split
        entries are not valid (record 0, never read)."""
        e = j + gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
        idx = gl.load(indices + idx_row + e, mask=e < j1, other=-1)
        ok = (idx >= 0) & (idx < num_slots)
        return ok, gl.where(ok, idx, 0).to(gl.int64)

    @gluon.jit
    def _load_scales(sa_ptr, ok, rec):
        sb = sa_ptr + rec * 164
        s0 = gl.load(sb + 0, mask=ok, other=0.0)
        s1 = gl.load(sb + 1, mask=ok, other=0.0)
        s2 = gl.load(sb + 2, mask=ok, other=0.0)
        s3 = gl.load(sb + 3, mask=ok, other=0.0)
        return s0, s1, s2, s3

    @gluon.jit
    def _load_tile(ckv_ptr, sa_ptr, kpe_ptr, indices, idx_row, j, j1, num_slots, ld: gl.constexpr):
        """The 64 selected records of entries ``j .. j + 63`` into registers: 8 [64, 64] e4m3 pieces, the 4
        [64] group scales and the [64, 64] bf16 k_pe; invalid rows are not read (0; their scores are -inf)."""
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        ok, rec = _tile_rows(indices, idx_row, j, j1, num_slots, ld)
        okc = ok[:, None]
        cb = ckv_ptr + rec[:, None] * 656 + cols[None, :]
        c0 = gl.load(cb + 0 * 64, mask=okc, other=0.0)
        c1 = gl.load(cb + 1 * 64, mask=okc, other=0.0)
        c2 = gl.load(cb + 2 * 64, mask=okc, other=0.0)
        c3 = gl.load(cb + 3 * 64, mask=okc, other=0.0)
        c4 = gl.load(cb + 4 * 64, mask=okc, other=0.0)
        c5 = gl.load(cb + 5 * 64, mask=okc, other=0.0)
        c6 = gl.load(cb + 6 * 64, mask=okc, other=0.0)
        c7 = gl.load(cb + 7 * 64, mask=okc, other=0.0)
        s0, s1, s2, s3 = _load_scales(sa_ptr, ok, rec)
        kp = gl.load(kpe_ptr + rec[:, None] * 328 + cols[None, :], mask=okc, other=0.0)
        return ok, c0, c1, c2, c3, c4, c5, c6, c7, s0, s1, s2, s3, kp

    @gluon.jit
    def _issue_gather(raw_c, raw_k, ckv_ptr, kpe_ptr, ok, rec, ld: gl.constexpr):
        """cp.async (16 B a thread and piece) of the valid rows' c_kv and k_pe into the raw stage; one group."""
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        okc = ok[:, None]
        cb = ckv_ptr + rec[:, None] * 656 + cols[None, :]
        for c in gl.static_range(8):
            _cp_async(raw_c.index(c), cb + c * 64, mask=okc)
        _cp_async(raw_k, kpe_ptr + rec[:, None] * 328 + cols[None, :], mask=okc)
        async_copy.commit_group()

    @gluon.jit
    def _read_raw(raw_c, raw_k, ok, ld: gl.constexpr):
        """The stage back in registers; rows that were not copied are 0 (the stage may hold anything there)."""
        okc = ok[:, None]
        c0 = gl.where(okc, raw_c.index(0).load(ld), 0.0)
        c1 = gl.where(okc, raw_c.index(1).load(ld), 0.0)
        c2 = gl.where(okc, raw_c.index(2).load(ld), 0.0)
        c3 = gl.where(okc, raw_c.index(3).load(ld), 0.0)
        c4 = gl.where(okc, raw_c.index(4).load(ld), 0.0)
        c5 = gl.where(okc, raw_c.index(5).load(ld), 0.0)
        c6 = gl.where(okc, raw_c.index(6).load(ld), 0.0)
        c7 = gl.where(okc, raw_c.index(7).load(ld), 0.0)
        kp = gl.where(okc, raw_k.load(ld), 0.0)
        return c0, c1, c2, c3, c4, c5, c6, c7, kp

    @gluon.jit
    def _put(kbuf, c: gl.constexpr, x, s):
        """e4m3 piece x (its rows' group scale / the tile's scale) -> fp16, into slab c (the one conversion)."""
        kbuf.index(c).store((x.to(gl.float32) * s[:, None]).to(gl.float16))

    @gluon.jit
    def _qk(qn_smem, kbuf, c: gl.constexpr, s):
        return warpgroup_mma(qn_smem.index(c), kbuf.index(c).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _pv(p_smem, kbuf, c: gl.constexpr, acc, alpha):
        return warpgroup_mma(p_smem, kbuf.index(c), acc * alpha[:, None], is_async=True)

    @gluon.jit
    def _store_chunk(base, c: gl.constexpr, o, scale, mask, orow, ocol, ty: gl.constexpr):
        gl.store(base + orow[:, None] + (c * 64 + ocol)[None, :], (o * scale[:, None]).to(ty), mask=mask)

    @gluon.jit
    def sparse_mla_kernel(
        q_nope, q_pe, ckv_ptr, sa_ptr, kpe_ptr, indices, out, lse_out, part_o, part_lse,
        sm_scale_log2, lse_scale, H, num_slots, topk, chunk, num_splits, num_groups,
        stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_idx_t,
        stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_i, stride_po_h, stride_pl_i,
        SPLIT: gl.constexpr, GATHER: gl.constexpr,
    ):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, 32, 16])
        slab_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        # 16-byte pieces: 4 threads per 64-byte e4m3 row, 8 rows per warp, 8 warps: one [64, 64] piece
        ld8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
        # bf16 rows of 128 bytes: 8 threads per row, 8 elements (16 bytes) each
        ld16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)

        t = gl.program_id(0) // num_groups
        h0 = (gl.program_id(0) % num_groups) * 64
        sp = gl.program_id(1)
        t64 = t.to(gl.int64)

        slab16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        qn_smem = gl.allocate_shared_memory(gl.float16, [8, 64, 64], slab16_l)     # q_nope x f, fp16
        qpe_base = gl.allocate_shared_memory(gl.bfloat16, [64, 64], slab_l)        # q_pe x f, bf16 (exact)
        qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], slab_l)        # q_pe x f / tile scale
        kbuf = gl.allocate_shared_memory(gl.float16, [8, 64, 64], slab16_l)        # c_kv x scale / tile scale
        kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], slab_l)        # k_pe as stored
        p_smem = gl.allocate_shared_memory(gl.float16, [64, 64], slab16_l)

        # -- Q: 8 fp16 slabs of q_nope x f (f a power of two per head: its largest |q| near 2^14, exact), q_pe x f
        # in bf16; padded heads are zero rows ----------------------------------------------------------------------
        qr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld16)) + h0
        qc = gl.arange(0, 64, layout=gl.SliceLayout(0, ld16))
        qm = (qr < H)[:, None]
        qn = q_nope + t64 * stride_qn_t + qr[:, None].to(gl.int64) * stride_qn_h + qc[None, :]
        amax = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld16))
        for c in gl.static_range(8):
            x = gl.load(qn + c * 64, mask=qm, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
        xp = gl.load(q_pe + t64 * stride_qp_t + qr[:, None].to(gl.int64) * stride_qp_h + qc[None, :], mask=qm,
                     other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(xp), axis=1))   # q_pe too: q_pe x f / T stays far from overflow
        f = gl.where(amax > 0, gl.exp2(gl.floor(gl.log2(16384.0 / amax))), 1.0)
        for c in gl.static_range(8):
            x = gl.load(qn + c * 64, mask=qm, other=0.0).to(gl.float32)
            qn_smem.index(c).store((x * f[:, None]).to(gl.float16))
        qpe_base.store((xp * f[:, None]).to(gl.bfloat16))
        row_scale = gl.convert_layout(sm_scale_log2 / f, row_l)
        big_f = sm_scale_log2 * 0.0   # running largest tile scale: the output is kept in its units

        m_i = gl.full([64], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([64], gl.float32, row_l)
        o0 = gl.zeros([64, 64], gl.float32, mma)
        o1 = gl.zeros([64, 64], gl.float32, mma)
        o2 = gl.zeros([64, 64], gl.float32, mma)
        o3 = gl.zeros([64, 64], gl.float32, mma)
        o4 = gl.zeros([64, 64], gl.float32, mma)
        o5 = gl.zeros([64, 64], gl.float32, mma)
        o6 = gl.zeros([64, 64], gl.float32, mma)
        o7 = gl.zeros([64, 64], gl.float32, mma)
        idx_row = t64 * stride_idx_t
        j0 = sp * chunk
        j1 = gl.minimum(j0 + chunk, topk)

        if GATHER == 2:
            # plain row-major stages (the layout of one [64, 64] piece; the leading dim indexes pieces, as for the
            # NVMMA slabs): the 16-byte pieces are written (cp.async) and read (LDS.128) in one register layout
            raw_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            raw_c = gl.allocate_shared_memory(gl.float8e4nv, [8, 64, 64], raw_l)
            raw_k = gl.allocate_shared_memory(gl.bfloat16, [64, 64], raw_l)
            ok, rec = _tile_rows(indices, idx_row, j0, j1, num_slots, ld8)
            _issue_gather(raw_c, raw_k, ckv_ptr, kpe_ptr, ok, rec, ld8)
            s0, s1, s2, s3 = _load_scales(sa_ptr, ok, rec)
            ok_n, rec_n = _tile_rows(indices, idx_row, j0 + 64, j1, num_slots, ld8)
        if GATHER == 1:
            ok, c0, c1, c2, c3, c4, c5, c6, c7, s0, s1, s2, s3, kp = _load_tile(
                ckv_ptr, sa_ptr, kpe_ptr, indices, idx_row, j0, j1, num_slots, ld8)
        for j in range(j0, j1, 64):
            if GATHER == 0:
                ok, c0, c1, c2, c3, c4, c5, c6, c7, s0, s1, s2, s3, kp = _load_tile(
                    ckv_ptr, sa_ptr, kpe_ptr, indices, idx_row, j, j1, num_slots, ld8)
            if GATHER == 2:
                async_copy.wait_group(0)
                _cta_barrier()   # every thread's copies landed; the previous tile's MMAs are done everywhere
                c0, c1, c2, c3, c4, c5, c6, c7, kp = _read_raw(raw_c, raw_k, ok, ld8)
                _cta_barrier()   # the stage is read: the next tile's copies may land in it during this one's MMAs
                _issue_gather(raw_c, raw_k, ckv_ptr, kpe_ptr, ok_n, rec_n, ld8)
                n0, n1, n2, n3 = _load_scales(sa_ptr, ok_n, rec_n)
            if GATHER != 2:   # the previous tile's MMAs are done in every warp before its slabs are overwritten
                _cta_barrier()
            # the tile's scale: a power of two >= its largest group scale (no valid row: the running one), so the
            # converted values stay <= 448 in fp16 and q_pe / it is exact in bf16
            tmax = gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), axis=0)
            t_scale = gl.where(tmax > 0, gl.exp2(-gl.floor(-gl.log2(tmax))), gl.where(big_f > 0, big_f, 1.0))
            inv_t = 1.0 / t_scale
            _put(kbuf, 0, c0, s0 * inv_t)
            _put(kbuf, 1, c1, s0 * inv_t)
            _put(kbuf, 2, c2, s1 * inv_t)
            _put(kbuf, 3, c3, s1 * inv_t)
            _put(kbuf, 4, c4, s2 * inv_t)
            _put(kbuf, 5, c5, s2 * inv_t)
            _put(kbuf, 6, c6, s3 * inv_t)
            _put(kbuf, 7, c7, s3 * inv_t)
            kpe_smem.store(kp)
            qpe_smem.store((qpe_base.load(ld16).to(gl.float32) * inv_t).to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()
            ok_s = gl.convert_layout(ok, col_l)
            # the next tile's records are in flight while this one's MMAs run (past the end: all masked)
            if GATHER == 1:
                ok, c0, c1, c2, c3, c4, c5, c6, c7, s0, s1, s2, s3, kp = _load_tile(
                    ckv_ptr, sa_ptr, kpe_ptr, indices, idx_row, j + 64, j1, num_slots, ld8)
            if GATHER == 2:
                ok = ok_n
                s0, s1, s2, s3 = n0, n1, n2, n3
                ok_n, rec_n = _tile_rows(indices, idx_row, j + 128, j1, num_slots, ld8)

            # S x f / tile scale: fp16 c_kv part + bf16 k_pe part in one fp32 accumulator
            s = gl.zeros([64, 64], gl.float32, mma)
            s = _qk(qn_smem, kbuf, 0, s)
            s = _qk(qn_smem, kbuf, 1, s)
            s = _qk(qn_smem, kbuf, 2, s)
            s = _qk(qn_smem, kbuf, 3, s)
            s = _qk(qn_smem, kbuf, 4, s)
            s = _qk(qn_smem, kbuf, 5, s)
            s = _qk(qn_smem, kbuf, 6, s)
            s = _qk(qn_smem, kbuf, 7, s)
            s = warpgroup_mma(qpe_smem, kpe_smem.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))

            s = gl.where(ok_s[None, :], s * (row_scale * t_scale)[:, None], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: alpha and P stay 0
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            # V is in units of the tile scale, the output in units of big_f: P x tile / big_f <= 1 in fp16
            f_new = gl.maximum(big_f, t_scale)
            alpha = alpha * (big_f / f_new)
            big_f = f_new
            p_smem.store((p * (t_scale / f_new)).to(gl.float16))
            fence_async_shared()
            _cta_barrier()
            o0 = _pv(p_smem, kbuf, 0, o0, alpha)
            o1 = _pv(p_smem, kbuf, 1, o1, alpha)
            o2 = _pv(p_smem, kbuf, 2, o2, alpha)
            o3 = _pv(p_smem, kbuf, 3, o3, alpha)
            o4 = _pv(p_smem, kbuf, 4, o4, alpha)
            o5 = _pv(p_smem, kbuf, 5, o5, alpha)
            o6 = _pv(p_smem, kbuf, 6, o6, alpha)
            o7 = _pv(p_smem, kbuf, 7, o7, alpha)
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))

        if GATHER == 2:
            async_copy.wait_group(0)   # the last (all-masked) copy group: nothing in flight at exit
        # -- epilogue: no valid entry is l == 0 (out 0, lse -inf); NaN stays NaN ----------------------------------
        empty = l_i == 0
        inv = gl.where(empty, 0.0, big_f / gl.where(empty, 1.0, l_i))
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
        heads = gl.arange(0, 64, layout=row_l) + h0
        hok = heads < H
        ocol = gl.arange(0, 64, layout=col_l)
        omask = hok[:, None]
        if SPLIT:
            item = t64 * num_splits + sp
            gl.store(part_lse + item * stride_pl_i + heads, lse, mask=hok)
            base = part_o + item * stride_po_i
            orow = heads.to(gl.int64) * stride_po_h
            ty: gl.constexpr = gl.float32
        else:
            gl.store(lse_out + t64 * stride_lse_t + heads * stride_lse_h, lse * lse_scale, mask=hok)
            base = out + t64 * stride_o_t
            orow = heads.to(gl.int64) * stride_o_h
            ty: gl.constexpr = out.dtype.element_ty
        _store_chunk(base, 0, o0, inv, omask, orow, ocol, ty)
        _store_chunk(base, 1, o1, inv, omask, orow, ocol, ty)
        _store_chunk(base, 2, o2, inv, omask, orow, ocol, ty)
        _store_chunk(base, 3, o3, inv, omask, orow, ocol, ty)
        _store_chunk(base, 4, o4, inv, omask, orow, ocol, ty)
        _store_chunk(base, 5, o5, inv, omask, orow, ocol, ty)
        _store_chunk(base, 6, o6, inv, omask, orow, ocol, ty)
        _store_chunk(base, 7, o7, inv, omask, orow, ocol, ty)


def sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, indices, out, lse, part_o, part_lse, *, sm_scale: float,
               num_splits: int, lse_scale: float, gather: str = DEFAULT_GATHER) -> None:
    """Launch the Gluon sparse kernel (and the split merge when ``num_splits > 1``).

    q_nope ``[n, H, 512]`` / q_pe ``[n, H, 64]`` bf16 (last dim contiguous); ckv / kpe / scale_arr: the e4m3
    ``[P, page, 512]``, bf16 ``[P, page, 64]`` and fp32 ``[P, page, 4]`` views of one contiguous record pool
    (``MLASparseAttention._split_pool``; slot s = record s); indices int32 ``[n, topk]``; out ``[n, H, 512]`` bf16
    and lse ``[n, H]`` fp32 (any strides, last dim of out contiguous); part_o / part_lse fp32
    ``[>= n * splits, H(, 512)]`` contiguous when splitting. ``gather``: how a tile's records reach shared memory
    (``GATHERS``).
    """
    from ..sparse_decode import _merge_splits_kernel
    from ..decode import LOG2E
    if gluon is None:
        raise RuntimeError(f"the gluon sparse kernel needs triton.experimental.gluon: {GLUON_IMPORT_ERROR}")
    n, H, _ = q_nope.shape
    P, page, _ = ckv.shape
    topk = indices.shape[1]
    want = (page * REC_BYTES, REC_BYTES)
    if (page > 1 and ckv.stride(1) != want[1]) or (P > 1 and ckv.stride(0) != want[0]):
        raise ValueError(f"kv_cache: the gluon sparse kernel reads a contiguous record pool (slot s = record s, "
                         f"strides {want + (1,)}), got strides {tuple(ckv.stride())}")
    if gather not in GATHERS:
        raise ValueError(f"gather: expected one of {sorted(GATHERS)}, got {gather!r}")
    if n == 0:
        return
    chunk = -(-topk // num_splits)
    chunk = -(-chunk // TILE) * TILE
    num_splits = -(-topk // chunk)
    split = num_splits > 1
    po = part_o if split else out
    pl = part_lse if split else lse
    groups = triton.cdiv(H, HEAD_GROUP)
    global LAST_COMPILED  # registers / spills of the last launch, for the device check
    LAST_COMPILED = sparse_mla_kernel[(n * groups, num_splits)](
        q_nope, q_pe, ckv, scale_arr, kpe, indices, out, lse, po, pl,
        sm_scale * LOG2E, lse_scale, H, P * page, topk, chunk, num_splits, groups,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        po.stride(0), po.stride(1), pl.stride(0),
        SPLIT=split, GATHER=GATHERS[gather], num_warps=NUM_WARPS,
    )
    if split:
        _merge_splits_kernel[(n, triton.cdiv(H, 8), triton.cdiv(DC, 64))](
            out, lse, part_o, part_lse, H, num_splits, lse_scale,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0),
            BLOCK_R=8, BLOCK_C=64, num_warps=4,
        )
