"""The dims-split H128 kernel (``fp8mla.kernels.decode_sm90_split``) on the H200: checks against float64, then
timings against the current wide kernel and the floor (read ceiling and bf16 matmul measured in this process,
CUDA graphs, L2 flushed before every replay). One command, <= ~3 minutes, a hang watchdog per step:

    python scripts/decode_split_device.py            # checks + timings; ends with CHECKS ALL PASS (n/n) or the fails
    python scripts/decode_split_device.py check      # checks only

Reuses scripts/decode_v2_device.py (cases with NaN in every unused slot and shuffled pages, the float64 reference,
the wide kernel's plan, ceilings, graph timing, watchdog, API checks). Writes $OUT/decode_split.json when $OUT is
set. FP8MLA_GLUON_SPLIT=1 is set inside (the API checks go through the gluon backend's switch).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "src"))
os.environ["FP8MLA_GLUON_SPLIT"] = "1"
os.environ.setdefault("DECODE_V2_HANG_S", "75")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
from fp8mla.kernels import decode_sm90_split as split  # noqa: E402

DC = dv.DC
DEV = dv.DEV
log = dv.log
RESULTS = dv.RESULTS
CALLS = {"split": 0}
CHECKS_DEADLINE_S = float(os.environ.get("SPLIT_CHECKS_DEADLINE", "110"))
BENCH_DEADLINE_S = float(os.environ.get("SPLIT_BENCH_DEADLINE", "165"))

_launch = split.launch


def _counted_launch(*a, **kw):
    CALLS["split"] += 1
    return _launch(*a, **kw)


split.launch = _counted_launch   # the backend looks the attribute up at run time: the API checks count here


class SplitPlan(dv.Plan):
    """decode_v2_device's host plan (same schedule, grid = slots x nhg, partial rows) launching the split kernel."""

    def run(self):
        c = self.c
        if DEV != "cuda":   # DECODE_V2_DEVICE=cpu: a dry run of the host code
            return
        _launch(self.desc[0], self.desc[1], c["q_nope"], c["q_pe"], c["scales"], self.t, self.out, self.lse,
                grid=self.grid, grid_batch=self.B, num_heads=c["H"], sm_scale=c["sm_scale"], page_size=c["page"],
                ns=self.ns, regs=self.regs, merge_p=self.merge_p, merge_c=self.merge_c, mode=self.mode,
                merge=self.merge)


def check(name, c, **plan_kw):
    """Poisoned outputs (NaN in out, lse and every partial), float64 reference, empty requests (o 0, lse -inf),
    two reruns bit-identical."""
    t0 = time.time()
    p = SplitPlan(c, **plan_kw)
    p.out.fill_(float("nan"))
    p.lse.fill_(float("nan"))
    p.t["part_o"].fill_(float("nan"))
    p.t["part_lse"].fill_(float("nan"))
    p.run()
    torch.cuda.synchronize()
    ref_o, ref_l = dv.reference(c)
    o, lse = p.out.double(), p.lse.double()
    empty = torch.tensor([L == 0 for L in c["kv_lens"]], device=DEV)
    fin = ~empty
    nan_bad = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
    rel = float((o[fin] - ref_o[fin]).norm() / ref_o[fin].norm()) if fin.any() else 0.0
    lse_err = float((lse[fin] - ref_l[fin]).abs().max() / ref_l[fin].abs().max().clamp_min(8.0)) if fin.any() else 0.0
    empty_ok = bool((o[empty] == 0).all() and (lse[empty] == -math.inf).all()) if empty.any() else True
    o1, l1 = p.out.clone(), p.lse.clone()
    p.run()
    p.run()
    torch.cuda.synchronize()
    same = bool(torch.equal(o1, p.out) and torch.equal(l1.nan_to_num(), p.lse.nan_to_num()))
    ok = nan_bad == 0 and rel <= 3e-3 and lse_err <= 6e-4 and empty_ok and same
    RESULTS["checks"].append(dict(name=name, ok=ok, rel_l2=rel, lse=lse_err, nan=nan_bad, empty_ok=empty_ok,
                                  rerun_identical=same, grid=p.grid, items=p.n_items))
    log(f"CHECK {'PASS' if ok else 'FAIL'} {name:36s} relL2 {rel:.2e} lse {lse_err:.1e} nan {nan_bad} "
        f"empty {empty_ok} rerun-identical {same} grid {p.grid} items {p.n_items} ({time.time() - t0:.1f} s)")
    return ok


def _api_checks():
    """decode_v2_device's H128 API checks (auto picks gluon; CUDA-graph replay after a re-plan, replay
    bit-identical, empty request 0) with the split switch on; each must have launched the split kernel."""
    out = []
    for name, fn in dv._api_checks():
        def run(fn=fn, name=name):
            n0 = CALLS["split"]
            ok = fn()
            used = CALLS["split"] > n0
            if not used:
                log(f"CHECK FAIL {name}: the split kernel was not launched (switch not honoured)")
            return ok and used
        out.append((name + " [split]", run))
    return out


def run_checks():
    odd = [1, 63, 64, 65, 0, 97, 514, 4096, 130]
    short = [0, 1, 63, 65, 1000]
    mk = dv.make_case
    checks = [
        ("H128 p64 odd lens", lambda: check("H128 p64 odd lens", mk(odd, 128, 64, seed=51))),
        ("H128 p64 lens 0/1/63/65/1000", lambda: check("H128 p64 lens 0/1/63/65/1000", mk(short, 128, 64, seed=52))),
        ("H128 p64 1 slot (2 CTAs)", lambda: check("H128 p64 1 slot (2 CTAs)", mk(odd, 128, 64, seed=53),
                                                   num_ctas=2)),
        ("H128 p64 7 slots (items wrap)", lambda: check("H128 p64 7 slots (items wrap)", mk(odd, 128, 64, seed=54),
                                                        num_ctas=14)),
        ("H128 p64 B1 L32768 many splits", lambda: check("H128 p64 B1 L32768 many splits",
                                                         mk([32768], 128, 64, seed=55))),
        ("H128 p64 all empty", lambda: check("H128 p64 all empty", mk([0, 0], 128, 64, seed=56))),
        ("H64 p64 odd lens (NHG 1)", lambda: check("H64 p64 odd lens (NHG 1)", mk(odd, 64, 64, seed=57))),
        ("H100 p16 odd lens (padded group)", lambda: check("H100 p16 odd lens (padded group)",
                                                           mk(odd, 100, 16, seed=58))),
        ("H128 p1 odd lens", lambda: check("H128 p1 odd lens", dv.to_page1(mk(short + [130], 128, 64, seed=59),
                                                                           seed=59, past=3))),
        ("H128 p64 fp16 q scales .05/.02 x4", lambda: check(
            "H128 p64 fp16 q scales .05/.02 x4", mk([777, 65, 3000], 128, 64, seed=60, q_dtype=torch.float16,
                                                    ckv_scale=0.05, kpe_scale=0.02, value=4.0))),
        ("H128 p64 ns2", lambda: check("H128 p64 ns2", mk(odd, 128, 64, seed=61), ns=2)),
        ("H40 p32 odd lens", lambda: check("H40 p32 odd lens", mk([1, 31, 33, 97, 2000], 40, 32, seed=62),
                                           num_ctas=7)),
    ]
    try:
        checks += _api_checks()
    except Exception as e:  # noqa: BLE001
        log(f"  API checks unavailable: {type(e).__name__}: {str(e)[:200]}")
    results = []
    for name, fn in checks:
        if time.time() - dv.T_START > CHECKS_DEADLINE_S:
            log(f"CHECK SKIP {name} (past {CHECKS_DEADLINE_S:.0f} s)")
            results.append((name + " (skipped)", False))
            continue
        results.append((name, dv._guarded(name, fn)))
    return results


SHAPES = [(128, 64, 8192), (128, 8, 8192), (128, 1, 32768), (64, 64, 8192)]


def run_bench():
    flush = dv.Flush()
    read, mm = dv.ceilings(flush)
    RESULTS["env"].update(read_gbps=read, matmul_tflops=mm)
    log(f"ceilings: read {read:.0f} GB/s (torch.sum 4 GB bf16), bf16 matmul {mm:.0f} TFLOP/s")
    table = []
    for H, B, L in SHAPES:
        if time.time() - dv.T_START > BENCH_DEADLINE_S:
            log(f"  skipped H{H} B{B} L{L}: past {BENCH_DEADLINE_S:.0f} s")
            continue
        c = dv.make_case([L] * B, H, 64, seed=B, nan_pool=False, spare=8)
        nbytes = B * L * (DC + dv.DK)
        floor = max(nbytes / (read * 1e9), 2 * B * H * L * (DC + dv.DK + DC) / (mm * 1e12)) * 1e3
        ref_o, _ = dv.reference(c, nreq=min(B, 2))
        row = dict(shape=f"H{H} B{B} L{L}", floor=floor)
        kinds = [("split", SplitPlan, {}), ("wide", dv.Plan, {})]
        if (H, B) == (128, 64):
            kinds.append(("split_cmp_only", SplitPlan, dict(mode=2)))   # producer loads nothing: compute alone
        for name, cls, kw in kinds:
            try:
                p = cls(c, **kw)
                p.run()
                torch.cuda.synchronize()
                err = float((p.out[:2].double() - ref_o).norm() / ref_o.norm())
                ms = dv.graph_ms(p.run, flush)
                row[name], row[name + "_err"] = ms, err
                log(f"  {row['shape']:16s} {name:15s} {ms:.4f} ms  {100 * floor / ms:5.1f}% floor  err {err:.1e}"
                    f"  grid {p.grid} items {p.n_items}")
            except Exception as e:  # noqa: BLE001
                log(f"  {row['shape']} {name}: {type(e).__name__}: {str(e)[:300]}")
        table.append(row)
        RESULTS["bench"].append(row)
        del c
        torch.cuda.empty_cache()
    return table


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    dv._WATCH["limit"] = float(os.environ["DECODE_V2_HANG_S"])
    dv._watchdog()
    results = run_checks()
    table = []
    if what != "check":
        dv._WATCH.update(name="bench", since=time.time(), limit=max(20.0, 200.0 - (time.time() - dv.T_START)))
        try:
            table = run_bench()
        except Exception as e:  # noqa: BLE001
            log(f"BENCH error: {type(e).__name__}: {str(e)[:300]}")
        dv._WATCH["name"] = None
    log("")
    log("== split summary ==")
    for r in table:
        f = r["floor"]
        cells = "  ".join(f"{k} {r[k]:.4f} ({100 * f / r[k]:4.1f}%)" for k in ("split", "wide", "split_cmp_only")
                          if k in r)
        log(f"  {r['shape']:16s} floor {f:.4f}  {cells}"
            + (f"  split/wide {r['wide'] / r['split']:.2f}x" if "split" in r and "wide" in r else ""))
    fails = [n for n, ok in results if not ok]
    for n in fails:
        log(f"  FAIL  {n}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_split.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
    n_ok = sum(ok for _, ok in results)
    log(f"CHECKS {'ALL PASS' if not fails else 'SOME FAIL'} ({n_ok}/{len(results)})")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
