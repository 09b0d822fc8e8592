"""The split merge: one Triton kernel that combines the normalized partials (o, lse base 2) of every split-KV
decode path by log-sum-exp in a fixed order: the Triton dense kernel's and the Gluon dense builds' work items (a
list of partials per request, ``merge_requests`` / ``launch_merge``) and the sparse and V4 kernels' index-row
splits (``num_parts`` consecutive partials per query token, ``merge_splits``). Bit-identical reruns whichever
program takes a request. (The torch backend's merge is ``merge_torch.merge_chunks``.)

This file imports nothing of fp8mla (devtools compiles it by path)."""
from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _entry(m_list, i, UNIFORM: tl.constexpr):
    # the partial at list place i: the request's list entry, or the place itself (consecutive splits)
    if UNIFORM:
        return i.to(tl.int64)
    else:
        return tl.load(m_list + i).to(tl.int64)


@triton.jit
def _entries(m_list, idx, ok, UNIFORM: tl.constexpr):
    if UNIFORM:
        return tl.where(ok, idx, 0).to(tl.int64)
    else:
        return tl.load(m_list + idx, mask=ok, other=0).to(tl.int64)


SEQ_PARTS = 16   # requests with at most this many partials: the fixed sequential merge
# The batch-invariant mode's merge: every list merged by the sequential formula (its order and rounding follow the
# list alone; the chunked path's BLOCK_P-wide sums would follow the block size), with fixed block sizes.
SEQ_ALWAYS = 1 << 30
INVARIANT_BLOCKS = (16, 128)


@triton.jit
def _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, rblk, cblk, H, num_parts, lse_scale,
                 stride_o_t, stride_o_h, stride_o_c, stride_lse_t, stride_lse_h, stride_po_i, stride_po_r,
                 stride_pl_i, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, min_parts,
                 SEQ: tl.constexpr, UNIFORM: tl.constexpr):
    # Rows rblk * ROWS + [0, ROWS), columns of block cblk of request b (< batch_size); nothing when the rows are
    # past the request or it has fewer than min_parts partials (one guard, not returns: the caller loops)
    if UNIFORM:   # request b = query token b, one row per head, partials b * num_parts + [0, num_parts)
        q0 = b
        nrows = H
        i0 = b * num_parts
        i1 = i0 + num_parts
    else:
        q0 = tl.load(qo_indptr + b)
        nrows = (tl.load(qo_indptr + b + 1) - q0) * H
        i0 = tl.load(m_ptr + b)
        i1 = tl.load(m_ptr + b + 1)
    r0 = rblk * ROWS
    if (r0 < nrows) & (i1 - i0 >= tl.maximum(min_parts, 2)):
        r = r0 + tl.arange(0, ROWS)
        rok = r < nrows
        offs_c = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
        if i1 - i0 <= SEQ:
            # the first step's list entries (clamped into the list) before the max pass, later ones a step ahead:
            # each step's loads go out together
            pa = _entry(m_list, i0, UNIFORM)
            pb = _entry(m_list, tl.minimum(i0 + 1, i1 - 1), UNIFORM)
            pc = _entry(m_list, tl.minimum(i0 + 2, i1 - 1), UNIFORM)
            pd = _entry(m_list, tl.minimum(i0 + 3, i1 - 1), UNIFORM)
            m = tl.full([ROWS], float("-inf"), tl.float32)
            for i in range(i0, i1, BLOCK_P):
                idx = i + tl.arange(0, BLOCK_P)
                ok = idx < i1
                p = _entries(m_list, idx, ok, UNIFORM)
                lse2 = tl.load(part_lse + p[:, None] * stride_pl_i + r[None, :], mask=ok[:, None] & rok[None, :],
                               other=float("-inf"))
                m = tl.maximum(m, tl.max(lse2, axis=0))
            m_use = tl.where(m == float("-inf"), 0.0, m)   # all empty: weights 0, not NaN
            acc = tl.zeros([ROWS, BLOCK_C], tl.float32)
            wsum = tl.zeros([ROWS], tl.float32)
            for i in range(i0, i1, 4):
                na = _entry(m_list, tl.minimum(i + 4, i1 - 1), UNIFORM)
                nb = _entry(m_list, tl.minimum(i + 5, i1 - 1), UNIFORM)
                nc = _entry(m_list, tl.minimum(i + 6, i1 - 1), UNIFORM)
                nd = _entry(m_list, tl.minimum(i + 7, i1 - 1), UNIFORM)
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
                p = _entries(m_list, idx, ok, UNIFORM)
                lse_i = tl.load(part_lse + p[:, None] * stride_pl_i + r[None, :], mask=ok[:, None] & rok[None, :],
                                other=float("-inf"))
                m_new = tl.maximum(m_run, tl.max(lse_i, axis=0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                keep = tl.exp2(m_run - m_use)
                w = tl.exp2(lse_i - m_use[None, :])
                # (not masked by w > 0: the rows' loads go out with the lse loads instead of one latency after
                # them; a listed partial is always written, an empty one as o = 0, lse = -inf, weight 0)
                o = tl.load(part_o + p[:, None, None] * stride_po_i + r[None, :, None] * stride_po_r
                            + offs_c[None, None, :], mask=(ok[:, None] & rok[None, :])[:, :, None], other=0.0)
                acc = acc * keep[:, None] + tl.sum(w[:, :, None] * o, axis=0)
                wsum = wsum * keep + tl.sum(w, axis=0)
                m_run = m_new
        # no weight at all (every partial empty): 0 / -inf; a NaN weight is not empty: its row and lse stay NaN
        empty = wsum == 0
        den = tl.where(empty, 1.0, wsum)
        o = tl.where(empty[:, None], 0.0, acc / den[:, None])
        tok = (q0 + r // H).to(tl.int64)
        head = r % H
        tl.store(out + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_c[None, :] * stride_o_c,
                 o.to(out.dtype.element_ty), mask=rok[:, None] & (offs_c >= 0)[None, :])
        if cblk == 0:
            lse = tl.where(empty, float("-inf"), m_use + tl.log2(den))
            tl.store(lse_out + tok * stride_lse_t + head * stride_lse_h, lse * lse_scale, mask=rok)


@triton.jit
def _merge_parts_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H, num_parts,
                        lse_scale, stride_o_t, stride_o_h, stride_o_c, stride_lse_t, stride_lse_h, stride_po_i,
                        stride_po_r, stride_pl_i, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                        ROWS: tl.constexpr = 1, min_parts=2, SEQ: tl.constexpr = 16, UNIFORM: tl.constexpr = False):
    """out/lse of requests pid 0, pid 0 + G, ... < batch_size (G: the grid's first size), rows pid 1 * ROWS +
    [0, ROWS) (row = query token * H + head), columns of block pid 2: a log-sum-exp merge of each request's
    partials m_list[m_ptr[b]:m_ptr[b+1]] when it has at least ``min_parts`` (>= 2; fewer: written by the decode
    kernel itself). batch_size is read from device memory, so a captured launch replays after any re-plan.
    ``UNIFORM`` (index-row splits): request b is query token b (< G, the grid's first size) with H rows and the
    partials b * num_parts + [0, num_parts); qo_indptr, m_ptr, m_list and batch_size are not read.
    The lse written is lse (base 2) x ``lse_scale``. Deterministic, whichever program takes a request:

    * at most SEQ partials: one sequential formula: m =
      max lse (exact in any order), m_use = m or 0 when all are empty, then in list order w = exp2(lse - m_use),
      acc = fma(o, w, acc), wsum += w; out = acc / wsum, lse = m_use + log2(wsum) (wsum 0: out 0, lse -inf; a
      NaN lse makes the row's out and lse NaN);
      partials read 4 at a time. Its result follows the list alone (BLOCK_P, BLOCK_C and ROWS only group work).
    * more: BLOCK_P partials per step (one round trip to memory each), an online merge across the steps (many
      partials are merged in few round trips, B1 L32k's 132 splits in one); its sums follow BLOCK_P."""
    if UNIFORM:
        nb = tl.num_programs(0)
    else:
        nb = tl.load(batch_size)
    for b in range(tl.program_id(0), nb, tl.num_programs(0)):
        _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, tl.program_id(1),
                     tl.program_id(2), H, num_parts, lse_scale, stride_o_t, stride_o_h, stride_o_c, stride_lse_t,
                     stride_lse_h, stride_po_i, stride_po_r, stride_pl_i, BLOCK_P, BLOCK_C, ROWS, min_parts, SEQ,
                     UNIFORM)


def merge_blocks(max_parts: int, batch: int = 0, rows: int = 16, n_sm: int = 132, dc: int = 512) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the merge for requests of up to ``max_parts`` partials. More than SEQ_PARTS: the
    chunked path's sizes (all of a request's partials in one step when they fit 256, BLOCK_P x BLOCK_C <= 8192,
    one row per program). Else BLOCK_P covers the list (the max pass) and BLOCK_C is the widest column block
    (128..dc) that still gives >= 2 programs per SM with ``merge_tile``'s rows when ``batch`` (the real batch, if
    known) is given; any value is correct for any later plan (both paths loop)."""
    bp = min(256, max(2, 1 << (max(1, max_parts) - 1).bit_length()))
    if max_parts > SEQ_PARTS:
        return bp, min(dc, max(32, 8192 // bp))
    c = dc
    while c > 128 and batch and batch * -(-rows // max(1, 1024 // c)) * (dc // c) < 2 * n_sm:
        c //= 2
    return bp, c


def merge_tile(block_c: int) -> int:
    """Rows per merge program for column block ``block_c``: 1024 fp32 per program when the columns are the
    sequential path's (>= 128: 8 per thread, 4 partials in flight), one row for the chunked path's narrow blocks
    (its step already loads BLOCK_P x BLOCK_C)."""
    return max(1, 1024 // block_c) if block_c >= 128 else 1


# Programs per SM where none is measured (the interpreter; a triton without the compiled kernel's counts): the
# resident count of the (128, 64) merge on sm_90 (165 registers).
WAVES = 3
_RESIDENT: dict = {}


def resident_per_sm(kern, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(SMs, programs of ``kern`` one SM holds at once for these arguments: the fewest that its registers, rounded
    up to 8 per thread, its threads and its shared memory allow). Cached per device and configuration."""
    import torch
    dev = args[0].device
    key = (dev.type, dev.index, str(args[0].dtype), tuple(sorted(kwargs.items())))
    if key not in _RESIDENT:
        if dev.type != "cuda":
            _RESIDENT[key] = (1, WAVES)
            return _RESIDENT[key]
        props = torch.cuda.get_device_properties(dev)
        try:
            ck = kern.warmup(*args, grid=(1,), **kwargs)
            ck._init_handles()
            regs, smem = ck.n_regs, ck.metadata.shared
        except (AttributeError, TypeError):   # (interpreted, or internals renamed: the default count)
            _RESIDENT[key] = (props.multi_processor_count, WAVES)
            return _RESIDENT[key]
        threads = 32 * kwargs["num_warps"]
        fits = [props.regs_per_multiprocessor // (-(-max(1, regs) // 8) * 8 * threads),
                props.max_threads_per_multi_processor // threads, 32]
        if smem:
            fits.append(props.shared_memory_per_multiprocessor // smem)
        _RESIDENT[key] = (props.multi_processor_count, max(1, min(fits)))
    return _RESIDENT[key]


def merge_requests(out, lse, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, *, grid_batch: int,
                   max_rows: int, num_heads: int, block_p: int, block_c: int, min_parts: int = 2,
                   seq: int = SEQ_PARTS) -> None:
    """The merge of work-item partials (``_merge_parts_kernel``): request b (< ``batch_size[0]`` <= ``grid_batch``)
    merges ``part_o[m_list[m_ptr[b]:m_ptr[b+1]]]`` (rows = query token x num_heads + head, columns contiguous; lse
    base 2) into out ``[n, H, Dc]`` / lse ``[n, H]`` (any strides) when it has at least ``min_parts`` partials.
    ``seq``: the longest list merged by the sequential formula (``SEQ_ALWAYS``: every list, the batch-invariant
    mode). ``block_c`` is capped at the columns.

    The grid's first size is not ``grid_batch`` but at most one resident wave of programs: a CUDA-graph plan
    passes the wrapper's ``max_batch_size`` (256 by default), and one program per request slot that returns at
    once cost +0.15 ms at one request of 32k tokens and 128 heads on the H200 (262,144 programs for 1,024 that
    work); with a wave, each program walks requests g, g + G, ... and the count no longer grows with the slots.
    (Fewer would leave memory parallelism unused; more would start a second round of whole walks.)"""
    dc = part_o.shape[-1]
    block_c = min(block_c, dc)
    # (the chunked path's step holds BLOCK_P x ROWS x BLOCK_C: kept <= 8192 fp32, as the one-row merge had it)
    rows_blk = min(merge_tile(block_c), triton.next_power_of_2(max(1, max_rows)), max(1, 8192 // (block_p * block_c)))
    n_r, n_c = triton.cdiv(max_rows, rows_blk), dc // block_c
    args = (out, lse, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, num_heads, 0, 1.0,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), part_o.stride(0),
            part_o.stride(1), part_lse.stride(0))
    kw = dict(BLOCK_P=block_p, BLOCK_C=block_c, ROWS=rows_blk, min_parts=min_parts, SEQ=seq, num_warps=4)
    n_sm, waves = resident_per_sm(_merge_parts_kernel, args, kw)
    g = max(1, min(grid_batch, waves * n_sm // (n_r * n_c)))
    _merge_parts_kernel[(g, n_r, n_c)](*args, **kw)


def launch_merge(out, lse, t: dict, *, grid_batch: int, max_rows: int, num_heads: int, merge_p: int, merge_c: int,
                 min_parts: int = 2, seq: int = SEQ_PARTS) -> None:
    """:func:`merge_requests` of a Gluon plan's arrays: partials ``t["part_o"]`` / ``t["part_lse"]``, lists
    ``t["m_ptr"]`` / ``t["m_list"]``, requests ``t["qo_indptr"]`` / ``t["batch_size"]``; ``t["merge_seq"]``, where
    the plan sets it (the batch-invariant mode: ``SEQ_ALWAYS``), replaces ``seq``."""
    merge_requests(out, lse, t["part_o"], t["part_lse"], t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"],
                   grid_batch=grid_batch, max_rows=max_rows, num_heads=num_heads, block_p=merge_p, block_c=merge_c,
                   min_parts=min_parts, seq=t.get("merge_seq", seq))


def merge_splits(out, lse, part_o, part_lse, *, num_parts: int, lse_scale: float = 1.0,
                 block_p: int = INVARIANT_BLOCKS[0], block_c: int = INVARIANT_BLOCKS[1]) -> None:
    """The merge of index-row splits (sparse and V4 kernels): query token t's ``num_parts`` partials
    ``part_o[t * num_parts + s]`` ``[H, D]`` / ``part_lse[t * num_parts + s]`` ``[H]`` (fp32, lse base 2; rows
    and columns contiguous), merged in split order into out ``[n, H, D]`` / lse ``[n, H]`` (any strides), lse
    written x ``lse_scale`` (1: base 2, ln 2: base e). The block sizes are fixed by default: the merge of a token
    follows its split count only, never the call's token count."""
    n, H, dc = out.shape
    if n == 0 or num_parts < 2:
        return
    block_c = min(block_c, dc)
    rows_blk = min(merge_tile(block_c), triton.next_power_of_2(H), max(1, 8192 // (block_p * block_c)))
    _merge_parts_kernel[(n, triton.cdiv(H, rows_blk), dc // block_c)](
        out, lse, part_o, part_lse, part_lse, part_lse, part_lse, part_lse, H, num_parts, lse_scale,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), part_o.stride(0),
        part_o.stride(1), part_lse.stride(0),
        BLOCK_P=block_p, BLOCK_C=block_c, ROWS=rows_blk, min_parts=2, SEQ=SEQ_PARTS, UNIFORM=True, num_warps=4)
