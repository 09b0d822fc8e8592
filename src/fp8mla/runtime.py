"""What this device and this Triton can do, asked in one place.

Every layer that must choose between the torch code, the portable Triton kernels and the Hopper Gluon kernel
asks here, so that the rules ("Triton on CUDA, or on the CPU under ``TRITON_INTERPRET=1``"; "Gluon on sm_90
when ``triton.experimental.gluon`` imports") are written once.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

LOG2E = 1.0 / math.log(2.0)   # exp(x) = exp2(x * LOG2E): the kernels' softmax runs in base 2
LN2 = math.log(2.0)           # base-2 lse -> natural-log lse


def interpreting() -> bool:
    """Triton kernels run in the CPU interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton")   # (importing it is the probe)
    except Exception:  # a broken install must not break the torch path
        return False
    return True


@functools.lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    if not _triton_importable():
        return False
    try:
        importlib.import_module("triton.experimental.gluon")   # (importing them is the probe)
        importlib.import_module("triton.experimental.gluon.language.nvidia.hopper")
    except Exception:
        return False
    return True


def triton_usable(device) -> bool:
    """The portable Triton kernels can run on ``device``: CUDA with triton, or the CPU interpreter."""
    device = torch.device(device)
    if not _triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def cuda_capability(device) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def gluon_usable(device) -> bool:
    """The warp-specialized Gluon decode kernel can run on ``device`` (Hopper, sm_90, and Gluon importable)."""
    return cuda_capability(device) == (9, 0) and _gluon_importable() and not interpreting()


def device_tags(device) -> frozenset:
    """What ``device`` can run, as the build records name it (``backends.capabilities``): "cuda" (a CUDA device),
    "triton" (the portable Triton kernels run there) and "sm90" (the Hopper Gluon builds run there)."""
    device = torch.device(device)
    tags = {"cuda"} if device.type == "cuda" else set()
    if triton_usable(device):
        tags.add("triton")
    if gluon_usable(device):
        tags.add("sm90")
    return frozenset(tags)


def num_sms(device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small machine, so tests see several splits per request


def available_backends(device="cpu") -> list[str]:
    """Backends that can run on ``device`` here: ``torch`` always, ``triton`` on CUDA (or on the CPU under
    ``TRITON_INTERPRET=1``), ``gluon`` on Hopper."""
    names = ["torch"]
    if triton_usable(device):
        names.append("triton")
    if gluon_usable(device):
        names.append("gluon")
    return names


BACKENDS = ("auto", "torch", "triton", "gluon")


def choose_backend(requested: str, device, supports_gluon=None) -> str:
    """The backend a plan runs on.

    ``requested`` "auto": gluon on Hopper when ``supports_gluon()`` says the plan fits it, else triton on CUDA,
    else torch. A named backend that cannot run here raises, naming why.
    ``supports_gluon``: a callable returning ``(ok, reason)`` for the plan at hand.
    """
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    if requested == "gluon":
        if not gluon_usable(device):
            raise RuntimeError(f"backend: 'gluon' cannot run on {device} here (needs an sm_90 GPU and "
                               "triton.experimental.gluon)")
        if supports_gluon is not None:
            ok, why = supports_gluon()
            if not ok:
                raise ValueError(f"backend: 'gluon' does not support this plan: {why}; use backend='triton'")
        return "gluon"
    if requested == "triton":
        if not triton_usable(device):
            raise RuntimeError(f"backend: 'triton' cannot run on {device} here (needs triton and a CUDA device, "
                               "or TRITON_INTERPRET=1 on the CPU)")
        return "triton"
    # auto
    if device.type != "cuda" or not triton_usable(device):
        return "torch"
    if gluon_usable(device) and supports_gluon is not None and supports_gluon()[0]:
        return "gluon"
    return "triton"
