"""Each consumer's normalized partial of a work item (``_store_item``, Gluon). The split merge that combines a
request's partials (``launch_merge``) is every decode path's: ``kernels.split.merge``."""
from __future__ import annotations

from ..split.merge import launch_merge  # noqa: F401 - the launchers' merge
from .config import gluon

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
