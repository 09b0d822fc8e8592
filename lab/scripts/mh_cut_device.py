"""Lab A/B (one H200): the heads-on-M build's request cut at spread lengths. Product code is not changed: the cut
is swapped in by replacing ``fp8mla.kernels.sm90.aligned_pieces`` for the variant's plans, and the partial buffers
are enlarged to the variant's item count (the product sizes them slots + batch).

Why: graph_spread_device.py (2026-12-02, fourth session) measured heads-on-M 1.19-1.46x the wide build at spread
lengths of 64-128 requests, and a dispatch model (items in order onto the free SM slots, 2 tiles of start cost per
item) fits those times at 2.65-2.98 us per makespan tile: the build loses on its cut (one CTA per request piece,
pieces floor(n_b x slots / T) per request: up to 1.5-2x the share), not per tile (2.7 us against the wide build's
3.4-3.7 per share tile). Variants: pieces ceil(n_b / P), P = f x share (f = 1, 1/2, 1/3), every piece <= P. The
model predicts H128 uniform B64 0.5345 -> ~0.41-0.43 ms (f 1/3-1/2) before the partials' extra traffic
(~60 MB at 235 items), i.e. ~0.92-0.97x the wide build (0.4426); equal lengths unchanged at f = 1.

Usage (device, repo root): PYTHONPATH=$PWD/src:$PWD/lab/scripts python3 lab/scripts/mh_cut_device.py --out OUT/mh_cut.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fp8mla.kernels.sm90 as sm90
from fp8mla import MLAPagedAttention
from fp8mla.bench.common import environment, measure_ceilings, time_ms
from fp8mla.bench.decode import reference_error
from graph_spread_device import DC, lengths, make

PRODUCT_CUT = sm90.aligned_pieces


def ceil_cut(f: float):
    def cut(tiles, num_ctas, min_tiles, slack=0):
        T = sum(tiles)
        if not tiles or T == 0:
            return PRODUCT_CUT(tiles, num_ctas, min_tiles, slack)
        P = max(min_tiles, int(-(-T // num_ctas) * f))
        return [max(1, -(-n // P)) for n in tiles]
    return cut


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda"
    ceil = measure_ceilings(dev)
    print(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s", flush=True)
    g = torch.Generator().manual_seed(7)   # the same lengths as graph_spread_device.py's run
    variants = {"cur": None, "f1": ceil_cut(1.0), "f0.5": ceil_cut(0.5), "f0.33": ceil_cut(1 / 3)}
    rows = []
    for H in (64, 128):
        for kind, B in (("equal8k", 64), ("uniform", 64), ("lognormal", 64), ("uniform", 8), ("lognormal", 8),
                        ("one_long", 16), ("uniform", 128)):
            lens = lengths(kind, B, g)
            pool, pa, qn, qp = make(lens, H, dev, g)
            # host lengths (as the engines' plans give them): the host schedule, where the cut is aligned_pieces
            pa_dev = pa
            pa = dict(pa, **{k: pa[k].cpu() for k in ("qo_indptr", "kv_indptr", "kv_len_arr")})
            ckv, kpe = pool[..., :DC], pool[..., DC:]
            out = torch.empty(B, H, DC, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(B, H, device=dev, dtype=torch.float32)
            res = dict(H=H, kind=kind, B=B, max_len=max(lens))
            for name in ["wide"] + list(variants):
                try:
                    cut = variants.get(name)
                    sm90.aligned_pieces = cut or PRODUCT_CUT
                    import fp8mla.backends._gluon_host_schedule as hs
                    hs._LAST_ITEMS = None
                    a = MLAPagedAttention(backend="gluon", heads_on_m=(name != "wide"))
                    a.plan(**pa, num_heads=H, kv_data_type="fp8_e4m3")
                    sm90.aligned_pieces = PRODUCT_CUT
                    p = a._plan.impl
                    if name != "wide":
                        n_items = p.n_items
                        if p.t["part_o"].shape[0] < n_items:   # the variant's items: partial rows for each
                            rws = p.t["part_o"].shape[1]
                            p.t["part_o"] = torch.empty(n_items, rws, DC, dtype=torch.float32, device=dev)
                            p.t["part_lse"] = torch.empty(n_items, rws, dtype=torch.float32, device=dev)
                        res[name + ":items"] = n_items
                    fn = (lambda a=a: a.run(qn, qp, ckv, kpe, out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0))
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    res[name + ":err"] = reference_error(out, qn, qp, ckv, kpe, pa_dev, 4)
                    res[name] = time_ms(fn, reps=args.reps)
                except Exception as e:  # noqa: BLE001 - record and go on
                    sm90.aligned_pieces = PRODUCT_CUT
                    res[name] = None
                    res[name + ":why"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            rows.append(res)
            w = res.get("wide")
            cells = "  ".join(f"{n} {res[n]:.4f} ({res[n] / w:.3f}x, {res.get(n + ':items', '-')} it)"
                              if res.get(n) and w else f"{n} -" for n in variants)
            errs = [v for k, v in res.items() if k.endswith(":err")]
            print(f"H{H:<3} {kind:<9} B{B:<3} wide {w if w is None else round(w, 4)}  {cells}  "
                  f"err {max(errs) if errs else float('nan'):.2e}", flush=True)
            for k, v in res.items():
                if k.endswith(":why"):
                    print(f"   {k}: {v}")
            del pool
    json.dump(dict(env=environment(), ceilings=vars(ceil), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
