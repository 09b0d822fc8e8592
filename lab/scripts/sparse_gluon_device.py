"""Device check of the Hopper Gluon sparse kernel (kernels/sm90/sparse.py; until the warp-specialized build each of
its gathers: async, regs, prefetch) beside the Triton one, in one run.

    PYTHONPATH=src python lab/scripts/sparse_gluon_device.py            # on the H200 (~2 min); JSON to $OUT
    PYTHONPATH=src TRITON_INTERPRET=1 python lab/scripts/sparse_gluon_device.py --dry-run   # CPU: plumbing only

1. correctness of backend="gluon" and "triton" against the float64 reference (``sparse_mla_reference``): heads
   8 / 16 / 64 / 128, topk 2048 / 128, B 1 / 8 / 64 (one query token per request; B64 at topk 2048 only for
   H 16 / 128 unless --full), fp8_ds_mla records in shuffled
   pages with NaN in every unused slot, -1 padding (scattered, trailing), one all -1 row and one out-of-pool
   entry, outputs poisoned with NaN before the call; a CUDA-graph replay after poisoning again.
2. timing (CUDA graph, L2 flushed, median) of both at the issue-27 targets: H128 / H16 / H8, topk 2048, B64
   (full rows of distinct random tokens), with the read-bandwidth and bf16 matmul ceilings measured in this
   process and the floor max(gathered bytes / BW, FLOPs / matmul) (FLOPs of the real heads, not the padding).
Every case fails soft (its error is recorded and the run goes on). Prints one short table; writes
$OUT/sparse_gluon_device.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

TARGETS_MS = {128: 0.08, 16: 0.035, 8: 0.035}   # sparse topk 2048, B64
LSE_TOL = 1e-4      # tests/test_sparse_triton.py's budget: out 3e-3 on the GPU, 5e-3 in the CPU interpreter
DC, DK = 512, 64


def _versions() -> dict:
    import triton
    d = dict(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])
    if torch.cuda.is_available():
        d["device"] = torch.cuda.get_device_name()
        d["capability"] = list(torch.cuda.get_device_capability())
    return d


def _compiled_facts(backend: str) -> dict:
    """Registers / spills of the last launch of the backend's kernel (the device's triton, not CI's)."""
    if backend == "gluon":
        from fp8mla.kernels.sm90 import sparse as mod
    else:
        from fp8mla.kernels import sparse_decode as mod
    k = mod.LAST_COMPILED
    out = {}
    for name in ("n_regs", "n_spills"):
        if hasattr(k, name):
            out[name] = int(getattr(k, name))
    if k is not None and getattr(k, "metadata", None) is not None:
        out["smem"] = int(getattr(k.metadata, "shared", -1))
    return out


# (label, backend, plan kernel options): the Gluon build beside the Triton kernel. The single-partition build's
# gathers (async / regs / prefetch, measured 2026-12-01) left the product with the warp-specialized build
# (lab/sparse_ws), which has one gather and no options.
KERNELS = [("gluon", "gluon", {}), ("triton", "triton", {})]


def correctness_case(H: int, topk: int, B: int, device, seed: int, pad: str) -> list[dict]:
    """One batch, every kernel of KERNELS on it (each failing soft)."""
    import fp8mla
    from fp8mla.testing import compare, make_sparse_batch
    L = topk + 37
    b = make_sparse_batch([L] * B, [1] * B, H, topk, 64, "fp8_ds_mla", pad=pad, seed=seed, device=device)
    r = b.run_args
    idx = r["indices"].clone()
    num_slots = r["kv_cache"].shape[0] * 64
    if B > 1:
        idx[0] = -1                       # a row with no token: out 0, lse -inf
        j = int((idx[1] >= 0).nonzero()[0]) if bool((idx[1] >= 0).any()) else 0
        idx[1, j] = num_slots + 5         # out of the pool: skipped like -1
    r["indices"] = idx
    ref_o, ref_l = b.reference()
    tol = 5e-3 if device == "cpu" else 3e-3
    rows = []
    for label, backend, opts in KERNELS:
        def one():
            attn = fp8mla.MLASparseAttention(backend=backend)
            attn.plan(**b.plan_args, **opts)
            out = torch.full((B, H, DC), math.nan, dtype=torch.bfloat16, device=device)
            lse = torch.full((B, H), math.nan, device=device)
            attn.run(**r, out=out, lse=lse, return_lse=True)
            c_o, c_l = compare(out, ref_o), compare(lse, ref_l)
            res = dict(splits=attn.splits_for(B), rel_l2=c_o.rel_l2, lse_rel_l2=c_l.rel_l2,
                       ok=bool(c_o.ok(tol) and c_l.ok(LSE_TOL)))
            if device != "cpu":
                from fp8mla.testing import capture_then_replay
                capture_then_replay(lambda: attn.run(**r, out=out, lse=lse), out)
                c_g = compare(out, ref_o)
                res.update(graph_rel_l2=c_g.rel_l2, ok=res["ok"] and bool(c_g.ok(tol)))
                res.update(_compiled_facts(backend))
            return res
        res = _soft(one)
        res.update(kernel=label, H=H, topk=topk, B=B, pad=pad)
        rows.append(res)
    return rows


def timing_case(backend: str, opts: dict, H: int, topk: int, B: int, device, ceil, reps: int) -> dict:
    import fp8mla
    from fp8mla.bench.common import cpu_time_ms, time_ms
    from fp8mla.bench.sparse import _pool, sparse_cost
    from fp8mla.formats import get_format
    fmt = get_format("fp8_ds_mla", sparse_ok=True)
    g = torch.Generator(device=device).manual_seed(H * 7 + B)
    L = 2 * topk
    kv, slots, _, _ = _pool(B, L, 64, fmt, device, g)
    pick = torch.rand(B, L, device=device, generator=g).argsort(dim=1)[:, :topk]
    indices = torch.gather(slots, 1, pick).to(torch.int32)
    q_nope = torch.randn(B, H, DC, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, DK, device=device, dtype=torch.bfloat16)
    out = torch.empty(B, H, DC, device=device, dtype=torch.bfloat16)
    lse = torch.empty(B, H, device=device)
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(H, topk, 64, 1.0 / math.sqrt(576), torch.bfloat16, "fp8_ds_mla", num_pages=kv.shape[0],
              device=device, **opts)
    run = lambda: attn.run(q_nope, q_pe, kv, indices, out=out, lse=lse)  # noqa: E731
    if device == "cpu":
        ms = cpu_time_ms(run, reps=1)
    else:
        ms = time_ms(run, reps=reps)
    nbytes, flops = sparse_cost(B, H, topk, fmt)
    res = dict(H=H, topk=topk, B=B, splits=attn.splits_for(B), ms=ms,
               gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9, target_ms=TARGETS_MS.get(H) if (topk, B) == (2048, 64) else None)
    if ceil is not None:
        floor = ceil.floor_ms(nbytes, flops)
        res.update(floor_ms=floor, pct_floor=100 * floor / ms)
    if device != "cpu":
        res.update(_compiled_facts(backend))
    return res


def _soft(fn, *args, **kw) -> dict:
    t = time.perf_counter()
    try:
        r = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - fail soft per case
        r = dict(error=f"{type(e).__name__}: {str(e)[:400]}", trace=traceback.format_exc()[-1500:])
    if isinstance(r, dict):
        r["wall_s"] = round(time.perf_counter() - t, 2)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: tiny sizes, no ceilings")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kernels", default=",".join(k[0] for k in KERNELS),
                    help="comma-separated subset of " + ", ".join(k[0] for k in KERNELS))
    ap.add_argument("--full", action="store_true", help="every heads x topk x B case (adds B64 topk 2048 at H8 / H64)")
    args = ap.parse_args(argv)
    chosen = args.kernels.split(",")
    unknown = set(chosen) - {k[0] for k in KERNELS}
    if unknown:
        ap.error(f"--kernels: unknown {sorted(unknown)}")
    KERNELS[:] = [k for k in KERNELS if k[0] in chosen]
    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    if dry:
        heads, topks, batches, timings = (16,), (128,), (1, 2), [(16, 128, 2)]
    else:
        heads, topks, batches = (8, 16, 64, 128), (2048, 128), (1, 8, 64)
        timings = [(128, 2048, 64), (16, 2048, 64), (8, 2048, 64)]
    report = dict(versions=_versions(), dry_run=dry, correctness=[], timing=[])
    seed = 0
    for H in heads:
        for topk in topks:
            for B in batches:
                if B == 64 and topk == 2048 and H in (8, 64) and not args.full:
                    continue   # the slowest batches to build on the host: H 16 / 128 cover B64 at topk 2048
                seed += 1
                pad = "scattered" if seed % 2 else "trailing"
                rows = _soft(correctness_case, H, topk, B, device, seed, pad)
                if "error" in rows:   # the batch itself failed
                    rows = [dict(rows, kernel="(batch)", H=H, topk=topk, B=B, pad=pad)]
                for r in rows:
                    report["correctness"].append(r)
                    status = "ok" if r.get("ok") else ("ERROR " + r["error"][:90] if "error" in r else "FAIL")
                    print(f"check {r['kernel']:14s} H{H:<3d} topk{topk:<5d} B{B:<3d} {pad:9s} "
                          f"rel_l2 {r.get('rel_l2', float('nan')):.2e} lse {r.get('lse_rel_l2', float('nan')):.2e} "
                          f"{status}", flush=True)
    ceil = None
    if not dry:
        try:
            from fp8mla.bench.common import measure_ceilings
            ceil = measure_ceilings("cuda")
            report["ceilings"] = dict(read_gbps=ceil.read_gbps, matmul_tflops=ceil.matmul_tflops)
        except Exception as e:  # noqa: BLE001
            report["ceilings"] = dict(error=f"{type(e).__name__}: {e}")
    for H, topk, B in timings:
        for label, backend, opts in KERNELS:
            r = _soft(timing_case, backend, opts, H, topk, B, device, ceil, args.reps)
            r.update(kernel=label, H=H, topk=topk, B=B)
            report["timing"].append(r)
    print(f"\n{'kernel':14s} {'H':>4s} {'topk':>5s} {'B':>3s} {'ms':>8s} {'target':>7s} {'GB/s':>6s} {'TFLOP/s':>7s} "
          f"{'%floor':>6s} regs spills")
    for r in report["timing"]:
        if "error" in r:
            print(f"{r['kernel']:14s} {r['H']:4d} {r['topk']:5d} {r['B']:3d}  ERROR {r['error'][:80]}")
            continue
        print(f"{r['kernel']:14s} {r['H']:4d} {r['topk']:5d} {r['B']:3d} {r['ms']:8.4f} "
              f"{r['target_ms'] or float('nan'):7.3f} {r['gbps']:6.0f} {r['tflops']:7.1f} "
              f"{r.get('pct_floor', float('nan')):6.1f} {r.get('n_regs', '-')} {r.get('n_spills', '-')}")
    if ceil is not None:
        print(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    bad = [r for r in report["correctness"] if not r.get("ok")]
    print(f"correctness: {len(report['correctness']) - len(bad)} / {len(report['correctness'])} ok")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sparse_gluon_device.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
