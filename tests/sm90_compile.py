"""What the sm_90a compile checks of the Hopper Gluon builds share (tests/test_compile_sparse_gluon.py,
tests/test_compile_v4_gluon.py): each of those files is also the script of its compile child, which compiles
the named cases in a process without TRITON_INTERPRET (conftest.py sets it; where it is set nothing compiles) and
prints their reports as JSON; the tests read the opcode counts of the partitions' tile loops from them.

Imported as ``tests.sm90_compile`` (the repository root on the path: pytest's ``pythonpath``, or the child
script's own insertion)."""
from __future__ import annotations

import collections
import importlib
import json
import os
import re
import subprocess
import sys

from devtools import sass as ck

# the whole opcode of an instruction line, modifiers included (HGMMA.64x64x16.F32.BF16)
_OPCODE = re.compile(r"^\s*(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")


def innermost_loops(sass: str) -> list[collections.Counter]:
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


def compile_report(src, num_warps: int, **extra) -> dict:
    """``devtools.sass.analyse`` of a Gluon source compiled for sm_90a, its SASS replaced by ``loops`` (the
    innermost loops of more than 4 instructions, ``innermost_loops``), with ``triton`` (the version) and
    ``extra``."""
    import triton
    from triton.backends.compiler import GPUTarget
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    r = ck.analyse(k)
    sass = r.pop("sass")
    r["ops"] = dict(r["ops"])
    r["loops"] = [dict(c) for c in innermost_loops(sass) if sum(c.values()) > 4]
    r["triton"] = triton.__version__
    r.update(extra)
    return r


def child_main(compile_case, cases: list[str]) -> int:
    """The compile child: {case: ``compile_case(case)`` or {"error": ...}} of each case, as JSON on stdout."""
    out = {}
    for case in cases:
        try:
            out[case] = compile_case(case)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[case] = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
    print(json.dumps(out))
    return 0


def _gluon_ok() -> bool:
    try:
        return hasattr(importlib.import_module("triton.experimental.gluon._runtime"), "GluonASTSource")
    except Exception:  # noqa: BLE001
        return False


def skip_unless_compilable():
    """A module's ``pytestmark``: skipped where ptxas / cuobjdump or Gluon are missing."""
    import pytest
    return pytest.mark.skipif(not (ck.tools_present() and _gluon_ok()),
                              reason="ptxas / cuobjdump or triton.experimental.gluon missing")


def compile_in_child(script: str, cases, timeout: int = 900) -> dict:
    """Run ``script`` (a compile check file) as the compile child of ``cases``: {case: report}; every case
    compiled, or the test fails with the child's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, script, *cases], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"compile subprocess failed:\n{p.stderr[-3000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for case, r in res.items():
        assert "error" not in r, f"{case}: {r['error']}"
    return res


def op_sum(lp, prefix: str) -> int:
    """Instructions of a loop's opcode counts whose opcode starts with ``prefix``."""
    return sum(n for op, n in lp.items() if op.startswith(prefix))


def roles(r: dict, converter_order) -> tuple[list, list, list]:
    """(loops, consumers' loops, converters' loops) of a report: the consumers' tile loops issue wgmma (HGMMA),
    the converters' gather with cp.async (LDGSTS) and issue none; the converters sorted by ``converter_order``
    (a key of a loop's counts)."""
    loops = [collections.Counter(lp) for lp in r["loops"]]
    consumers = [lp for lp in loops if op_sum(lp, "HGMMA") > 0]
    converters = sorted((lp for lp in loops if op_sum(lp, "HGMMA") == 0 and op_sum(lp, "LDGSTS") > 0),
                        key=converter_order)
    return loops, consumers, converters
