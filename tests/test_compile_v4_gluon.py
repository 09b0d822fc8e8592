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
devtools/sass.py's ``v4_source`` / ``analyse`` / ``instructions`` / ``tools_present``."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

if __name__ != "__main__":
    import pytest
    pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if __name__ == "__main__":   # the compile child runs this file as a script: devtools at the repository root, the
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]   # package in src/ (an installed fp8mla comes first otherwise)
from devtools import sass as ck  # noqa: E402

# {case: (format kind, SPLIT)}: devtools.sass.V4_BUILDS (the SASS record's V4 builds)
CASES = dict(ck.V4_BUILDS)
# per format: (converter A's, B's) 16-byte copies and e4m3 unpacks a thread and tile, scale-word copies each
COPIES = {1: ((8, 64), (10, 48), 2), 2: ((8, 64), (8, 64), 4), 0: ((16, 0), (16, 0), 0)}
# the whole opcode of an instruction line, modifiers included (HGMMA.64x64x16.F32.BF16)
_OPCODE = re.compile(r"^\s*(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")


def _innermost_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop that contains no other loop (the tile loops of the four partitions, and the
    warp-specialize dispatch), from the backward branches of the stream."""
    body = [(a, t) for a, t in ck.instructions(sass) if a >= 0]
    spans = []
    for addr, text in body:
        targets = ck._HEX.findall(text)
        if ck.opcode(text).split(".")[0] == "BRA" and targets and int(targets[-1], 16) < addr:
            spans.append((int(targets[-1], 16), addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [collections.Counter(m.group(1) for a, t in body if lo <= a <= hi and (m := _OPCODE.match(t)))
            for lo, hi in inner]


def compile_case(case: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from fp8mla.kernels.sm90 import v4_partitions as mod
    fmt, split = CASES[case]
    k = triton.compile(ck.v4_source(fmt, split), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=mod.NUM_WARPS))
    r = ck.analyse(k)
    sass = r.pop("sass")
    r["ops"] = dict(r["ops"])
    r["loops"] = [dict(c) for c in _innermost_loops(sass) if sum(c.values()) > 4]
    r["smem_model"] = mod.smem_bytes(fmt)
    r["smem_limit"] = mod.SMEM_LIMIT
    r["fmt"] = fmt
    r["triton"] = triton.__version__
    return r


if __name__ == "__main__":
    out = {}
    for case in sys.argv[1:]:
        try:
            out[case] = compile_case(case)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[case] = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
    print(json.dumps(out))
    sys.exit(0)


def _gluon_ok() -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


pytestmark = pytest.mark.skipif(not (ck.tools_present() and _gluon_ok()),
                                reason="ptxas / cuobjdump or triton.experimental.gluon missing")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"compile subprocess failed:\n{p.stderr[-3000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for case, r in res.items():
        assert "error" not in r, f"{case}: {r['error']}"
    return res


def _sum(lp, prefix):
    return sum(n for op, n in lp.items() if op.startswith(prefix))


def _roles(r):
    loops = [collections.Counter(lp) for lp in r["loops"]]
    consumers = [lp for lp in loops if _sum(lp, "HGMMA") > 0]
    converters = sorted((lp for lp in loops if _sum(lp, "HGMMA") == 0 and _sum(lp, "LDGSTS") > 0),
                        key=lambda lp: (-_sum(lp, "F2FP.F16.E4M3"), -lp["LDGSTS.E.BYPASS.128"]))
    return loops, consumers, converters


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
