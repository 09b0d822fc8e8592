"""fp8mla's Triton kernels compiled for a GPU target without a GPU (triton.compile with a GPUTarget), in the
configuration each launcher picks there (``launch_config``), and read with ``devtools.sass.analyse``: registers,
spills, shared memory, instruction counts, byte-wise shared loads (``LDS.U8``) inside loops.
``tests/test_compile_targets.py`` runs ``python -m devtools.triton_targets --batch FILE`` in child processes;
``scripts/compile_kernels.py`` is the command line over it. torch is not needed.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types

from .sass import analyse, bin_dir, tools_present  # noqa: F401 - re-exported for the tests and the script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "src", "fp8mla", "kernels")
ARCHS = (80, 89, 90, 120)
KERNELS = ("decode", "split_merge", "extend", "ragged", "merge_state")


def _load_kernels():
    """The kernel modules by file path (no fp8mla / torch import needed: their launchers import torch lazily or
    get a stub)."""
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            stub = types.ModuleType("torch")
            stub.Tensor = object
            sys.modules["torch"] = stub
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: triton.language's own helpers are interpreted, nothing compiles "
                           "in this process; run this script (e.g. --batch) in a process without it")
    pkg = types.ModuleType("fp8mla_kernels")
    pkg.__path__ = [KDIR]
    sys.modules.setdefault("fp8mla_kernels", pkg)
    mods = {}
    for name in ("softmax", "decode", "extend", "ragged", "merge_state", "split_merge"):
        full = f"fp8mla_kernels.{name}"
        if full not in sys.modules:
            path = os.path.join(KDIR, *(("split", "merge.py") if name == "split_merge" else (f"{name}.py",)))
            spec = importlib.util.spec_from_file_location(full, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            spec.loader.exec_module(mod)
        mods[name] = sys.modules[full]
    return mods


def launch_config(kernel: str, arch: int, *, heads: int = 16, kv_mode: int = 0, **overrides) -> dict:
    """The constexprs / launch options each launcher picks on sm_<arch> (from the launchers' own default
    functions), with overrides. ``kv``: the pool element type (``fp8e4nv``, ``bf16``, or ``u8`` = FP8 bits on
    sm_80, where Triton has no FP8 type). ``heads``: query rows of the decode tile / heads of the extend."""
    m = _load_kernels()
    raw = arch < 89
    fp8 = kv_mode != 1 and overrides.get("kv", "fp8e4nv") != "bf16"
    if kernel == "decode":
        d = m["decode"].default_config(heads, kv_mode, arch)
        v_cvt = m["decode"].V_CONVERT[d["v_convert"]]
        c = dict(kv=("u8" if raw else "fp8e4nv") if fp8 else "bf16", num_warps=d["num_warps"],
                 num_stages=d["num_stages"], PAGE=64, DC=512, DK=64, GROUP=128, BLOCK_M=d["block_m"],
                 BLOCK_N=d["block_n"], NUM_STAGES=d["num_stages"], CAUSAL=True, KV_MODE=kv_mode, FP32_DOT=False,
                 Q_SPLIT=False, EVICT="evict_first", IDX64=False,
                 NCH=m["decode"].column_chunks(kv_mode, 512, v_cvt), V_CVT=v_cvt, RAW_FP8=1 if raw and fp8 else 0)
    elif kernel == "split_merge":   # the work-item lists' merge at the sizes the Triton dense plans launch
        bp, bc = m["split_merge"].INVARIANT_BLOCKS
        c = dict(num_warps=4, num_stages=1, BLOCK_P=bp, BLOCK_C=bc, ROWS=m["split_merge"].merge_tile(bc),
                 SEQ=m["split_merge"].SEQ_PARTS, UNIFORM=False)
    elif kernel == "extend":
        group = kv_mode == 2
        t = m["extend"].default_tiles(heads, False, group, arch)
        c = dict(kv=("u8" if raw else "fp8e4nv") if fp8 else "bf16", num_warps=t["num_warps"],
                 num_stages=t["num_stages"], PAGE=64, DC=512, DK=64, BLOCK_DC=512, BLOCK_DK=64,
                 BLOCK_Q=t["block_q"], BLOCK_H=t["block_h"], BLOCK_N=t["block_n"],
                 NUM_HB=max(1, heads // t["block_h"]), CAUSAL=True, HAS_GROUP=group, GROUP_SIZE=128,
                 FP32_DOT=False, V_ASM=bool(t["v_asm"]) and fp8 and not group, RAW_FP8=1 if raw and fp8 else 0)
    elif kernel == "ragged":
        dqk, dv = overrides.pop("dims", (192, 128))
        da, db = m["ragged"].split_head_dim(dqk)
        bm, bn, nw, ns = m["ragged"].default_tiles(dqk, dv, arch, False)
        c = dict(num_warps=nw, num_stages=ns, GQA=1, DQK=dqk, DA=da, DB=db, DV=dv, BLOCK_DV=max(16, dv),
                 BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, FP32_DOT=False)
    elif kernel == "merge_state":
        c = dict(num_warps=4, num_stages=1, D=512, BLOCK_D=512, BLOCK_R=8)
    else:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    c.update(overrides)
    return c


# Shared memory a block may use (opt-in maximum), by target: a kernel above it compiles but cannot launch.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


# Pointer element types and float scalars by argument name; every other non-constexpr argument is an i32.
_PTR = {
    "decode": {"q_nope": "bf16", "q_pe": "bf16", "ckv": "KV", "kpe": "KV", "scale_arr": "fp32", "scales": "fp32",
               "out": "bf16", "lse_out": "fp32", "part_o": "fp32", "part_lse": "fp32"},
    "split_merge": {"out": "bf16", "lse_out": "fp32", "part_o": "fp32", "part_lse": "fp32"},
    "extend": {"qn_ptr": "bf16", "qp_ptr": "bf16", "ckv_ptr": "KV", "kpe_ptr": "KV", "gs_ptr": "fp32",
               "scales_ptr": "fp32", "o_ptr": "bf16", "lse_ptr": "fp32"},
    "ragged": {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "o_ptr": "bf16", "lse_ptr": "fp32"},
    "merge_state": {"va_ptr": "bf16", "sa_ptr": "fp32", "vb_ptr": "bf16", "sb_ptr": "fp32", "vo_ptr": "bf16",
                    "so_ptr": "fp32"},
}
_FLOAT = {"sm_scale_log2", "sm_scale", "qk_scale", "lse_scale"}
# Strides that are 1 in every real launch: Triton specializes an int argument equal to 1 as a constant.
_ONES = {"stride_o_c", "stride_lse_h", "stride_sa_g", "stride_lh", "stride_gs_g", "stride_sa_h", "stride_sb_h",
         "stride_so_h"}
# Strides that are not multiples of 16 elements in a real launch (e.g. [n, H] lse rows for H = 8).
_ODD = {"stride_lse_t", "stride_lse_n", "stride_ln", "stride_pl_i", "stride_sa_n", "stride_sb_n", "stride_so_n",
        "stride_sa_s", "stride_gs_s", "stride_sa_p", "stride_gs_p"}


def _kernel_fn(kernel: str):
    m = _load_kernels()
    return {"decode": m["decode"]._mla_decode_kernel, "split_merge": m["split_merge"]._merge_parts_kernel,
            "extend": m["extend"]._extend_kernel, "ragged": m["ragged"]._ragged_fwd_kernel,
            "merge_state": m["merge_state"]._merge_state_kernel}[kernel]


def compile_kernel(kernel: str, arch: int, **overrides):
    """triton.compile for GPUTarget('cuda', arch, 32) (sm_90 -> sm_90a, as Triton does); returns the compiled
    kernel and the config used. ``heads`` / ``kv_mode`` / ``dims`` select the launcher's defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = launch_config(kernel, arch, **overrides)
    fn = _kernel_fn(kernel)
    names = fn.arg_names
    kv = cfg.get("kv", "fp8e4nv")
    const = {k: v for k, v in cfg.items() if k in names and k not in ("kv",)}
    const.update({n: 1 for n in names if n in _ONES})
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in _PTR[kernel]:
            sig[n] = "*" + (kv if _PTR[kernel][n] == "KV" else _PTR[kernel][n])
        elif n in _FLOAT:
            sig[n] = "fp32"
        elif n.startswith("stride") or n in ("H", "R", "num_pages", "num_parts", "min_parts"):
            sig[n] = "i32"
        else:
            sig[n] = "*i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n.startswith("stride") and n not in _ODD and sig[n] == "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return k, cfg


@functools.lru_cache(maxsize=None)
def report(kernel: str, arch: int, overrides: tuple = ()) -> dict:
    """compile + analyse, cached per (kernel, arch, overrides) within a process."""
    k, cfg = compile_kernel(kernel, arch, **dict(overrides))
    r = analyse(k)
    r["cfg"] = cfg
    return r


def batch(cases: list) -> list:
    """``[[kernel, arch, {overrides}], ...]`` -> one result dict per case (no SASS text), or ``{"error": ...}``."""
    out = []
    for kernel, arch, over in cases:
        try:
            over = {k: tuple(v) if isinstance(v, list) else v for k, v in over.items()}
            r = dict(report(kernel, int(arch), tuple(sorted(over.items()))))
            r.pop("sass")
            r["ops"] = dict(r["ops"])
            r["cfg"] = {k: v for k, v in r["cfg"].items()}
            out.append(r)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            out.append({"error": f"{type(e).__name__}: {str(e)[:2000]}"})
    return out


def main(argv=None):
    """``--batch FILE``: JSON results of the file's ``[[kernel, arch, {overrides}], ...]`` on stdout."""
    import argparse
    import json
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", required=True)
    a = p.parse_args(argv)
    with open(a.batch) as f:
        print(json.dumps(batch(json.load(f))))


if __name__ == "__main__":
    main()
