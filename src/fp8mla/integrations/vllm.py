"""vLLM plugin: registers fp8mla as the MLA attention backend ``FP8MLA``.

Installed as the ``vllm.general_plugins`` entry point ``fp8mla`` (``pip install 'fp8mla[vllm]'``), so every vLLM
process (front end, engine core, workers) calls :func:`register` at start-up; users then pick the backend with
``--attention-backend FP8MLA`` (or ``LLM(..., attention_config={"backend": "FP8MLA"})``).

:func:`register` is cheap and imports no vLLM internals beyond the backend registry: the backend classes live in
:mod:`fp8mla.integrations.vllm_backend`, which vLLM imports only when ``FP8MLA`` is selected, and which checks the
vLLM version first (:mod:`fp8mla.integrations.versions`). A plugin must never break a vLLM that does not use it,
so an unsupported vLLM only logs here; selecting ``FP8MLA`` on it raises the error naming what is supported.
"""
from __future__ import annotations

import logging

from .versions import UnsupportedEngineVersion, check_version, import_error

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "register"]

BACKEND_NAME = "FP8MLA"
BACKEND_PATH = "fp8mla.integrations.vllm_backend.FP8MLABackend"
logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: adds ``FP8MLA`` to vLLM's attention-backend registry.

    Idempotent (vLLM loads plugins once per process, but tests may call it again). On vLLM's CPU platform, whose
    backend choice only knows its own MLA backends, an explicit ``FP8MLA`` selection is routed to fp8mla too.
    """
    global _registered
    if _registered:
        return
    try:  # first: without the engine, the version check below would only log
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        raise import_error("vllm", "vllm.v1.attention.backends.registry", e) from e
    try:
        check_version("vllm")
    except UnsupportedEngineVersion as e:  # selecting FP8MLA will raise this again, from the backend module
        logger.warning("%s", e)
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    _route_cpu_platform(AttentionBackendEnum[BACKEND_NAME])
    _registered = True


def _route_cpu_platform(member) -> None:
    """vLLM's ``CpuPlatform.get_attn_backend_cls`` returns CPU_MLA for any MLA selection other than its own two
    (it logs "Cannot use ... backend on CPU"); wrap it so that an explicit FP8MLA selection is honoured. Other
    selections and other platforms are untouched (CUDA/ROCm validate a selected backend through its class)."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except Exception:  # a vLLM build without the CPU platform
        return
    original = CpuPlatform.__dict__.get("get_attn_backend_cls")
    original_fn = getattr(original, "__func__", None)
    if original_fn is None or getattr(original_fn, "_fp8mla_routed", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if selected_backend == member and getattr(attn_selector_config, "use_mla", False):
            logger.info("Using %s backend (fp8mla) on the CPU platform.", BACKEND_NAME)
            return member.get_path()
        return original_fn(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._fp8mla_routed = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
