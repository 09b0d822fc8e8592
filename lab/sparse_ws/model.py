"""A CPU torch model of the sparse prototype's arithmetic and index handling (its kernel.py, now the product's
``kernels/sm90/sparse_partitions.py``; the prototype at commit 80896ec), against the float64 reference.

It follows the kernel step by step per (token, 64-head group, split), vectorized over tokens and heads: the split
geometry (``fp8mla.kernels.sm90.sparse.split_geometry``), entry validity (-1, out of the pool, past the split's end), the per-token
scale T_t (exponent bits), the converter's fp16(fp16(e4m3) x fp16(s_g / T_t)) and bf16(k_pe / T_t), Q x f in
fp16 / bf16, fp32 scores x row scale x T_t, the owner's online softmax with F folded into the exponent, P' =
fp16((p / F) x T_t), fp32 P'.V, the epilogue O / l (bf16, or fp32 partials and a log-sum-exp merge in split order).
``per_tile=True`` models the product's current build instead (one T per tile, fp32 product rounded once,
P x T / F), to compare the two schemes' error. What it does not model: fp32 accumulation order inside the MMAs
(float64 here, then rounded to fp32) and MUFU ex2's approximation.

    python lab/sparse_ws/model.py      # prints rel L2 vs float64 for H 8, 16, 64, 128 (both schemes)
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))
from fp8mla.kernels.sm90.sparse import split_geometry  # noqa: E402  (importable without Gluon)

LOG2E = 1.4426950408889634


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    b = x.float().contiguous().view(torch.int32)
    t = ((b + 0x007FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(x > 0, t, torch.ones_like(t))


def model_sparse_ws(q_nope, q_pe, pool, indices, *, sm_scale: float, num_splits: int, per_tile: bool = False):
    """(out bf16 [n, H, 512], lse fp32 [n, H] base 2) as the kernel computes them. pool: uint8 [P, page, 656]."""
    n, H, _ = q_nope.shape
    P, page, _ = pool.shape
    num_slots = P * page
    recs = pool.reshape(num_slots, 656)
    vals = recs[:, :512].contiguous().view(torch.float8_e4m3fn)           # [slots, 512]
    scl = recs[:, 512:528].contiguous().view(torch.float32)               # [slots, 4]
    kpe = recs[:, 528:].contiguous().view(torch.bfloat16)                 # [slots, 64]
    topk = indices.shape[1]
    chunk, splits = split_geometry(topk, num_splits)
    # Q: per-head power of two f, largest |q| near 2^14
    qn, qp = q_nope.float(), q_pe.float()
    amax = torch.maximum(qn.abs().amax(-1), qp.abs().amax(-1))
    f = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(16384.0 / amax))), torch.ones_like(amax))
    qn16 = (qn * f[..., None]).half().double()                             # [n, H, 512]
    qpb = (qp * f[..., None]).bfloat16().double()
    row_scale = (sm_scale * LOG2E / f).float()                             # [n, H]
    parts_o, parts_l = [], []
    for sp in range(splits):
        j0, j1 = sp * chunk, min(sp * chunk + chunk, topk)
        m = torch.full((n, H), -math.inf)
        F = torch.zeros(n, H)
        l = torch.zeros(n, H)
        O = torch.zeros(n, H, 512)
        for j in range(j0, j1, 64):
            e = torch.arange(j, j + 64)
            idx = torch.where(e[None, :] < j1, indices[:, e.clamp(max=topk - 1)].long(), torch.full((n, 64), -1))
            ok = (idx >= 0) & (idx < num_slots)
            rec = torch.where(ok, idx, 0)
            s4 = torch.where(ok[..., None], scl[rec], 0.0)                   # zero-filled when not valid
            x = torch.where(ok[..., None], vals[rec].float(), 0.0)         # [n, 64, 512] e4m3 values
            kp = torch.where(ok[..., None], kpe[rec].float(), 0.0)
            if per_tile:
                tmax = s4.amax(dim=(1, 2))                                   # [n]
                T = torch.where(tmax > 0, _pow2_ceil(tmax), torch.where(F[:, 0] > 0, F[:, 0], 1.0))
                T = T[:, None].expand(n, 64)
                ratio = s4 / T[..., None]                                   # fp32
                K = (x * ratio.repeat_interleave(128, -1)).half().double()
                Kp = kp.double()
                qpe_t = (qpb / T[:, :1, None].double()).bfloat16().double()  # q_pe x f / T in bf16
                S = torch.einsum("nhd,ntd->nht", qn16, K) + torch.einsum("nhd,ntd->nht", qpe_t, Kp)
                S = S.float() * T[:, None, :] * row_scale[..., None]
            else:
                T = _pow2_ceil(s4.amax(-1))                                  # [n, 64]
                ratio = (s4 / T[..., None]).half()                          # fp16(s_g / T_t)
                K = (x.half() * ratio.repeat_interleave(128, -1)).double()  # fp16 x fp16 -> fp16 (HMUL2)
                K = K.half().double()
                Kp = (kp / T[..., None]).bfloat16().double()                # exact
                S = torch.einsum("nhd,ntd->nht", qn16, K) + torch.einsum("nhd,ntd->nht", qpb, Kp)
                S = S.float() * row_scale[..., None] * T[:, None, :]
            Tv = torch.where(ok, T, 0.0)                                     # tv: 0 = not valid
            S = torch.where((Tv > 0)[:, None, :], S, -math.inf)
            m_new = torch.maximum(m, S.amax(-1))
            if per_tile:
                # the product's build: P x T / F, alpha x F_old / F_new
                m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                p = torch.exp2(S - m_use[..., None])
                alpha = torch.exp2(m - m_use)
                l = l * alpha + p.sum(-1)
                f_new = torch.maximum(F, T[:, :1].expand(n, H))
                Pp = (p * (T[:, None, :] / f_new[..., None])).half().double()
                alpha = alpha * torch.where(f_new > 0, F / f_new, 0.0)
                O = O * alpha[..., None] + torch.einsum("nht,ntd->nhd", Pp, K).float()
                F, m = f_new, m_new
                continue
            f_new = torch.maximum(F, Tv.amax(-1)[:, None].expand(n, H))
            lgf = lambda v: torch.log2(torch.where(v > 0, v, 1.0))           # exact for powers of two
            m_e = torch.where(m_new == -math.inf, 0.0, m_new) + lgf(f_new)
            p = torch.exp2(S - m_e[..., None])                               # p / F
            alpha = torch.exp2(m + lgf(F) - m_e)
            l = l * alpha + p.sum(-1)
            Pp = (p * Tv[:, None, :]).half().double()
            O = O * alpha[..., None] + torch.einsum("nht,ntd->nhd", Pp, K).float()
            m, F = m_new, f_new
        empty = l == 0
        if per_tile:
            inv = torch.where(empty, 0.0, F / torch.where(empty, 1.0, l))
            lse = torch.where(empty, -math.inf, m + torch.log2(torch.where(empty, 1.0, l)))
        else:
            inv = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, l))
            lgF = torch.log2(torch.where(F > 0, F, 1.0))
            lse = torch.where(empty, -math.inf, m + lgF + torch.log2(torch.where(empty, 1.0, l)))
        parts_o.append(O * inv[..., None])
        parts_l.append(lse)
    if splits == 1:
        return parts_o[0].bfloat16(), parts_l[0]
    # the product's merge: log-sum-exp over the splits, in order
    L = torch.stack(parts_l)                                                 # [S, n, H]
    mx = L.amax(0)
    mx_use = torch.where(mx == -math.inf, 0.0, mx)
    w = torch.exp2(L - mx_use)
    tot = w.sum(0)
    o = sum(w[k][..., None] * parts_o[k] for k in range(splits))
    o = torch.where(tot[..., None] > 0, o / torch.where(tot > 0, tot, 1.0)[..., None], 0.0)
    lse = torch.where(tot > 0, mx_use + torch.log2(torch.where(tot > 0, tot, 1.0)), -math.inf)
    return o.bfloat16(), lse


def _cases():
    # (H, topk, tokens, splits, seed)
    return [(8, 2048, 4, 1, 1), (16, 2048, 4, 3, 2), (64, 2048, 2, 2, 3), (128, 2048, 2, 1, 4), (16, 1000, 3, 3, 5),
            (64, 129, 3, 2, 6), (8, 37, 2, 1, 7)]


def run(verbose: bool = True) -> list[dict]:
    from fp8mla.testing import compare, make_sparse_batch
    res = []
    for H, topk, B, splits, seed in _cases():
        b = make_sparse_batch([topk + 37] * B, [1] * B, H, topk, 64, "fp8_ds_mla", pad="scattered", seed=seed,
                              selected=lambda b_, i: topk - 3 * b_ if b_ else min(topk, topk + 37))
        r = b.run_args
        r["indices"][0, 0] = r["kv_cache"].shape[0] * 64 + 3                # out of the pool
        if B >= 3:
            r["indices"][B - 1] = -1                                         # no token: out 0, lse -inf
        ref_o, ref_l = b.reference()
        row = {"H": H, "topk": topk, "tokens": B, "splits": splits}
        for name, pt in (("ws", False), ("current", True)):
            o, l = model_sparse_ws(r["q_nope"], r["q_pe"], r["kv_cache"], r["indices"],
                                   sm_scale=b.plan_args["sm_scale"], num_splits=splits, per_tile=pt)
            c, cl = compare(o, ref_o), compare(l, ref_l)
            row[name] = {"rel_l2": c.rel_l2, "nan_mismatch": c.nan_mismatch, "lse_rel_l2": cl.rel_l2}
        # the bf16 rounding of the exact output alone (the floor any bf16-output kernel has)
        row["bf16_floor"] = compare(ref_o.bfloat16(), ref_o).rel_l2
        res.append(row)
        if verbose:
            print(f"H{H:<4} topk {topk:<5} tokens {B} splits {splits}: ws rel L2 {row['ws']['rel_l2']:.3e} "
                  f"(lse {row['ws']['lse_rel_l2']:.1e}, NaN mismatches {row['ws']['nan_mismatch']}); current "
                  f"build's scheme {row['current']['rel_l2']:.3e}; bf16 rounding alone {row['bf16_floor']:.3e}",
                  flush=True)
    return res


if __name__ == "__main__":
    run()
