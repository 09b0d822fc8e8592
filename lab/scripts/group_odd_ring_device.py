"""The group build at H <= 16 on its 3-stage ring (kernel log 29: an odd ring has per-consumer ready barriers, so
the group build takes 3 stages there instead of 2; 4 do not fit). One short GPU run (~1.5 min):

    PYTHONPATH=$PWD/src python3 scripts/group_odd_ring_device.py

Float64 checks of scripts/group_device.py at H8/H16 (odd lengths over NaN pools, 7 CTAs, B1 L32k splits, scales
e^+-8, bit-identical reruns), at the depth the adapter now plans (3), then CUDA-graph timings of NS 3 against NS 2
at H16 B64 L8k, B8 L8k, B128 L2k. Prediction: ~.18 ms at B64 (the racy NS 3 timed .183 against .205 at NS 2,
2026-12-01 03:26 UTC), B8 unchanged."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("group_device", os.path.join(ROOT, "scripts/group_device.py"))
gd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gd)
dv, dsm, log = gd.dv, gd.dsm, gd.log


def main() -> int:
    assert dsm.ring_depth(3, 16, False, group=True) == 3
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    ok = gd.check("group H16 p64 odd lens NS3", gd.group_case(odd, 16, 64, seed=16))
    ok &= gd.check("group H8 p64 odd lens NS3", gd.group_case(odd, 8, 64, seed=8))
    ok &= gd.check("group H16 p64 7 CTAs NS3", gd.group_case(odd, 16, 64, seed=6), num_ctas=7)
    ok &= gd.check("group H16 p64 B1 L32k NS3", gd.group_case([32768], 16, 64, seed=8))
    ok &= gd.check("group H16 p64 scales e^+-8 NS3", gd.group_case(odd, 16, 64, seed=10, spread=8.0))
    log(f"GROUP NS3 CHECKS {'ALL PASS' if ok else 'SOME FAIL'}")
    if not ok:
        return 1
    flush = dv.Flush()
    for B, L in ((64, 8192), (8, 8192), (128, 2048)):
        c = gd.group_case([L] * B, 16, 64, seed=B, nan_pool=False)
        t = {ns: dv.graph_ms(gd.GPlan(c, ns=ns).run, flush, reps=30) for ns in (3, 2)}
        log(f"BENCH group H16 B{B} L{L}: NS3 {t[3]:.4f} ms, NS2 {t[2]:.4f} ms ({t[2] / t[3]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
