"""Markdown tables (ms per call, % of the FP8 floor) from ``fp8mla bench decode`` CSVs, for docs/benchmarks.md.

    python scripts/bench_table.py docs/data/decode_2026-12-01_0601_p64.csv [--page 64] [--metric ms|pct_fp8_floor|...]
"""
import argparse
import csv

p = argparse.ArgumentParser()
p.add_argument("csv", nargs="+")
p.add_argument("--page", type=int, default=64)
p.add_argument("--metric", default="ms", choices=["ms", "pct_fp8_floor", "gbps", "tflops", "rel_l2"])
a = p.parse_args()
rows = [r for f in a.csv for r in csv.DictReader(open(f)) if int(r["page"]) == a.page]
shapes = []
for r in rows:
    s = (int(r["H"]), int(r["B"]), int(r["L"]))
    if s not in shapes:
        shapes.append(s)
series = []
for r in rows:
    k = (r["kernel"], r["kv"])
    if k not in series:
        series.append(k)
fmt = {"ms": "{:.4f}", "pct_fp8_floor": "{:.0f}%", "gbps": "{:.0f}", "tflops": "{:.0f}", "rel_l2": "{:.1e}"}[a.metric]
print("| kernel / KV | " + " | ".join(f"H{h} B{b} L{L // 1024}k" for h, b, L in shapes) + " |")
print("|---|" + "---|" * len(shapes))
for k, kv in series:
    cells = []
    for s in shapes:
        v = next((r[a.metric] for r in rows if (r["kernel"], r["kv"]) == (k, kv)
                  and (int(r["H"]), int(r["B"]), int(r["L"])) == s), None)
        cells.append(fmt.format(float(v)) if v is not None else "-")
    print(f"| {k} / {kv} | " + " | ".join(cells) + " |")
