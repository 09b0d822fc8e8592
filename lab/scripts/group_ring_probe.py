"""Why the group build is ~2x slower than the per-tensor one at H16 (2026-12-01 03:24 UTC run: B64 L8k .209 vs
.107 ms): its ring has 2 stages there (4 do not fit shared memory with the scale tiles and four P^T tiles; 3 is odd,
and the alternating-tile kernel's parity wait races at an odd depth, kernel log 25). One GPU run, ~2 min:

    PYTHONPATH=$PWD/src python3 scripts/group_ring_probe.py

CUDA-graph timings (L2 flushed) of the group and per-tensor builds at H16 for NS 2, NS 3 (ran 03:26 UTC with the
racy single ready barrier per stage, timing only; since kernel log 29 an odd ring has per-consumer barriers) and,
per-tensor, NS 4; plus compute-only (MODE 2: consumers compute on whatever the stage holds, the producer does not
copy) at NS 2. Prediction: if the ring depth is the cause, group NS 3 is ~1.4-1.6x faster than NS 2 and per-tensor
NS 2 is about as slow as group NS 2; if the consumers are, group compute-only NS 2 stays near group NS 2."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("group_device", os.path.join(ROOT, "scripts/group_device.py"))
gd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gd)
dv, log = gd.dv, gd.log


def main() -> int:
    flush = dv.Flush()
    for B, L in ((64, 8192), (8, 8192), (128, 2048)):
        c = gd.group_case([L] * B, 16, 64, seed=B, nan_pool=False)
        c_pt = dict(c, scales=torch.tensor([0.02, 1.0], dtype=torch.float32, device=dv.DEV))
        row = []
        for name, cc, kw in (("group ns2", c, dict(ns=2)), ("group ns3", c, dict(ns=3)),
                             ("group ns2 compute-only", c, dict(ns=2, mode=2)),
                             ("tensor ns2", c_pt, dict(ns=2, group=False)),
                             ("tensor ns3", c_pt, dict(ns=3, group=False)),
                             ("tensor ns4", c_pt, dict(ns=4, group=False)),
                             ("tensor ns2 compute-only", c_pt, dict(ns=2, mode=2, group=False))):
            try:
                t = dv.graph_ms(gd.GPlan(cc, **kw).run, flush, reps=30)
                row.append(f"{name} {t:.4f}")
            except Exception as e:   # a variant that does not build or fit: say so, go on
                row.append(f"{name} FAILED {type(e).__name__}: {str(e)[:120]}")
        log(f"PROBE H16 B{B} L{L}: " + "; ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
