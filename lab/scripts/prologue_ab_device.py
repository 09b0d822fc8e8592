"""A/B of two small-batch changes (kernel log 30), through MLAPagedAttention on the H200, CUDA-graph replay, L2
flushed, every variant on the same values in one process, in the order A B C D D C B A per shape (median of each
variant's two timings):

    PYTHONPATH=$PWD/src python3 scripts/prologue_ab_device.py [--out DIR]

  base      FP8MLA_GLUON_Q1P=0 FP8MLA_PDL_MERGE=0   (the kernel of logs 27-29)
  pdl       the merge kernel as a programmatic dependent launch of the decode kernel
  q1p       each item's Q loaded in one pass (decode_sm90 launch(q_one_pass=True))
  both
Also checks every variant's output against the base variant's (bit-identical: neither change touches the math).
``--fused``: the fused last-arriver merge (FP8MLA_GLUON_FUSED_MERGE=1, lists <= 16) against the merge kernel
instead (its sums run in another order: close, not bit-identical). Writes DIR/prologue_ab.json.""" 
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from fp8mla import MLAPagedAttention
from fp8mla.bench.common import time_ms
from fp8mla.bench.decode import DC, DK, make_pool

VARIANTS = {"base": dict(FP8MLA_GLUON_Q1P="0", FP8MLA_PDL_MERGE="0"),
            "pdl": dict(FP8MLA_GLUON_Q1P="0", FP8MLA_PDL_MERGE="1"),
            "q1p": dict(FP8MLA_GLUON_Q1P="1", FP8MLA_PDL_MERGE="0"),
            "both": dict(FP8MLA_GLUON_Q1P="1", FP8MLA_PDL_MERGE="1")}
# --fused: the in-kernel last-arriver merge (kernel log 15, off) against the merge kernel, under the request-aligned
# cut of log 27 (one item per CTA: the last arriver merges at the very end instead of before its next item)
FUSED = {"base": dict(FP8MLA_GLUON_FUSED_MERGE="0"),
         "fused16": dict(FP8MLA_GLUON_FUSED_MERGE="1", FP8MLA_GLUON_FUSED_MAX_PARTS="16")}
SHAPES = [(16, 1, 32768), (16, 8, 8192), (16, 32, 4096), (16, 128, 2048), (16, 64, 8192), (128, 1, 32768),
          (128, 8, 8192), (128, 64, 8192)]


def main() -> int:
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    variants = FUSED if "--fused" in sys.argv else VARIANTS
    rows = []
    for H, B, L in SHAPES:
        pool, plan_args = make_pool(B, L, 64, "fp8_e4m3", "cuda")
        ckv, kpe = pool[..., :DC], pool[..., DC:]
        q_nope = torch.randn(B, H, DC, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(B, H, DK, device="cuda", dtype=torch.bfloat16)
        outs, times = {}, {v: [] for v in variants}
        for name in list(variants) + list(reversed(variants)):
            os.environ.update(variants[name])
            attn = MLAPagedAttention(backend="gluon")
            attn.plan(**plan_args, num_heads=H, kv_data_type="fp8_e4m3")
            out = torch.empty(B, H, DC, device="cuda", dtype=torch.bfloat16)
            fn = lambda a=attn, o=out: a.run(q_nope, q_pe, ckv, kpe, out=o, ckv_scale=1.0, kpe_scale=1.0)
            times[name].append(time_ms(fn, reps=30))
            outs[name] = out
        same = {v: bool(torch.equal(outs[v], outs["base"])) for v in variants}
        close = {v: float((outs[v].float() - outs["base"].float()).norm() / outs["base"].float().norm())
                 for v in variants}
        row = dict(shape=f"H{H} B{B} L{L}", **{v: statistics.median(t) for v, t in times.items()},
                   bit_identical=same, rel_to_base=close)
        rows.append(row)
        print(f"AB H{H:<3d} B{B:<3d} L{L:<6d} " + "  ".join(f"{v} {row[v]:.4f}" for v in variants)
              + "  | " + " ".join(f"{v} {row['base'] / row[v]:.3f}x" for v in variants if v != "base")
              + f" | same {all(same.values())} (max rel {max(close.values()):.1e})", flush=True)
        del pool, ckv, kpe
        torch.cuda.empty_cache()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(rows, open(os.path.join(out_dir, "prologue_ab.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
