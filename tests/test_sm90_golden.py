"""Guard of the Hopper decode kernels' SASS: every named build (``devtools.sass.sm90_builds``: the dense
``fp8mla.kernels.sm90.KNOWN_BUILDS`` and the sparse kernel split and not, ``sparse_split`` / ``sparse_nosplit``)
compiled for sm_90a with this environment's triton must match the golden record of that triton version
(``tests/golden/sm90_triton-<version>.json``): registers, spills, shared memory, MMA and LDS.U8 counts and the
SHA-256 of the instruction stream (addresses, branch targets and names stripped). A change that moves the SASS of
a build is a kernel change: re-record (``python -m devtools.sass record``) in the commit that makes it, and say so.

``sha256_params`` hashes the stream with the constant-bank operands normalized: a change that only removes a kernel
parameter (the others' offsets move) keeps it, while ``sha256`` changes; such a commit re-records the strict one.
``sha256_regs`` hashes it with the register numbers normalized; for the builds ``sass.REGISTER_RENUMBERING`` names
under this triton (its ptxas numbers their registers differently from one compile of the same PTX to the next) it
replaces the two strict hashes, which could not be reproduced there; every other build keeps all three.
The compiles run in two child processes (the suite sets TRITON_INTERPRET=1, under which nothing compiles): ~30 s
on two cores. Under ``CI=true`` a missing Gluon or ptxas fails the test instead of skipping it.
"""
from __future__ import annotations

import json
import os

import pytest

from devtools import sass

pytestmark = pytest.mark.compile
NAMES = sorted(sass.sm90_builds())


@pytest.fixture(scope="module")
def golden() -> dict:
    sass.require_compile_tools()
    path = sass.golden_path()
    if not os.path.exists(path):
        msg = f"no golden SASS record for triton {sass.triton_version()} ({path}): python -m devtools.sass record"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def compiled(golden) -> dict:
    return sass.compile_many(NAMES)


def test_golden_record_covers_every_build(golden):
    assert sorted(golden["builds"]) == NAMES
    assert golden["triton"] == sass.triton_version()


@pytest.mark.parametrize("name", NAMES)
def test_build_sass_matches_golden(golden, compiled, name):
    got = compiled[name]
    assert "error" not in got, f"{name}: {got.get('error')}"
    d = sass.diff(golden["builds"][name], got, renumbered=sass.renumbering(name) is not None)
    assert not d, f"{name} (golden from commit {golden['commit'][:10]}):\n" + "\n".join(d)


def test_stream_hash_sees_a_changed_instruction_and_ignores_addresses():
    """The hash is over the instructions, not where they sit: a shifted address or branch target keeps it, an
    operand change moves it; the parameter-normalized hash ignores only c[0x0][...] offsets."""
    a = ("        Function : k\n"
         "        /*0000*/   LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */\n"
         "        /*0010*/   @P0 BRA 0x1390 ;   /* 0x0000001000b00947 */\n"
         "        /*0020*/   CALL.REL.NOINC `(_merge_fn) ;   /* 0x0 */\n"
         "        /*0030*/   HGMMA.64x16x16.F32 R24, gdesc[UR4], RZ ;   /* 0x0 */\n")
    moved = a.replace("/*0010*/", "/*0110*/").replace("0x1390", "0x2390").replace("_merge_fn", "_other")
    assert sass.stream_hash(a) == sass.stream_hash(moved)
    changed = a.replace("R24", "R26")
    assert sass.stream_hash(a) != sass.stream_hash(changed)
    param = a.replace("c[0x0][0x28]", "c[0x0][0x30]")
    assert sass.stream_hash(a) != sass.stream_hash(param)
    assert sass.stream_hash(a, params=True) == sass.stream_hash(param, params=True)
    s = sass.summary(a, "ptxas info : Used 168 registers, 0 bytes spill stores, 0 bytes spill loads", 1024)
    assert s["mma"] == {"HGMMA": 1, "QGMMA": 0, "HMMA": 0} and s["instructions"] == 4 and s["regs"] == [168]
    assert s["spills"] == [[0, 0]]


def test_register_hash_ignores_only_register_numbers():
    """sha256_regs: renumbered registers (R, UR, predicates) keep it; another opcode, immediate, offset or a zero
    register in place of a numbered one moves it; an opcode's type suffix (.B32) is not taken for a register."""
    a = ("        Function : k\n"
         "        /*0000*/   @!P0 IMAD.U32 R192, RZ, RZ, UR28 ;   /* 0x0 */\n"
         "        /*0010*/   R2UR UR22, R192 ;   /* 0x0 */\n"
         "        /*0020*/   LDS.U.B32 R4, [R2+0x40] ;   /* 0x0 */\n")
    renum = a.replace("R192", "R196").replace("UR28", "UR30").replace("@!P0", "@!P3")
    assert sass.stream_hash(a) != sass.stream_hash(renum)
    assert sass.stream_hash(a, regs=True) == sass.stream_hash(renum, regs=True)
    for changed in (a.replace("IMAD.U32", "IMAD.MOV.U32"), a.replace("0x40", "0x80"), a.replace("UR28", "URZ"),
                    a.replace("LDS.U.B32", "LDS.U.B64"), a.replace("@!P0", "@P0")):
        assert sass.stream_hash(a, regs=True) != sass.stream_hash(changed, regs=True)
    assert sass.summary(a, "", 0)["sha256_regs"] == sass.stream_hash(a, regs=True)


def test_renumbered_builds_skip_only_the_strict_hashes():
    """A build marked renumbering is compared on everything but sha256 / sha256_params; an unmarked one on all."""
    want = {"sha256": "a", "sha256_params": "b", "sha256_regs": "c", "regs": [168]}
    got = dict(want, sha256="x", sha256_params="y")
    assert sass.diff(want, got, renumbered=True) == []
    assert len(sass.diff(want, got)) == 2
    assert sass.diff(want, dict(got, sha256_regs="z"), renumbered=True)
    assert sass.diff(want, dict(got, regs=[170]), renumbered=True)
    for version, builds in sass.REGISTER_RENUMBERING.items():
        assert set(builds) <= set(NAMES), f"triton {version}: {set(builds) - set(NAMES)} are not named builds"
        assert all(builds.values()), f"triton {version}: every marked build says why"
