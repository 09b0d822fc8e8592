"""Shared test setup: the device, the backends to test, per-case seeds and the hypothesis profile.

Without a CUDA device the Triton kernels run in Triton's interpreter, which is chosen by ``TRITON_INTERPRET=1``
when ``triton`` is first imported: so it is set here, before anything imports triton.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import fp8mla  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The Triton backend is tested when it can run here (a GPU, or the interpreter) and its module exists.
_HAS_TRITON_BACKEND = (Path(fp8mla.__file__).parent / "backends" / "triton.py").exists()
BACKENDS = ["torch"] + (["triton"] if _HAS_TRITON_BACKEND and "triton" in fp8mla.available_backends(DEVICE)
                        else [])

# For ``@pytest.mark.parametrize("backend", BACKEND_PARAMS)``: triton cases carry the ``triton`` marker (select
# them with ``-m triton``) and show up as skipped, with the reason, where the backend cannot run.
BACKEND_PARAMS = [pytest.param("torch", id="torch")] + [
    pytest.param("triton", id="triton", marks=[pytest.mark.triton] + (
        [] if "triton" in BACKENDS else
        [pytest.mark.skip(reason="triton backend not here (no fp8mla/backends/triton.py, or triton cannot run)")]))
]

# Deterministic property tests: the same examples on every run and every machine.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs the Triton backend (interpreter on CPU)")


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def case_seed(request) -> int:
    """A seed of its own for each test case, stable across runs (from the test id)."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def sm90_compile_tools():
    """The Gluon kernel's compile tests need Gluon, ptxas and cuobjdump: skipped without them, failed under CI=true
    (CI pins the triton that has them)."""
    from devtools.sass import require_compile_tools
    require_compile_tools()


def gluon_build(spec, layout, options: dict):
    """What the gluon builds answer for a dense plan (``backends.select``): the named build (``sm90.Sm90Build``),
    or why neither takes it (a str). The plan's device is asked as it is: patch ``fp8mla.runtime.gluon_usable``
    to describe an sm_90 GPU."""
    from fp8mla.backends.select import Refusal, dense_question, qo_range, select
    choice = select(dense_question(spec, qo_range(layout), options), "gluon")
    return choice.reason if isinstance(choice, Refusal) else choice.build


def compile_report_in_child(module: str = "devtools.sass", timeout: int = 600,
                            **kw) -> tuple[dict, str]:
    """``<module>.compile_report(**kw, sass_path=...)`` for sm_90a in a child process (the CPU suite may run under
    TRITON_INTERPRET=1, where gluon.jit cannot compile): (the report, the SASS text). Fails the test with the
    child's stderr when it does not print its report."""
    import json
    import subprocess
    import sys
    import tempfile
    code = ("import json, sys, importlib; k = importlib.import_module(sys.argv[1]); "
            "r = k.compile_report(sass_path=sys.argv[2], **json.loads(sys.argv[3])); print('REPORT', json.dumps(r))")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as d:
        sass = os.path.join(d, "k.sass")
        res = subprocess.run([sys.executable, "-c", code, module, sass, json.dumps(kw)], capture_output=True,
                             text=True, env=env, timeout=timeout)
        line = [x for x in res.stdout.splitlines() if x.startswith("REPORT ")]
        assert res.returncode == 0 and line, res.stderr[-3000:]
        return json.loads(line[-1][len("REPORT "):]), open(sass).read()
