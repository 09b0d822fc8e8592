"""Timing probes of the prototype (kernel.py ``probe``; WRONG results, timing only): where the ~6,500 cycles a tile
go. 0 the build; 1 no HMUL2 in the converters; 2 no gather after the first tile (the stage keeps tile 0); 3 both;
and the build with ``sidx=False`` (run 1's: the scale copies' indices loaded where the copies are issued).
H128 topk 2048 B64 (1 split) and H16 (2 splits), CUDA graph, L2 flushed, median; JSON to --out.

    PYTHONPATH=$PWD/src:$PWD python3 lab/sparse_ws/probe_device.py --out $OUT/sparse_ws_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel as ws  # noqa: E402
from check_device import timing_inputs, views  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sparse_ws_probe.json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from fp8mla.bench.common import time_ms
    res = []
    for H, splits in ((128, 1), (16, 2)):
        kv, indices, q_nope, q_pe = timing_inputs(H, 2048, 64, "cuda")
        ckv, kpe, sa = views(kv)
        B = 64
        _, s_eff = ws.split_geometry(2048, splits)
        out = torch.empty(B, H, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B, H, device="cuda")
        po = torch.empty(B * s_eff, H, 512, device="cuda")
        pl = torch.empty(B * s_eff, H, device="cuda")
        for probe, sidx in ((0, True), (0, False), (1, True), (2, True), (3, True)):
            rec = dict(H=H, splits=s_eff, probe=probe, sidx=sidx)
            try:
                fn = lambda p=probe, si=sidx: ws.sparse_mla(q_nope, q_pe, ckv, kpe, sa, indices, out, lse, po, pl,  # noqa
                                                            sm_scale=1 / math.sqrt(576), num_splits=splits,
                                                            lse_scale=1.0, probe=p, sidx=si)
                fn()
                torch.cuda.synchronize()
                rec["ms"] = time_ms(fn, reps=args.reps)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res.append(rec)
            print(rec, flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
