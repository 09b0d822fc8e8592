"""Hardware counters of the Gluon decode kernel on an H200 (the next diagnosis step of docs/benchmarks.md's kernel
logs 10, 14 and 16: why the consumers take ~2x their tensor work per tile). NOT RUN YET: written 2026-11-30 after
the day's device time was spent; the ncu flags are the documented ones, the driver is decode_v2_device.py's.

    # one shape per ncu process (the first launch compiles and is skipped; the second is profiled):
    ncu --target-processes all -k regex:mla_decode_sm90_kernel --launch-skip 1 --launch-count 1 \\
        --set full --import-source no -o $OUT/h16_b64 \\
        python3 scripts/ncu_decode_device.py 16 64 8192
    ncu --import $OUT/h16_b64.ncu-rep --page details --print-units base | \\
        grep -E "Duration|DRAM Throughput|Tensor|Issue Slots Busy|Stall|Warp Cycles Per Issued|Registers"
    # the same for 128 64 8192, and MODE 2 (compute only: no TMA traffic) with a 4th argument 2

Prints the kernel's median time from a plain loop (no graph) so the profiled launch can be matched. Arguments:
H B L [MODE] (MODE 0 real run, 2 compute-only probe)."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    H, B, L = (int(a) for a in sys.argv[1:4])
    mode = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if not torch.cuda.is_available():
        print("ncu_decode_device.py: needs a CUDA device", file=sys.stderr)
        return 2
    c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
    p = dv.Plan(c, mode=mode, merge=False)
    p.run()                     # compiles (ncu --launch-skip 1 skips it)
    torch.cuda.synchronize()
    p.run()                     # the profiled launch
    torch.cuda.synchronize()
    ms = dv.events_ms(p.run, 10, lambda: None)
    print(f"H{H} B{B} L{L} mode {mode}: kernel {ms:.4f} ms (plain launches, L2 warm), grid {p.grid}, "
          f"items {p.n_items}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
