"""The wide variant's softmax row sums kept per thread (``launch(wide_row_sums=True)``, kernel log 22): the
timeline (scripts/timeline_device.py) put 2.1K of the 6.1K cycles of an H128 tile in the softmax, which reduces the
row sums across the 4 warps every tile; the H16 kernel keeps them per thread and reduces once per item.

    PYTHONPATH=$PWD/src python3 scripts/wide_sums_device.py

Checks against float64 (H128 and H40 odd lengths over NaN pools, page 1, B1 L32k), then CUDA-graph timings (L2
flushed) against the default at H128 B64 / B8 / B1, then the tile timeline of both at H128 B64."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("timeline_device", os.path.join(ROOT, "scripts/timeline_device.py"))
tdev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tdev)
dv, dsm, log = tdev.dv, tdev.dsm, tdev.log


class WPlan(tdev.TPlan):
    def __init__(self, c, *, sums=False, merge=True, **kw):
        super().__init__(c, **kw)
        self.sums, self.do_merge = sums, merge

    def run(self):
        c = self.c
        dsm.launch(self.desc[0], self.desc[1], c["q_nope"], c["q_pe"], c["scales"], self.t, self.out, self.lse,
                   grid=self.grid, grid_batch=self.B, max_rows=c["H"], num_heads=c["H"], sm_scale=c["sm_scale"],
                   page_size=c["page"], ns=self.ns, regs=self.regs, merge_p=self.merge_p, merge_c=self.merge_c,
                   mode=self.mode, merge=self.do_merge, timeline=self.tl, wide_row_sums=self.sums)


def main() -> int:
    if not torch.cuda.is_available():
        print("wide_sums_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    dv.Plan = WPlan
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    ok = True
    for name, c in (("H128 p64 odd lens", dv.make_case(odd, 128, 64, seed=23)),
                    ("H40 p64 odd lens", dv.make_case(odd, 40, 64, seed=22)),
                    ("H128 p1 odd lens", dv.to_page1(dv.make_case([1, 65, 514, 0, 97], 128, 64, seed=25), seed=25,
                                                     past=2)),
                    ("H128 p64 B1 L32768", dv.make_case([32768], 128, 64, seed=26))):
        ok &= bool(dv.check_case(f"wide row sums {name}", c, sums=True))
    log(f"WIDE SUMS CHECKS {'ALL PASS' if ok else 'SOME FAIL'}")
    flush = dv.Flush()
    for H, B, L in [(128, 64, 8192), (128, 8, 8192), (128, 1, 32768)]:
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        a = dv.graph_ms(WPlan(c).run, flush, reps=30)
        b = dv.graph_ms(WPlan(c, sums=True).run, flush, reps=30)
        log(f"BENCH H{H} B{B} L{L}: default {a:.4f} ms, wide row sums {b:.4f} ms ({a / b:.2f}x)")
    c = dv.make_case([8192] * 64, 128, 64, seed=192, nan_pool=False, spare=8)
    for sums in (False, True):
        p = WPlan(c, sums=sums, timeline=True, merge=False)
        p.run()
        torch.cuda.synchronize()
        st = tdev.phases(p.tl)
        log(f"TIMELINE H128 B64 L8192 wide_row_sums={sums}: " + ", ".join(
            f"{k} {st[k]['median']:.0f}" for k in tdev.PHASES + ["tile"] if k in st) + " cycles (medians)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
