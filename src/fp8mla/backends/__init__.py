"""Attention backends: peers behind one small interface.

Each backend module has ``build(layout, spec, options, state=None) -> plan object`` and the plan object a
``run(q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e)`` that only launches:

- ``torch``: gathers the referenced tokens, fp32 math; any device; the reference-like fallback.
- ``triton``: the portable split-KV Triton kernels (every GPU Triton supports; the CPU interpreter in CI).
- ``gluon``: the warp-specialized Hopper kernel (sm_90), for the plans one of its builds takes.
- ``gather_cast``: a strategy over another backend: gather the batch's tokens into a 16-bit workspace, then
  run the 16-bit kernel on it (a baseline; never a cast of the pool).

Arguments of ``run``: ``scales`` fp32 ``[2]`` device tensor (ckv, kpe per-tensor scales; 1 for 16-bit pools),
``ckv_scale_arr`` ``[P, page, Dc // 128]`` fp32 or None, ``out [n, H, Dc]`` (query dtype), ``lse [n, H]`` fp32,
written base 2 unless ``base_e``. ``state``: what a backend keeps across plans of one wrapper (the CUDA-graph
buffers).

Which backend (and which build of it) runs a plan is chosen in one place, ``select`` (``select.py``), from the
records each build declares (``capabilities.py``); the sparse API's backends (``sparse_torch``, ``sparse_triton``,
``sparse_gluon``) are chosen the same way and plan through the same ``build`` -> plan object -> ``run`` shape.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ..formats import KVFormat

__all__ = ["AttentionSpec", "SparseSpec", "build", "build_sparse"]


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


@dataclass(frozen=True)
class SparseSpec:
    """What a sparse plan fixes (``MLASparseAttention.plan``): every call's shapes, dtypes and format, and how its
    index rows may be split (``num_splits`` pinned or None, ``min_split`` entries at least per split)."""

    num_heads: int
    topk: int
    page_size: int
    sm_scale: float
    q_dtype: torch.dtype
    kv_format: KVFormat
    head_dim_ckv: int
    head_dim_kpe: int
    num_pages: int | None
    device: torch.device
    num_splits: int | None = None
    min_split: int = 256
    batch_invariant: bool = False


def _module(name: str):
    return importlib.import_module(f".{name}", __name__)


def build(name: str, layout, spec: AttentionSpec, options: dict, state: dict):
    """The plan object of backend ``name``. ``state`` is a dict the backend may keep buffers in (per wrapper)."""
    return _module(name).build(layout, spec, options, state)


def build_sparse(name: str, spec: SparseSpec, options: dict):
    """The plan object of sparse backend module ``name`` (``sparse_torch``, ``sparse_triton``, ``sparse_gluon``):
    it owns its split rule and workspace; ``splits_for(n)`` and ``run(q_nope, q_pe, ckv, kpe, scale_arr, scales,
    indices, out, lse, base_e)`` (the pool's views as ``MLASparseAttention`` makes them)."""
    return _module(name).build(spec, options)
