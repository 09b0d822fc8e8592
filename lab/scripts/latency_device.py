"""Where a small batch's time goes (the B1 / B8 targets): the Gluon decode kernel built with its timing probe
(``launch(timeline=...)``), inside a CUDA graph between three one-thread kernels that read the GPU's global timer.

    PYTHONPATH=$PWD/src python3 scripts/latency_device.py [--out DIR]

Graph: stamp A, decode kernel (per CTA: global timer and clock64 at consumer entry, Q in shared memory, the first
tile's data, the last tile's P.V, consumer exit; per tile: the six clock64 stamps of timeline_device.py), stamp B,
merge kernel, stamp C. Replayed after an L2 flush, as the benchmark does; the stamps of the last replay are read.
Prints, per shape (microseconds, medians over CTAs unless said): the event time of the whole graph; launch = A ->
first CTA entry; rollout = first -> last CTA entry; prologue = entry -> Q ready; first data = entry -> first ready
barrier passed; tiles = first ready -> last P.V; epilogue = last P.V -> exit; drain = last exit -> B; merge = B -> C.
Prologue steps (global timer, from entry): the CTA's item range loaded, the item loaded, its kv_len and query row
loaded, its Q rows loaded, Q in shared memory. H16 B1 and B8 also without the L2 flush (warm caches). Also the plain
graph (no stamps) for what the probe costs. LATENCY_Q1P=0: the two-pass Q prologue of kernel logs 1-29 (the
kernel's default before 83b7d3a; docs/data/latency_2026-12-01_twopass.txt), else one pass. Writes
DIR/latency.json.""" 
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
dsm, log = dv.dsm, dv.log
T = 64   # tiles recorded per consumer (rows 0-3 also hold the per-CTA stamps in slots 6 / 7)


@triton.jit
def _gt_stamp(ptr, i):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + i, t)


class LPlan(dv.Plan):
    def __init__(self, c, *, probe=False, **kw):
        super().__init__(c, **kw)
        self.tl = torch.zeros(self.grid, 2, T, 8, dtype=torch.int64, device="cuda") if probe else None
        self.gt = torch.zeros(4, dtype=torch.int64, device="cuda")

    def run(self):
        c = self.c
        if self.tl is not None:
            _gt_stamp[(1,)](self.gt, 0)
        dsm.launch(self.desc[0], self.desc[1], c["q_nope"], c["q_pe"], c["scales"], self.t, self.out, self.lse,
                   grid=self.grid, grid_batch=self.B, max_rows=c["H"], num_heads=c["H"], sm_scale=c["sm_scale"],
                   page_size=c["page"], ns=self.ns, merge_p=self.merge_p, merge_c=self.merge_c, merge=False,
                   timeline=self.tl, q_one_pass=os.environ.get("LATENCY_Q1P", "1") == "1")
        if self.tl is not None:
            _gt_stamp[(1,)](self.gt, 1)
        dsm.launch_merge(self.out, self.lse, self.t, grid_batch=self.B, max_rows=c["H"], num_heads=c["H"],
                         merge_p=self.merge_p, merge_c=self.merge_c)
        if self.tl is not None:
            _gt_stamp[(1,)](self.gt, 2)


def analyse(p: LPlan) -> dict:
    x = p.tl.double().cpu()                    # [grid, 2, T, 8]
    gt = p.gt.double().cpu()
    entry = x[:, :, 0, 6]
    exit_ = x[:, :, 2, 6]
    used = (entry > 0) & (exit_ > 0)
    # the SM clock under the run: clock64 cycles per global-timer ns between each consumer's entry and exit
    rate = (x[:, :, 2, 7] - x[:, :, 0, 7]) / (exit_ - entry).clamp_min(1)
    clock_ghz = float(rate[used & (exit_ - entry > 2000)].median())
    cyc = lambda a, b: ((b - a) / clock_ghz / 1e3)   # cycles -> us
    prologue = cyc(x[:, :, 0, 7], x[:, :, 1, 7])
    tiles_ok = x[:, :, :, 1] > 0
    first_ready = torch.where(tiles_ok[:, :, 0], x[:, :, 0, 1], float("nan"))
    n = tiles_ok.sum(-1)                        # tiles per consumer
    last = (n - 1).clamp_min(0)
    last_pv = torch.gather(x[..., 5], 2, last[..., None]).squeeze(-1)
    first_data = cyc(x[:, :, 0, 7], first_ready)
    tiles = cyc(first_ready, last_pv)
    epi = cyc(last_pv, x[:, :, 2, 7])
    sel = used & (n > 0)

    def med(v, m=sel):
        v = v[m]
        v = v[~torch.isnan(v)]
        return float(v.median()) if v.numel() else float("nan")
    # the first item's prologue steps (global timer, ns -> us, from entry): range loaded, item loaded, kv_len and
    # query row loaded, Q rows loaded (first pass), Q in shared memory
    steps = {}
    prev = entry
    for name, row in (("range", 4), ("item", 5), ("len_qrow", 6), ("q_rows", 7), ("q_smem", 1)):
        cur = x[:, :, row, 6]
        steps[f"step_{name}_us"] = med((cur - prev) / 1e3, used & (cur > 0))
        prev = cur
    e = entry[used]
    return dict(**steps,launch_us=float(e.min() - gt[0]) / 1e3, rollout_us=float(e.max() - e.min()) / 1e3,
                prologue_us=med(prologue), first_data_us=med(first_data), tiles_us=med(tiles),
                tiles_max_us=float(tiles[sel].nan_to_num(0).max()), epilogue_us=med(epi),
                tiles_per_consumer=float(n[sel].double().median()),
                exit_spread_us=float(exit_[used].max() - exit_[used].min()) / 1e3,
                drain_us=float(gt[1] - exit_[used].max()) / 1e3, merge_us=float(gt[2] - gt[1]) / 1e3,
                stamps_total_us=float(gt[2] - gt[0]) / 1e3, clock_ghz=clock_ghz)


def main() -> int:
    if not torch.cuda.is_available():
        print("latency_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    flush = dv.Flush()
    res = []
    cases = [(16, 1, 32768, True), (16, 1, 32768, False), (16, 8, 8192, True), (16, 8, 8192, False),
             (16, 32, 4096, True), (16, 64, 8192, True), (128, 1, 32768, True), (128, 8, 8192, True)]
    for H, B, L, flushed in cases:
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        base, probe = LPlan(c), LPlan(c, probe=True)
        fl = flush if flushed else (lambda: None)
        ms0 = dv.graph_ms(base.run, fl)
        ms1 = dv.graph_ms(probe.run, fl)   # (the last replay's stamps stay)
        torch.cuda.synchronize()
        a = analyse(probe)
        tag = "" if flushed else " (L2 warm: no flush)"
        row = dict(shape=f"H{H} B{B} L{L}{tag}", graph_ms=ms0, graph_probe_ms=ms1, items=probe.n_items,
                   grid=probe.grid, **a)
        res.append(row)
        log(f"  prologue steps{tag}: " + " ".join(f"{k[5:-3]} {v:.2f}" for k, v in a.items() if k.startswith("step_")))
        log(f"LATENCY H{H} B{B} L{L}{tag}: graph {ms0 * 1e3:.1f} us (probe {ms1 * 1e3:.1f}), grid {probe.grid}, items "
            f"{probe.n_items}, tiles/consumer {a['tiles_per_consumer']:.0f} | launch {a['launch_us']:.1f} rollout "
            f"{a['rollout_us']:.1f} prologue {a['prologue_us']:.1f} first-data {a['first_data_us']:.1f} tiles "
            f"{a['tiles_us']:.1f} (max {a['tiles_max_us']:.1f}) epilogue {a['epilogue_us']:.1f} exit-spread "
            f"{a['exit_spread_us']:.1f} drain {a['drain_us']:.1f} merge {a['merge_us']:.1f} | A->C "
            f"{a['stamps_total_us']:.1f} us, SM clock {a['clock_ghz']:.2f} GHz")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(res, open(os.path.join(out_dir, "latency.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
