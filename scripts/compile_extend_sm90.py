"""Compile the paged extend kernel for sm_90 without a GPU (ptxas ships with triton) and print registers, spills,
shared memory, SASS instruction counts, and whether the loop's c_kv/k_pe loads are pipelined (cp.async in the
TTGIR) or synchronous. Use the triton version of the target machine (3.6 on the H200); torch is not needed.

    python scripts/compile_extend_sm90.py [--kv fp8e4nv|bf16] [--block-h 64 --block-q 1 --block-n 32 --warps 8
                                          --stages 2] [--group] [--page 64] [--sass out.sass]
    python scripts/compile_extend_sm90.py --grid     # the configurations the bench sweeps, both pools
"""
import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types

if "torch" not in sys.modules:  # extend.py imports torch for its launcher only; the kernel does not need it
    try:
        import torch  # noqa: F401
    except ImportError:
        _t = types.ModuleType("torch")
        _t.Tensor = object
        sys.modules["torch"] = _t
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "ext", os.path.join(os.path.dirname(__file__), "..", "src", "fp8mla", "kernels", "extend.py"))
ext = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ext)

KEYS = ["HMMA", "HGMMA", "F2FP", "F2F", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "STL", "LDL", "MUFU", "BAR"]


def compile_one(kv="fp8e4nv", block_h=64, block_q=1, block_n=32, warps=8, stages=2, group=False, page=64,
                sass_path=None, **extra):
    fn = ext._extend_kernel
    names = fn.arg_names
    ptr = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "ckv_ptr": f"*{kv}", "kpe_ptr": f"*{kv}", "gs_ptr": "*fp32",
           "scales_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32", "sm_scale": "fp32"}
    const = dict(PAGE=page, DC=512, DK=64, BLOCK_DC=512, BLOCK_DK=64, BLOCK_Q=block_q, BLOCK_H=block_h,
                 BLOCK_N=block_n, NUM_HB=max(1, 128 // block_h), CAUSAL=True, HAS_GROUP=group, GROUP_SIZE=128,
                 FP32_DOT=False)
    const.update({k: v for k, v in extra.items() if k in names})
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
    # what the launcher sees on the GPU: 16-byte aligned pointers, strides multiples of 16 (576-wide pool rows)
    div16 = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_lse_n")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=div16)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".ptx", delete=False, mode="w") as f:
        f.write(k.asm["ptx"])
    v = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", f.name, "-o", f.name + ".cubin"],
                       capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", v)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-sass", f.name], capture_output=True,
                          text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0]
                              for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    ops["LDS.U8"] = len(re.findall(r"\bLDS\.U8\b", sass))
    ttgir = k.asm["ttgir"]
    res = dict(regs=int(regs.group(1)) if regs else -1,
               spill_st=int(spill.group(1)) if spill else -1, spill_ld=int(spill.group(2)) if spill else -1,
               smem=k.metadata.shared, ops=ops,
               # in the TTGIR: loads issued as cp.async (pipelined) vs plain tt.load (synchronous, in registers)
               async_copies=len(re.findall(r"ttg\.async_copy_global_to_local", ttgir)),
               sync_loads=len(re.findall(r"= tt\.load ", ttgir)),
               wgmma=len(re.findall(r"ttng\.warp_group_dot ", ttgir)),
               mma_sync=len(re.findall(r"= tt\.dot ", ttgir)))
    if sass_path:
        open(sass_path, "w").write(sass)
        open(sass_path + ".ttgir", "w").write(ttgir)
        open(sass_path + ".ptx", "w").write(k.asm["ptx"])
    return res


def fmt(res):
    o = res["ops"]
    return (f"regs {res['regs']:3d} spill st/ld {res['spill_st']}/{res['spill_ld']} B smem {res['smem']:6d} B | "
            f"ttgir: warp_group_dot {res['wgmma']} tt.dot {res['mma_sync']} cp.async {res['async_copies']} "
            f"tt.load {res['sync_loads']} | " + " ".join(f"{k}={o.get(k, 0)}" for k in KEYS + ["LDS.U8"]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv", default="fp8e4nv", help="pool element type: fp8e4nv, fp8e5, bf16")
    p.add_argument("--block-h", type=int, default=64)
    p.add_argument("--block-q", type=int, default=1)
    p.add_argument("--block-n", type=int, default=32)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--group", action="store_true")
    p.add_argument("--set", nargs="*", default=[], help="extra constexprs NAME=int")
    p.add_argument("--grid", action="store_true", help="the bench's extend variants, fp8 and bf16 pools")
    p.add_argument("--sass", default=None)
    a = p.parse_args()
    extra = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in a.set}
    if a.grid:  # (block_h, block_q, block_n, num_warps, num_stages); the first is the GPU default
        grid = [(64, 1, 32, 8, 2), (64, 1, 32, 8, 3), (64, 1, 16, 8, 3), (64, 1, 64, 8, 2), (32, 2, 32, 8, 2),
                (16, 4, 32, 8, 2)]
        for kv in ("fp8e4nv", "bf16"):
            for t in grid:
                try:
                    print(f"{kv:8s} h{t[0]}q{t[1]}n{t[2]}w{t[3]}s{t[4]:<3d} {fmt(compile_one(kv, *t, page=a.page))}",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - e.g. ptxas out of registers at 16 warps
                    print(f"{kv:8s} h{t[0]}q{t[1]}n{t[2]}w{t[3]}s{t[4]} FAILED {type(e).__name__}", flush=True)
        return
    r = compile_one(a.kv, a.block_h, a.block_q, a.block_n, a.warps, a.stages, a.group, a.page, a.sass, **extra)
    print(fmt(r))


if __name__ == "__main__":
    main()
