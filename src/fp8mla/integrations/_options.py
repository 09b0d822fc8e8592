"""Options the engine adapters read from the environment (engines give a backend no other way to take them)."""
from __future__ import annotations

import os

BACKEND_ENV = "FP8MLA_BACKEND"
BACKENDS = ("auto", "torch", "triton", "gluon")


def backend() -> str:
    """fp8mla's kernel backend for the engine adapters: ``FP8MLA_BACKEND`` = auto (default: Gluon on Hopper, else
    Triton on CUDA, else torch), torch, triton (on the CPU: under ``TRITON_INTERPRET=1``) or gluon."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKENDS}, got {value!r}")
    return value


def ragged_backend() -> str:
    """The choice for the ragged prefill over fresh latents: its Triton kernel takes head dims <= 256 (MLA's
    absorbed 576/512 are wider) and it has no Gluon kernel, so "auto" (which falls back to torch) unless torch
    is asked for."""
    return "torch" if backend() == "torch" else "auto"


def vllm_batch_invariant() -> bool:
    """vLLM's batch-invariant switch (``VLLM_BATCH_INVARIANT=1``), as the running vLLM exposes it: ``vllm.envs``
    (newer), ``vllm.model_executor.layers.batch_invariant.vllm_is_batch_invariant()`` (0.11-0.12), else the
    variable itself, read as vLLM reads it (an int, non-zero = on)."""
    try:
        import vllm.envs as envs
        return bool(getattr(envs, "VLLM_BATCH_INVARIANT"))
    except (ImportError, AttributeError):
        pass
    try:
        from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant
        return bool(vllm_is_batch_invariant())
    except (ImportError, AttributeError):
        pass
    try:
        return int(os.environ.get("VLLM_BATCH_INVARIANT", "0")) != 0
    except ValueError:
        return False


def sglang_deterministic(server_args) -> bool:
    """SGLang's deterministic inference (``--enable-deterministic-inference``: ``server_args.
    enable_deterministic_inference``); False for a ServerArgs without the field (older SGLang) or none."""
    return bool(getattr(server_args, "enable_deterministic_inference", False))
