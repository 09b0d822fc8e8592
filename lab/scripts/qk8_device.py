"""FP8 scores in the Gluon decode kernel (``launch(qk8=2|3)``, kernel log 18): S = K.Q^T as e4m3 x e4m3 wgmma with
K read straight from the TMA stage (no K conversion), Q split into 2 (bf16) or 3 (fp16) e4m3 terms; P.V unchanged.

    PYTHONPATH=$PWD/src python3 scripts/qk8_device.py [chunks] [--out DIR]

1. Checks against float64 (decode_v2_device.check_case: NaN-poisoned outputs and partials, rel L2 <= 3e-3, lse,
   empty requests, bit-identical reruns) for the QK8 kernel, with the default kernel's error on the same case
   beside it: odd lengths over NaN pools, 1/7 CTAs, H8/H16/H40/H128, pages 1/16/64/128, fp16 q with scales,
   B1 L32k (many splits), all empty.
2. Timings (CUDA graphs, L2 flushed, median of 30): default vs QK8 at the issue's shapes, the read ceiling
   measured in the same process. Prints one line per shape and writes DIR/qk8.json."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
dsm = dv.dsm
log = dv.log


class QPlan(dv.Plan):
    """decode_v2_device.Plan with the FP8-scores variant (qk8 e4m3 terms of Q; 0 = the default kernel)."""

    def __init__(self, c, *, qk8=0, chunks=False, **kw):
        super().__init__(c, **kw)
        self.qk8, self.chunks = qk8, chunks

    def launch_kw(self) -> dict:
        return dict(super().launch_kw(), qk8=self.qk8, qk8_chunks=self.chunks)


def terms(c):
    return dsm.qk8_terms(c["q_nope"].dtype)


def checks() -> bool:
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    cases = [
        ("H16 p64 odd lens", dv.make_case(odd, 16, 64, seed=1), {}),
        ("H16 p64 odd lens, 7 CTAs", dv.make_case(odd, 16, 64, seed=2), dict(num_ctas=7)),
        ("H8 p64 (padded heads)", dv.make_case([300, 7, 2000], 8, 64, seed=4), {}),
        ("H16 p128", dv.make_case([1, 127, 129, 1000, 64], 16, 128, seed=5), {}),
        ("H16 p16", dv.make_case([1, 15, 17, 63, 65, 1000, 0], 16, 16, seed=13), {}),
        ("H16 p64 fp16 q (3 terms), scales .05/.02, x4",
         dv.make_case([777, 65, 3000], 16, 64, seed=6, q_dtype=torch.float16, ckv_scale=0.05, kpe_scale=0.02,
                      value=4.0), {}),
        ("H16 p64 B1 L32768 (many splits)", dv.make_case([32768], 16, 64, seed=7), {}),
        ("H16 p64 all empty", dv.make_case([0, 0], 16, 64, seed=9), {}),
        ("H16 p1 odd lens", dv.to_page1(dv.make_case(odd, 16, 64, seed=21), seed=21, past=3), {}),
        ("H40 p64 odd lens (wide HPW 32)", dv.make_case(odd, 40, 64, seed=22), {}),
        ("H128 p64 odd lens", dv.make_case(odd, 128, 64, seed=23), {}),
        ("H128 p64 bf16 scales .05/.02", dv.make_case([2000, 5, 700], 128, 64, seed=24, ckv_scale=0.05,
                                                     kpe_scale=0.02, value=4.0), {}),
        ("H128 p1 odd lens", dv.to_page1(dv.make_case([1, 65, 514, 0, 97], 128, 64, seed=25), seed=25, past=2), {}),
        ("H128 p64 B1 L32768", dv.make_case([32768], 128, 64, seed=26), {}),
    ]
    ok = True
    dv.Plan = QPlan   # check_case builds its plan through dv.Plan
    for name, c, kw in cases:
        base = dv.check_case(f"default  {name}", c, **kw, qk8=0)
        q = dv.check_case(f"qk8 x{terms(c)} {name}", c, **kw, qk8=terms(c))
        ok &= bool(q)
        if not base:
            log(f"  (the default kernel failed this case too)")
    log(f"QK8 CHECKS {'ALL PASS' if ok else 'SOME FAIL'}")
    return ok


SHAPES = [(16, 64, 8192), (16, 1, 32768), (16, 8, 8192), (16, 32, 4096), (16, 128, 2048),
          (128, 64, 8192), (128, 8, 8192), (128, 1, 32768)]


def bench(out_dir, deadline_s=150.0):
    flush = dv.Flush()
    read, mm = dv.ceilings(flush)
    log(f"ceilings: read {read:.0f} GB/s, bf16 mm {mm:.0f} TFLOP/s")
    rows = []
    t0 = time.time()
    for H, B, L in SHAPES:
        if time.time() - t0 > deadline_s:
            log(f"deadline: skipped H{H} B{B} L{L} and later")
            break
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        floor = B * L * (dv.DC + dv.DK) / (read * 1e9) * 1e3
        r = dict(H=H, B=B, L=L, floor_ms=floor)
        for name, q in (("default", 0), ("qk8", terms(c))):
            p = QPlan(c, qk8=q)
            r[name] = dv.graph_ms(p.run, flush, reps=30)
        r["speedup"] = r["default"] / r["qk8"]
        rows.append(r)
        log(f"BENCH H{H:<3d} B{B:<3d} L{L:<6d} floor {floor:.4f}  default {r['default']:.4f}  qk8 {r['qk8']:.4f} ms"
            f"  ({r['speedup']:.2f}x; qk8 at {100 * floor / r['qk8']:.0f}% of floor)")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(dict(read_gbs=read, mm_tflops=mm, rows=rows, checks=dv.RESULTS["checks"],
                       env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))),
                  open(os.path.join(out_dir, "qk8.json"), "w"), indent=1)


def chunks_run(out_dir):
    """Second run (kernel log 18): one score accumulator per 128-column chunk (``qk8_chunks``, 5 independent wgmma
    chains) against the one-chain QK8 and the default kernel, H16 (the H128 build spills 864 B with 5 accumulators
    beside 128 O registers: not timed)."""
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    dv.Plan = QPlan
    ok = True
    for name, c in (("H16 p64 odd lens", dv.make_case(odd, 16, 64, seed=1)),
                    ("H16 p1 odd lens", dv.to_page1(dv.make_case(odd, 16, 64, seed=21), seed=21, past=3)),
                    ("H16 p64 B1 L32768", dv.make_case([32768], 16, 64, seed=7))):
        ok &= bool(dv.check_case(f"qk8 x2 chunks {name}", c, qk8=2, chunks=True))
    flush = dv.Flush()
    read, mm = dv.ceilings(flush)
    log(f"ceilings: read {read:.0f} GB/s, bf16 mm {mm:.0f} TFLOP/s")
    rows = []
    for H, B, L in [(16, 64, 8192), (16, 128, 2048), (16, 8, 8192), (16, 1, 32768)]:
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        r = dict(H=H, B=B, L=L, floor_ms=B * L * (dv.DC + dv.DK) / (read * 1e9) * 1e3)
        for name, kw in (("default", dict(qk8=0)), ("qk8", dict(qk8=2)), ("qk8_chunks", dict(qk8=2, chunks=True)),
                         ("qk8_chunks_compute_only", dict(qk8=2, chunks=True, mode=2)),
                         ("default_compute_only", dict(qk8=0, mode=2))):
            # (this sequence hit "unspecified launch failure" on 2026-11-30 at its first shape, kernel log 20:
            # say which variant runs, synchronized, so that a repro names it)
            log(f"  timing H{H} B{B} L{L} {name} ...")
            r[name] = dv.graph_ms(QPlan(c, **kw).run, flush, reps=int(os.environ.get("QK8_REPS", "30")))
            torch.cuda.synchronize()
            log(f"  ... {name} {r[name]:.4f} ms")
        rows.append(r)
        log("BENCH " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(dict(read_gbs=read, rows=rows, checks=dv.RESULTS["checks"]),
                  open(os.path.join(out_dir, "qk8_chunks.json"), "w"), indent=1)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("qk8_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    if "chunks" in sys.argv[1:]:
        return 0 if chunks_run(out) else 1
    ok = checks()
    bench(out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
