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
written base 2 unless ``base_e``. ``state``: a :class:`PlanState`, what a backend keeps across plans of one
wrapper (the CUDA-graph buffers and the memos of a wrapper's repeated plans).

Which backend (and which build of it) runs a plan is chosen in one place, ``select`` (``select.py``), from the
records each build declares (``capabilities.py``); the sparse API's backends (``sparse_torch``, ``sparse_triton``,
``sparse_gluon``) are chosen the same way and plan through the same ``build`` -> plan object -> ``run`` shape.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from ..formats import KVFormat

__all__ = ["AttentionSpec", "PlanState", "SparseSpec", "build", "build_sparse"]


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


@dataclass(eq=False)
class PlanState:
    """What one backend keeps across the plans of one wrapper (``MLAPagedAttention`` holds one per backend it has
    planned on). A CUDA-graph wrapper re-plans every decode step into the same buffers, so the buffers and the
    memos that spare a re-plan its repeated work live here; fields a backend does not use stay None."""

    # FlashInfer's constructor buffers by the name of the buffer they replace (CUDA-graph wrappers only): the
    # tensors the captured kernels read
    external: dict = field(default_factory=dict)
    # the backend's CUDA-graph buffers (``_graph.GraphBuffers``: triton, gluon), made by its first CUDA-graph plan
    graph: object = None
    # triton: ``(key, options, cfg, max_rows, target)``, the kernel configuration and split target of the last
    # CUDA-graph plan (they ask the device's properties), reused while the key and the options dict are the same
    config: tuple | None = None
    # triton: ``(plan, rule)``, the last host-scheduled CUDA-graph plan and its split rule (``replan_rows``)
    host_plan: tuple | None = None
    # gluon: ``(key, build)``, the named build selected for the last plan's spec, query lengths and options
    selected: tuple | None = None
    # gluon: the wrapper's options merged over the backend's defaults, and the options dict they came from (by
    # identity: merged once per wrapper)
    opts: dict | None = None
    opts_from: dict | None = None
    # gluon: ``(plan, item_req)``, the plan ``replan_rows`` last built and its host schedule's item list
    rows_items: tuple | None = None
    # gluon: the query tokens per request a CUDA-graph wrapper's first plan fixed (``plan_max_qo``)
    graph_max_qo: int | None = None


def _module(name: str):
    return importlib.import_module(f".{name}", __name__)


def build(name: str, layout, spec: AttentionSpec, options: dict, state: PlanState):
    """The plan object of backend ``name``. ``state``: the backend's :class:`PlanState` of this wrapper."""
    return _module(name).build(layout, spec, options, state)


def build_sparse(name: str, spec: SparseSpec, options: dict):
    """The plan object of sparse backend module ``name`` (``sparse_torch``, ``sparse_triton``, ``sparse_gluon``):
    it owns its split rule and workspace; ``splits_for(n)`` and ``run(q_nope, q_pe, ckv, kpe, scale_arr, scales,
    indices, out, lse, base_e)`` (the pool's views as ``MLASparseAttention`` makes them)."""
    return _module(name).build(spec, options)
