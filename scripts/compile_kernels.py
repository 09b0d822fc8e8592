"""Compile fp8mla's Triton kernels for a GPU target without a GPU and report what the SASS says: registers,
spills (local memory), shared memory, instruction counts, and byte-wise shared loads (``LDS.U8``) inside loops.
ptxas and cuobjdump come with the triton wheel (triton/backends/nvidia/bin); torch is not needed.

    python scripts/compile_kernels.py --kernel decode --arch 90 [--set BLOCK_N=32 V_CVT=1 NCH=4] [--sass out.sass]
    python scripts/compile_kernels.py --kernel all --arch all          # every kernel's default for every target
    python scripts/compile_kernels.py --kernel extend --arch 90 --grid # the extend tile variants the bench sweeps

Kernels: decode, split_merge, extend, ragged, merge_state. Targets: 80, 89, 90 (sm_90a), 120. Each kernel's
configuration per target is ``launch_config`` below: what its launcher picks there (e.g. the decode kernel on
sm_80 reads the FP8 pool as uint8 and converts by bit manipulation; on sm_80/89/120 it converts V by inline asm
in 128-column chunks). The report is for the triton of this environment; the H200 runs triton 3.6, whose SASS
may differ: check there with the same script.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from devtools.triton_targets import (ARCHS, KERNELS, bin_dir, compile_kernel, report,  # noqa: E402
                                     tools_present)


KEYS = ["HMMA", "HGMMA", "QMMA", "F2FP", "F2F", "PRMT", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STL", "LDL", "BAR"]


def fmt(r: dict) -> str:
    o = r["ops"]
    return (f"regs {r['regs']:3d} stack {r['stack']} B spill ops {r['spill_ops']} smem {r['smem']:6d} B | "
            f"LDS.U8 {r['lds_u8']} (in {r['loops']} loops {r['lds_u8_in_loops']}) | "
            + " ".join(f"{k}={o.get(k, 0)}" for k in KEYS))


def _parse_set(items):
    out = {}
    for kv in items:
        k, v = kv.split("=", 1)
        out[k] = int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="decode", help=f"one of {KERNELS} or 'all'")
    p.add_argument("--arch", default="90", help="80, 89, 90, 120 or 'all'")
    p.add_argument("--set", nargs="*", default=[], help="overrides NAME=value (constexprs, num_warps, kv=...)")
    p.add_argument("--grid", action="store_true", help="extend: the bench's tile variants, fp8 and bf16 pools")
    p.add_argument("--sass", default=None, help="write the SASS (and .ttgir, .ptx) of a single compile here")
    a = p.parse_args()
    if not tools_present():
        sys.exit(f"ptxas/cuobjdump not found in {bin_dir()}")
    kernels = KERNELS if a.kernel == "all" else (a.kernel,)
    archs = ARCHS if a.arch == "all" else (int(a.arch),)
    extra = _parse_set(a.set)
    if a.grid:  # (block_h, block_q, block_n, num_warps, num_stages); the first is the GPU default
        for kv in ("fp8e4nv", "bf16"):
            for h, q, n, w, s in [(64, 1, 64, 8, 2), (64, 1, 32, 8, 2), (64, 1, 32, 8, 3), (64, 1, 16, 8, 3),
                                  (32, 2, 32, 8, 2), (16, 4, 32, 8, 2)]:
                for arch in archs:
                    try:
                        r = report("extend", arch, tuple(dict(kv=kv, BLOCK_H=h, BLOCK_Q=q, BLOCK_N=n, num_warps=w,
                                                              num_stages=s, NUM_HB=128 // h, **extra).items()))
                        print(f"sm_{arch} {kv:8s} h{h}q{q}n{n}w{w}s{s:<3d} {fmt(r)}", flush=True)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        print(f"sm_{arch} {kv:8s} h{h}q{q}n{n}w{w}s{s} FAILED {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:100]}", flush=True)
        return
    for kernel in kernels:
        for arch in archs:
            try:
                r = report(kernel, arch, tuple(extra.items()))
            except Exception as e:  # noqa: BLE001
                print(f"{kernel:12s} sm_{arch}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            print(f"{kernel:12s} sm_{arch}: {fmt(r)}", flush=True)
            if a.sass:
                k, _ = compile_kernel(kernel, arch, **extra)
                open(a.sass, "w").write(r["sass"])
                open(a.sass + ".ttgir", "w").write(k.asm["ttgir"])
                open(a.sass + ".ptx", "w").write(k.asm["ptx"])


if __name__ == "__main__":
    main()
