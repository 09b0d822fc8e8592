"""Compile the decode kernel for sm_90 without a GPU (ptxas ships with triton) and print registers, spills,
shared memory and instruction counts of the SASS. Use the triton version of the target machine (3.6 on the H200).

    python scripts/compile_decode_sm90.py [--block-n 64 --warps 4 --stages 2 --kv-mode 0 --page 64 --sass out.sass]
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib.util  # noqa: E402
spec = importlib.util.spec_from_file_location(
    "dec", os.path.join(os.path.dirname(__file__), "..", "src", "fp8mla", "kernels", "decode.py"))
dec = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dec)

p = argparse.ArgumentParser()
p.add_argument("--block-m", type=int, default=16)
p.add_argument("--block-n", type=int, default=64)
p.add_argument("--warps", type=int, default=4)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--kv-mode", type=int, default=0)
p.add_argument("--kv", default="fp8e4nv")
p.add_argument("--page", type=int, default=64)
p.add_argument("--idx64", action="store_true")
p.add_argument("--asm", action="store_true")
p.add_argument("--sass", default=None)
a = p.parse_args()

fn = dec._mla_decode_kernel
names = fn.arg_names
kv = a.kv
ptr = {"q_nope": "*bf16", "q_pe": "*bf16", "ckv": f"*{kv}", "kpe": f"*{kv}", "scale_arr": "*fp32", "scales": "*fp32",
       "out": "*bf16", "lse_out": "*fp32", "part_o": "*fp32", "part_lse": "*fp32", "sm_scale_log2": "fp32"}
const = dict(PAGE=a.page, DC=512, DK=64, GROUP=128, BLOCK_M=a.block_m, BLOCK_N=a.block_n, NUM_STAGES=a.stages,
             CAUSAL=True, KV_MODE=a.kv_mode, FP32_DOT=False, Q_SPLIT=False, EVICT="evict_first", IDX64=a.idx64,
             CVT_ASM=a.asm)
sig = {}
for n in names:
    if n in const:
        sig[n] = "constexpr"
    elif n in ptr:
        sig[n] = ptr[n]
    elif n.startswith("stride") or n == "H":
        sig[n] = "i32"
    else:
        sig[n] = "*i32"
attrs = {}
src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                       if sig[n].startswith("*") or (n.startswith("stride") and n not in ("stride_lse_t",))})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=a.warps, num_stages=a.stages))
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".ptx", delete=False, mode="w") as f:
    f.write(k.asm["ptx"])
v = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", f.name, "-o", f.name + ".cubin"],
                   capture_output=True, text=True).stderr
regs = re.search(r"Used (\d+) registers", v)
spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)
print(f"regs {regs.group(1) if regs else '?'} spill st/ld {spill.group(1) if spill else '?'}/"
      f"{spill.group(2) if spill else '?'} B  smem {k.metadata.shared} B", end="  ")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(k.asm["cubin"])
sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", f.name], capture_output=True,
                      text=True).stdout
ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
keys = ["HMMA", "HGMMA", "QGMMA", "F2FP", "F2F", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STL", "LDL", "MUFU", "SHFL", "BAR"]
print(" ".join(f"{k_}={ops.get(k_, 0)}" for k_ in keys))
if a.sass:
    open(a.sass, "w").write(sass)
    open(a.sass + ".ttgir", "w").write(k.asm["ttgir"])
