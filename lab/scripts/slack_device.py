"""One A/B of the request-aligned schedule's slack (kernel log 27's open question): ``fp8mla bench decode`` at H128
(B64 L8k, B32 L4k, B128 L2k), page 64, with decode_sm90.ALIGNED_SLACK 1 (default) and 3 in one process. At H128 B64
L8k slack 3 lets every request run whole in one CTA (128 tiles against the contiguous cut's 125): no merge, no
second item per CTA.

    PYTHONPATH=$PWD/src python3 scripts/slack_device.py OUTDIR"""
from __future__ import annotations

import argparse
import sys

from fp8mla.bench import decode as bench
from fp8mla.kernels import decode_sm90 as k


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "slack_out"
    for slack in (1, 3, 1):
        k.ALIGNED_SLACK = slack
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        print(f"== ALIGNED_SLACK {slack}", flush=True)
        bench.main(p.parse_args(["--heads", "128", "--pages", "64", "--kv", "fp8_e4m3", "--shapes", "64x8192",
                                 "32x4096", "128x2048", "--reps", "20", "--out", f"{out}/slack{slack}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
