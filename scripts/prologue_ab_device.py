"""A/B of two small-batch changes (kernel log 30), through MLAPagedAttention on the H200, CUDA-graph replay, L2
flushed, every variant on the same values in one process, in the order A B C D D C B A per shape (median of each
variant's two timings):

    PYTHONPATH=$PWD/src python3 scripts/prologue_ab_device.py [--out DIR]

  base      FP8MLA_GLUON_Q1P=0 FP8MLA_PDL_MERGE=0   (the kernel of logs 27-29)
  pdl       the merge kernel as a programmatic dependent launch of the decode kernel
  q1p       each item's Q loaded in one pass (decode_sm90 launch(q_one_pass=True))
  both
Also checks every variant's output against the base variant's (bit-identical: neither change touches the math).
Writes DIR/prologue_ab.json."""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from fp8mla import MLAPagedAttention
from fp8mla.bench.common import time_ms
from fp8mla.bench.decode import DC, DK, make_pool

VARIANTS = {"base": ("0", "0"), "pdl": ("0", "1"), "q1p": ("1", "0"), "both": ("1", "1")}
SHAPES = [(16, 1, 32768), (16, 8, 8192), (16, 32, 4096), (16, 128, 2048), (16, 64, 8192), (128, 1, 32768),
          (128, 8, 8192), (128, 64, 8192)]


def main() -> int:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    rows = []
    for H, B, L in SHAPES:
        pool, plan_args = make_pool(B, L, 64, "fp8_e4m3", "cuda")
        ckv, kpe = pool[..., :DC], pool[..., DC:]
        q_nope = torch.randn(B, H, DC, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(B, H, DK, device="cuda", dtype=torch.bfloat16)
        outs, times = {}, {v: [] for v in VARIANTS}
        for name in list(VARIANTS) + list(reversed(VARIANTS)):
            q1p, pdl = VARIANTS[name]
            os.environ["FP8MLA_GLUON_Q1P"], os.environ["FP8MLA_PDL_MERGE"] = q1p, pdl
            attn = MLAPagedAttention(backend="gluon")
            attn.plan(**plan_args, num_heads=H, kv_data_type="fp8_e4m3")
            out = torch.empty(B, H, DC, device="cuda", dtype=torch.bfloat16)
            fn = lambda a=attn, o=out: a.run(q_nope, q_pe, ckv, kpe, out=o, ckv_scale=1.0, kpe_scale=1.0)
            times[name].append(time_ms(fn, reps=30))
            outs[name] = out
        same = {v: bool(torch.equal(outs[v], outs["base"])) for v in VARIANTS}
        row = dict(shape=f"H{H} B{B} L{L}", **{v: statistics.median(t) for v, t in times.items()},
                   bit_identical=same)
        rows.append(row)
        print(f"AB H{H:<3d} B{B:<3d} L{L:<6d} " + "  ".join(f"{v} {row[v]:.4f}" for v in VARIANTS)
              + f"  | q1p {row['base'] / row['q1p']:.3f}x pdl {row['base'] / row['pdl']:.3f}x both "
              f"{row['base'] / row['both']:.3f}x | same {all(same.values())}", flush=True)
        del pool, ckv, kpe
        torch.cuda.empty_cache()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(rows, open(os.path.join(out_dir, "prologue_ab.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
