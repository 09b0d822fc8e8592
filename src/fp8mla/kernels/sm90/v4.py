"""Hopper (sm_90a) DeepSeek V4 attention in Gluon over ``fp8_v4`` / ``fp8_v41`` / ``bf16`` pools: the host side
(plan check, split policy, launch). The kernel and its four warp-specialized partitions are in
``v4_partitions.py``.

One CTA per (query token, 64-head group, split), 16 warps (the sparse build's scheme, ``sparse.py``): two
converter warpgroups gather the selected rows of a 64-entry tile with cp.async and dequantize them once into bf16
NVMMA slabs; two consumer warpgroups alternate as the owner of a tile's scores and softmax and share its P.V over
the whole 512-value row (V = K, RoPE columns included). Heads are the MMA's M side, padded to 64 rows (H 8 / 16:
one group, zero query rows, never written). A token's entries are its window segment, then its compressed
segment, each padded to whole tiles; a split walks a contiguous range of those tiles and writes a normalized
partial that the split merge (``kernels/split/merge.merge_splits``) combines by log-sum-exp in split order (with
a sink, split 0 also writes the sink as one more partial).

Numerics: bf16 queries only (fp16 is refused: ``supports``); bf16 K = V (exact for every format) and P, fp32
accumulation and softmax. Each pool is addressed as ``page * page stride + offset * record``: any page stride
that is a multiple of 4 bytes (fp8mla's and vLLM's pools have such pages).
"""
from __future__ import annotations

import triton

from .v4_partitions import (FMT_BF16, FMT_V4, FMT_V41, GLUON_IMPORT_ERROR, NUM_WARPS, REGS, SMEM_LIMIT, TILE,
                            gluon, smem_bytes)

# backend="auto" picks this build on Hopper for every plan it takes (its record: backends.capabilities.GLUON_V4).
# Compiled and its SASS checked (tests/test_compile_v4_gluon.py); its GPU check is tests/test_v4_gluon.py.

HEAD_GROUP = 64        # heads per CTA (the wgmma M side)
MAX_HEADS = 128
FORMATS = {"bf16": FMT_BF16, "fp8_v4": FMT_V4, "fp8_v41": FMT_V41}
LOG2E = 1.4426950408889634
LAST_COMPILED = None

__all__ = ["FORMATS", "HEAD_GROUP", "MAX_HEADS", "SMEM_LIMIT", "smem_bytes", "pool_pointers", "supports",
           "tile_splits", "tiles_of", "v4_attention"]


def supports(num_heads: int, fmt_name: str, q_dtype_name: str) -> tuple[bool, str]:
    """(ok, why not) for a plan on this build."""
    if fmt_name not in FORMATS:
        return False, f"kv_format: the gluon V4 build reads {sorted(FORMATS)}, got {fmt_name!r}"
    if q_dtype_name != "bfloat16":
        return False, f"q_data_type: the gluon V4 build takes bfloat16 queries, got {q_dtype_name}"
    if not 1 <= num_heads <= MAX_HEADS:
        return False, f"num_heads: the gluon V4 build takes 1..{MAX_HEADS}, got {num_heads}"
    return True, ""


def tiles_of(window_topk: int, compressed_topk: int) -> tuple[int, int]:
    """(window tiles, all tiles) of a token's row: each segment padded to whole 64-entry tiles."""
    w = -(-window_topk // TILE)
    return w, w + -(-compressed_topk // TILE)


def tile_splits(total_tiles: int, num_splits: int) -> tuple[int, int]:
    """(chunk, splits): tiles a split walks and the splits that are not empty, the shared rule
    (``kernels.split.rows.split_geometry``) over the row's entries in whole tiles. The split count itself: one wave
    of one CTA per SM (``kernels.split.rows.wave_splits`` over head groups of ``HEAD_GROUP``, ``backends.v4_gluon``)
    or the plan's."""
    from ..split.rows import split_geometry
    chunk, splits = split_geometry(total_tiles * TILE, num_splits, TILE)
    return chunk // TILE, splits


def pool_pointers(view, kind: int):
    """(e4m3, bf16, int32 views of the same bytes, page stride in 16-byte units) of a pool's page view (uint8
    ``[P, page_bytes]`` for the FP8 formats, bf16 ``[P, page, 512]`` for bf16: ``formats_v4.pool_geometry``). The
    kernel reads record bytes, 16-byte pieces and scale words at their offsets from these bases."""
    import torch
    if kind == FMT_BF16:
        if view.shape[1] > 1 and view.stride(1) != 512:
            raise ValueError(f"pool: the gluon V4 kernel reads bf16 rows 1024 bytes apart, got strides "
                             f"{tuple(view.stride())}")
        b8, stride_bytes = view.view(torch.uint8), view.stride(0) * 2
    else:
        b8, stride_bytes = view, view.stride(0)
    if view.shape[0] == 1:
        stride_bytes = 0   # one page: its stride is never used
    if stride_bytes % 16 or view.data_ptr() % 16:
        raise ValueError(f"pool: the gluon V4 kernel needs a 16-byte aligned pool with pages 16-byte apart, got a "
                         f"page stride of {stride_bytes} bytes at address {view.data_ptr():#x}")
    return b8.view(torch.float8_e4m3fn), b8.view(torch.bfloat16), b8.view(torch.int32), stride_bytes // 16


def v4_attention(q, out, lse, part_o, part_lse, sinks, window, compressed, *, fmt: int, sm_scale: float,
                 num_splits: int, lse_scale: float) -> None:
    """Launch the Gluon V4 kernel (and the split merge when it splits).

    q ``[n, H, 512]`` bf16 (last dim contiguous); out ``[n, H, 512]`` bf16 (last dim contiguous); lse ``[n, H]``
    fp32; window / compressed: ``backends.v4_gluon``'s segments (``view``, ``page_size``, ``num_pages``,
    ``indices`` int32 ``[n, topk]`` with a contiguous last dim, ``lengths`` int32 ``[n]`` or None; compressed None
    for a layer without compressed rows); part_o / part_lse fp32 ``[>= n * parts, H(, 512)]`` contiguous when
    splitting, ``parts = splits + (sinks is not None)`` (``tile_splits`` gives the splits that run).
    """
    from ..split.merge import merge_splits
    if gluon is None:
        raise RuntimeError(f"the gluon V4 kernel needs triton.experimental.gluon: {GLUON_IMPORT_ERROR}")
    from .v4_partitions import v4_attention_kernel
    n, H, _ = q.shape
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"num_heads: the gluon V4 kernel takes 1..{MAX_HEADS}, got {H}")
    if n == 0:
        return
    w_topk = window.indices.shape[1]
    c_topk = compressed.indices.shape[1] if compressed is not None else 0
    w_tiles, total = tiles_of(w_topk, c_topk)
    chunk, num_splits = tile_splits(total, num_splits)
    split = num_splits > 1
    has_sink = sinks is not None
    parts = num_splits + int(has_sink)
    c = compressed if compressed is not None else window
    w8, w16, w32, w_stride = pool_pointers(window.view, fmt)
    c8, c16, c32, c_stride = pool_pointers(c.view, fmt) if compressed is not None else (w8, w16, w32, w_stride)
    po = part_o if split else out
    pl = part_lse if split else lse
    groups = triton.cdiv(H, HEAD_GROUP)
    dummy = window.indices
    global LAST_COMPILED  # registers / spills of the last launch, for the device check
    # the kernel's bundles (v4_attention_kernel unpacks each in this order)
    LAST_COMPILED = v4_attention_kernel[(n * groups, num_splits)](
        (q, out, lse, po, pl, sinks if has_sink else lse),
        (w8, w16, w32, w_stride, window.page_size, window.num_pages * window.page_size, window.indices,
         window.indices.stride(0), w_topk, window.lengths if window.lengths is not None else dummy),
        (c8, c16, c32, c_stride, c.page_size, c.num_pages * c.page_size, c.indices, c.indices.stride(0), c_topk,
         c.lengths if compressed is not None and c.lengths is not None else dummy),
        (sm_scale * LOG2E, lse_scale, H, chunk, num_splits, parts, groups, w_tiles, total),
        (q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
         po.stride(0), po.stride(1), pl.stride(0)),
        FMT=fmt, HAS_W_LEN=window.lengths is not None,
        HAS_C_LEN=compressed is not None and compressed.lengths is not None, HAS_SINK=has_sink, SPLIT=split,
        REGS=REGS, num_warps=NUM_WARPS,
    )
    if split:
        merge_splits(out, lse, part_o, part_lse, num_parts=parts, lse_scale=lse_scale)
