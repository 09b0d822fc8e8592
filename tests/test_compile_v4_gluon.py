"""The Hopper Gluon DeepSeek V4 build (kernels/sm90/v4_partitions.py) compiled for sm_90a without a GPU, with its
SASS facts per tile loop, for each pool format (fp8_v4 split and not, fp8_v41, bf16; sinks and both segments'
lengths on): the two consumer loops issue 48 bf16 wgmma (HGMMA.64x64x16.F32.BF16) each (32 for the owner's
scores over the 512-value row, 16 for its half of P.V, RoPE columns included) and no HMMA, with no local-memory
traffic; the two converter loops gather with 16-byte cp.async (LDGSTS.E.BYPASS.128: fp8_v4 A 8 e4m3 pieces, B 6
+ 4 RoPE pieces; fp8_v41 8 each; bf16 16 each) plus their scale words, and convert each e4m3 value once (16
packed unpacks a thread, chunk and tile); no byte-wise shared loads in those loops; 128 registers at launch;
shared memory as modelled and within one block's 227 KB; spills bounded (triton 3.9: 40-64 B of stack, a few LDL
in the converters' loops). The GPU checks are tests/test_v4_gluon.py.

Compiled in a subprocess without TRITON_INTERPRET (conftest.py sets it; where it is set nothing compiles), with
devtools/sass.py's ``v4_source`` and the compile checks' common parts (tests/sm90_compile.py)."""
from __future__ import annotations

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

# {case: (format kind, SPLIT)}: devtools.sass.V4_BUILDS (the SASS record's V4 builds)
CASES = dict(ck.V4_BUILDS)
# per format: (converter A's, B's) 16-byte copies and e4m3 unpacks a thread and tile, scale-word copies each
COPIES = {1: ((8, 64), (10, 48), 2), 2: ((8, 64), (8, 64), 4), 0: ((16, 0), (16, 0), 0)}


def compile_case(case: str) -> dict:
    from fp8mla.kernels.sm90 import v4_partitions as mod
    fmt, split = CASES[case]
    return sc.compile_report(ck.v4_source(fmt, split), mod.NUM_WARPS, smem_model=mod.smem_bytes(fmt),
                             smem_limit=mod.SMEM_LIMIT, fmt=fmt)


if __name__ == "__main__":
    sys.exit(sc.child_main(compile_case, sys.argv[1:]))


pytestmark = sc.skip_unless_compilable()
_sum = sc.op_sum


@pytest.fixture(scope="module")
def compiled():
    return sc.compile_in_child(__file__, CASES)


def _roles(r):
    return sc.roles(r, lambda lp: (-_sum(lp, "F2FP.F16.E4M3"), -lp["LDGSTS.E.BYPASS.128"]))


@pytest.mark.parametrize("case", list(CASES))
def test_v4_gluon_build_sass(compiled, case):
    r = compiled[case]
    _, consumers, converters = _roles(r)
    assert len(consumers) == 2 and len(converters) == 2, r["loops"]
    for lp in consumers:
        assert _sum(lp, "HGMMA") == 48 and lp["HGMMA.64x64x16.F32.BF16"] == 48, lp
        assert _sum(lp, "LDGSTS") == 0 and lp["MUFU.EX2"] >= 32, lp
    assert r["ops"].get("HMMA", 0) == 0, f"{case}: mma.sync in the SASS"
    (copies_a, unpack_a), (copies_b, unpack_b), words = COPIES[r["fmt"]]
    a, b = converters
    for lp, copies, unpacks in ((a, copies_a, unpack_a), (b, copies_b, unpack_b)):
        assert lp["LDGSTS.E.BYPASS.128"] == copies, lp
        assert _sum(lp, "LDGSTS") == copies + words, lp            # the scale words: 4-byte copies, rows r, r + 32
        assert lp["F2FP.F16.E4M3.UNPACK_B"] == unpacks, lp         # each e4m3 value converted once
        assert _sum(lp, "HMMA") == 0, lp
    for lp in consumers + converters:
        assert lp["LDS.U8"] == 0, lp
    assert r["lds_u8"] <= 1   # the warp-specialize dispatch reads one byte flag, outside the tile loops
    assert r["smem_model"] <= r["smem"] <= min(r["smem_model"] + 1024, r["smem_limit"]), (r["smem"], r["smem_model"])


@pytest.mark.parametrize("case", list(CASES))
def test_v4_gluon_build_spills(compiled, case):
    r = compiled[case]
    loops, consumers, _ = _roles(r)
    assert r["regs"] <= 128, r["regs"]   # 16 warps at launch: setmaxnreg moves registers between the roles
    if r["triton"].startswith("3.6."):   # the H200's triton: not compiled there yet, no bound recorded
        pytest.skip("spill bounds recorded under triton 3.9 only")
    assert r["stack"] <= 80, r["stack"]   # triton 3.9: 40-64 B, loop-invariant values of the converters
    for lp in loops:
        assert _sum(lp, "STL") <= 2 and _sum(lp, "LDL") <= 10, lp
    for lp in consumers:
        assert _sum(lp, "STL") == 0 and _sum(lp, "LDL") == 0, lp
