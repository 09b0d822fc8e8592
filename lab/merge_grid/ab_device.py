"""A/B on one H200: the product's split merge against lab/merge_grid's launches, in CUDA-graph wrappers of 256
request slots (max_batch_size) and in plain plans, both Gluon builds (wide, heads-on-M), ms by CUDA-graph replay.

    PYTHONPATH=$PWD/src python lab/merge_grid/ab_device.py --out $OUT      # GPU, ~1.5-2.5 min (compiles included)
    PYTHONPATH=$PWD/src python lab/merge_grid/ab_device.py --dry-run      # CPU: the launch sizes and programs only

For H 16/64/128 and (B, L) in (1, 32768), (8, 8192), (64, 8192), page 64, FP8 e4m3: ``MLAPagedAttention(
backend="gluon", heads_on_m=False / True)`` planned plain and with ``use_cuda_graph=True, max_batch_size=256``;
each plan run with the product merge and each variant patched in where the builds call it (``kernel.launch_merge``,
``heads_on_m.launch_merge``; a call counter checks the patch took). Each run: out against float64 on the first 2
requests (rel L2 <= 3e-3, NaN positions matching), out / lse bit-identical to the product's in the same plan and
after the timed replays (the rerun guarantee), then ``fp8mla.bench.common.time_ms`` (median of 50 graph replays,
L2 flushed). Prints one line per run and the table; writes ab.json under --out. Exit 1 on any failed check.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import merge_grid as mg  # noqa: E402

from fp8mla.kernels.sm90 import heads_on_m as sm90_heads_on_m  # noqa: E402
from fp8mla.kernels.sm90 import kernel as sm90_kernel  # noqa: E402
from fp8mla.kernels.sm90 import merge as sm90_merge  # noqa: E402

HEADS = (16, 64, 128)
SHAPES = ((1, 32768), (8, 8192), (64, 8192))
MAX_BATCH = 256
PAGE = 64
REL_L2 = 3e-3
US_PER_1000 = 0.58   # the H200's cost of 1,000 merge programs that return at once (docs/benchmarks.md)


def counted(fn, name: str):
    def launch(*a, **kw):
        launch.calls += 1
        return fn(*a, **kw)
    launch.calls, launch.__name__ = 0, name
    return launch


@contextlib.contextmanager
def merge_launch(fn):
    """``fn`` as the merge both builds launch (their modules' own ``launch_merge`` name)."""
    saved = sm90_kernel.launch_merge, sm90_heads_on_m.launch_merge
    sm90_kernel.launch_merge = sm90_heads_on_m.launch_merge = fn
    try:
        yield
    finally:
        sm90_kernel.launch_merge, sm90_heads_on_m.launch_merge = saved


def dry_run(n_sm: int = 132) -> int:
    """The merge launch of each plan here, from the backend's own sizing (gluon.merge_sizes with the device-side
    schedule's guess, as these plans from device tensors take): programs of the product (plain: B slots; graph:
    256) and of the variants at the resident count of their sm_90a compile here (triton of this machine: the
    device's triton may allocate other register counts; the device prints the grids it launched)."""
    from fp8mla.backends.gluon import merge_sizes
    from fp8mla.kernels import sm90 as k
    print("programs of the merge launch (product / strided / flat; waves = resident programs per SM of the sm_90a "
          f"compile), and what the variants save in the graph plan at {US_PER_1000} us per 1,000 programs")
    print(f"{'H':>3} {'build':5} {'B':>3} {'L':>6} {'(P, C)':>10} {'units/req':>9} {'waves s/f':>9} "
          f"{'plain p/s/f':>16} {'graph p/s/f':>20}   saved us (strided, flat)")
    for H in HEADS:
        for mh in (False, True):
            if mh and H < k.MH_MIN_HEADS:
                continue
            b = k.Sm90Build.for_heads_on_m(H, PAGE) if mh else k.Sm90Build.for_plan(H, PAGE, 1, True, False, False, 3)
            for B, L in SHAPES:
                mp, mc = merge_sizes(None, B, max(1, n_sm // b.nhg), H, n_sm)
                kw = dict(max_rows=H, merge_p=mp, merge_c=mc)
                kern = {"strided": mg._merge_strided_kernel, "flat": mg._merge_flat_kernel}
                w = {s: mg.compile_sm90(kern[s], **kw)["resident"] for s in mg.SCHEMES}
                n = {s: mg.programs(mg.grid_of(s, grid_batch=MAX_BATCH, n_sm=n_sm, waves=w[s], **kw))
                     for s in mg.SCHEMES}
                n["product"] = mg.programs(mg.grid_of("product", grid_batch=MAX_BATCH, n_sm=n_sm, **kw))
                n_plain = {s: mg.programs(mg.grid_of(s, grid_batch=B, n_sm=n_sm, waves=w.get(s, 1), **kw))
                           for s in ("product",) + mg.SCHEMES}
                _, n_r, n_c = mg.merge_geometry(max_rows=H, merge_p=mp, merge_c=mc)
                saved = {s: (n["product"] - n[s]) * US_PER_1000 / 1000 for s in mg.SCHEMES}
                label = "mh" if mh else ("wide" if b.wide else "h16")
                print(f"{H:3d} {label:5} {B:3d} {L:6d} {str((mp, mc)):>10} {n_r * n_c:9d} "
                      f"{w['strided']:4d}/{w['flat']:<4d} "
                      f"{'/'.join(str(n_plain[s]) for s in ('product',) + mg.SCHEMES):>16} "
                      f"{'/'.join(str(n[s]) for s in ('product',) + mg.SCHEMES):>20}   "
                      + ", ".join(f"{saved[s]:.1f}" for s in mg.SCHEMES), flush=True)
    return 0


def bits(x):
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32).clone()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    a = p.parse_args()
    if a.dry_run:
        return dry_run()
    from fp8mla.attention import MLAPagedAttention
    from fp8mla.bench.common import time_ms
    from fp8mla.bench.decode import build_label, make_pool
    from fp8mla.reference import mla_reference
    from fp8mla.testing import compare
    dev = "cuda"
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    inner = {s: mg.make_launch_merge(s, n_sm) for s in mg.SCHEMES}   # (.last: the grid of its latest launch)
    merges = {"product": counted(sm90_merge.launch_merge, "product")}
    merges.update({s: counted(inner[s], s) for s in mg.SCHEMES})
    rows, fails, t_start = [], [], time.time()
    for H in a.heads:
        for B, L in SHAPES:
            pool, plan_args = make_pool(B, L, PAGE, "fp8_e4m3", dev)
            ckv, kpe = pool[..., :512], pool[..., 512:]
            g = torch.Generator(device=dev).manual_seed(H * 1000 + B)
            q_nope = torch.randn(B, H, 512, device=dev, generator=g).to(torch.bfloat16)
            q_pe = torch.randn(B, H, 64, device=dev, generator=g).to(torch.bfloat16)
            out = torch.empty(B, H, 512, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(B, H, device=dev, dtype=torch.float32)
            nref = min(B, 2)
            pa = plan_args
            ref, _ = mla_reference(q_nope[:nref], q_pe[:nref], ckv, kpe, pa["qo_indptr"][: nref + 1],
                                   pa["kv_indptr"][: nref + 1], pa["kv_indices"], pa["kv_len_arr"][:nref],
                                   sm_scale=pa["sm_scale"], causal=True)
            for mh in (False, True):
                plans = {}
                try:
                    for mode, extra in (("plain", {}), ("graph", dict(use_cuda_graph=True, max_batch_size=MAX_BATCH))):
                        attn = MLAPagedAttention(backend="gluon", heads_on_m=mh, **extra)
                        attn.plan(**plan_args, num_heads=H, kv_data_type="fp8_e4m3")
                        plans[mode] = attn
                except ValueError as e:
                    print(f"H{H} B{B} L{L} heads_on_m={mh}: not taken ({str(e)[:160]})", flush=True)
                    continue
                impl = plans["graph"]._plan.impl
                row = dict(H=H, B=B, L=L, build=build_label(impl.build), merge=(impl.merge_p, impl.merge_c),
                           grid_batch={m: plans[m]._plan.impl.grid_batch for m in plans})
                first = {}
                for mode, attn in plans.items():
                    def run(attn=attn):
                        attn.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0)
                    # (the product timed again after the variants: the drift of the process, for the ratios)
                    for name, fn in list(merges.items()) + [("product_again", merges["product"])]:
                        key = f"{mode}/{name}"
                        with merge_launch(fn):
                            calls = fn.calls
                            out.fill_(math.nan)
                            lse.fill_(math.nan)
                            run()
                            torch.cuda.synchronize()
                            c = compare(out[:nref], ref)
                            ob, lb = bits(out), bits(lse)
                            ms = time_ms(run, reps=a.reps)
                            rerun = torch.equal(bits(out), ob) and torch.equal(bits(lse), lb)
                        took = fn.calls > calls
                        first.setdefault(mode, (ob, lb))
                        same = torch.equal(ob, first[mode][0]) and torch.equal(lb, first[mode][1])
                        ok = took and c.ok(REL_L2) and same and rerun
                        row[key] = dict(ms=ms, rel_l2=c.rel_l2, nan_mismatch=c.nan_mismatch, patched=took,
                                        same_as_product=same, rerun_same=rerun,
                                        launch=inner[name].last if name in inner else None)
                        if not ok:
                            fails.append(f"H{H} B{B} L{L} {row['build']} {key}")
                        print(f"{'ok  ' if ok else 'FAIL'} H{H:<3d} B{B:<3d} L{L:<6d} {row['build']:5s} {key:14s} "
                              f"{ms:8.4f} ms  rel_l2 {c.rel_l2:.2e} nan {c.nan_mismatch} patched {took} "
                              f"bits=product {same} rerun {rerun}"
                              + (f" grid {inner[name].last['grid']} (waves {inner[name].last['waves']})"
                                 if name in inner else ""), flush=True)
                row["plain_vs_graph_bits"] = torch.equal(first["plain"][0], first["graph"][0])
                print(f"     H{H} B{B} L{L} {row['build']}: graph out bit-identical to plain: "
                      f"{row['plain_vs_graph_bits']} (information: the same schedule)", flush=True)
                rows.append(row)
            del pool, ckv, kpe
            torch.cuda.empty_cache()
    print_table(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ab.json"), "w") as f:
        json.dump(dict(rows=rows, fails=fails, seconds=time.time() - t_start,
                       device=torch.cuda.get_device_name(0)), f, indent=1, default=str)
    print(f"{len(fails)} failed checks{': ' + '; '.join(fails) if fails else ''}; {time.time() - t_start:.0f} s")
    return 1 if fails else 0


def print_table(rows):
    s1, s2 = mg.SCHEMES
    print(f"\n{'H':>3} {'B':>3} {'L':>6} {'build':5} | {'plain':>7} {s1:>7} {s2:>7} | {'graph':>7} {s1:>7} {s2:>7} | "
          f"{'graph/plain':>11} {s1 + '/prod':>12} {s2 + '/prod':>10} | plain: {s1 + '/prod':>12} {s2 + '/prod':>10} | "
          "drift (product again / first: plain, graph)")
    for r in rows:
        ms = {k: r[k]["ms"] for k in r if isinstance(r[k], dict) and "ms" in r[k]}
        gp, pp = ms["graph/product"], ms["plain/product"]
        print(f"{r['H']:3d} {r['B']:3d} {r['L']:6d} {r['build']:5} | {pp:7.4f} {ms['plain/' + s1]:7.4f} "
              f"{ms['plain/' + s2]:7.4f} | {gp:7.4f} {ms['graph/' + s1]:7.4f} {ms['graph/' + s2]:7.4f} | "
              f"{gp / pp:11.3f} {ms['graph/' + s1] / gp:12.3f} {ms['graph/' + s2] / gp:10.3f} | "
              f"       {ms['plain/' + s1] / pp:12.3f} {ms['plain/' + s2] / pp:10.3f} | "
              f"{ms['plain/product_again'] / pp:.3f}, {ms['graph/product_again'] / gp:.3f}")


if __name__ == "__main__":
    sys.exit(main())
