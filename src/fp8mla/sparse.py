"""MLASparseAttention: sparse (DSA) MLA over a paged latent pool, for GLM-5 and DeepSeek-V3.2.

Every query token attends to its own list of cached tokens (the ``topk`` a lightning indexer selected), given as
global token slots ``page * page_size + offset`` into the pool; ``-1`` marks an unused entry (skipped, as in
FlashMLA). One call serves decode (one token per request), multi-token decode (MTP) and prefill (every token of a
chunk): rows of ``indices`` are independent, so no request structure is needed. docs/sparse.md has the contract.

``plan()`` fixes the shapes, dtypes and format (no tensor data, O(1) host work), asks ``backends.select`` for the
build and hands a ``backends.SparseSpec`` to that backend (``sparse_torch``, ``sparse_triton``, ``sparse_gluon``),
whose plan owns its split rule and split workspace, as ``MLAPagedAttention``'s backends do; ``run()`` checks its
tensors against the plan, makes the pool's views and calls the backend plan's ``run``, with no device-to-host
sync (``FP8MLA_CHECK=1`` adds the host check of the index values), so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backends
from ._checks import check_positive_int, check_tensor, plain_number
from ._scales import DeviceScales, check_q_dtype, check_scale, check_sm_scale
from .backends import SparseSpec
from .backends._sparse_splits import INDEX_BLOCK
from .backends.select import Refusal, refusal_error, select, sparse_question
from .formats import KVFormat, get_format
from .layout import debug_checks

__all__ = ["MLASparseAttention", "SPARSE_BACKENDS", "SparseKernelError"]

SPARSE_BACKENDS = ("auto", "torch", "triton", "gluon")
HEAD_DIMS = (512, 64)


class SparseKernelError(ValueError):
    """A plan the chosen sparse kernel cannot run (format, topk, head dims); the message says which and why."""


@dataclass
class _Plan:
    spec: SparseSpec
    backend: str
    impl: object    # the backend's plan object (``backends.build_sparse``): its split rule, workspace and launch


class MLASparseAttention:
    """Sparse MLA attention: each query token over its own ``topk`` selected cached tokens.

    Args:
        backend: ``"auto"`` (gluon on Hopper for the plans it takes, else triton on CUDA, else torch),
            ``"torch"`` (fp32 torch code, any device), ``"triton"`` (the portable kernel,
            ``fp8mla.kernels.sparse_decode``; on the CPU under ``TRITON_INTERPRET=1``), ``"gluon"`` (the
            warp-specialized Hopper build, ``fp8mla.kernels.sm90.sparse``: sm_90, fp8_ds_mla records, bf16
            queries, H <= 128; refused by name elsewhere).
        batch_invariant: each query token's output and lse are the same bits whatever else the call holds (its
            number of tokens, their order and index rows): every row is split in the same ``num_splits`` (default
            ``ceil(topk / 512)``) whatever the call's size, partials merged in split order; the torch code runs
            row by row. Backends torch and triton, and the gluon build when named (``auto`` picks triton).
            docs/batch_invariance.md has the contract.

    Example:
        >>> import torch, fp8mla
        >>> cache = fp8mla.PagedMLACache(1, num_pages=4, page_size=16, kv_format="fp8_ds_mla")
        >>> s = cache.add_sequence(num_tokens=40)
        >>> cache.append(0, [s], torch.randn(40, 512), torch.randn(40, 64))
        >>> attn = fp8mla.MLASparseAttention(backend="torch")
        >>> attn.plan(num_heads=8, topk=64, page_size=16, sm_scale=576 ** -0.5, q_data_type=torch.bfloat16,
        ...           kv_data_type="fp8_ds_mla", device=cache.device)
        >>> slots = torch.tensor(cache.pages(s)).repeat_interleave(16) * 16 + torch.arange(48) % 16
        >>> indices = torch.full((1, 64), -1, dtype=torch.int32)
        >>> indices[0, :40] = slots[:40]
        >>> q_nope, q_pe = torch.randn(1, 8, 512).bfloat16(), torch.randn(1, 8, 64).bfloat16()
        >>> out, lse = attn.run(q_nope, q_pe, indices=indices, **cache.sparse_run_inputs(0), return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 8, 512]), torch.Size([1, 8]))
    """

    def __init__(self, backend: str = "auto", *, batch_invariant: bool = False):
        if not isinstance(backend, str) or backend not in SPARSE_BACKENDS:
            raise ValueError(f"backend: expected one of {SPARSE_BACKENDS}, got {backend!r}")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
        self._backend = backend
        self._invariant = batch_invariant
        self._plan: _Plan | None = None
        self._scales = DeviceScales()

    # -- plan -----------------------------------------------------------------------------------------------
    def plan(self, num_heads: int, topk: int, page_size: int, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type, *, head_dim_ckv: int = 512, head_dim_kpe: int = 64, num_pages: int | None = None,
             device=None, num_splits: int | None = None, min_split: int = 256, **kernel_options) -> None:
        """Fix what every following ``run()`` gets.

        Args:
            num_heads: query heads per token (GLM-5: 64, or 8 per GPU at TP 8; V3.2: 128 or 16).
            topk: entries per index row (GLM-5 / V3.2: 2048); shorter selections are padded with -1. The
                Triton kernel needs a multiple of 64 (the gluon build and the torch code take any).
            page_size: tokens per page of the pool (slot = page * page_size + offset).
            sm_scale: softmax scale of the scores (``1 / sqrt(192)`` style; any positive finite float).
            q_data_type: ``torch.bfloat16`` or ``torch.float16``; out has this dtype.
            kv_data_type: ``"fp8_ds_mla"`` (656-byte records), ``"fp8_e4m3"``, ``"fp8_e5m2"``,
                ``"fp8_e4m3_group"``, ``"bf16"``, ``"fp16"`` or a storage dtype (per-tensor scales for FP8).
            head_dim_ckv, head_dim_kpe: 512 and 64 (the only latent widths the sparse models use).
            num_pages: pool pages, when known: run() then checks the pool against it.
            device: where run() will get its tensors (default: the current CUDA device, else the CPU). The
                plan sees no tensor to take it from, unlike the dense ``plan()``: name it (``cache.device``)
                whenever the pool may not be on the default device, e.g. a CPU pool on a GPU machine.
            num_splits: fix the number of programs an index row is split over (default: chosen per call
                from the number of tokens, so that small batches still fill the GPU: twice the SM count for
                triton, one wave of one CTA per SM for gluon; in the batch-invariant mode ``ceil(topk / 512)``).
            min_split: fewest index entries one split program walks (a multiple of 64).
            **kernel_options: Triton tuning (``block_h``, ``block_n``, ``num_warps``, ``num_stages``,
                ``v_convert``); the gluon build has none.
        """
        num_heads = check_positive_int("num_heads", num_heads)
        topk = check_positive_int("topk", topk)
        page_size = check_positive_int("page_size", page_size)
        sm_scale = check_sm_scale(sm_scale)
        check_q_dtype(q_data_type)
        fmt = get_format(kv_data_type, arg="kv_data_type", sparse_ok=True)
        if (head_dim_ckv, head_dim_kpe) != HEAD_DIMS:
            raise SparseKernelError(f"head_dim_ckv/head_dim_kpe: sparse MLA takes {HEAD_DIMS[0]} + {HEAD_DIMS[1]} "
                                    f"(GLM-5, DeepSeek-V3.2), got {head_dim_ckv} + {head_dim_kpe}")
        if num_pages is not None:
            num_pages = check_positive_int("num_pages", num_pages)
        if num_splits is not None:
            num_splits = check_positive_int("num_splits", num_splits)
        min_split = plain_number(min_split)
        if isinstance(min_split, bool) or not isinstance(min_split, int) or min_split <= 0 or \
                min_split % INDEX_BLOCK:
            raise ValueError(f"min_split: expected a positive multiple of {INDEX_BLOCK}, got {min_split!r}")
        unknown = set(kernel_options) - {"block_h", "block_n", "num_warps", "num_stages", "v_convert"}
        if unknown:
            raise TypeError(f"plan: unknown keyword(s) {sorted(unknown)}")
        for k in ("block_h", "block_n", "num_warps", "num_stages"):  # plain ints for the kernel's constexprs
            if kernel_options.get(k) is not None:
                kernel_options[k] = check_positive_int(k, kernel_options[k])
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        choice = self._select(num_heads, topk, fmt, q_data_type, device)
        spec = SparseSpec(num_heads, topk, page_size, sm_scale, q_data_type, fmt, head_dim_ckv, head_dim_kpe,
                          num_pages, device, num_splits, min_split, self._invariant)
        self._plan = _Plan(spec, choice.backend, backends.build_sparse(choice.module, spec, kernel_options))

    def _select(self, num_heads: int, topk: int, fmt: KVFormat, q_dtype: torch.dtype, device):
        """The build that runs a plan (``backends.select``), or the exception that names what is missing."""
        choice = select(sparse_question(num_heads, topk, fmt, q_dtype, torch.device(device), self._invariant),
                        self._backend)
        if isinstance(choice, Refusal):
            raise refusal_error(choice, SparseKernelError)
        return choice

    @property
    def batch_invariant(self) -> bool:
        """Whether this object runs in the batch-invariant mode (constructor's ``batch_invariant``)."""
        return self._invariant

    @property
    def backend(self) -> str:
        """The backend the last plan chose."""
        return self._require_plan().backend

    def splits_for(self, num_tokens: int) -> int:
        """Programs each index row is split over for a call with ``num_tokens`` query tokens."""
        return self._require_plan().impl.splits_for(num_tokens)

    def _require_plan(self) -> _Plan:
        if self._plan is None:
            raise RuntimeError("run: plan() has not been called")
        return self._plan

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            return_lse_base_on_e: bool = False, *, kpe_cache: torch.Tensor | None = None, ckv_scale=None,
            ckv_scale_arr: torch.Tensor | None = None, kpe_scale=None):
        """Sparse attention of every query token over the tokens its index row names.

        Args:
            q_nope: ``[n, H, 512]``, q_pe: ``[n, H, 64]`` in the planned query dtype (absorbed queries).
            kv_cache: the layer's pool. ``fp8_ds_mla``: uint8 ``[P, page_size, 656]`` (or FlashMLA's
                ``[P, page_size, 1, 656]``; the bytes may be typed float8_e4m3fn, as FlashMLA's tests do). Other
                formats: ``[P, page_size, 576]`` of the storage dtype (c_kv | k_pe), or ``ckv_cache [P, page_size,
                512]`` with ``kpe_cache`` given.
            indices: int32 ``[n, topk]`` global token slots ``page * page_size + offset``; -1 = no token.
                Entries outside ``[0, P * page_size)`` are skipped like -1 (``FP8MLA_CHECK=1`` raises instead).
            out: ``[n, H, 512]`` query dtype, written in place; lse: ``[n, H]`` fp32.
            return_lse: return ``(out, lse)``; return_lse_base_on_e: lse in natural log (default base 2).
            kpe_cache: ``[P, page_size, 64]`` when kv_cache holds only c_kv.
            ckv_scale, kpe_scale: per-tensor scales of ``fp8_e4m3`` / ``fp8_e5m2`` (floats or 1-element fp32
                tensors; both required, as the dense API); ckv_scale_arr: ``[P, page_size, 4]`` fp32 group scales
                of ``fp8_e4m3_group``. ``fp8_ds_mla`` records carry their own scales: pass none.
        Returns:
            ``out`` or ``(out, lse)``. A row with no valid index gives out 0 and lse -inf.
        """
        plan = self._require_plan()
        p = plan.spec
        dev, H = p.device, p.num_heads
        check_tensor("q_nope", q_nope, dtype=p.q_dtype, ndim=3, device=dev)
        n = q_nope.shape[0]
        check_tensor("q_nope", q_nope, shape=(n, H, p.head_dim_ckv))
        check_tensor("q_pe", q_pe, dtype=p.q_dtype, shape=(n, H, p.head_dim_kpe), device=dev)
        check_tensor("indices", indices, dtype=torch.int32, shape=(n, p.topk), device=dev)
        if indices.numel() and indices.stride(-1) != 1:
            raise ValueError(f"indices: expected a contiguous last dimension, got strides {tuple(indices.stride())}")
        ckv, kpe, sa, P = self._split_pool(p, kv_cache, kpe_cache)
        scales = self._resolve(p, ckv_scale, kpe_scale, ckv_scale_arr, sa, P)
        if p.kv_format.scale_kind == "group":
            sa = ckv_scale_arr
        if out is None:
            out = torch.empty(n, H, p.head_dim_ckv, dtype=p.q_dtype, device=dev)
        else:
            check_tensor("out", out, dtype=p.q_dtype, shape=(n, H, p.head_dim_ckv), device=dev)
            if out.numel() and out.stride(-1) != 1:
                raise ValueError(f"out: expected a contiguous last dimension, got strides {tuple(out.stride())}")
        if lse is None:
            lse = torch.empty(n, H, dtype=torch.float32, device=dev)
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(n, H), device=dev)
        if debug_checks() and indices.numel():
            _check_index_values(indices, P * p.page_size)
        if n:
            plan.impl.run(q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, bool(return_lse_base_on_e))
        return (out, lse) if return_lse else out

    def _split_pool(self, p: SparseSpec, kv_cache, kpe_cache):
        """(ckv, kpe, scale_arr, P): the views the kernels read. A record pool gives strided views of its bytes
        as e4m3 c_kv, fp32 scales and bf16 k_pe, so every path reads the records in place."""
        dev, page = p.device, p.page_size
        if p.kv_format.scale_kind == "record":
            if kpe_cache is not None:
                raise ValueError("kpe_cache: an fp8_ds_mla record holds k_pe itself; expected None")
            # uint8 (vLLM's fp8_ds_mla pool) or float8_e4m3fn (FlashMLA's tests type the same bytes so)
            check_tensor("kv_cache", kv_cache, dtype=(torch.uint8, torch.float8_e4m3fn), device=dev)
            kv_cache = kv_cache.view(torch.uint8)
            if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:  # FlashMLA's [P, page, h_k = 1, 656]
                kv_cache = kv_cache[:, :, 0]
            check_tensor("kv_cache", kv_cache, shape=(p.num_pages, page, 656))
            if kv_cache.stride(-1) != 1 or kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4 or \
                    kv_cache.storage_offset() % 4:
                raise ValueError(f"kv_cache: expected 656-byte records with contiguous bytes and 4-byte aligned "
                                 f"rows, got strides {tuple(kv_cache.stride())}")
            P = kv_cache.shape[0]
            return (kv_cache[..., :512].view(torch.float8_e4m3fn),
                    kv_cache.view(torch.bfloat16)[..., 264:328],
                    kv_cache.view(torch.float32)[..., 128:132], P)
        dtype = p.kv_format.storage_dtype
        Dc, Dk = p.head_dim_ckv, p.head_dim_kpe
        if kpe_cache is None:
            check_tensor("kv_cache", kv_cache, dtype=dtype, shape=(p.num_pages, page, Dc + Dk), device=dev)
            ckv, kpe = kv_cache[..., :Dc], kv_cache[..., Dc:]
        else:
            check_tensor("kv_cache", kv_cache, dtype=dtype, shape=(p.num_pages, page, Dc), device=dev)
            check_tensor("kpe_cache", kpe_cache, dtype=dtype, shape=(kv_cache.shape[0], page, Dk), device=dev)
            ckv, kpe = kv_cache, kpe_cache
        for name, t in (("kv_cache", ckv), ("kpe_cache", kpe)):
            if t.numel() and t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
        return ckv, kpe, None, ckv.shape[0]

    def _resolve(self, p: SparseSpec, ckv_scale, kpe_scale, ckv_scale_arr, record_scales, P: int):
        """The fp32 [2] device tensor (ckv_scale, kpe_scale); the group scale tensor checked."""
        fmt = p.kv_format
        if fmt.scale_kind == "record":
            for name, v in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale), ("ckv_scale_arr", ckv_scale_arr)):
                if v is not None:
                    raise ValueError(f"{name}: fp8_ds_mla records carry their own c_kv scales and a bf16 k_pe; "
                                     f"expected None, got {v!r}")
            ckv_scale = kpe_scale = 1.0
        elif fmt.scale_kind == "group":
            if ckv_scale_arr is None:
                raise ValueError("ckv_scale_arr: kv_data_type 'fp8_e4m3_group' needs per-token group scales "
                                 f"[{P}, {p.page_size}, 4] fp32, got None")
            check_tensor("ckv_scale_arr", ckv_scale_arr, dtype=torch.float32, shape=(P, p.page_size, 4),
                         device=p.device)
            if ckv_scale_arr.stride(-1) != 1:
                raise ValueError(f"ckv_scale_arr: expected a contiguous last dimension, got strides "
                                 f"{tuple(ckv_scale_arr.stride())}")
            if ckv_scale is not None:
                raise ValueError(f"ckv_scale: the group format's c_kv scales are per group (ckv_scale_arr); "
                                 f"expected None, got {ckv_scale!r}")
            if kpe_scale is None:
                raise ValueError("kpe_scale: an FP8 pool (fp8_e4m3_group) needs kpe_scale (real = stored x scale; "
                                 "1.0 when k_pe was stored unscaled), got None")
            ckv_scale = 1.0
        else:
            if ckv_scale_arr is not None:
                raise ValueError(f"ckv_scale_arr: kv_data_type {fmt.name!r} has no group scales; expected None")
            if fmt.is_fp8 and (ckv_scale is None or kpe_scale is None):
                name = "ckv_scale" if ckv_scale is None else "kpe_scale"
                raise ValueError(f"{name}: an FP8 pool ({fmt.name}) needs {name} (real = stored x scale; 1.0 when "
                                 "stored unscaled), got None")
        ckv = check_scale("ckv_scale", ckv_scale, fmt, p.device, allowed=fmt.scale_kind == "tensor")
        kpe = check_scale("kpe_scale", kpe_scale, fmt, p.device, allowed=fmt.is_fp8 and fmt.scale_kind != "record")
        return self._scales.set(ckv, kpe, p.device, debug_checks())


def _check_index_values(indices: torch.Tensor, num_slots: int) -> None:
    """``FP8MLA_CHECK=1``: index values on the host (one sync). The kernels skip out-of-pool entries like -1, so
    without this check a wrong slot id drops a token silently."""
    bad = (indices < -1) | (indices >= num_slots)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"indices: expected slots in [0, {num_slots}) or -1, got indices[{t}, {j}] = "
                         f"{int(indices[t, j])}")
