"""The DeepSeek V4 kernels (kernels/v4_attention.py and its use of the split merge, kernels/quant_v4.py) compiled
for sm_80, sm_89, sm_90a and sm_120 without a GPU, in the configuration ``launch_config`` picks, with
devtools/triton_targets.py's helpers (ptxas / cuobjdump from the triton wheel): each compiles, fits the target's
shared memory, and the attention kernel's scores and P.V run on tensor cores (HMMA / HGMMA in the SASS). The
register and spill numbers are printed (``-s``) and held to a stack bound: they are the evidence for GPUs the
project has no measurement of.

Compiled in a subprocess without TRITON_INTERPRET (conftest.py sets it; where it is set nothing compiles)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if __name__ != "__main__":
    import pytest
    triton = pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":   # the compile child runs this file as a script: devtools is at the repository root
    sys.path.insert(0, os.path.dirname(HERE))
from devtools import triton_targets as ck  # noqa: E402

ARCHS = (80, 89, 90, 120)
# (kernel, FMT, options, targets): the attention kernel per format (the V4 record with sinks and splits, as decode
# at small batch runs it, and V4.1, on every target; the batch-invariant cut and bf16 on two), the write kernels
# on two.
CASES = {"attn-v4-split-sink": ("attn", 1, dict(SPLIT=True, HAS_SINK=True, HAS_C=True, HAS_W_LEN=True,
                                                HAS_C_LEN=True), ARCHS),
         "attn-v4-rowcut-sink": ("attn", 1, dict(SPLIT=True, HAS_SINK=True, HAS_C=True, HAS_W_LEN=True,
                                                 HAS_C_LEN=True, ROW_CUT=True), (80, 90)),
         "attn-v41": ("attn", 2, dict(SPLIT=False, HAS_SINK=True, HAS_C=True), ARCHS),
         "attn-bf16": ("attn", 0, dict(SPLIT=False, HAS_SINK=False, HAS_C=False), (80, 90)),
         "quant-v4": ("quant", 1, dict(NG=8, G=64, NQ=448), (80, 90)),
         "quant-v41": ("quant", 2, dict(NG=16, G=32, NQ=512), (89, 120))}
# bytes of local memory a thread may spill to (sm_80: fp8_v4 16 B and the split + sink build 24 B with triton 3.9.0;
# the split + sink build 40 B with triton 3.6.0)
MAX_STACK = 48


def _modules():
    ck._load_kernels()  # registers the fp8mla_kernels package (decode, softmax) without importing fp8mla
    for name in ("quant_append", "sparse_decode", "v4_attention", "quant_v4"):
        full = f"fp8mla_kernels.{name}"
        if full not in sys.modules:
            spec = importlib.util.spec_from_file_location(full, os.path.join(ck.KDIR, f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            spec.loader.exec_module(mod)
    return sys.modules["fp8mla_kernels.v4_attention"], sys.modules["fp8mla_kernels.quant_v4"]


def compile_case(case: str, arch: int) -> dict:
    import triton as _triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kind, fmt, opts, _ = CASES[case]
    attn, quant = _modules()
    if kind == "attn":
        fn = attn._v4_attention_kernel
        tile = attn.DEFAULT_TILES[fmt]
        cfg = {**dict(FMT=fmt, BLOCK_H=tile["block_h"], BLOCK_N=tile["block_n"], FP32_DOT=False, Q_SPLIT=False, HAS_W_LEN=False,
                      HAS_C=False, HAS_C_LEN=False, HAS_SINK=False, SPLIT=False, ROW_CUT=False), **opts}
        ptr = {"q": "bf16", "out": "bf16", "lse_out": "fp32", "part_o": "fp32", "part_lse": "fp32",
               "sinks": "fp32", "w8": "u8", "w16": "bf16", "c8": "u8", "c16": "bf16", "w_idx": "i32",
               "c_idx": "i32", "w_len": "i32", "c_len": "i32"}
        if fmt == 0:
            ptr.update(w8="bf16", c8="bf16")
        warps, stages = tile["num_warps"], 1
    else:
        fn = quant._quant_v4_kernel
        cfg = dict(FMT=fmt, BLOCK_T=4, BF16_MAX_=quant.BF16_MAX, **opts)
        ptr = {"p8": "u8", "p16": "i16", "slot_ptr": "i32", "kv_ptr": "bf16"}
        warps, stages = 4, 1
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in cfg:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = "*" + ptr[n]
        elif n in ("sm_scale_log2", "lse_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cfg.items()}, attrs=attrs)
    k = _triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    r = ck.analyse(k)
    r.pop("sass")
    r["ops"] = dict(r["ops"])
    return r


def _batch(cases):
    out = []
    for case, arch in cases:
        try:
            out.append(compile_case(case, arch))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append({"error": f"{type(e).__name__}: {str(e)[:2000]}"})
    return out


ALL = [(c, a) for c in CASES for a in CASES[c][3]]

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(_batch([tuple(x) for x in json.load(f)])))
    sys.exit(0)

pytestmark = pytest.mark.skipif(not ck.tools_present(), reason="ptxas / cuobjdump not in the triton wheel")


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled once, in two processes without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = []
    for half in (ALL[0::2], ALL[1::2]):
        f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(half, f)
        f.close()
        procs.append((half, f.name, subprocess.Popen([sys.executable, __file__, f.name], env=env,
                                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    results = {}
    for half, name, p in procs:
        out, err = p.communicate(timeout=1200)
        os.remove(name)
        assert p.returncode == 0, f"test_compile_v4.py subprocess failed:\n{err[-3000:]}"
        for key, r in zip(half, json.loads(out)):
            results[key] = r
    return results


@pytest.mark.parametrize("case,arch", ALL)
def test_v4_kernels_compile(compiled, case, arch):
    r = compiled[(case, arch)]
    assert "error" not in r, f"{case} sm_{arch}: {r.get('error')}"
    print(f"{case} sm_{arch}: {r['regs']} registers, stack {r['stack']} B, {r['spill_ops']} spill ops, "
          f"smem {r['smem']} B")
    assert r["smem"] <= ck.SMEM_LIMIT[arch], f"{case} on sm_{arch}: {r['smem']} B of shared memory"
    assert r["stack"] <= MAX_STACK, f"{case} on sm_{arch}: stack {r['stack']} B"
    if CASES[case][0] == "attn":
        mma = r["ops"].get("HMMA", 0) + r["ops"].get("HGMMA", 0)
        assert mma > 0, f"{case} on sm_{arch}: no tensor-core MMA in the SASS ({sorted(r['ops'])[:20]})"
