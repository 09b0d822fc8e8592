"""The software-pipelined H <= 16 kernel (``fp8mla.kernels.decode_sm90_pipe``) on the H200: checks against float64
and bit for bit against the current kernel (``decode_sm90``, H16 path), then timings against it and the floor (read
ceiling measured in this process, CUDA graphs, L2 flushed before every replay). One command, <= ~3 minutes, a
hang watchdog per step:

    python scripts/decode_pipe_device.py            # checks + timings; ends with CHECKS ALL PASS (n/n) or the fails
    python scripts/decode_pipe_device.py check      # checks only

Every check: NaN in out, lse and every partial before the run, NaN in every unused pool slot (and past kv_len),
shuffled pages; float64 reference (rel L2 <= 3e-3, lse); empty requests o = 0, lse = -inf; two reruns
bit-identical; and, with the merge off in both, the pipelined kernel's direct outputs and split partials
bit-identical to decode_sm90's (the merge kernels differ: decode_sm90's is being reworked).
Reuses scripts/decode_v2_device.py (cases, reference, the current kernel's plan, ceilings, graph timing, watchdog).
Writes $OUT/decode_pipe.json when $OUT is set. FP8MLA_GLUON_PIPE=1 is set inside (the API checks go through the
gluon backend's switch and must have launched the pipelined kernel).
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
os.environ["FP8MLA_GLUON_PIPE"] = "1"
os.environ.setdefault("DECODE_V2_HANG_S", "75")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
from fp8mla.kernels import decode_sm90_pipe as pipe  # noqa: E402

DC = dv.DC
DEV = dv.DEV
log = dv.log
RESULTS = dv.RESULTS
CALLS = {"pipe": 0}
CHECKS_DEADLINE_S = float(os.environ.get("PIPE_CHECKS_DEADLINE", "115"))   # no new check after this
BENCH_DEADLINE_S = float(os.environ.get("PIPE_BENCH_DEADLINE", "160"))    # no new shape after this (+15 s: variants)

_launch_for_plan = pipe.launch_for_plan


def _counted(*a, **kw):
    CALLS["pipe"] += 1
    return _launch_for_plan(*a, **kw)


pipe.launch_for_plan = _counted   # the backend looks the attribute up at run time: the API checks count here


class PipePlan(dv.Plan):
    """decode_v2_device's host plan (same schedule, grid, partial rows) launching the pipelined kernel."""

    def __init__(self, c, *, ns=pipe.NS_DEFAULT, xg=None, red=True, depth=11, **kw):
        super().__init__(c, ns=ns, **kw)
        self.xg, self.red, self.depth = xg, red, depth

    def run(self):
        c = self.c
        if DEV != "cuda":   # DECODE_V2_DEVICE=cpu: a dry run of the host code
            return
        pipe.launch(self.desc[0], self.desc[1], c["q_nope"], c["q_pe"], c["scales"], self.t, self.out, self.lse,
                    grid=self.grid, grid_batch=self.B, num_heads=c["H"], sm_scale=c["sm_scale"], page_size=c["page"],
                    ns=self.ns, regs=self.regs, merge_p=self.merge_p, merge_c=self.merge_c, mode=self.mode,
                    merge=self.merge, global_exchange=self.xg, red=self.red, depth=self.depth)


def _bits(x):
    return x.contiguous().view(torch.int32 if x.element_size() == 4 else torch.int16)


def _poison(p):
    p.out.fill_(float("nan"))
    p.lse.fill_(float("nan"))
    p.t["part_o"].fill_(float("nan"))
    p.t["part_lse"].fill_(float("nan"))


def bit_identical(c, plan_kw):
    """Merge off in both kernels: out/lse written directly (whole-request items) and the partials of split
    requests (rows < H), bit for bit; the pipelined kernel at plan_kw, the current one at its default NS 3."""
    kw = {k: v for k, v in plan_kw.items() if k in ("num_ctas", "min_tiles")}
    a = PipePlan(c, merge=False, **plan_kw)
    b = dv.Plan(c, merge=False, **kw)
    for p in (a, b):
        _poison(p)
        p.run()
    torch.cuda.synchronize()
    H = c["H"]
    m_ptr = b.t["m_ptr"].tolist()
    split_items = [i for r in range(len(m_ptr) - 1) if m_ptr[r + 1] - m_ptr[r] >= 2
                   for i in b.t["m_list"][m_ptr[r]:m_ptr[r + 1]].tolist()]
    same = torch.equal(_bits(a.out), _bits(b.out)) and torch.equal(_bits(a.lse), _bits(b.lse))
    if split_items:
        idx = torch.tensor(split_items, device=DEV, dtype=torch.long)
        same = same and torch.equal(_bits(a.t["part_o"][idx, :H]), _bits(b.t["part_o"][idx, :H]))
        same = same and torch.equal(_bits(a.t["part_lse"][idx, :H]), _bits(b.t["part_lse"][idx, :H]))
    return bool(same), len(split_items)


def check(name, c, *, bitid=True, **plan_kw):
    t0 = time.time()
    p = PipePlan(c, **plan_kw)
    _poison(p)
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
    bid, nsplit = bit_identical(c, plan_kw) if bitid else (True, -1)
    ok = nan_bad == 0 and rel <= 3e-3 and lse_err <= 6e-4 and empty_ok and same and bid
    RESULTS["checks"].append(dict(name=name, ok=ok, rel_l2=rel, lse=lse_err, nan=nan_bad, empty_ok=empty_ok,
                                  rerun_identical=same, bit_identical=bid if bitid else None, grid=p.grid,
                                  items=p.n_items))
    log(f"CHECK {'PASS' if ok else 'FAIL'} {name:36s} relL2 {rel:.2e} lse {lse_err:.1e} nan {nan_bad} "
        f"empty {empty_ok} rerun {same} vs-current {bid if bitid else '-'} ({nsplit} split parts) grid {p.grid} "
        f"items {p.n_items} ({time.time() - t0:.1f} s)")
    return ok


def _api_checks():
    """Through MLAPagedAttention with FP8MLA_GLUON_PIPE=1 at H16: auto picks gluon and the pipelined kernel;
    CUDA-graph replay after a re-plan (longer / shorter / empty requests), replays bit-identical."""
    import fp8mla
    from fp8mla.reference import mla_reference
    from fp8mla.testing import capture_then_replay, make_paged_batch

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    def auto_pick():
        H = 16
        b = make_paged_batch([700, 1, 64, 0, 1500], [1] * 5, H, 64, "fp8_e4m3", device=DEV, seed=31)
        attn = fp8mla.MLAPagedAttention(backend="auto")
        attn.plan(**b.plan_args)
        out = torch.full((5, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
        lse = torch.full((5, H), float("nan"), device=DEV)
        n0 = CALLS["pipe"]
        attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        ro, rl = b.reference()
        fin = torch.isfinite(rl)
        e, le = rel(out, ro), float((lse[fin] - rl[fin]).abs().max())
        name = attn._plan.backend
        used = CALLS["pipe"] > n0
        ok = name == "gluon" and used and e <= 3e-3 and le <= 5e-3 and not torch.isnan(out).any()
        log(f"CHECK {'PASS' if ok else 'FAIL'} {'API H16 auto -> ' + name:36s} pipe launched {used} relL2 {e:.2e} "
            f"lse {le:.1e}")
        return ok

    def graph_replan():
        H = 16
        attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
        b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 64, "fp8_e4m3", device=DEV, seed=32, spare_pages=60)
        attn.plan(**b1.plan_args)
        q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
        out = torch.empty_like(q_nope)
        lse = torch.empty(3, H, device=DEV)
        kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
        n0 = CALLS["pipe"]
        g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
        used = CALLS["pipe"] > n0
        e1 = rel(out, b1.reference()[0])
        a = dict(b1.plan_args)
        pages = a["kv_indices"]
        a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEV)
        a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEV)
        a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
        attn.plan(**a)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                               a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
        e2 = rel(out[:2], ref[:2])
        o1 = out.clone()
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(o1, out)
        empty_ok = bool((out[2] == 0).all())
        ok = used and e1 <= 3e-3 and e2 <= 3e-3 and same and empty_ok
        log(f"CHECK {'PASS' if ok else 'FAIL'} {'API H16 graph replay after re-plan':36s} pipe launched {used} "
            f"relL2 {e1:.2e} / {e2:.2e} replay-identical {same} empty {empty_ok}")
        return ok

    return [("API H16 auto picks gluon + pipe", auto_pick), ("API H16 graph replay after re-plan", graph_replan)]


def run_checks():
    odd = [1, 63, 65, 97, 514, 0, 1000, 130]
    mk = dv.make_case
    checks = [
        ("H16 p64 odd lens", lambda: check("H16 p64 odd lens", mk(odd, 16, 64, seed=71))),
    ]
    try:
        checks += _api_checks()
    except Exception as e:  # noqa: BLE001
        log(f"  API checks unavailable: {type(e).__name__}: {str(e)[:200]}")
    checks += [
        ("H16 p64 7 slots (items wrap)", lambda: check("H16 p64 7 slots (items wrap)", mk(odd, 16, 64, seed=72),
                                                       num_ctas=7)),
        ("H16 p64 B1 L32768 many splits", lambda: check("H16 p64 B1 L32768 many splits", mk([32768], 16, 64, seed=74))),
        ("H8 p64 (padded heads)", lambda: check("H8 p64 (padded heads)", mk([300, 7, 2000, 0, 65], 8, 64, seed=75))),
        ("H1 p64", lambda: check("H1 p64", mk([1000, 63, 1, 514], 1, 64, seed=76), num_ctas=9)),
        ("H16 p16 odd lens", lambda: check("H16 p16 odd lens", mk([1, 15, 17, 63, 65, 1000, 0], 16, 16, seed=77),
                                           num_ctas=11)),
        ("H16 p1 odd lens", lambda: check("H16 p1 odd lens", dv.to_page1(mk(odd, 16, 64, seed=78), seed=78, past=3),
                                          num_ctas=13)),
        ("H16 p64 fp16 q scales .05/.02 x4", lambda: check(
            "H16 p64 fp16 q scales .05/.02 x4", mk([777, 65, 3000], 16, 64, seed=79, q_dtype=torch.float16,
                                                   ckv_scale=0.05, kpe_scale=0.02, value=4.0))),
        ("H16 p64 all empty", lambda: check("H16 p64 all empty", mk([0, 0], 16, 64, seed=80))),
        ("H16 p64 ns4 (smem exchange)", lambda: check("H16 p64 ns4 (smem exchange)", mk(odd, 16, 64, seed=81),
                                                      ns=4, num_ctas=7)),
        ("H16 p64 ns3, 1 slot", lambda: check("H16 p64 ns3, 1 slot", mk(odd, 16, 64, seed=83), ns=3, num_ctas=1)),
        ("H16 p64 depth 22 (QK, P.V 2 in flight)", lambda: check("H16 p64 depth 22 (QK, P.V 2 in flight)",
                                                                  mk(odd, 16, 64, seed=85), depth=22, num_ctas=7)),
        ("H16 p64 triton's max reduction", lambda: check("H16 p64 triton's max reduction", mk(odd, 16, 64, seed=84),
                                                         red=False)),
    ]
    results = []
    for name, fn in checks:
        if time.time() - dv.T_START > CHECKS_DEADLINE_S:
            log(f"CHECK SKIP {name} (past {CHECKS_DEADLINE_S:.0f} s)")
            results.append((name + " (skipped)", False))
            continue
        results.append((name, dv._guarded(name, fn)))
    return results


SHAPES = [(16, 64, 8192), (16, 128, 2048), (16, 32, 4096), (16, 8, 8192), (16, 1, 32768)]   # most important first
TARGETS = {(16, 64, 8192): .090, (16, 128, 2048): .045, (16, 32, 4096): .025, (16, 8, 8192): .015,
           (16, 1, 32768): .012}


def _time(row, name, cls, kw, c, ref_o, flush):
    try:
        p = cls(c, **kw)
        p.run()
        torch.cuda.synchronize()
        err = float((p.out[:2].double() - ref_o).norm() / ref_o.norm()) if kw.get("merge", True) else 0.0
        ms = dv.graph_ms(p.run, flush)
        row[name], row[name + "_err"] = ms, err
        log(f"  {row['shape']:16s} {name:16s} {ms:.4f} ms  {100 * row['floor'] / ms:5.1f}% floor  err {err:.1e}"
            f"  grid {p.grid} items {p.n_items}")
    except Exception as e:  # noqa: BLE001
        log(f"  {row['shape']} {name}: {type(e).__name__}: {str(e)[:300]}")


def run_bench():
    """Pass 1: every shape, the pipelined kernel vs the current one (B64 also kernel-only, merge off). Pass 2 (time
    left): B64 L8k variants (NS 4 with the shared-memory exchange, triton's max reduction, wait depths 12/21/22,
    compute-only probes: the producer loads nothing)."""
    flush = dv.Flush()
    read, mm = dv.ceilings(flush)
    RESULTS["env"].update(read_gbps=read, matmul_tflops=mm, torch=torch.__version__)
    try:
        import triton
        RESULTS["env"]["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    log(f"ceilings: read {read:.0f} GB/s (torch.sum 4 GB bf16), bf16 matmul {mm:.0f} TFLOP/s")
    table, cases = [], {}
    extras = [("pipe_ns4", PipePlan, dict(ns=4)), ("pipe_d12", PipePlan, dict(depth=12)),
              ("pipe_tlred", PipePlan, dict(red=False)), ("pipe_d21", PipePlan, dict(depth=21)),
              ("pipe_d22", PipePlan, dict(depth=22)), ("pipe_cmp_only", PipePlan, dict(mode=2, merge=False)),
              ("current_cmp_only", dv.Plan, dict(mode=2, merge=False))]
    for H, B, L in SHAPES:
        if time.time() - dv.T_START > BENCH_DEADLINE_S:
            log(f"  skipped H{H} B{B} L{L}: past {BENCH_DEADLINE_S:.0f} s")
            continue
        c = dv.make_case([L] * B, H, 64, seed=B, nan_pool=False, spare=8)
        floor = B * L * (DC + dv.DK) / (read * 1e9) * 1e3
        ref_o, _ = dv.reference(c, nreq=min(B, 2))
        row = dict(shape=f"H{H} B{B} L{L}", floor=floor, target=TARGETS.get((H, B, L)))
        kinds = [("pipe", PipePlan, {}), ("current", dv.Plan, {})]
        if (H, B) == (16, 64):
            kinds += [("pipe_kernel", PipePlan, dict(merge=False)), ("current_kernel", dv.Plan, dict(merge=False))]
            cases["b64"] = (c, ref_o, row)
        for name, cls, kw in kinds:
            _time(row, name, cls, kw, c, ref_o, flush)
        table.append(row)
        RESULTS["bench"].append(row)
        if (H, B) != (16, 64):
            del c
            torch.cuda.empty_cache()
    if "b64" in cases:
        c, ref_o, row = cases["b64"]
        for name, cls, kw in extras:
            if time.time() - dv.T_START > BENCH_DEADLINE_S + 15:
                log(f"  skipped B64 variant {name}: past {BENCH_DEADLINE_S + 15:.0f} s")
                continue
            _time(row, name, cls, kw, c, ref_o, flush)
    return table


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
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
    log("== pipe summary (ms; % of the HBM floor) ==")
    keys = ("pipe", "current", "pipe_ns4", "pipe_tlred", "pipe_d12", "pipe_d21", "pipe_d22", "pipe_kernel",
            "current_kernel", "pipe_cmp_only", "current_cmp_only")
    for r in table:
        f = r["floor"]
        cells = "  ".join(f"{k} {r[k]:.4f} ({100 * f / r[k]:4.1f}%)" for k in keys if k in r)
        log(f"  {r['shape']:16s} floor {f:.4f} target {r['target']}  {cells}"
            + (f"  current/pipe {r['current'] / r['pipe']:.3f}x" if "pipe" in r and "current" in r else ""))
    fails = [n for n, ok in results if not ok]
    for n in fails:
        log(f"  FAIL  {n}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_pipe.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
    n_ok = sum(ok for _, ok in results)
    log(f"CHECKS {'ALL PASS' if not fails else 'SOME FAIL'} ({n_ok}/{len(results)})")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
