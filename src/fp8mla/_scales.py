"""The argument checks the dense and sparse APIs share: the softmax scale, the query dtype and the per-tensor KV
scales, and the fp32 ``[2]`` device tensor the kernels read the KV scales from."""
from __future__ import annotations

import math

import torch

from ._checks import ArgumentTypeError, plain_number, same_device

__all__ = ["DeviceScales", "MAX_SM_SCALE", "Q_DTYPES", "check_q_dtype", "check_scale", "check_sm_scale"]

Q_DTYPES = (torch.bfloat16, torch.float16)
# Scores beyond this scale overflow fp32 (|q.k| of unit-variance 576-dim rows is ~1e2; x 1e6 is still finite).
MAX_SM_SCALE = 1e6
FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)


def check_sm_scale(v) -> float:
    """A positive finite softmax scale <= ``MAX_SM_SCALE`` (a 1-element CPU tensor is taken as its value)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu":
        v = float(v)
    v = plain_number(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= MAX_SM_SCALE:
        raise ValueError(f"sm_scale: expected a positive finite float <= {MAX_SM_SCALE:g} (larger scales overflow "
                         f"the fp32 scores), got {v!r}")
    return float(v)


def check_q_dtype(q_dtype) -> torch.dtype:
    if q_dtype not in Q_DTYPES:
        raise ArgumentTypeError(f"q_data_type: expected one of {list(Q_DTYPES)}, got {q_dtype!r}")
    return q_dtype


def check_scale(name: str, v, fmt, device, *, allowed: bool):
    """A per-tensor scale: None (= 1), a positive finite float, or a 1-element fp32 tensor on the plan's
    device (returned as a 0-d tensor; its value is checked on the device). ``allowed``: the format takes one."""
    if v is None:
        return 1.0
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype != torch.float32 or not same_device(v.device, device):
            raise ValueError(f"{name}: expected a float or a 1-element fp32 tensor on {device}, got a "
                             f"{v.dtype} tensor of shape {tuple(v.shape)} on {v.device}")
        if not allowed:
            raise ValueError(f"{name}: kv_data_type {fmt.name!r} takes no {name}, got a tensor")
        return v.reshape(())
    v = plain_number(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (FP32_TINY <= v <= FP32_MAX):
        raise ValueError(f"{name}: expected a positive finite float in fp32's normal range [{FP32_TINY:.3g}, "
                         f"{FP32_MAX:.3g}] (the kernels use it in fp32), got {v!r}")
    if not allowed and v != 1.0:
        raise ValueError(f"{name}: kv_data_type {fmt.name!r} takes no {name} (only 1.0), got {v!r}")
    return float(v)


class DeviceScales:
    """The fp32 ``[2]`` device tensor (ckv_scale, kpe_scale) the kernels read, one per wrapper: refilled only when
    a host value changes, so a captured replay costs nothing here. ``host``: the floats it holds, or None when it
    came from device tensors."""

    def __init__(self):
        self.tensor = None
        self.host = None

    def set(self, ckv, kpe, device, debug: bool = False) -> torch.Tensor:
        """``ckv``/``kpe``: what :func:`check_scale` returned. A device scale that is not positive and finite
        becomes NaN, so the output is NaN, never plausible (``debug``: raise instead, with one sync)."""
        if self.tensor is None or self.tensor.device != device:
            self.tensor = torch.ones(2, dtype=torch.float32, device=device)
            self.host = (1.0, 1.0)
        if isinstance(ckv, float) and isinstance(kpe, float):
            if self.host != (ckv, kpe):
                self.tensor.copy_(torch.tensor([ckv, kpe]), non_blocking=True)
                self.host = (ckv, kpe)
            return self.tensor
        for i, v in enumerate((ckv, kpe)):
            if isinstance(v, torch.Tensor):
                ok = torch.isfinite(v) & (v > 0)
                self.tensor[i].copy_(torch.where(ok, v, torch.full_like(v, math.nan)))
                if debug and not bool(ok):
                    raise ValueError(f"{('ckv_scale', 'kpe_scale')[i]}: expected a positive finite value, got "
                                     f"{float(v)}")
            else:
                self.tensor[i].fill_(v)
        self.host = None
        return self.tensor
