"""fp8_math's error budget measured on a grid: MLAPagedAttention(fp8_math=True) against the
float64 reference, and the default kernel on the same batches, over NaN-poisoned shuffled pools.

    PYTHONPATH=$PWD/src python3 scripts/fp8math_device.py [--out DIR]

Grid: H 16 / 128 x page 1 / 64 x values N(0, 1) and 4 N(0, 1) (peaked attention) with scales 1 or .05 / .02, every
request length of the attention grid (0, 1, 17, 33, 96, 97, 114, 514) plus 4097, one NaN page past each request's
pages; then H 8 (fp16 queries), H 40 (page 16), MTP (H16 qo 1-4 mixed, H128 qo 2), B1 L32k (many splits). Per
case: rel L2 of out, max |lse error|, NaN, queries that see no token (out 0, lse -inf), bit-identical rerun (the
default kernel on the grid cases only: each build compiles once per process).
Prints one line per case and the grid's maxima; exit 1 if fp8_math breaks its budget (rel L2 2e-2) anywhere or
any structural check fails. Writes DIR/fp8math.json."""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

import fp8mla
from fp8mla.testing import compare, make_paged_batch

BUDGET = 2e-2
KV_LENS = [0, 1, 17, 33, 96, 97, 114, 514, 4097]


def run_case(name, lens, qo, H, page, *, q_dtype=torch.bfloat16, value=1.0, scales=(1.0, 1.0), seed=0,
             default=True):
    b = make_paged_batch(lens, qo, H, page, "fp8_e4m3", device="cuda", seed=seed, q_dtype=q_dtype,
                         value_scale=value, ckv_scale=scales[0], kpe_scale=scales[1], extra_pages=1)
    ref_out, ref_lse = b.reference()
    fin = torch.isfinite(ref_lse).cpu()
    row = dict(case=name)
    for tag, kw in (("default", {}), ("fp8_math", dict(fp8_math=True)))[0 if default else 1:]:
        attn = fp8mla.MLAPagedAttention(backend="gluon", **kw)
        attn.plan(**b.plan_args)
        n = sum(qo)
        out = torch.full((n, H, 512), math.nan, dtype=q_dtype, device="cuda")
        lse = torch.full((n, H), math.nan, device="cuda")
        attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
        o2, l2 = attn.run(**b.run_args, return_lse=True)
        torch.cuda.synchronize()
        c = compare(out, ref_out)
        lerr = float((lse.double().cpu() - ref_lse.double().cpu())[fin].abs().max()) if fin.any() else 0.0
        lmax = float(ref_lse.double().cpu()[fin].abs().max()) if fin.any() else 0.0   # (relative: / max(lmax, 8))
        ok_struct = (not torch.isnan(out).any() and not torch.isnan(lse).any()
                     and torch.equal(torch.isfinite(lse).cpu(), fin) and bool((out.cpu()[~fin] == 0).all())
                     and torch.equal(o2, out) and torch.equal(l2, lse))
        row[tag] = dict(rel_l2=c.rel_l2, lse_err=lerr, lse_rel=lerr / max(lmax, 8.0), struct_ok=bool(ok_struct))
    f = row["fp8_math"]
    d = row.get("default", dict(rel_l2=float("nan"), lse_err=float("nan"), struct_ok=True))
    row["ok"] = f["struct_ok"] and d["struct_ok"] and f["rel_l2"] <= BUDGET and not d["rel_l2"] > 3e-3
    print(f"{'ok ' if row['ok'] else 'BAD'} {name:44s} fp8_math rel {f['rel_l2']:.2e} lse {f['lse_err']:.1e} "
          f"({f['lse_rel']:.1e} of max |lse|) | "
          f"default rel {d['rel_l2']:.2e} lse {d['lse_err']:.1e} | struct {f['struct_ok']}/{d['struct_ok']}",
          flush=True)
    return row


def main() -> int:
    if not torch.cuda.is_available():
        print("fp8math_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    t0 = time.time()
    rows = []
    seed = 0
    for H in (16, 128):
        for page in (64, 1):
            for value, scales in ((1.0, (1.0, 1.0)), (4.0, (0.05, 0.02))):
                seed += 1
                rows.append(run_case(f"H{H} p{page} x{value:g} scales {scales[0]:g}/{scales[1]:g} grid lens",
                                     KV_LENS, [1] * len(KV_LENS), H, page, value=value, scales=scales, seed=seed))
    rows.append(run_case("H8 p64 fp16 q x4 scales .05/.02", KV_LENS, [1] * 9, 8, 64, q_dtype=torch.float16,
                         value=4.0, scales=(0.05, 0.02), seed=31, default=False))
    rows.append(run_case("H40 p16", KV_LENS, [1] * 9, 40, 16, seed=32, default=False))
    rows.append(run_case("H128 p64 fp16 q", KV_LENS, [1] * 9, 128, 64, q_dtype=torch.float16, seed=33, default=False))
    rows.append(run_case("MTP H16 p64 qo 1-4", [1, 2, 17, 300, 514, 4097], [2, 3, 1, 4, 2, 3], 16, 64, seed=34, default=False))
    rows.append(run_case("MTP H128 p1 qo 2", [2, 97, 514, 4097], [2, 2, 1, 2], 128, 1, seed=35, default=False))
    rows.append(run_case("H16 p64 B1 L32k (splits)", [32768], [1], 16, 64, seed=36, default=False))
    rows.append(run_case("H128 p64 B1 L32k (splits) x4", [32768], [1], 128, 64, value=4.0, seed=37, default=False))
    worst = max(r["fp8_math"]["rel_l2"] for r in rows)
    worst_d = max(r["default"]["rel_l2"] for r in rows if "default" in r)
    worst_l = max(r["fp8_math"]["lse_err"] for r in rows)
    worst_lr = max(r["fp8_math"]["lse_rel"] for r in rows)
    ok = all(r["ok"] for r in rows)
    print(f"FP8_MATH GRID {'ALL PASS' if ok else 'SOME FAIL'} ({sum(r['ok'] for r in rows)}/{len(rows)}): "
          f"fp8_math max rel L2 {worst:.2e} (budget {BUDGET:.0e}), max lse err {worst_l:.1e} ({worst_lr:.1e} of max "
          f"|lse|); default max rel L2 "
          f"{worst_d:.2e}; {time.time() - t0:.0f} s", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(rows, open(os.path.join(out_dir, "fp8math.json"), "w"), indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
