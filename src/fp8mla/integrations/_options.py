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
