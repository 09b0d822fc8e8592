"""Each consumer's normalized partial of a work item (``_store_item``, Gluon), and the split merge that combines a
request's partials by log-sum-exp in a fixed order (``_merge_parts_kernel``, Triton; bit-identical reruns)."""
from __future__ import annotations

import triton
import triton.language as tl

from .config import DC, gluon

if gluon is not None:
    from .config import gl
    from .fragments import _per_item

    @gluon.jit
    def _store_item(acc, m_use, l_i, ckv_scale, item, rows, outputs, mma: gl.constexpr, HPW: gl.constexpr,
                    MTP: gl.constexpr):
        # One consumer's normalized (o, lse base 2) for heads h0 + hcol: the final out/lse when the item is the
        # whole request, else the item's fp32 partial (the merge kernel combines a request's partials).
        # An empty state (l = 0) writes o = 0, lse = -inf. acc: the 8 O^T chunks; item: (it, t0, t1, L, qtok);
        # rows: (h0, H, nrows); outputs: the kernel's bundle (kernel.py)
        o0, o1, o2, o3, o4, o5, o6, o7 = acc
        it, t0, t1, L, qtok = item
        h0, H, nrows = rows
        (out, lse_out, part_o, part_lse, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
         stride_pl_i) = outputs
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
def _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, rblk, cblk, H,
                 stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, min_parts, SEQ: tl.constexpr):
    # Rows rblk * ROWS + [0, ROWS), columns of block cblk of request b (< batch_size); nothing when the rows are
    # past the request or it has fewer than min_parts partials (one guard, not returns: the caller loops)
    q0 = tl.load(qo_indptr + b)
    nrows = (tl.load(qo_indptr + b + 1) - q0) * H
    r0 = rblk * ROWS
    i0 = tl.load(m_ptr + b)
    i1 = tl.load(m_ptr + b + 1)
    if (r0 < nrows) & (i1 - i0 >= tl.maximum(min_parts, 2)):
        r = r0 + tl.arange(0, ROWS)
        rok = r < nrows
        offs_c = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
        if i1 - i0 <= SEQ:
            # the first step's list entries (clamped into the list) before the max pass, later ones a step ahead:
            # each step's loads go out together
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
                # (not masked by w > 0: the rows' loads go out with the lse loads instead of one latency after
                # them; a listed partial is always written, an empty one as o = 0, lse = -inf, weight 0)
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
        if cblk == 0:
            tl.store(lse_out + tok * stride_lse_t + head, tl.where(seen, m_use + tl.log2(den), float("-inf")),
                     mask=rok)


@triton.jit
def _merge_parts_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H,
                        stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr = 1, min_parts=2,
                        SEQ: tl.constexpr = 16):
    """out/lse of requests pid 0, pid 0 + G, ... < batch_size (G: the grid's first size), rows pid 1 * ROWS +
    [0, ROWS) (row = query token * H + head), columns of block pid 2: a log-sum-exp merge of each request's
    partials m_list[m_ptr[b]:m_ptr[b+1]] when it has at least ``min_parts`` (>= 2; fewer: written by the decode
    kernel itself). batch_size is read from device memory, so a captured launch replays after any re-plan.
    Deterministic, whichever program takes a request:

    * at most SEQ partials: one sequential formula: m =
      max lse (exact in any order), m_use = m or 0 when all are empty, then in list order w = exp2(lse - m_use),
      acc = fma(o, w, acc), wsum += w; out = acc / wsum, lse = m_use + log2(wsum) (wsum 0: out 0, lse -inf);
      partials read 4 at a time.
    * more: BLOCK_P partials per step (one round trip to memory each), an online merge across the steps (the
      original formula: many partials are merged in few round trips, B1 L32k's 132 splits in one)."""
    for b in range(tl.program_id(0), tl.load(batch_size), tl.num_programs(0)):
        _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, tl.program_id(1),
                     tl.program_id(2), H, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
                     stride_pl_i, BLOCK_P, BLOCK_C, ROWS, min_parts, SEQ)


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


def launch_merge(out, lse, t: dict, *, grid_batch: int, max_rows: int, num_heads: int, merge_p: int, merge_c: int,
                 min_parts: int = 2) -> None:
    """The split merge (``_merge_parts_kernel``) of the partials a decode launch wrote into ``t["part_o"]`` /
    ``t["part_lse"]`` (rows = query token x num_heads + head, lse base 2): every request of at least
    ``min_parts`` partials, of the ``t["batch_size"]`` (<= ``grid_batch``) the plan holds.

    The grid's first size is not ``grid_batch`` but at most one resident wave of programs: a CUDA-graph plan
    passes the wrapper's ``max_batch_size`` (256 by default), and one program per request slot that returns at
    once cost +0.15 ms at one request of 32k tokens and 128 heads on the H200 (262,144 programs for 1,024 that
    work); with a wave, each program walks requests g, g + G, ... and the count no longer grows with the slots.
    (Fewer would leave memory parallelism unused; more would start a second round of whole walks.)"""
    po, pl = t["part_o"], t["part_lse"]
    # (the chunked path's step holds BLOCK_P x ROWS x BLOCK_C: kept <= 8192 fp32, as the one-row merge had it)
    rows_blk = min(merge_tile(merge_c), triton.next_power_of_2(max_rows), max(1, 8192 // (merge_p * merge_c)))
    n_r, n_c = triton.cdiv(max_rows, rows_blk), DC // merge_c
    args = (out, lse, po, pl, t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], num_heads,
            out.stride(0), out.stride(1), lse.stride(0), po.stride(0), po.stride(1), pl.stride(0))
    kw = dict(BLOCK_P=merge_p, BLOCK_C=merge_c, ROWS=rows_blk, min_parts=min_parts, SEQ=SEQ_PARTS, num_warps=4)
    n_sm, waves = resident_per_sm(_merge_parts_kernel, args, kw)
    g = max(1, min(grid_batch, waves * n_sm // (n_r * n_c)))
    _merge_parts_kernel[(g, n_r, n_c)](*args, **kw)
