"""The Hopper Gluon sparse build (kernels/sm90/sparse_partitions.py) compiled for sm_90a without a GPU, with its SASS
facts per tile loop: the two consumer loops issue 52 wgmma (HGMMA) each (36 for the owner's scores: 32 fp16 c_kv +
4 bf16 k_pe, 16 for its half of P.V) and no HMMA; the two converter loops gather with cp.async (LDGSTS: A 8 c_kv +
4 k_pe pieces of 16 bytes and 4 scale words, B 8 + 4) and convert each e4m3 value once (64 packed unpacks and 64
HMUL2 a thread and tile); no byte-wise shared loads in those loops; shared memory within one block's 227 KB;
spills: none under triton 3.6 (the H200's), bounded under later versions (triton 3.9: 40-56 B of stack, a few LDL
in converter A's loop, none in the consumers'). The GPU checks are tests/test_sparse_gluon.py.

Compiled in a subprocess without TRITON_INTERPRET (conftest.py sets it; where it is set nothing compiles), with
devtools/sass.py's ``sparse_source`` and the compile checks' common parts (tests/sm90_compile.py)."""
from __future__ import annotations

import importlib
import os
import sys

if __name__ != "__main__":
    import pytest
    pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":   # the compile child runs this file as a script: devtools at the repository root, the
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]   # package in src/ (an installed fp8mla comes first otherwise)
from devtools import sass as ck  # noqa: E402
from tests import sm90_compile as sc  # noqa: E402

# The launch's argument types and divisibility: devtools.sass.sparse_source (the SASS record's sparse builds).
CASES = {"split": dict(SPLIT=True), "nosplit": dict(SPLIT=False)}


def compile_case(case: str) -> dict:
    mod = importlib.import_module("fp8mla.kernels.sm90.sparse_partitions")
    return sc.compile_report(ck.sparse_source(CASES[case]["SPLIT"]), mod.NUM_WARPS, smem_model=mod.smem_bytes(),
                             smem_limit=mod.SMEM_LIMIT)


if __name__ == "__main__":
    sys.exit(sc.child_main(compile_case, sys.argv[1:]))


pytestmark = sc.skip_unless_compilable()
_sum = sc.op_sum


@pytest.fixture(scope="module")
def compiled():
    return sc.compile_in_child(__file__, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_gluon_build_sass(compiled, case):
    r = compiled[case]
    _, consumers, converters = sc.roles(r, lambda lp: -_sum(lp, "LDGSTS"))
    assert len(consumers) == 2 and len(converters) == 2, r["loops"]
    for lp in consumers:
        assert _sum(lp, "HGMMA") == 52, lp
        assert lp["HGMMA.64x64x16.F32"] == 48 and lp["HGMMA.64x64x16.F32.BF16"] == 4, lp
        assert _sum(lp, "LDGSTS") == 0 and lp["MUFU.EX2"] >= 32, lp
    assert r["ops"].get("HMMA", 0) == 0, f"{case}: mma.sync in the SASS"
    # converter A: 8 c_kv + 4 k_pe 16-byte pieces and 4 scale words a thread and tile; B: 8 + 4 scale words
    a, b = converters
    assert a["LDGSTS.E.BYPASS.128"] == 12 and _sum(a, "LDGSTS") == 16, a
    assert b["LDGSTS.E.BYPASS.128"] == 8 and _sum(b, "LDGSTS") == 12, b
    for lp in converters:   # each e4m3 value converted once: 128 a thread and tile -> 64 unpacks, 64 HMUL2
        assert lp["F2FP.F16.E4M3.UNPACK_B"] == 64 and lp["HMUL2"] == 64, lp
    for lp in consumers + converters:
        assert lp["LDS.U8"] == 0, lp
    assert r["lds_u8"] <= 1   # the warp-specialize dispatch reads one byte flag, outside the tile loops
    assert r["smem_model"] <= r["smem"] <= r["smem_limit"], (r["smem"], r["smem_model"])


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_gluon_build_spills(compiled, case):
    r = compiled[case]
    loops, consumers, _ = sc.roles(r, lambda lp: 0)
    assert r["regs"] <= 128, r["regs"]   # 16 warps at launch: setmaxnreg moves registers between the roles
    if r["triton"].startswith("3.6."):   # the H200's triton: no spill anywhere
        assert r["stack"] == 0 and r["spill_ops"] == 0, (r["stack"], r["spill_ops"])
    else:   # triton 3.9's register allocation spills a few loop-invariant values, never in the consumers' loops
        assert r["stack"] <= 64, r["stack"]
        for lp in loops:
            assert _sum(lp, "STL") <= 2 and _sum(lp, "LDL") <= 10, lp
    for lp in consumers:
        assert _sum(lp, "STL") == 0 and _sum(lp, "LDL") == 0, lp
