"""The ready-barrier parity race of the alternating-tile (H <= 16) Gluon kernel at an odd ring depth (kernel log 25
of docs/benchmarks.md) and its fix (log 29). One GPU run, <= 5 min (four processes, each compiling its kernel):

    PYTHONPATH=$PWD/src python3 scripts/ring_parity_device.py

The two consumers take alternate tiles and wait on a ready barrier with the parity of the tile's phase. With one
barrier per stage and NS odd, a stage's consecutive phases belong to alternating consumers, so a consumer can reach
phase k while the barrier is still in phase k - 1 (the other consumer's tile not landed) and its parity wait passes
on phase k - 2. Run on the H200 (2026-12-01 03:08 UTC) with that kernel: NS 3 gave 2 differing replays in 1,000 and
the ring-only probe faulted; NS 4 was clean. Since log 29 an odd ring gives each consumer its own ready barrier per
stage (every phase of a barrier is then one consumer's, in order). Each run below is its own process (a fault ends
a CUDA context):

  * ``replays NS``: H16 B64 L8k (the shape of every "unspecified launch failure"), one eager run checked against
    float64 on 4 requests, then 1,000 CUDA-graph replays, each output compared bit for bit with the first run's
    (the kernel is otherwise deterministic: any difference is a wrong read).
  * ``ring NS``: the ring-only probe (MODE 1: consumers arrive without computing, the race's widest window), 200
    launches.

Prediction with the fix: NS 3 and NS 4 both clean (0 differing replays, no fault, no hang).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _dv():
    spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def replays(ns: int, n: int = 1000) -> None:
    dv = _dv()
    c = dv.make_case([8192] * 64, 16, 64, seed=3, nan_pool=False)
    p = dv.Plan(c, ns=ns)
    p.run()
    torch.cuda.synchronize()
    ref_o, _ = dv.reference(c, nreq=4)
    rel = float((p.out[:4].double() - ref_o).norm() / ref_o.norm())
    first = p.out.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p.run()
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    t0 = time.time()
    for _ in range(n):
        g.replay()
        bad += (p.out != first).any(dim=-1).any(dim=-1).sum()
    torch.cuda.synchronize()
    print(f"RESULT replays ns={ns}: relL2(first run, 4 requests) {rel:.2e}; {int(bad)} request outputs differ "
          f"from the first run over {n} replays ({time.time() - t0:.1f} s)", flush=True)


def ring(ns: int, n: int = 200) -> None:
    dv = _dv()
    c = dv.make_case([8192] * 64, 16, 64, seed=3, nan_pool=False)
    p = dv.Plan(c, ns=ns, mode=1, merge=False)
    t0 = time.time()
    for _ in range(n):
        p.run()
    torch.cuda.synchronize()
    print(f"RESULT ring ns={ns}: {n} ring-only launches clean ({time.time() - t0:.1f} s)", flush=True)


def main():
    if len(sys.argv) == 3:   # one measurement, in this process
        {"replays": replays, "ring": ring}[sys.argv[1]](int(sys.argv[2]))
        return
    for what in ("replays", "ring"):
        for ns in (4, 3):
            try:
                r = subprocess.run([sys.executable, __file__, what, str(ns)], capture_output=True, text=True,
                                   timeout=90)
                lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("RESULT") or "Error" in x]
                print(f"{what} ns={ns}: rc {r.returncode}; " + (" | ".join(lines[-3:]) or "(no result)"), flush=True)
            except subprocess.TimeoutExpired:
                print(f"{what} ns={ns}: TIMEOUT after 90 s (a hang: a barrier wait that never completes)", flush=True)


if __name__ == "__main__":
    main()
