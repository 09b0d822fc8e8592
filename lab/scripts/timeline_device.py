"""Where a consumer's tile goes (kernel log 21's measurement): the Gluon decode kernel built with its timing probe
(``launch(timeline=...)``: each consumer stamps its SM's clock64 at six points of each tile) on the H200.

    PYTHONPATH=$PWD/src python3 lab/scripts/timeline_device.py [--out DIR]

Phases per tile (cycles, median and 90th percentile over every recorded tile of every CTA and consumer):
  ready  stamp 0 -> 1   waiting on the ring's ready barrier (the data)
  qk     1 -> 2         tail sanitize + K conversion + the 36 score MMAs, to the scores in registers
  soft   2 -> 3         scale, mask, row max across the 4 warps, exp2, row sums
  pstore 3 -> 4         P^T to shared memory + fence
  pv     4 -> 5         V^T conversion + 32 MMAs (+ their waits)
  gap    5 -> next 0    empty arrive, loop step, and (at an item's end) the epilogue / exchange / next item's Q
Also the kernel's time with and without the probe (plain launches, median of 20) to show what the stamps cost, and
the SM clock implied (cycles of the whole tile loop / time). Writes DIR/timeline.json."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("qk8_device", os.path.join(ROOT, "scripts/qk8_device.py"))
q = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(q)
dv, dsm, log = q.dv, q.dsm, q.log

PHASES = ["ready", "qk", "soft", "pstore", "pv", "gap"]
T = 96   # tiles recorded per consumer


class TPlan(q.QPlan):
    def __init__(self, c, *, timeline=False, **kw):
        super().__init__(c, **kw)
        self.tl = torch.zeros(self.grid, 2, T, 8, dtype=torch.int64, device="cuda") if timeline else None

    def launch_kw(self) -> dict:
        return dict(super().launch_kw(), merge=False, timeline=self.tl)


def phases(tl: torch.Tensor) -> dict:
    """Per-phase cycle statistics over the recorded tiles (a tile counts when all six stamps are set)."""
    x = tl.double()[..., :6]                                   # [grid, 2, T, 6]
    ok = (x > 0).all(-1)
    d = {name: (x[..., i + 1] - x[..., i])[ok] for i, name in enumerate(PHASES[:5])}
    nxt = torch.roll(x[..., 0], -1, dims=2) - x[..., 5]       # this tile's P.V done -> the next tile's stamp 0
    ok2 = ok & torch.roll(ok, -1, dims=2)
    ok2[..., -1] = False
    d["gap"] = nxt[ok2]
    tile = torch.roll(x[..., 0], -1, dims=2) - x[..., 0]
    d["tile"] = tile[ok2]
    out = {}
    for k, v in d.items():
        v = v[v >= 0]
        if v.numel():
            out[k] = dict(median=float(v.median()), p90=float(v.quantile(0.9)), mean=float(v.mean()), n=int(v.numel()))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("timeline_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    res = []
    for H, B, L, kw in [(16, 64, 8192, {}), (16, 64, 8192, dict(mode=2)), (16, 64, 8192, dict(qk8=2, chunks=True)),
                        (16, 8, 8192, {}), (16, 1, 32768, {}), (128, 64, 8192, {}), (128, 64, 8192, dict(mode=2))]:
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        base = TPlan(c, **kw)
        probe = TPlan(c, timeline=True, **kw)
        base.run(); probe.run(); torch.cuda.synchronize()
        ms0 = dv.events_ms(base.run, 20, lambda: None)
        probe.tl.zero_()
        ms1 = dv.events_ms(probe.run, 20, lambda: None)   # (the last launch's stamps stay)
        torch.cuda.synchronize()
        st = phases(probe.tl)
        name = f"H{H} B{B} L{L}" + "".join(f" {k}={v}" for k, v in kw.items())
        row = dict(shape=name, ms=ms0, ms_probe=ms1, phases=st)
        res.append(row)
        log(f"TIMELINE {name}: kernel {ms0:.4f} ms, with stamps {ms1:.4f} ms")
        for k in PHASES + ["tile"]:
            if k in st:
                s = st[k]
                log(f"    {k:7s} median {s['median']:7.0f}  p90 {s['p90']:7.0f}  mean {s['mean']:7.0f} cycles"
                    f"  (n {s['n']})")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(res, open(os.path.join(out_dir, "timeline.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
