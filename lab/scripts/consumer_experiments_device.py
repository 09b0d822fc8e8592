"""Two consumer experiments the tile timeline pointed to (kernel log 22; written 2026-11-30 after the day's
device time was spent: NOT RUN yet):

  * H <= 16: two P.V chunk groups in flight instead of one (``launch(pv_in_flight=2)``): the timeline put 1.7K of
    a tile's 4.35K cycles in the P.V phase, 53 cycles per HGMMA, against ~33 when both consumers share the tensor
    pipe at full rate (log 6's probe) and 31 measured for the e4m3 score MMAs, which wait on no conversion.
  * wide (H > 16): the softmax row sums kept per thread and reduced once per item (``launch(wide_row_sums=True)``),
    as the H16 kernel does: the timeline put 2.1K of an H128 tile's 6.1K cycles in the softmax, which reduces the
    row sums across the 4 warps every tile (the H16 softmax: 0.64K).
  * H <= 16: a fourth ring stage (``ns=4``, 221 KB of shared memory) for the long tail of the data waits (p90
    ~1.5K cycles at NS 3).

    PYTHONPATH=$PWD/src python3 scripts/consumer_experiments_device.py

For each: checks against float64 (odd lengths over NaN pools, page 1, B1 L32k, bit-identical reruns), then
CUDA-graph timings (L2 flushed) against the default, then the tile timeline of both. Predicted: H16 B64 L8k
.108 -> ~.095 ms (P.V phase ~1.1K cycles); H128 B64 L8k .423 -> ~.33-.37 ms (softmax ~0.8-1.2K cycles; the build
spills 224 B, 7 reloads per tile)."""
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
    def __init__(self, c, *, sums=False, pvw=1, merge=True, **kw):
        super().__init__(c, **kw)
        self.sums, self.pvw, self.do_merge = sums, pvw, merge

    def launch_kw(self) -> dict:
        return dict(super().launch_kw(), merge=self.do_merge, wide_row_sums=self.sums, pv_in_flight=self.pvw)


def main() -> int:
    if not torch.cuda.is_available():
        print("consumer_experiments_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    dv.Plan = WPlan
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    ok = True
    for exp, kw, cases in (
            ("pv_in_flight=2", dict(pvw=2), (
                ("H16 p64 odd lens", dv.make_case(odd, 16, 64, seed=1)),
                ("H8 p64", dv.make_case([300, 7, 2000], 8, 64, seed=4)),
                ("H16 p1 odd lens", dv.to_page1(dv.make_case(odd, 16, 64, seed=21), seed=21, past=3)),
                ("H16 p64 B1 L32768", dv.make_case([32768], 16, 64, seed=7)))),
            ("wide_row_sums", dict(sums=True), (
                ("H128 p64 odd lens", dv.make_case(odd, 128, 64, seed=23)),
                ("H40 p64 odd lens", dv.make_case(odd, 40, 64, seed=22)),
                ("H128 p1 odd lens", dv.to_page1(dv.make_case([1, 65, 514, 0, 97], 128, 64, seed=25), seed=25,
                                                 past=2)),
                ("H128 p64 B1 L32768", dv.make_case([32768], 128, 64, seed=26))))):
        for name, c in cases:
            ok &= bool(dv.check_case(f"{exp} {name}", c, **kw))
    log(f"EXPERIMENT CHECKS {'ALL PASS' if ok else 'SOME FAIL'}")
    flush = dv.Flush()
    for H, B, L, kw in [(16, 64, 8192, dict(pvw=2)), (16, 8, 8192, dict(pvw=2)), (16, 1, 32768, dict(pvw=2)),
                        (128, 64, 8192, dict(sums=True)), (128, 8, 8192, dict(sums=True)),
                        (128, 1, 32768, dict(sums=True))]:
        c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
        a = dv.graph_ms(WPlan(c).run, flush, reps=30)
        b = dv.graph_ms(WPlan(c, **kw).run, flush, reps=30)
        log(f"BENCH H{H} B{B} L{L}: default {a:.4f} ms, {kw} {b:.4f} ms ({a / b:.2f}x)")
    for H, kw in ((16, dict(pvw=2)), (128, dict(sums=True))):
        c = dv.make_case([8192] * 64, H, 64, seed=64 + H, nan_pool=False, spare=8)
        for k in ({}, kw):
            p = WPlan(c, timeline=True, merge=False, **k)
            p.run()
            torch.cuda.synchronize()
            st = tdev.phases(p.tl)
            log(f"TIMELINE H{H} B64 L8192 {k or 'default'}: " + ", ".join(
                f"{n} {st[n]['median']:.0f}" for n in tdev.PHASES + ["tile"] if n in st) + " cycles (medians)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
