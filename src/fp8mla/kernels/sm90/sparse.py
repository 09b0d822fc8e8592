"""Hopper (sm_90a) sparse MLA decode in Gluon over ``fp8_ds_mla`` records: the host side (plan check, split
policy, launch). The kernel and its four warp-specialized partitions are in ``sparse_partitions.py``.

One CTA per (query token, 64-head group, split), 16 warps: two converter warpgroups gather the selected 656-byte
records with cp.async and convert them with a per-token power-of-two scale into fp16 / bf16 NVMMA slabs, two
consumer warpgroups alternate as the owner of a tile's scores and softmax and share its P.V. Heads are the MMA's
M side, padded to 64 rows (H 8 / 16: one group, zero query rows, never written); query tokens cannot share a tile
since each gathers its own index row. Index entries are slot ids ``page * page_size + offset``; -1, ids outside
the pool and entries past the row are never read and score -inf; any topk >= 1.

Splits: an index row is cut over ``num_splits`` CTAs, each writing a normalized partial (o, lse base 2) that
the split merge (``kernels.split.merge.merge_splits``) combines by log-sum-exp in split order. The split count
that fills the GPU is one wave (``kernels.split.rows.wave_splits``): one CTA per SM (~200 KB of shared memory
each), so more splits would only add waves and a longer merge (H200: 0.124 ms at H128 topk 2048 B64 with 1
split, 0.163 with 3).

Numerics: bf16 queries only (an fp16 query is refused: its record, ``backends.capabilities.GLUON_SPARSE``); fp16
K, V and P, fp32 accumulation. The record pool must be contiguous over pages (slot s is record s).
"""
from __future__ import annotations

import triton

from .sparse_partitions import GLUON_IMPORT_ERROR, NUM_WARPS, REGS, SMEM_LIMIT, TILE, gluon, smem_bytes

REC_BYTES = 656        # fp8_ds_mla record: 512 e4m3 | 4 fp32 scales | 64 bf16 k_pe
DC, DK = 512, 64
HEAD_GROUP = 64        # heads per CTA (the wgmma M side)
MAX_HEADS = 128
LAST_COMPILED = None

__all__ = ["HEAD_GROUP", "MAX_HEADS", "SMEM_LIMIT", "sparse_mla", "smem_bytes"]


def sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, indices, out, lse, part_o, part_lse, *, sm_scale: float,
               num_splits: int, lse_scale: float) -> None:
    """Launch the Gluon sparse kernel (and the split merge when ``num_splits > 1``).

    q_nope ``[n, H, 512]`` / q_pe ``[n, H, 64]`` bf16 (last dim contiguous); ckv / kpe / scale_arr: the e4m3
    ``[P, page, 512]``, bf16 ``[P, page, 64]`` and fp32 ``[P, page, 4]`` views of one contiguous record pool
    (``MLASparseAttention._split_pool``; slot s = record s); indices int32 ``[n, topk]``; out ``[n, H, 512]`` bf16
    and lse ``[n, H]`` fp32 (any strides, last dim of out contiguous); part_o / part_lse fp32
    ``[>= n * splits, H(, 512)]`` contiguous when splitting (``kernels.split.rows.split_geometry`` gives the
    splits that run).
    """
    from ..decode import LOG2E
    from ..split.merge import merge_splits
    from ..split.rows import split_geometry
    from .sparse_partitions import sparse_mla_kernel
    if gluon is None:
        raise RuntimeError(f"the gluon sparse kernel needs triton.experimental.gluon: {GLUON_IMPORT_ERROR}")
    n, H, _ = q_nope.shape
    P, page, _ = ckv.shape
    topk = indices.shape[1]
    want = (page * REC_BYTES, REC_BYTES)
    if (page > 1 and ckv.stride(1) != want[1]) or (P > 1 and ckv.stride(0) != want[0]):
        # the kernel addresses record s at s x 656 bytes: a strided pool would read the wrong records silently
        raise ValueError(f"kv_cache: the gluon sparse kernel reads a contiguous record pool (slot s = record s, "
                         f"strides {want + (1,)}), got strides {tuple(ckv.stride())}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"num_heads: the gluon sparse kernel takes 1..{MAX_HEADS}, got {H}")
    if n == 0 or topk == 0:
        return
    chunk, num_splits = split_geometry(topk, num_splits, TILE)
    split = num_splits > 1
    po = part_o if split else out
    pl = part_lse if split else lse
    groups = triton.cdiv(H, HEAD_GROUP)
    global LAST_COMPILED  # registers / spills of the last launch, for the device check
    # the kernel's bundles (sparse_mla_kernel: the order of each tuple is the order its unpacking reads)
    inputs = (q_nope, q_pe, ckv, scale_arr, kpe, indices)
    results = (out, lse, po, pl)
    sizes = (sm_scale * LOG2E, lse_scale, H, P * page, topk, chunk, num_splits, groups)
    strides = (q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), indices.stride(0),
               out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), po.stride(0), po.stride(1), pl.stride(0))
    LAST_COMPILED = sparse_mla_kernel[(n * groups, num_splits)](inputs, results, sizes, strides, SPLIT=split,
                                                                REGS=REGS, num_warps=NUM_WARPS)
    if split:
        merge_splits(out, lse, part_o, part_lse, num_parts=num_splits, lse_scale=lse_scale)
