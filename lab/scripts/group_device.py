"""Per-token group scales in the Gluon decode kernel (``launch(scale_desc=...)``, kernel log 24 of
docs/benchmarks.md; written 2026-12-01 without a GPU: NOT RUN yet). One GPU run, <= ~4 min:

    PYTHONPATH=$PWD/src python3 scripts/group_device.py

1. Checks against float64 on the dequantized KV (stored e4m3 x each token's group scale), through the kernel's
   ``launch``: odd lengths over NaN pools (NaN also in the unused slots' scale rows), pages 1/16/32/64/128, H
   8/16/32/40/128, fp16 queries,
   7 CTAs (items wrap the ring), B1 L32k (many splits), NS 2, group scales spread over e^+-8 within a tile (the P
   normalization), bit-identical reruns.
2. CUDA-graph timings (L2 flushed, median of 50): the group kernel against the per-tensor Gluon kernel on the same
   stored values (the cost of the scales) and the Triton kernel's group path through MLAPagedAttention (what group
   plans run today), with the read ceiling of the same process.

The group build has 16 rows per consumer at any head count (at 32 per consumer it spills 1.4 KB under triton 3.6
and serializes its wgmma under 3.9): H > 32 takes ceil(H / 32) head-group CTAs per schedule slot (H128: 4, where
the per-tensor kernel takes 2 of 32 heads per consumer).

Prediction (before any run; sm_90a SASS under triton 3.6: H16 696 B of spill, 18 reloads per tile per consumer;
H32 596 B; H128 544 B, 11): per tile the group path adds the scale tile's loads and one cross-warp max, four P^T
stores instead of one, and loses the QK overlap of the next slab's conversion with the previous slab's MMA (the
default kernel's registers are full). H16 B64 L8k .111 -> ~.14-.16 ms; H128 B64 L8k .42 -> ~.7-.9 ms (twice the
CTA-tiles, each ~0.75x the 32-head one, times the group overhead); the Triton group path ~1.5-2x slower than the
group kernel. Error like the per-tensor kernel's (rel L2 ~1.7e-3).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
sys.path.insert(0, os.path.join(ROOT, "src"))   # fp8mla (the Triton group path), when PYTHONPATH does not have it
dsm, log, DC, DK = dv.dsm, dv.log, dv.DC, dv.DK
RESULTS = {"checks": dv.RESULTS["checks"], "bench": []}   # (check_case appends its rows there)


def group_case(kv_lens, H, page, *, seed=0, spread=1.0, kpe_scale=1.0, **kw):
    """``dv.make_case`` with per-token group scales: the stored e4m3 values stay, each (token, group) gets the
    scale 0.02 x e^U(-spread, spread); slots no request uses hold NaN scales (as their NaN rows)."""
    c = dv.make_case(kv_lens, H, page, seed=seed, kpe_scale=kpe_scale, **kw)
    P = c["pool"].shape[0]
    g = torch.Generator(device=dv.DEV).manual_seed(seed + 7)
    sa = 0.02 * torch.exp((torch.rand(P, page, dsm.GROUPS, device=dv.DEV, generator=g) * 2 - 1) * spread)
    unused = torch.isnan(c["pool"][..., 0].float())
    sa[unused] = float("nan")
    c["scale_arr"] = sa.contiguous()
    c["scales"] = torch.tensor([1.0, kpe_scale], dtype=torch.float32, device=dv.DEV)
    return c


class GPlan(dv.Plan):
    def __init__(self, c, *, group=True, **kw):
        super().__init__(c, **kw, **({"max_hpw": dsm.GROUP_MAX_HPW, "group": True} if group else {}))
        self.sdesc = dsm.scale_descriptor(c["scale_arr"]) if group else None

    def launch_kw(self) -> dict:
        return dict(super().launch_kw(), **({"scale_desc": self.sdesc} if self.sdesc is not None else {}))


def check(name, c, **plan_kw):
    """``dv.check_case`` with the group plan (its row goes to RESULTS["checks"]; ``dv.reference`` applies the case's
    group scales)."""
    return dv.check_case(name, c, plan_cls=GPlan, **plan_kw)


def run_checks() -> bool:
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    ok = True
    for H in (8, 16, 32, 40, 128):
        ok &= check(f"H{H} p64 odd lens", group_case(odd, H, 64, seed=H))
    ok &= check("H16 p16 odd lens", group_case(odd, 16, 16, seed=3))
    ok &= check("H16 p32 odd lens", group_case(odd, 16, 32, seed=12))
    ok &= check("H16 p128 odd lens", group_case(odd, 16, 128, seed=13))
    ok &= check("H16 p64 fp16 q, kpe 7", group_case(odd, 16, 64, seed=14, kpe_scale=7.0, q_dtype=torch.float16))
    ok &= check("H16 p1 odd lens", group_case([1, 63, 65, 0, 700, 130], 16, 1, seed=4))
    ok &= check("H128 p1 odd lens", group_case([1, 65, 0, 700], 128, 1, seed=5))
    ok &= check("H16 p64 7 CTAs", group_case(odd, 16, 64, seed=6), num_ctas=7)
    ok &= check("H16 p64 B1 L32k many splits", group_case([32768], 16, 64, seed=8))
    ok &= check("H32 p64 NS2", group_case(odd, 32, 64, seed=9), ns=2)
    ok &= check("H16 p64 scales e^+-8", group_case(odd, 16, 64, seed=10, spread=8.0))
    ok &= check("H128 p64 scales e^+-8, kpe 3", group_case(odd, 128, 64, seed=11, spread=8.0, kpe_scale=3.0))
    return ok


def triton_group(c):
    """The Triton kernel's group path through MLAPagedAttention (what group plans run today)."""
    from fp8mla.attention import MLAPagedAttention
    a = MLAPagedAttention(backend="triton")
    B = len(c["kv_lens"])
    a.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["H"], DC, DK, c["page"], True,
           c["sm_scale"], c["q_nope"].dtype, "fp8_e4m3_group")
    out = torch.empty(B, c["H"], DC, dtype=c["q_nope"].dtype, device=dv.DEV)
    kps = float(c["scales"][1])
    return lambda: a.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, kpe_scale=kps,
                         ckv_scale_arr=c["scale_arr"]), out


SHAPES = [(16, 64, 8192), (16, 1, 32768), (16, 8, 8192), (16, 128, 2048), (128, 64, 8192), (128, 8, 8192)]


def run_bench():
    flush = dv.Flush()
    read, mm = dv.ceilings(flush)
    log(f"ceilings: read {read:.0f} GB/s, bf16 mm {mm:.0f} TFLOP/s")
    RESULTS["ceilings"] = dict(read_gbs=read, mm_tflops=mm)
    for H, B, L in SHAPES:
        c = group_case([L] * B, H, 64, seed=B, nan_pool=False)
        floor = B * L * (576 + 16) / (read * 1e9) * 1e3
        g = GPlan(c)
        t_g = dv.graph_ms(g.run, flush)
        c_pt = dict(c, scales=torch.tensor([0.02, 1.0], dtype=torch.float32, device=dv.DEV))
        t_p = dv.graph_ms(GPlan(c_pt, group=False).run, flush)
        fn, out = triton_group(c)
        t_t = dv.graph_ms(fn, flush)
        o_g = g.out.double()
        rel = float((o_g - out.double()).norm() / out.double().norm())
        row = dict(H=H, B=B, L=L, floor_ms=floor, gluon_group=t_g, gluon_tensor=t_p, triton_group=t_t,
                   gluon_vs_triton_rel=rel)
        RESULTS["bench"].append(row)
        log(f"BENCH H{H} B{B} L{L}: floor {floor:.4f}  gluon group {t_g:.4f} ({floor / t_g:.0%} of floor)  "
            f"gluon per-tensor {t_p:.4f} (group/tensor {t_g / t_p:.2f}x)  triton group {t_t:.4f} "
            f"(gluon {t_t / t_g:.2f}x faster)  rel(gluon, triton) {rel:.1e}")
        save()


def save():
    """$OUT/group_device.json, rewritten after the checks and after each timing (a timeout keeps what ran)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "group_device.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def main():
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    ok = run_checks()
    save()
    if ok or "--bench-anyway" in sys.argv:
        run_bench()
    log("ALL CHECKS PASS" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
