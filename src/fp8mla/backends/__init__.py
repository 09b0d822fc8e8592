"""Attention backends: peers behind one small interface.

Each backend module has ``build(layout, spec, options, state=None) -> plan object`` and the plan object a
``run(q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e)`` that only launches:

- ``torch``: gathers the referenced tokens, fp32 math; any device; the reference-like fallback.
- ``triton``: the portable split-KV Triton kernels (every GPU Triton supports; the CPU interpreter in CI).
- ``gluon``: the warp-specialized Hopper kernel (sm_90), for the plans its ``select_build()`` accepts.
- ``gather_cast``: a strategy over another backend: gather the batch's tokens into a 16-bit workspace, then
  run the 16-bit kernel on it (a baseline; never a cast of the pool).

Arguments of ``run``: ``scales`` fp32 ``[2]`` device tensor (ckv, kpe per-tensor scales; 1 for 16-bit pools),
``ckv_scale_arr`` ``[P, page, Dc // 128]`` fp32 or None, ``out [n, H, Dc]`` (query dtype), ``lse [n, H]`` fp32,
written base 2 unless ``base_e``. ``state``: what a backend keeps across plans of one wrapper (the CUDA-graph
buffers).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ..formats import KVFormat

__all__ = ["AttentionSpec", "build", "supports_gluon"]


@dataclass(frozen=True)
class AttentionSpec:
    """What a plan fixes besides the page table."""

    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    page_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_format: KVFormat
    device: torch.device
    use_cuda_graph: bool = False


def _module(name: str):
    return importlib.import_module(f".{name}", __name__)


def supports_gluon(spec: AttentionSpec, layout, options: dict) -> tuple[bool, str]:
    """(ok, reason): whether the Gluon kernel takes this plan (False with the reason when it is missing)."""
    try:
        mod = _module("gluon")
    except Exception as e:  # not built on this install, or Gluon missing
        return False, f"the gluon backend is not available ({type(e).__name__}: {e})"
    b = mod.select_build(spec, layout, options)
    return (False, b) if isinstance(b, str) else (True, "")


def build(name: str, layout, spec: AttentionSpec, options: dict, state: dict):
    """The plan object of backend ``name``. ``state`` is a dict the backend may keep buffers in (per wrapper)."""
    return _module(name).build(layout, spec, options, state)
