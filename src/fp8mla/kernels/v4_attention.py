"""DeepSeek V4 attention over paged K = V pools: shared-KV MQA, two index segments, attention sinks.

One program owns (query token, head tile, split). A query token's keys are two segments, each over its own paged
pool and its own index row (global slots ``page * page_size + offset``, -1 = none, entries at or past the
segment's length ignored): the sliding window's slots, then the compressed rows' slots. A split is a contiguous
range of the two rows laid end to end. The program walks it ``BLOCK_N`` entries at a time, gathers the selected
512-value rows, dequantizes them in registers to bf16 and uses each row for both products:

    s = (q . k) * sm_scale          o = softmax([s, sink]) @ k     (the sink adds to the denominator only)

Formats (``FMT``, see ``fp8mla.formats_v4``): 0 bf16; 1 ``fp8_v4`` (448 e4m3 NoPE with one ue8m0 scale per 64,
64 bf16 RoPE, scales in rows at the end of the page); 2 ``fp8_v41`` (512 e4m3 with one ue8m0 scale per 32, per
token). e4m3 bits become fp16 by integer ops (``decode._bits_to_fp16``: value / 256, NaN kept; the same code on
every target, sm_80 included), times ``2^(e - 127) * 256`` from the scale byte's bits: exact in bf16, so the
MMAs are bf16 x bf16 with fp32 accumulation. An fp16 query is split into two bf16 parts (``Q_SPLIT``). Softmax in
fp32 with exp2; P is rounded to bf16 for the P.V MMA. Under the interpreter (``FP32_DOT``) the same rounded
operands are multiplied in fp32.

Masking: an entry that is -1, outside ``[0, num_slots)`` or at or past its segment's length is never loaded (a
NaN in an unselected slot never reaches the output) and scores -inf. The epilogue adds the sink ``exp(sink_h)``
to the denominator; a row with no valid entry gives out 0 and lse -inf, or with a sink out 0 and lse = the sink.

Splits: each split writes a normalized partial (o, lse base 2); with a sink, split 0 also writes the sink as one
more partial (o = 0, lse = sink * log2 e), and the split merge (``kernels.split.merge.merge_splits``) combines them all
by log-sum-exp in order: the sink lands in the denominator exactly as in the one-program epilogue. The default cut
splits the two padded rows laid end to end in ``num_splits`` equal ranges (chosen per call from its size). The
batch-invariant cut (``ROW_CUT``) follows the row alone: its ``len = window length + compressed length`` entries
(the compressed ones right after the window's last) in ``n = ceil(len / chunk)`` ranges of ``ceil(len / n)``
entries (the last the rest); the grid has the pieces of a full row, and programs past a shorter row's pieces write empty
partials (o 0, lse -inf: weight 0 in the merge).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .decode import LOG2E, _bits_to_fp16, _dot
from .softmax import softmax_step

FMT_BF16, FMT_V4, FMT_V41 = 0, 1, 2
D = 512


@triton.jit
def _load_rows(p8, p16, row, srow, ok, FMT: tl.constexpr):
    """[BLOCK_N, 512] bf16 keys of the selected tokens (masked rows are 0, never loaded)."""
    col = tl.arange(0, 512)
    if FMT == 0:
        k = tl.load(p16 + row[:, None] + col[None, :], mask=ok[:, None], other=0.0).to(tl.bfloat16)
    else:
        if FMT == 1:
            NQ: tl.constexpr = 448
            G: tl.constexpr = 64
        else:
            NQ: tl.constexpr = 512
            G: tl.constexpr = 32
        fm = ok[:, None] & (col < NQ)[None, :]
        b = tl.load(p8 + row[:, None] + col[None, :], mask=fm, other=0)
        v = _bits_to_fp16(b, 1).to(tl.float32)
        if FMT == 1:
            # one load of the row's 7 scale bytes, broadcast over their 64-value groups (triton 3.9: no spills
            # on sm_89/90a/120, 16 B on sm_80, against up to 96 B for a 512-wide gather of the bytes)
            NS: tl.constexpr = 512 // G
            g = tl.arange(0, NS)
            sb = tl.load(p8 + srow[:, None] + g[None, :], mask=ok[:, None] & (g < NQ // G)[None, :], other=0)
            sc = ((sb.to(tl.int32) + 8) << 23).to(tl.float32, bitcast=True)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [sc.shape[0], NS, G]), [sc.shape[0], 512])
        else:
            # fp8_v41's 16 bytes: the gathered form compiles with fewer spills than the broadcast one (8 vs 32 B
            # on sm_89, triton 3.9)
            sb = tl.load(p8 + srow[:, None] + (col // G)[None, :], mask=fm, other=0)
            sc = ((sb.to(tl.int32) + 8) << 23).to(tl.float32, bitcast=True)
        # sc = 2^(e - 127) from the byte's bits, times 256 for the fp16 conversion's value / 256
        k = v * sc
        if FMT == 1:
            rm = ok[:, None] & (col >= NQ)[None, :]
            r = tl.load(p16 + (row // 2 + 224)[:, None] + (col - NQ)[None, :], mask=rm, other=0.0)
            k = tl.where((col < NQ)[None, :], k, r.to(tl.float32))
        k = k.to(tl.bfloat16)
    return k


@triton.jit
def _segment(acc, m_i, l_i, qa, qb, p8, p16, stride_p, stride_s, scale_off, scale_stride, page_size, num_slots,
             idx_row, lo, hi, row_scale, FMT: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
             Q_SPLIT: tl.constexpr):
    """Entries ``[lo, hi)`` of one segment's index row into the running softmax state."""
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + j, mask=j < hi, other=-1)
        ok = (idx >= 0) & (idx < num_slots)
        safe = tl.where(ok, idx, 0)
        page = (safe // page_size).to(tl.int64)
        slot = (safe % page_size).to(tl.int64)
        row = page * stride_p + slot * stride_s
        srow = page * stride_p + scale_off + slot * scale_stride
        k = _load_rows(p8, p16, row, srow, ok, FMT)
        kt = tl.trans(k)
        s = _dot(qa, kt, tl.zeros([qa.shape[0], BLOCK_N], tl.float32), FP32_DOT)
        if Q_SPLIT:
            s = _dot(qb, kt, s, FP32_DOT)
        s = tl.where(ok[None, :], s * row_scale, float("-inf"))
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        acc = _dot(p.to(tl.bfloat16), k, acc * alpha[:, None], FP32_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _v4_attention_kernel(
    q, out, lse_out, part_o, part_lse, sinks,
    w8, w16, w_stride_p, w_stride_s, w_scale_off, w_scale_stride, w_page, w_slots, w_idx, w_stride_idx, w_topk,
    w_len,
    c8, c16, c_stride_p, c_stride_s, c_scale_off, c_scale_stride, c_page, c_slots, c_idx, c_stride_idx, c_topk,
    c_len,
    sm_scale_log2, lse_scale, H, chunk, num_splits, num_parts, num_head_tiles,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_po_i, stride_po_h,
    stride_pl_i,
    FMT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
    Q_SPLIT: tl.constexpr, HAS_W_LEN: tl.constexpr, HAS_C: tl.constexpr, HAS_C_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, ROW_CUT: tl.constexpr,
):
    t = tl.program_id(0) // num_head_tiles
    sp = tl.program_id(1)
    heads = (tl.program_id(0) % num_head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < H
    t64 = t.to(tl.int64)
    col = tl.arange(0, 512)
    q32 = tl.load(q + t64 * stride_q_t + heads[:, None] * stride_q_h + col[None, :], mask=row_ok[:, None],
                  other=0.0).to(tl.float32)
    if FP32_DOT:
        qa = q32
        qb = q32
    else:
        qa = q32.to(tl.bfloat16)
        qb = (q32 - qa.to(tl.float32)).to(tl.bfloat16)  # an fp16 query's low part (0 for bf16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    w_end = w_topk
    if HAS_W_LEN:
        w_end = tl.minimum(tl.maximum(tl.load(w_len + t), 0), w_topk)
    c_end = 0
    if HAS_C:
        c_end = c_topk
        if HAS_C_LEN:
            c_end = tl.minimum(tl.maximum(tl.load(c_len + t), 0), c_topk)
    if ROW_CUT:
        # the batch-invariant cut: the row's own entries (window then compressed, w_end + c_end of them) in
        # ceil(len / chunk) pieces of ceil(len / pieces) entries (the last the rest); split programs past them
        # write empty partials. Not rounded to whole BLOCK_N blocks: the compressed entries start anywhere in a
        # block anyway, and the rounding (the compiler then knows the alignment) spills 64 B on sm_80, 24 B without
        row_len = w_end + c_end
        pieces = tl.maximum(tl.cdiv(row_len, chunk), 1)
        per = tl.cdiv(row_len, pieces)
        j0 = sp * per
        j1 = tl.minimum(j0 + per, row_len)
        c_start = w_end    # the compressed entries follow the window's last one
    else:
        j0 = sp * chunk
        j1 = j0 + chunk
        c_start = w_topk   # the compressed entries follow the whole window row
    c_lo = tl.maximum(j0 - c_start, 0)   # both ranges fixed before the walk: two values live through it
    c_hi = tl.minimum(j1 - c_start, c_end)
    acc, m_i, l_i = _segment(acc, m_i, l_i, qa, qb, w8, w16, w_stride_p, w_stride_s, w_scale_off, w_scale_stride,
                             w_page, w_slots, w_idx + t64 * w_stride_idx, j0, tl.minimum(j1, w_end), sm_scale_log2,
                             FMT, BLOCK_N, FP32_DOT, Q_SPLIT)
    if HAS_C:
        acc, m_i, l_i = _segment(acc, m_i, l_i, qa, qb, c8, c16, c_stride_p, c_stride_s, c_scale_off,
                                 c_scale_stride, c_page, c_slots, c_idx + t64 * c_stride_idx, c_lo, c_hi,
                                 sm_scale_log2, FMT, BLOCK_N, FP32_DOT, Q_SPLIT)

    # -- epilogue: "no token" is l == 0 (out 0, lse -inf); NaN gave l = NaN and stays NaN ----------------------
    if HAS_SINK and not SPLIT:
        sk = tl.load(sinks + heads, mask=row_ok, other=0.0) * 1.4426950408889634
        m2 = tl.maximum(m_i, sk)
        m_use = tl.where(m2 == float("-inf"), 0.0, m2)
        a = tl.exp2(m_i - m_use)
        l_i = l_i * a + tl.exp2(sk - m_use)
        acc = acc * a[:, None]
        m_i = m2
    empty = l_i == 0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o = tl.where(empty[:, None], 0.0, acc * inv[:, None])
    if SPLIT:
        item = t64 * num_parts + sp
        tl.store(part_lse + item * stride_pl_i + heads, lse, mask=row_ok)
        tl.store(part_o + item * stride_po_i + heads[:, None].to(tl.int64) * stride_po_h + col[None, :], o,
                 mask=row_ok[:, None])
        if HAS_SINK:
            if sp == 0:  # the sink as one more partial: weight exp(sink), value 0
                sitem = t64 * num_parts + num_splits
                sk = tl.load(sinks + heads, mask=row_ok, other=0.0) * 1.4426950408889634
                tl.store(part_lse + sitem * stride_pl_i + heads, sk, mask=row_ok)
                tl.store(part_o + sitem * stride_po_i + heads[:, None].to(tl.int64) * stride_po_h + col[None, :],
                         tl.zeros([BLOCK_H, 512], tl.float32), mask=row_ok[:, None])
    else:
        tl.store(lse_out + t64 * stride_lse_t + heads * stride_lse_h, lse * lse_scale, mask=row_ok)
        tl.store(out + t64 * stride_o_t + heads[:, None] * stride_o_h + col[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None])


@dataclass
class Segment:
    """One index segment as the kernel reads it. ``p8``: the pool's bytes (uint8; a bf16 pool: unused, pass
    ``p16``), ``p16``: the same memory as bf16; ``stride_p`` / ``stride_s``: page and token strides (bytes for
    the FP8 formats, bf16 elements for bf16); ``scale_off`` / ``scale_stride``: the scale bytes of token ``s``
    at ``page * stride_p + scale_off + s * scale_stride``; ``indices`` int32 ``[n, topk]``; ``lengths`` int32
    ``[n]`` or None."""

    p8: object
    p16: object
    stride_p: int
    stride_s: int
    scale_off: int
    scale_stride: int
    page_size: int
    num_slots: int
    indices: object
    lengths: object = None


# Tiles per format (compiled for sm_80/89/90a/120 by tests/test_compile_v4.py, not yet timed on a GPU): 16 query
# heads (the MMA's smallest M) x BLOCK_N keys. The FP8 formats dequantize a [BLOCK_N, 512] tile in fp32
# registers: 16 keys a step keeps fp8_v4 (but 16 B on sm_80) spill-free at 4 warps and fp8_v41 at 8.
DEFAULT_TILES = {FMT_BF16: dict(block_h=16, block_n=32, num_warps=4),
                 FMT_V4: dict(block_h=16, block_n=16, num_warps=4),
                 FMT_V41: dict(block_h=16, block_n=16, num_warps=8)}


def launch_config(fmt: int, device, *, block_h: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Launch settings for format ``fmt`` (``DEFAULT_TILES``), any of them overridable."""
    import torch
    d = DEFAULT_TILES[fmt]
    cfg = dict(block_h=block_h or d["block_h"], block_n=block_n or d["block_n"],
               num_warps=num_warps or d["num_warps"], num_stages=num_stages or 1)
    for name in ("block_h", "block_n"):
        v = cfg[name]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {v}")
    cfg["fp32_dot"] = torch.device(device).type != "cuda"
    return cfg


def invariant_programs(topk: int, chunk: int) -> int:
    """Split programs a row in the batch-invariant cut: enough for the longest row (both index rows full), the
    shared ``split.rows.invariant_splits``, and at least one: a row without entries still has the program that
    writes its output (zeros and lse -inf, or the sink's)."""
    from .split.rows import invariant_splits
    return max(1, invariant_splits(topk, chunk))


def v4_attention(q, out, lse, part_o, part_lse, sinks, window: Segment, compressed: Segment | None, *, fmt: int,
                 sm_scale: float, num_splits: int, lse_scale: float, block_h: int, block_n: int, num_warps: int,
                 num_stages: int, fp32_dot: bool, invariant_chunk: int | None = None) -> None:
    """Launch the V4 kernel (and the split merge when ``num_splits > 1``).

    q ``[n, H, 512]`` bf16/fp16 (last dim contiguous); out ``[n, H, 512]`` (last dim contiguous), lse ``[n, H]``
    fp32; part_o ``[>= n * parts, H, 512]`` / part_lse ``[>= n * parts, H]`` fp32 contiguous when splitting,
    ``parts = num_splits + (sinks is not None)``; sinks fp32 ``[H]`` or None. ``lse_scale``: 1 (base 2) or ln 2.
    ``invariant_chunk`` (the batch-invariant cut, a multiple of ``block_n``): each row's own entries are cut in
    ``ceil(len / invariant_chunk)`` pieces (:func:`invariant_programs` programs a row; ``num_splits`` is ignored).
    """
    import torch
    n, H, _ = q.shape
    if n == 0:
        return
    topk_w = window.indices.shape[1]
    topk_c = compressed.indices.shape[1] if compressed is not None else 0
    from .split.merge import merge_splits
    from .split.rows import split_geometry
    if invariant_chunk is not None:
        chunk = invariant_chunk
        num_splits = invariant_programs(topk_w + topk_c, invariant_chunk)
    else:
        chunk, num_splits = split_geometry(topk_w + topk_c, num_splits, block_n)
    split = num_splits > 1
    has_sink = sinks is not None
    parts = num_splits + int(has_sink)
    c = compressed if compressed is not None else window
    po = part_o if split else out
    pl = part_lse if split else lse
    tiles = triton.cdiv(H, block_h)
    dummy_len = window.indices
    _v4_attention_kernel[(n * tiles, num_splits)](
        q, out, lse, po, pl, sinks if has_sink else lse,
        window.p8, window.p16, window.stride_p, window.stride_s, window.scale_off, window.scale_stride,
        window.page_size, window.num_slots, window.indices, window.indices.stride(0), topk_w,
        window.lengths if window.lengths is not None else dummy_len,
        c.p8, c.p16, c.stride_p, c.stride_s, c.scale_off, c.scale_stride, c.page_size, c.num_slots, c.indices,
        c.indices.stride(0), topk_c, c.lengths if c.lengths is not None else dummy_len,
        sm_scale * LOG2E, lse_scale, H, chunk, num_splits, parts, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        po.stride(0), po.stride(1), pl.stride(0),
        FMT=fmt, BLOCK_H=block_h, BLOCK_N=block_n, FP32_DOT=fp32_dot,
        Q_SPLIT=q.dtype == torch.float16 and not fp32_dot, HAS_W_LEN=window.lengths is not None,
        HAS_C=compressed is not None, HAS_C_LEN=compressed is not None and compressed.lengths is not None,
        HAS_SINK=has_sink, SPLIT=split, ROW_CUT=invariant_chunk is not None, num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        merge_splits(out, lse, part_o, part_lse, num_parts=parts, lse_scale=lse_scale)
