"""Large-query error of the heads-on-M build against the wide build and the Triton kernel (same batches), to tell a
numerics defect of the new build from the fp16 rounding of Q that every fp8mla kernel shares. Queries x qmag over
[777, 64]-token batches (the GPU test's shape), several seeds; rel L2 of out against float64 per kernel.
Device:  PYTHONPATH=$PWD/src python3 lab/scripts/qmag_ab_device.py      (~1 min)"""
import torch

import fp8mla
from fp8mla.testing import compare, make_paged_batch

rows = []
for H in (128, 64):
    for qmag in (1.0, 30.0, 300.0):
        for seed in range(6):
            b = make_paged_batch([777, 64], [1, 1], H, 64, "fp8_e4m3", device="cuda", seed=int(H + qmag) + 1000 * seed,
                                 ckv_scale=0.05, kpe_scale=0.02)
            for key in ("q_nope", "q_pe"):
                b.run_args[key] = (b.run_args[key].float() * qmag).to(b.run_args[key].dtype)
            ref, _ = b.reference()
            errs = {}
            for name, kw in (("mh", dict(backend="gluon", heads_on_m=True)), ("wide", dict(backend="gluon", heads_on_m=False)),
                             ("triton", dict(backend="triton"))):
                try:
                    a = fp8mla.MLAPagedAttention(**kw)
                    a.plan(**b.plan_args)
                    n, h, d = b.run_args["q_nope"].shape
                    out = torch.full((n, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
                    a.run(**b.run_args, out=out)
                    errs[name] = compare(out, ref).rel_l2
                except Exception as e:  # noqa: BLE001
                    errs[name] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append((H, qmag, seed, errs))
            print(f"H{H} q x {qmag:g} seed {seed}: " + "  ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in errs.items()), flush=True)
