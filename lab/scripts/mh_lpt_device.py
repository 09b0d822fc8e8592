"""A/B (one H200): the heads-on-M build's longest-first host schedule (plans with host lengths, plain and in a
256-slot CUDA-graph wrapper) against its
request-order cut (the same build planned with device-only lengths: ``schedule_device``, the old cut) and the wide
build, at equal and spread lengths, 64 and 128 heads.

Prediction (a dispatch model fitted to graph_spread_device.py's run of 2026-12-02 17:38: items in grid order onto
the free SM slots, 2 tiles of start cost each, 2.65-2.98 us per makespan tile at the large shapes): longest-first
0.69-0.86x the wide build at every shape of that run (H128 uniform B64 0.368 ms vs wide 0.4426 and the old cut
0.5345; H128 uniform B128 0.689 vs 0.843 / 1.112; H64 uniform B64 0.188 vs 0.260 / 0.332), equal lengths unchanged.
Not modelled: the extra partials' traffic of the contiguous cut (<= slots + B items, as the wide build's).

Usage (device, repo root): PYTHONPATH=$PWD/src:$PWD/lab/scripts python3 lab/scripts/mh_lpt_device.py --out OUT/mh_lpt.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from fp8mla import MLAPagedAttention
from fp8mla.bench.common import environment, measure_ceilings, time_ms
from fp8mla.bench.decode import reference_error
from graph_spread_device import DC, lengths, make

SHAPES = (("equal8k", 64), ("uniform", 64), ("lognormal", 64), ("uniform", 8), ("lognormal", 8), ("one_long", 16),
          ("uniform", 128), ("equal2k", 128), ("equal4k", 32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda"
    ceil = measure_ceilings(dev)
    print(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True)
    g = torch.Generator().manual_seed(7)   # graph_spread_device.py's lengths for its shapes
    rows = []
    for H in (64, 128):
        for kind, B in SHAPES:
            lens = [2048] * B if kind == "equal2k" else [4096] * B if kind == "equal4k" else lengths(kind, B, g)
            pool, pa_dev, qn, qp = make(lens, H, dev, g)
            pa_host = dict(pa_dev, **{key: pa_dev[key].cpu() for key in ("qo_indptr", "kv_indptr", "kv_len_arr")})
            ckv, kpe = pool[..., :DC], pool[..., DC:]
            out = torch.empty(B, H, DC, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(B, H, device=dev, dtype=torch.float32)
            T = sum(lens)
            res = dict(H=H, kind=kind, B=B, max_len=max(lens), floor_ms=ceil.floor_ms(T * 576, 2 * H * T * 1088))
            for name, mh, pa in (("wide", False, pa_host), ("mh_lpt", True, pa_host), ("mh_old", True, pa_dev),
                                 ("auto", None, pa_host), ("wide_graph", False, pa_host), ("mh_graph", True, pa_host)):
                try:
                    graph = dict(use_cuda_graph=True, max_batch_size=256) if name.endswith("_graph") else {}
                    a = MLAPagedAttention(backend="gluon", heads_on_m=mh, **graph)
                    a.plan(**pa, num_heads=H, kv_data_type="fp8_e4m3")
                    if name == "auto":
                        res["auto_build"] = "mh" if a._plan.impl.build.heads_on_m else "wide"
                    fn = (lambda a=a: a.run(qn, qp, ckv, kpe, out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0))
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    res[name + ":err"] = reference_error(out, qn, qp, ckv, kpe, pa_dev, 4)
                    res[name] = time_ms(fn, reps=args.reps)
                except Exception as e:  # noqa: BLE001 - record and go on
                    res[name] = None
                    res[name + ":why"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            rows.append(res)
            w = res.get("wide")
            cell = lambda n: (f"{res[n]:.4f} ({res[n] / w:.3f}x)" if res.get(n) and w else "-")  # noqa: E731
            errs = [v for key, v in res.items() if key.endswith(":err")]
            print(f"H{H:<3} {kind:<9} B{B:<3} max {max(lens):>5}  wide {cell('wide')}  mh_lpt {cell('mh_lpt')}  "
                  f"mh_old {cell('mh_old')}  auto[{res.get('auto_build')}] {cell('auto')}  graph: wide {cell('wide_graph')} "
                  f"mh {cell('mh_graph')}  floor {res['floor_ms']:.4f}  "
                  f"err {max(errs) if errs else float('nan'):.2e}", flush=True)
            for key, v in res.items():
                if key.endswith(":why"):
                    print(f"   {key}: {v}")
            del pool
    json.dump(dict(env=environment(), ceilings=vars(ceil), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
