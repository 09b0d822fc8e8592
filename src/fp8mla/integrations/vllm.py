"""vLLM plugin: registers fp8mla as the MLA attention backend ``FP8MLA``.

Installed as the ``vllm.general_plugins`` entry point ``fp8mla`` (``pip install 'fp8mla[vllm]'``), so every vLLM
process (front end, engine core, workers) calls :func:`register` at start-up; users then pick the backend with
``--attention-backend FP8MLA`` (or ``LLM(..., attention_config={"backend": "FP8MLA"})``).

:func:`register` is cheap and imports no vLLM internals beyond the backend registry: the backend classes live in
:mod:`fp8mla.integrations.vllm_backend`, which vLLM imports only when ``FP8MLA`` is selected, and which checks the
vLLM version first (:mod:`fp8mla.integrations.versions`). A plugin must never break a vLLM that does not use it,
so on an unsupported vLLM it logs one warning and registers nothing: vLLM starts with its own backends.
"""
from __future__ import annotations

import logging
import os

from .versions import SKIP_ENV, describe, engine_version, is_supported, require_installed
from .vllm_releases import release_row

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "backend_member", "register"]

BACKEND_NAME = "FP8MLA"
BACKEND_PATH = "fp8mla.integrations.vllm_backend.FP8MLABackend"
logger = logging.getLogger(__name__)
_registered = False
_declined = False  # an unsupported release: warned once, nothing registered


def register() -> None:
    """The ``vllm.general_plugins`` entry point: adds ``FP8MLA`` to vLLM's attention-backend registry.

    Never breaks vLLM: on a release outside :data:`fp8mla.integrations.versions.SUPPORTED` it logs one warning
    through vLLM's logger, naming the supported range, and registers nothing (vLLM starts with its own backends;
    ``FP8MLA_SKIP_VERSION_CHECK=1`` registers anyway); a registry that refuses the name is logged the same way.
    Idempotent (vLLM loads plugins once per process, but tests may call it again). On vLLM's CPU platform, whose
    backend choice only knows its own MLA backends, an explicit ``FP8MLA`` selection is routed to fp8mla too.
    Without vLLM installed it raises :class:`fp8mla.integrations.versions.EngineNotInstalled` (an ImportError)
    saying how to install it.
    """
    global _registered, _declined
    if _registered or _declined:
        return
    require_installed("vllm", "fp8mla.integrations.vllm.register()")
    version = engine_version("vllm") or "unknown"
    if (not _version_supported(version)) and os.environ.get(SKIP_ENV) != "1":
        _declined = True
        _vllm_logger().warning(
            "fp8mla %s: vLLM %s is installed, but fp8mla's FP8MLA attention backend supports vLLM %s; it is not "
            "registered, and vLLM runs with its own attention backends. Install a supported vLLM to use FP8MLA "
            "(%s=1 registers it anyway, at your own risk).", _fp8mla_version(), version, describe("vllm"),
            SKIP_ENV)
        return
    try:
        member = _add_member(release_row(version))
    except Exception as e:  # noqa: BLE001 - a registry this plugin does not know must not stop vLLM
        _declined = True
        _vllm_logger().warning("fp8mla %s: could not register the FP8MLA attention backend in vLLM %s (%s: %s); "
                               "vLLM runs with its own attention backends.", _fp8mla_version(), version,
                               type(e).__name__, e)
        return
    _make_spawn_safe(member)
    _route_cpu_platform(member)
    _registered = True


def _version_supported(version: str) -> bool:
    try:
        return is_supported("vllm", version)
    except ValueError:  # not a release number
        return False


def _vllm_logger():
    """vLLM's own logger (its handler and format, ``VLLM_LOGGING_LEVEL``), else the standard one."""
    try:
        from vllm.logger import init_logger
        return init_logger("vllm.fp8mla")
    except Exception:  # noqa: BLE001
        return logger


def _fp8mla_version() -> str:
    from fp8mla import __version__
    return __version__


def _add_member(row):
    """The ``FP8MLA`` member of ``AttentionBackendEnum`` with fp8mla's backend path, added the way ``row``'s
    releases allow (:class:`fp8mla.integrations.vllm_releases.VllmRelease`)."""
    from vllm.v1.attention.backends import registry
    enum = registry.AttentionBackendEnum
    if BACKEND_NAME not in enum.__members__:
        if row.registry_takes_new_names:
            registry.register_backend(BACKEND_NAME, BACKEND_PATH)
        else:  # what later releases' AttentionBackendEnum.register does, then the override as for any member
            member = object.__new__(enum)
            member._name_, member._value_ = BACKEND_NAME, BACKEND_PATH
            setattr(enum, BACKEND_NAME, member)
            enum._member_map_[BACKEND_NAME] = member
            enum._value2member_map_[BACKEND_PATH] = member
            enum._member_names_.append(BACKEND_NAME)
            registry.register_backend(member, BACKEND_PATH)
    return enum[BACKEND_NAME]


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
