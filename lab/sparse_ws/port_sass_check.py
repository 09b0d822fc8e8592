"""The port's check (CPU, sm_90a): the product's sparse kernel (src/fp8mla/kernels/sm90/sparse_partitions.py)
compiles to the same SASS instruction stream (devtools/sass.stream_hash: addresses and names stripped) as this
prototype's default build (kernel.py, probe 0, sidx on: the build of H200 run 3), split and no-split.

    PYTHONPATH=$PWD/src /tmp/venv36_sp/bin/python lab/sparse_ws/port_sass_check.py   # triton 3.6 (the H200's)

2026-12-02, triton 3.6.0: identical (split b2cf5dc2..., no-split 34077285...).
"""
import sys, os, importlib.util
sys.path.insert(0, os.getcwd())
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from devtools import sass as ck
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m; spec.loader.exec_module(m); return m
lab = load("labk", "lab/sparse_ws/kernel.py")
import fp8mla.kernels.sm90.sparse_partitions as prod  # (PYTHONPATH=$PWD/src: the package, for its relative imports)
PTR = lab._PTR; DIV = lab._DIV16
def comp(fn, const):
    names = fn.arg_names
    sig = {k: "constexpr" if k in const else PTR.get(k, "fp32" if k in ("sm_scale_log2", "lse_scale") else "i32") for k in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*") or k in DIV}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    s = ck.analyse(k)["sass"]
    return ck.stream_hash(s), len(s.splitlines())
for split in (True, False):
    a = comp(lab.sparse_ws_kernel, dict(SPLIT=split, REGS=208, stride_lse_h=1, PROBE=0, SIDX=True))
    b = comp(prod.sparse_mla_kernel, dict(SPLIT=split, REGS=208, stride_lse_h=1))
    print("split" if split else "no-split", "identical" if a == b else "DIFFERENT", a[0][:8], b[0][:8])
