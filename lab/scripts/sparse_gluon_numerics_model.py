"""A torch model of kernels/sm90/sparse.py's arithmetic (not the kernel): K'_c = fp16(e4m3 x s / T) with T a power
of two >= the tile's largest scale, k_pe bf16, Q_nope16 = fp16(q x f_h), Q_pe' = bf16(q_pe x f_h / T), P' = fp16(p x
T / F), fp32 accumulation, bf16 output; its relative L2 error against the float64 reference per shape. Measured
(CPU): ~1.68e-3 at H 8..128, topk 128 / 2048 (the bf16 output rounding alone: 1.66e-3; the same with bf16 K and P:
~2.7e-3, against the device check's 3e-3 budget). Run: PYTHONPATH=src python lab/scripts/sparse_gluon_numerics_model.py
"""
import math, torch, fp8mla
from fp8mla.testing import make_sparse_batch, compare
fmt = fp8mla.formats.get_format("fp8_ds_mla", sparse_ok=True)
for H, topk, B in ((16, 2048, 4), (128, 128, 4), (64, 2048, 2), (8, 2048, 8)):
    b = make_sparse_batch([topk + 37] * B, [1] * B, H, topk, 64, "fp8_ds_mla", seed=H)
    r = b.run_args; ref_o, ref_l = b.reference()
    kv = r["kv_cache"]; P = kv.shape[0] * 64
    outs = []
    for t in range(B):
        idx = r["indices"][t].long(); ok = (idx >= 0) & (idx < P); safe = torch.where(ok, idx, 0)
        recs = kv.reshape(-1, 656)[safe]
        c8 = recs[:, :512].view(torch.float8_e4m3fn).float()
        sc = recs[:, 512:528].contiguous().view(torch.float32) * ok[:, None]
        kpe = recs[:, 528:].contiguous().view(torch.bfloat16).float() * ok[:, None]
        qn = r["q_nope"][t].float(); qp = r["q_pe"][t].float()
        amax = torch.maximum(qn.abs().amax(1), qp.abs().amax(1))
        f = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(16384.0 / amax))), 1.0)
        qn16 = (qn * f[:, None]).half().float()
        m = torch.full((H,), -math.inf); l = torch.zeros(H); o = torch.zeros(H, 512); F = 1.0; first = True
        for j in range(0, topk, 64):
            okj = ok[j:j+64]
            smax = sc[j:j+64].max().item()
            St = 2.0 ** math.ceil(math.log2(smax)) if smax > 0 else 1.0
            Kc = (torch.where(okj[:, None], c8[j:j+64], 0) * sc[j:j+64].repeat_interleave(128, 1) / St).half().float()
            qp_ = (qp * f[:, None] / St).bfloat16().float()
            sacc = qn16 @ Kc.T + qp_ @ kpe[j:j+64].T
            s = sacc * (St * b.plan_args["sm_scale"] * 1.4426950408889634) / f[:, None]
            s = torch.where(okj[None], s, -math.inf)
            mn = torch.maximum(m, s.max(1).values); mu = torch.where(mn == -math.inf, 0, mn)
            a = torch.exp2(m - mu); p = torch.exp2(s - mu[:, None]); l = l * a + p.sum(1); m = mn
            Fn = max(F, St)
            o = o * (a * F / Fn)[:, None] + (p * St / Fn).half().float() @ Kc[:, :512]
            F = Fn
        outs.append((o * F / l[:, None]).bfloat16())
    print(H, topk, B, compare(torch.stack(outs), ref_o))
