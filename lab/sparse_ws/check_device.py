"""The warp-specialized sparse prototype (lab/sparse_ws/kernel.py) on one H200: float64 checks, then CUDA-graph
timings beside the product's Gluon sparse build and the Triton sparse kernel, with the read-bandwidth and bf16
matmul ceilings of the same process.

    PYTHONPATH=$PWD/src:$PWD python3 lab/sparse_ws/check_device.py --out $OUT/sparse_ws.json   # GPU, < 4 min
    PYTHONPATH=$PWD/src:$PWD python3 lab/sparse_ws/check_device.py --dry-run                   # CPU parts

1. checks (in a child process with a time limit: a deadlocked barrier cannot stop the run): fresh random
   ``fp8_ds_mla`` batches (make_sparse_batch: shuffled pages, NaN in every unused record), -1 padding scattered /
   trailing, an out-of-pool entry, an all -1 row, odd topk (37, 129, 1000) and split counts (1, 2, 3, 7), outputs
   and lse poisoned with NaN, H 8 / 16 / 64 / 128; rel L2 <= 3e-3 vs float64, lse rel L2 <= 1e-4, no NaN mismatch,
   a rerun bit-identical, one CUDA-graph replay after poisoning again.
2. timings (CUDA graph, L2 flushed, median): H128 / H16 / H8, topk 2048 of 4096 tokens, B64 (full rows of distinct
   random tokens, as docs/benchmarks.md's sparse table): the prototype at the product's split count and at the
   one-wave count, the product's Gluon build (backend="gluon"), the Triton kernel (backend="triton"), the floor
   max(gathered bytes / read BW, FLOPs / bf16 matmul). The prototype is timed only if its checks ran to the end
   (no hang); a failed check is flagged in the table.
Every case fails soft. Writes one JSON (--out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kernel as ws  # noqa: E402

DC, DK = 512, 64
TOL, LSE_TOL = 3e-3, 1e-4
# (name, H, topk, B, splits, pad, extras)
CHECKS = [
    ("H8 topk2048 B3 s1", 8, 2048, 3, 1, "scattered"),
    ("H8 topk37 B5 s1 trailing", 8, 37, 5, 1, "trailing"),
    ("H16 topk2048 B4 s3", 16, 2048, 4, 3, "scattered"),
    ("H16 topk1000 B3 s2 trailing", 16, 1000, 3, 2, "trailing"),
    ("H64 topk1000 B3 s2", 64, 1000, 3, 2, "scattered"),
    ("H64 topk2048 B2 s7", 64, 2048, 2, 7, "scattered"),
    ("H128 topk2048 B4 s1", 128, 2048, 4, 1, "scattered"),
    ("H128 topk129 B3 s3", 128, 129, 3, 3, "scattered"),
    ("H16 topk2048 B64 s2", 16, 2048, 64, 2, "scattered"),
    ("H128 topk2048 B16 s1", 128, 2048, 16, 1, "trailing"),
]
TIMED = [(128, 2048, 64), (16, 2048, 64), (8, 2048, 64)]
RESULTS: dict = {"checks": [], "timings": [], "env": {}, "errors": []}


def log(msg):
    print(msg, flush=True)


def save(path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def views(kv):
    """(ckv e4m3 [P, page, 512], kpe bf16 [P, page, 64], scales fp32 [P, page, 4]) of a record pool, as the
    product's MLASparseAttention._split_pool makes them."""
    k8 = kv.view(torch.uint8)
    return k8[..., :512].view(torch.float8_e4m3fn), k8.view(torch.bfloat16)[..., 264:328], \
        k8.view(torch.float32)[..., 128:132]


def make_check(H, topk, B, pad, seed, device):
    from fp8mla.testing import make_sparse_batch
    b = make_sparse_batch([topk + 37] * B, [1] * B, H, topk, 64, "fp8_ds_mla", pad=pad, seed=seed, device=device)
    r = b.run_args
    idx = r["indices"].clone()
    num_slots = r["kv_cache"].shape[0] * 64
    if B > 1:
        idx[B - 1] = -1                                        # no token: out 0, lse -inf
        ok0 = (idx[0] >= 0).nonzero()
        idx[0, int(ok0[0]) if len(ok0) else 0] = num_slots + 5   # out of the pool: skipped like -1
        idx[0, -1] = -7                                        # another negative id
    r["indices"] = idx
    return b


def run_ws(b, out, lse, splits):
    from fp8mla.testing import compare  # noqa: F401
    r = b.run_args
    n, H = r["q_nope"].shape[:2]
    ckv, kpe, sa = views(r["kv_cache"])
    _, s = ws.split_geometry(r["indices"].shape[1], splits)
    po = torch.full((n * s, H, DC), math.nan, device=out.device)
    pl = torch.full((n * s, H), math.nan, device=out.device)
    ws.sparse_mla(r["q_nope"], r["q_pe"], ckv, kpe, sa, r["indices"], out, lse, po, pl,
                  sm_scale=b.plan_args["sm_scale"], num_splits=splits, lse_scale=1.0)
    return po, pl


def child_checks(path, device="cuda"):
    from fp8mla.testing import compare, capture_then_replay
    for k, (name, H, topk, B, splits, pad) in enumerate(CHECKS):
        rec = {"name": name, "H": H, "topk": topk, "B": B, "splits": splits, "pad": pad}
        t0 = time.perf_counter()
        try:
            b = make_check(H, topk, B, pad, 500 + k, device)
            ref_o, ref_l = b.reference()
            out = torch.full((B, H, DC), math.nan, dtype=torch.bfloat16, device=device)
            lse = torch.full((B, H), math.nan, device=device)
            run_ws(b, out, lse, splits)
            torch.cuda.synchronize()
            c, cl = compare(out, ref_o), compare(lse, ref_l)
            empty_ok = bool((out[B - 1] == 0).all() and (lse[B - 1] == -math.inf).all()) if B > 1 else True
            o2 = torch.full_like(out, math.nan)
            l2 = torch.full_like(lse, math.nan)
            run_ws(b, o2, l2, splits)
            torch.cuda.synchronize()
            rerun = bool(torch.equal(o2.view(torch.int16), out.view(torch.int16)) and torch.equal(
                torch.nan_to_num(l2, neginf=-1e30), torch.nan_to_num(lse, neginf=-1e30)))
            rec.update(rel_l2=c.rel_l2, max_abs=c.max_abs, nan_mismatch=c.nan_mismatch, worst=c.worst,
                       lse_rel_l2=cl.rel_l2, lse_nan_mismatch=cl.nan_mismatch, empty_ok=empty_ok, rerun_identical=rerun)
            ok = c.ok(TOL) and cl.ok(LSE_TOL) and empty_ok and rerun
            if k == 0:   # a CUDA-graph replay after poisoning
                capture_then_replay(lambda: run_ws(b, out, lse, splits), out)
                cg = compare(out, ref_o)
                rec["graph_rel_l2"] = cg.rel_l2
                ok = ok and cg.ok(TOL)
            if not ok and B > 1:   # where: by token
                rec["rel_l2_by_token"] = [compare(out[t], ref_o[t]).rel_l2 for t in range(min(B, 8))]
            rec["ok"] = bool(ok)
            k_ = ws.LAST_COMPILED
            if k_ is not None:
                rec.update(n_regs=getattr(k_, "n_regs", None), n_spills=getattr(k_, "n_spills", None),
                           smem=getattr(getattr(k_, "metadata", None), "shared", None))
        except Exception as e:  # noqa: BLE001 - fail soft
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}", trace=traceback.format_exc()[-2000:])
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        RESULTS["checks"].append(rec)
        save(path)
        log(f"check {'PASS' if rec['ok'] else 'FAIL'}  {name}: " + (rec.get("error") or
            f"rel_l2 {rec['rel_l2']:.2e} lse {rec['lse_rel_l2']:.1e} nan_mm {rec['nan_mismatch']} empty_ok "
            f"{rec['empty_ok']} rerun {rec['rerun_identical']} ({rec['wall_s']} s)"))


# -- timing ---------------------------------------------------------------------------------------------------
def timing_inputs(H, topk, B, device):
    from fp8mla.bench.sparse import _pool
    from fp8mla.formats import get_format
    fmt = get_format("fp8_ds_mla", sparse_ok=True)
    g = torch.Generator(device=device).manual_seed(H * 7 + B)
    L = 2 * topk
    kv, slots, _, _ = _pool(B, L, 64, fmt, device, g)
    pick = torch.rand(B, L, device=device, generator=g).argsort(dim=1)[:, :topk]
    indices = torch.gather(slots, 1, pick).to(torch.int32)
    q_nope = torch.randn(B, H, DC, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, DK, device=device, dtype=torch.bfloat16)
    return kv, indices, q_nope, q_pe


def run_timings(path, reps, ws_ok):
    import fp8mla
    from fp8mla.bench.common import measure_ceilings, time_ms
    from fp8mla.bench.sparse import sparse_cost
    from fp8mla.testing import compare
    device = "cuda"
    try:
        ceil = measure_ceilings(device)
        RESULTS["ceilings"] = {"read_gbps": ceil.read_gbps, "matmul_tflops": ceil.matmul_tflops}
    except Exception as e:  # noqa: BLE001
        ceil = None
        RESULTS["errors"].append(f"ceilings: {type(e).__name__}: {e}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sm_scale = 1.0 / math.sqrt(576)
    for H, topk, B in TIMED:
        try:
            kv, indices, q_nope, q_pe = timing_inputs(H, topk, B, device)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"inputs H{H}: {type(e).__name__}: {e}")
            continue
        nbytes, flops = sparse_cost(B, H, topk, "fp8_ds_mla")
        floor = ceil.floor_ms(nbytes, flops) if ceil else None
        ref = {}
        runners = []
        prod_splits = None
        for label, backend in (("product gluon", "gluon"), ("triton", "triton")):
            try:
                attn = fp8mla.MLASparseAttention(backend=backend)
                attn.plan(H, topk, 64, sm_scale, torch.bfloat16, "fp8_ds_mla", num_pages=kv.shape[0], device=device)
                out = torch.empty(B, H, DC, device=device, dtype=torch.bfloat16)
                lse = torch.empty(B, H, device=device)
                runners.append((label, attn.splits_for(B), (lambda a=attn, o=out, l_=lse:
                                                            a.run(q_nope, q_pe, kv, indices, out=o, lse=l_)), out))
                if backend == "gluon":
                    prod_splits = attn.splits_for(B)
            except Exception as e:  # noqa: BLE001
                RESULTS["timings"].append(dict(kernel=label, H=H, topk=topk, B=B, error=f"{type(e).__name__}: {e}"))
        if ws_ok in ("ok", "failed"):
            ckv, kpe, sa = views(kv)
            groups = -(-H // 64)
            wave = max(1, sms // (B * groups))
            cand = [("ws (product splits)", prod_splits or wave), ("ws (one wave)", wave)]
            seen = set()
            for label, s in cand:
                _, s_eff = ws.split_geometry(topk, s)
                if s_eff in seen:
                    continue
                seen.add(s_eff)
                out = torch.empty(B, H, DC, device=device, dtype=torch.bfloat16)
                lse = torch.empty(B, H, device=device)
                po = torch.empty(B * s_eff, H, DC, device=device)
                pl = torch.empty(B * s_eff, H, device=device)
                fn = (lambda o=out, l_=lse, po=po, pl=pl, s=s: ws.sparse_mla(
                    q_nope, q_pe, ckv, kpe, sa, indices, o, l_, po, pl, sm_scale=sm_scale, num_splits=s,
                    lse_scale=1.0))
                runners.append((label, s_eff, fn, out))
        for label, s, fn, out in runners:
            rec = dict(kernel=label, H=H, topk=topk, B=B, splits=s)
            try:
                fn()
                torch.cuda.synchronize()
                ms = time_ms(fn, reps=reps)
                rec.update(ms=ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9)
                if floor:
                    rec.update(floor_ms=floor, pct_floor=100 * floor / ms)
                if label == "product gluon":
                    ref["o"] = out.clone()
                elif "o" in ref:   # agreement with the product's build on the timed inputs
                    rec["rel_l2_vs_product"] = compare(out, ref["o"]).rel_l2
                if label.startswith("ws") and ws_ok != "ok":
                    rec["note"] = "checks failed"
            except Exception as e:  # noqa: BLE001
                rec.update(error=f"{type(e).__name__}: {str(e)[:400]}")
            RESULTS["timings"].append(rec)
            save(path)
            log(f"time {label:20s} H{H} B{B} splits {s}: " + (rec.get("error") or f"{rec['ms']:.4f} ms"))


def table():
    rows = RESULTS["timings"]
    log("\nkernel                 H    B  splits   ms       %floor  GB/s   TFLOP/s  vs product  note")
    for r in rows:
        if "error" in r:
            log(f"{r['kernel']:22s} {r['H']:<4} {r['B']:<4} ERROR {r['error'][:90]}")
            continue
        log(f"{r['kernel']:22s} {r['H']:<4} {r['B']:<4} {r['splits']:<7} {r['ms']:.4f}   "
            f"{r.get('pct_floor', float('nan')):5.1f}   {r['gbps']:5.0f}  {r['tflops']:6.1f}   "
            f"{r.get('rel_l2_vs_product', float('nan')):.1e}    {r.get('note', '')}")
    for H, topk, B in TIMED:
        f = [r for r in rows if r["H"] == H and "ms" in r]
        if f and "floor_ms" in f[0]:
            log(f"floor H{H} B{B}: {f[0]['floor_ms']:.4f} ms")
    if "ceilings" in RESULTS:
        c = RESULTS["ceilings"]
        log(f"ceilings: read {c['read_gbps']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s")
    n_ok = sum(1 for r in RESULTS["checks"] if r.get("ok"))
    log(f"checks: {n_ok} / {len(RESULTS['checks'])} passed (of {len(CHECKS)})")


def dry_run():
    """CPU: the numerics model vs float64, the split geometry, the launcher's refusals, the check inputs."""
    import model
    from fp8mla.testing import compare
    ok_all = True
    res = model.run(verbose=True)
    worst = max(r["ws"]["rel_l2"] for r in res)
    nanm = sum(r["ws"]["nan_mismatch"] for r in res)
    log(f"model: worst rel L2 {worst:.3e}, NaN mismatches {nanm} -> {'PASS' if worst <= TOL and nanm == 0 else 'FAIL'}")
    ok_all &= worst <= TOL and nanm == 0
    geo = [(ws.split_geometry(t, s), t, s) for t, s in ((2048, 1), (2048, 3), (2048, 7), (129, 3), (37, 2),
                                                          (1000, 2), (64, 5))]
    good = all(c % 64 == 0 and (n - 1) * c < t <= n * c for (c, n), t, s in geo)
    log(f"split geometry {[(t, s, g) for g, t, s in geo]} -> {'PASS' if good else 'FAIL'}")
    ok_all &= good
    # the check inputs build and their float64 reference runs (the model stands in for the kernel)
    for k, (name, H, topk, B, splits, pad) in enumerate(CHECKS[:8]):
        b = make_check(H, topk, B, pad, 500 + k, "cpu")
        ref_o, ref_l = b.reference()
        r = b.run_args
        o, l_ = model.model_sparse_ws(r["q_nope"], r["q_pe"], r["kv_cache"], r["indices"],
                                      sm_scale=b.plan_args["sm_scale"], num_splits=splits)
        c, cl = compare(o, ref_o), compare(l_, ref_l)
        empty_ok = bool((o[B - 1] == 0).all() and (l_[B - 1] == -math.inf).all()) if B > 1 else True
        ok = c.ok(TOL) and cl.ok(LSE_TOL) and empty_ok
        ok_all &= ok
        log(f"model on check '{name}': rel_l2 {c.rel_l2:.2e} lse {cl.rel_l2:.1e} empty_ok {empty_ok} -> "
            f"{'PASS' if ok else 'FAIL'}")
    # the checker catches a wrong output
    b = make_check(16, 128, 3, "scattered", 1, "cpu")
    ref_o, ref_l = b.reference()
    bad = ref_o.bfloat16().clone()
    bad[0, 0, :64] *= 1.5
    caught = not compare(bad, ref_o).ok(TOL)
    log(f"checker catches a 50% error on 64 values: {'PASS' if caught else 'FAIL'}")
    ok_all &= caught
    # launcher refusal: a non-contiguous pool
    try:
        ckv, kpe, sa = views(b.run_args["kv_cache"])
        ws.sparse_mla(b.run_args["q_nope"], b.run_args["q_pe"], ckv[:, ::2], kpe, sa, b.run_args["indices"],
                      None, None, None, None, sm_scale=0.1, num_splits=1, lse_scale=1.0)
        refused = False
    except (ValueError, RuntimeError) as e:
        refused = True
        log(f"  ({type(e).__name__}: {str(e)[:100]})")
    log(f"launcher refuses a strided pool (or no Gluon): {'PASS' if refused else 'FAIL'}")
    ok_all &= refused
    log(f"dry run: {'ALL PASS' if ok_all else 'FAILURES'}")
    return 0 if ok_all else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sparse_ws.json"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--child", action="store_true", help="(internal) run the checks, write --out")
    ap.add_argument("--check-timeout", type=float, default=110.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        return dry_run()
    if args.child:
        child_checks(args.out)
        return 0
    import triton
    RESULTS["env"] = dict(torch=torch.__version__, triton=triton.__version__,
                          device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    t0 = time.time()
    ws_ok = "ok"
    if not args.skip_checks:
        child_out = args.out + ".checks.json"
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--out", child_out],
                               timeout=args.check_timeout, capture_output=True, text=True)
            log(p.stdout[-6000:])
            if p.returncode != 0:
                log(p.stderr[-3000:])
                RESULTS["errors"].append(f"checks child rc {p.returncode}: {p.stderr[-1500:]}")
        except subprocess.TimeoutExpired as e:
            ws_ok = "hang"
            log((e.stdout or b"")[-4000:].decode() if isinstance(e.stdout, bytes) else str(e.stdout)[-4000:])
            RESULTS["errors"].append(f"checks child timed out after {args.check_timeout} s (hang?)")
            log(f"checks: TIMED OUT after {args.check_timeout} s: the prototype is not timed")
        try:
            with open(child_out) as f:
                RESULTS["checks"] = json.load(f)["checks"]
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"checks json: {e}")
        if ws_ok == "ok":
            recs = RESULTS["checks"]
            if len(recs) < len(CHECKS):
                ws_ok = "crashed"     # the child stopped early: not timed (a fault would poison this process)
            elif any("error" in r for r in recs):
                ws_ok = "errored"     # an exception (perhaps a CUDA fault): not timed
            elif not all(r.get("ok") for r in recs):
                ws_ok = "failed"      # wrong but ran to the end: timed, flagged
    RESULTS["ws_status"] = ws_ok
    RESULTS["checks_wall_s"] = round(time.time() - t0, 1)
    save(args.out)
    run_timings(args.out, args.reps, ws_ok)
    RESULTS["wall_s"] = round(time.time() - t0, 1)
    save(args.out)
    table()
    log(f"wrote {args.out} ({RESULTS['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
