"""Heads-on-M vs wide build in a CUDA-graph wrapper (the engines' launch) at spread request lengths, one H200.

The question (graph-mode ``auto``): a graph wrapper fixes its build at the first plan, so ``auto`` cannot pick by
the lengths of later plans; at equal lengths heads-on-M was 10-14% faster in graph mode (2026-12-02, third
run), and its request-aligned pieces can be 1.6-1.9x the contiguous share at spread lengths. This times both
builds on the same plans (graph wrapper of 256 slots, and plain plans for reference) over length sets an engine
sees: equal, uniform random, log-normal, one long request among short ones. Prediction: heads-on-M stays <= 1.0x
the wide build at equal and mildly spread lengths and loses (>1.0x) where one long request dominates a small
batch. Every run is checked against float64 on its first requests.

Usage (device, repo root): PYTHONPATH=$PWD/src python3 lab/scripts/graph_spread_device.py --out OUT/graph_spread.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from fp8mla import MLAPagedAttention
from fp8mla.bench.common import environment, measure_ceilings, time_ms
from fp8mla.bench.decode import reference_error

DC, DK, PAGE = 512, 64, 64


def lengths(kind: str, B: int, g: torch.Generator) -> list[int]:
    if kind == "equal8k":
        return [8192] * B
    if kind == "uniform":      # U[512, 16384]
        return [int(x) for x in torch.randint(512, 16385, (B,), generator=g)]
    if kind == "lognormal":    # median ~4k, long tail, capped at 32k
        return [int(min(32768, max(16, math.exp(x)))) for x in (torch.randn(B, generator=g) * 1.0 + math.log(4096))]
    if kind == "one_long":     # one 32k request among 1k ones
        return [32768] + [1024] * (B - 1)
    raise ValueError(kind)


def make(lens, H, device, g):
    pages = [-(-n // PAGE) for n in lens]
    P = sum(pages) + 8
    pool = torch.randn(P, PAGE, DC + DK, device=device).to(torch.float8_e4m3fn)
    pool[sum(pages):] = float("nan")   # unused pages: NaN (never read)
    perm = torch.randperm(P - 8, device=device).to(torch.int32)
    B = len(lens)
    i32 = dict(dtype=torch.int32, device=device)
    kv_indptr = torch.zeros(B + 1, **i32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(pages, **i32), 0)
    plan_args = dict(qo_indptr=torch.arange(B + 1, **i32), kv_indptr=kv_indptr, kv_indices=perm,
                     kv_len_arr=torch.tensor(lens, **i32), head_dim_ckv=DC, head_dim_kpe=DK, page_size=PAGE,
                     causal=True, sm_scale=1.0 / math.sqrt(192), q_data_type=torch.bfloat16)
    q_nope = torch.randn(B, H, DC, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, DK, device=device, dtype=torch.bfloat16)
    return pool, plan_args, q_nope, q_pe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda"
    ceil = measure_ceilings(dev)
    print(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True)
    g = torch.Generator().manual_seed(7)
    rows = []
    for H in (64, 128):
        for kind, B in (("equal8k", 64), ("uniform", 64), ("lognormal", 64), ("uniform", 8), ("lognormal", 8),
                        ("one_long", 16), ("uniform", 128)):
            lens = lengths(kind, B, g)
            pool, pa, qn, qp = make(lens, H, dev, g)
            ckv, kpe = pool[..., :DC], pool[..., DC:]
            out = torch.empty(B, H, DC, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(B, H, device=dev, dtype=torch.float32)
            T = sum(lens)
            floor = ceil.floor_ms(T * (DC + DK), 2 * H * T * (DC + DK + DC))
            res = dict(H=H, kind=kind, B=B, tokens=T, max_len=max(lens), floor_ms=floor)
            for mode in ("graph", "plain"):
                for build in ("wide", "mh"):
                    name = f"{build},{mode}"
                    try:
                        kw = dict(use_cuda_graph=True, max_batch_size=256) if mode == "graph" else {}
                        a = MLAPagedAttention(backend="gluon", heads_on_m=(build == "mh"), **kw)
                        a.plan(**pa, num_heads=H, kv_data_type="fp8_e4m3")
                        fn = (lambda a=a: a.run(qn, qp, ckv, kpe, out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0))
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        err = reference_error(out, qn, qp, ckv, kpe, pa, 4)
                        ms = time_ms(fn, reps=args.reps)
                        res[name] = ms
                        res[name + ":err"] = err
                    except Exception as e:  # noqa: BLE001 - record and go on
                        res[name] = None
                        res[name + ":why"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            rows.append(res)
            fmt = lambda k: f"{res[k]:.4f}" if res.get(k) else "  -   "  # noqa: E731
            ratio = (res["mh,graph"] / res["wide,graph"]) if res.get("mh,graph") and res.get("wide,graph") else float("nan")
            print(f"H{H:<3} {kind:<9} B{B:<3} max {max(lens):>5}  graph wide {fmt('wide,graph')} mh {fmt('mh,graph')} "
                  f"(mh/wide {ratio:.3f})  plain wide {fmt('wide,plain')} mh {fmt('mh,plain')}  floor {floor:.4f}  "
                  f"err {max(v for k, v in res.items() if k.endswith(':err')):.2e}", flush=True)
            for k, v in res.items():
                if k.endswith(":why"):
                    print(f"   {k}: {v}")
            del pool
    json.dump(dict(env=environment(), ceilings=vars(ceil), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
