"""The Triton sparse kernel (kernels/sparse_decode.py) and its split merge (kernels/split/merge.py) compiled for
sm_80, sm_89, sm_90a and sm_120 without a GPU, in the configuration ``launch_config`` picks there, with devtools/triton_targets.py's helpers
(ptxas / cuobjdump from the triton wheel): no spills and no byte-wise shared loads (``LDS.U8``) in any
loop on the portable targets, shared memory within what each target gives one block. sm_90a's default (the dense
decode's H200 tile) is checked to compile and fit; it may spill, as the dense decode's does.

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

PORTABLE = (80, 89, 120)
# (format, heads): GLM-5's record at 8-16 heads per GPU (TP) and 64 (DP attention; V3.2's 128 gets the same
# 32-row tile, default_config gives the group path 32 rows for any H > 16), per-tensor e4m3; the split merge.
CASES = {"record-h16": ("fp8_ds_mla", 16), "record-h64": ("fp8_ds_mla", 64), "fp8-h16": ("fp8_e4m3", 16),
         "merge": (None, 16)}
_ONES = {"stride_o_c", "stride_lse_h", "stride_sa_g"}
# Strides that are not multiples of 16 elements in real launches: a record's bf16 / fp32 views (328 / 164
# elements a token), lse rows of [n, H] for small H, the partial lse rows.
_ODD = {"stride_lse_t", "stride_pl_i"}
_ODD_RECORD = {"stride_kpe_s", "stride_sa_s", "stride_sa_p", "stride_kpe_p"}


def _sparse_module():
    ck._load_kernels()  # registers the fp8mla_kernels package (decode, softmax) without importing fp8mla
    full = "fp8mla_kernels.sparse_decode"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, os.path.join(ck.KDIR, "sparse_decode.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
    return sys.modules[full]


def _config(fmt_name: str | None, heads: int, arch: int) -> dict:
    _sparse_module()
    dec = sys.modules["fp8mla_kernels.decode"]
    if fmt_name is None:   # merge_splits' launch (index-row splits)
        mm = sys.modules["fp8mla_kernels.split_merge"]
        bp, bc = mm.INVARIANT_BLOCKS
        return dict(num_warps=4, num_stages=1, BLOCK_P=bp, BLOCK_C=bc, ROWS=mm.merge_tile(bc), SEQ=mm.SEQ_PARTS,
                    UNIFORM=True)
    record = fmt_name == "fp8_ds_mla"
    kv_mode = dec.KV_GROUP if record else dec.KV_FP8_FP16_MATH
    d = dec.default_config(heads, kv_mode, arch)
    v_cvt = dec.V_CONVERT[d["v_convert"]]
    raw = arch < 89
    return dict(kv_type="u8" if raw else "fp8e4nv", kpe_type="bf16" if record else ("u8" if raw else "fp8e4nv"),
                num_warps=d["num_warps"], num_stages=d["num_stages"], PAGE=64, DC=512, DK=64, GROUP=128,
                BLOCK_H=d["block_m"], BLOCK_N=d["block_n"], NUM_STAGES=d["num_stages"], KV_MODE=kv_mode,
                KPE_BF16=record, FP32_DOT=False, Q_SPLIT=False, EVICT="evict_first", IDX64=False,
                NCH=dec.column_chunks(kv_mode, 512, v_cvt), V_CVT=v_cvt, RAW_FP8=1 if raw else 0, SPLIT=True,
                )


def compile_case(case: str, arch: int) -> dict:
    import triton as _triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fmt_name, heads = CASES[case]
    sd = _sparse_module()
    cfg = _config(fmt_name, heads, arch)
    fn = sys.modules["fp8mla_kernels.split_merge"]._merge_parts_kernel if fmt_name is None else sd._sparse_mla_kernel
    names = fn.arg_names
    ptr = {"q_nope": "bf16", "q_pe": "bf16", "ckv": cfg.get("kv_type"), "kpe": cfg.get("kpe_type"), "scale_arr": "fp32",
           "scales": "fp32", "indices": "i32", "out": "bf16", "lse_out": "fp32", "part_o": "fp32",
           "part_lse": "fp32"}
    const = {k: v for k, v in cfg.items() if k in names}
    const.update({n: 1 for n in names if n in _ONES})
    odd = _ODD | (_ODD_RECORD if fmt_name == "fp8_ds_mla" else set())
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr:
            sig[n] = "*" + ptr[n]
        elif n in ("sm_scale_log2", "lse_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n.startswith("stride") and n not in odd and sig[n] == "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = _triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    r = ck.analyse(k)
    r.pop("sass")
    r["ops"] = dict(r["ops"])
    r["cfg"] = cfg
    return r


def _batch(cases):
    out = []
    for case, arch in cases:
        try:
            out.append(compile_case(case, arch))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append({"error": f"{type(e).__name__}: {str(e)[:2000]}"})
    return out


ALL = [(c, a) for c in CASES for a in PORTABLE + (90,)]

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
        assert p.returncode == 0, f"test_compile_sparse.py subprocess failed:\n{err[-3000:]}"
        for key, r in zip(half, json.loads(out)):
            results[key] = r
    return results


def _get(compiled, case, arch):
    r = compiled[(case, arch)]
    assert "error" not in r, f"{case} sm_{arch}: {r.get('error')}"
    return r


@pytest.mark.parametrize("arch", PORTABLE)
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_portable_targets_compile_clean(compiled, case, arch):
    r = _get(compiled, case, arch)
    assert r["smem"] <= ck.SMEM_LIMIT[arch], f"{case} on sm_{arch}: {r['smem']} B of shared memory"
    assert r["stack"] == 0 and r["spill_ops"] == 0, (
        f"{case} on sm_{arch}: spills (stack {r['stack']} B, {r['spill_ops']} STL/LDL), {r['regs']} registers, "
        f"{r['cfg']}")
    assert r["lds_u8_in_loops"] == 0, f"{case} on sm_{arch}: {r['lds_u8_in_loops']} LDS.U8 inside loops"
    if case != "merge":
        assert r["ops"].get("HMMA", 0) > 0, f"{case} on sm_{arch}: no tensor-core MMA in the SASS"


def test_record_h128_gets_the_h64_tile():
    """Why no H128 case compiles: its launch configuration is H64's on every target."""
    from fp8mla.kernels.decode import KV_GROUP, default_config  # the choice _config makes, read in this process
    assert all(default_config(128, KV_GROUP, a) == default_config(64, KV_GROUP, a) for a in PORTABLE + (90,))


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_sm90_defaults_compile_and_fit(compiled, case):
    r = _get(compiled, case, 90)
    assert r["smem"] <= ck.SMEM_LIMIT[90], f"{case} on sm_90a: {r['smem']} B of shared memory"
