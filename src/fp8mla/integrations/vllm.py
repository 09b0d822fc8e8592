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

from .versions import UnsupportedEngineVersion, check_version, require_installed

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "backend_member", "register"]

BACKEND_NAME = "FP8MLA"
BACKEND_PATH = "fp8mla.integrations.vllm_backend.FP8MLABackend"
logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: adds ``FP8MLA`` to vLLM's attention-backend registry.

    Idempotent (vLLM loads plugins once per process, but tests may call it again). On vLLM's CPU platform, whose
    backend choice only knows its own MLA backends, an explicit ``FP8MLA`` selection is routed to fp8mla too.
    Without vLLM installed it raises :class:`fp8mla.integrations.versions.EngineNotInstalled` (an ImportError)
    saying how to install it.
    """
    global _registered
    if _registered:
        return
    require_installed("vllm", "fp8mla.integrations.vllm.register()")
    try:
        check_version("vllm")
    except UnsupportedEngineVersion as e:  # selecting FP8MLA will raise this again, from the backend module
        logger.warning("%s", e)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    member = AttentionBackendEnum[BACKEND_NAME]
    _make_spawn_safe(member)
    _route_cpu_platform(member)
    _registered = True


def backend_member():
    """The ``FP8MLA`` member of vLLM's ``AttentionBackendEnum``, registered first if this process has not yet.

    The member is added at run time, so a process that unpickles a vLLM config naming it before vLLM loads its
    plugins there (a spawned engine core or worker: vLLM's CPU platform always spawns, CUDA does with
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn``) would not find it by value. The member pickles as a call of this
    function instead (:func:`_make_spawn_safe`)."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return AttentionBackendEnum[BACKEND_NAME]


def _reduce_member(protocol=None):
    return backend_member, ()


def _make_spawn_safe(member) -> None:
    """Pickle (and cloudpickle) ``member`` by reference to :func:`backend_member`: an Enum member pickles as
    ``AttentionBackendEnum(value)``, which fails in a process where the plugin has not run yet. The override
    lives on the member alone (pickle looks ``__reduce_ex__`` up on the object); vLLM's own members are
    untouched."""
    member.__reduce_ex__ = _reduce_member
    member.__reduce__ = _reduce_member


def _route_cpu_platform(member) -> None:
    """vLLM's ``CpuPlatform.get_attn_backend_cls`` returns CPU_MLA for any MLA selection other than its own two
    (it logs "Cannot use ... backend on CPU"); wrap it so that an explicit FP8MLA selection is honoured, and
    refused by name for a model without MLA (which vLLM would silently serve with another backend). Other
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
        if selected_backend == member:
            if not getattr(attn_selector_config, "use_mla", False):
                raise ValueError(f"--attention-backend {BACKEND_NAME}: fp8mla implements MLA attention only "
                                 "(DeepSeek-V2/V3, Kimi-K2 and other models with kv_lora_rank); this model does "
                                 "not use MLA. Leave --attention-backend out to let vLLM choose.")
            if getattr(attn_selector_config, "use_sparse", False):
                raise ValueError(f"--attention-backend {BACKEND_NAME}: sparse MLA (DeepSeek-V3.2's DSA) is not "
                                 "supported by fp8mla's vLLM backend")
            from .vllm_backend import latent_width_error
            head_size = getattr(attn_selector_config, "head_size", None)
            why = latent_width_error(head_size) if head_size else None
            if why:
                raise ValueError(why)
            return member.get_path()
        return original_fn(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._fp8mla_routed = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
