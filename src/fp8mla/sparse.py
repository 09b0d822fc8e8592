"""MLASparseAttention: sparse (DSA) MLA over a paged latent pool, for GLM-5 and DeepSeek-V3.2.

Every query token attends to its own list of cached tokens (the ``topk`` a lightning indexer selected), given as
global token slots ``page * page_size + offset`` into the pool; ``-1`` marks an unused entry (skipped, as in
FlashMLA). One call serves decode (one token per request), multi-token decode (MTP) and prefill (every token of a
chunk): rows of ``indices`` are independent, so no request structure is needed. docs/sparse.md has the contract.

``plan()`` fixes the shapes, dtypes, format and the split workspace (no tensor data, O(1) host work); ``run()``
checks its tensors against the plan and launches, with no device-to-host sync (``FP8MLA_CHECK=1`` adds the host
check of the index values), so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._checks import ArgumentTypeError, check_positive_int, check_tensor, plain_number
from ._softmax import softmax_rows
from .attention import MAX_SM_SCALE, Q_DTYPES, _check_scale
from .backends._invariant import GLUON_AUTO, SPARSE_INVARIANT_SPLIT
from .formats import KVFormat, get_format
from .layout import debug_checks
from .runtime import LN2, LOG2E, choose_backend, num_sms

__all__ = ["MLASparseAttention", "SPARSE_BACKENDS", "SparseKernelError"]

SPARSE_BACKENDS = ("auto", "torch", "triton", "gluon")
INDEX_BLOCK = 64  # the Triton kernel walks index rows 64 entries at a time: topk must be a multiple of it
HEAD_DIMS = (512, 64)


class SparseKernelError(ValueError):
    """A plan the chosen sparse kernel cannot run (format, topk, head dims); the message says which and why."""


@dataclass
class _SparsePlan:
    num_heads: int
    topk: int
    page_size: int
    sm_scale: float
    q_dtype: torch.dtype
    fmt: KVFormat
    head_dim_ckv: int
    head_dim_kpe: int
    num_pages: int | None
    device: torch.device
    backend: str
    num_splits: int | None
    min_split: int
    invariant: bool = False           # the batch-invariant mode: splits follow topk only
    config: dict | None = None        # the Triton launch configuration
    part_o: torch.Tensor | None = None    # split workspace (fixed at plan: CUDA-graph safe)
    part_lse: torch.Tensor | None = None
    retired: list = field(default_factory=list)   # the invariant mode's outgrown workspaces (kept alive)


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
            row by row. Backends torch and triton; the gluon build is refused (``auto`` picks triton).
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
        self._plan: _SparsePlan | None = None
        self._scales = None
        self._scales_host = None

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
        sm_scale = plain_number(sm_scale)
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or \
                not (0 < sm_scale <= MAX_SM_SCALE):
            raise ValueError(f"sm_scale: expected a positive finite float <= {MAX_SM_SCALE:g}, got {sm_scale!r}")
        if q_data_type not in Q_DTYPES:
            raise ArgumentTypeError(f"q_data_type: expected one of {list(Q_DTYPES)}, got {q_data_type!r}")
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
        backend = choose_backend(self._backend, device, _gluon_support(self._backend, num_heads, fmt,
                                                                       q_data_type, topk, self._invariant))
        if backend == "triton" and topk % INDEX_BLOCK:
            # No quiet fallback to the torch code on a GPU: padding the rows costs nothing, the torch path a lot.
            raise SparseKernelError(f"topk: the triton sparse kernel needs a multiple of {INDEX_BLOCK} (pad the index "
                                    f"rows with -1, or plan backend='torch'), got {topk}")
        p = _SparsePlan(num_heads, topk, page_size, float(sm_scale), q_data_type, fmt, head_dim_ckv, head_dim_kpe,
                        num_pages, device, backend, num_splits, min_split, self._invariant)
        if backend == "triton":
            from .kernels import sparse_decode
            p.config = sparse_decode.launch_config(num_heads, fmt, device, **kernel_options)
            cap = self._split_capacity(p)
            if cap:
                p.part_o = torch.empty(cap, num_heads, head_dim_ckv, dtype=torch.float32, device=device)
                p.part_lse = torch.empty(cap, num_heads, dtype=torch.float32, device=device)
        elif backend == "gluon":
            from .kernels.sm90 import sparse as sm90_sparse
            if kernel_options:
                raise TypeError(f"plan: kernel options {sorted(kernel_options)} are for the triton backend, not "
                                "'gluon'")
            p.config = {"block_h": sm90_sparse.HEAD_GROUP}
            cap = self._split_capacity(p)
            if cap:
                p.part_o = torch.empty(cap, num_heads, head_dim_ckv, dtype=torch.float32, device=device)
                p.part_lse = torch.empty(cap, num_heads, dtype=torch.float32, device=device)
        elif kernel_options:
            raise TypeError(f"plan: kernel options {sorted(kernel_options)} are for the triton backend, not "
                            f"{backend!r}")
        self._plan = p

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
        p = self._require_plan()
        return _splits(p, num_tokens)

    def _split_capacity(self, p: _SparsePlan) -> int:
        """Largest ``tokens x splits`` any call can need: splits > 1 only while tokens x head tiles is under the
        GPU's target program count, so this is bounded by O(SMs) and independent of the batch."""
        if p.num_splits is not None or p.invariant:
            return 0  # a fixed split count: the workspace is sized per call (see _run_kernel)
        cap = 0
        for n in range(1, _target_programs(p) + 1):
            s = _splits(p, n)
            if s > 1:
                cap = max(cap, n * s)
        return cap

    def _require_plan(self) -> _SparsePlan:
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
                ``[P, page_size, 1, 656]``; the bytes may be typed float8_e4m3fn, as FlashMLA's tests do). Other formats: ``[P, page_size, 576]`` of the storage dtype
                (c_kv | k_pe), or ``ckv_cache [P, page_size, 512]`` with ``kpe_cache`` given.
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
        p = self._require_plan()
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
        if p.fmt.scale_kind == "group":
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
            if p.backend in ("triton", "gluon"):
                self._run_kernel(p, q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse,
                                 bool(return_lse_base_on_e))
            else:
                _run_torch(p, q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, bool(return_lse_base_on_e))
        return (out, lse) if return_lse else out

    def _split_pool(self, p: _SparsePlan, kv_cache, kpe_cache):
        """(ckv, kpe, scale_arr, P): the views the kernels read. A record pool gives strided views of its bytes
        as e4m3 c_kv, fp32 scales and bf16 k_pe, so every path reads the records in place."""
        dev, page = p.device, p.page_size
        if p.fmt.scale_kind == "record":
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
        dtype = p.fmt.storage_dtype
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

    def _resolve(self, p: _SparsePlan, ckv_scale, kpe_scale, ckv_scale_arr, record_scales, P: int):
        """The fp32 [2] device tensor (ckv_scale, kpe_scale); the group scale tensor checked."""
        fmt = p.fmt
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
        ckv = _check_scale("ckv_scale", ckv_scale, fmt, p.device, allowed=fmt.scale_kind == "tensor")
        kpe = _check_scale("kpe_scale", kpe_scale, fmt, p.device, allowed=fmt.is_fp8 and fmt.scale_kind != "record")
        if self._scales is None or self._scales.device != p.device:
            self._scales = torch.ones(2, dtype=torch.float32, device=p.device)
            self._scales_host = (1.0, 1.0)
        if isinstance(ckv, float) and isinstance(kpe, float):
            if self._scales_host != (ckv, kpe):
                self._scales.copy_(torch.tensor([ckv, kpe]), non_blocking=True)
                self._scales_host = (ckv, kpe)
        else:
            for i, v in enumerate((ckv, kpe)):
                if isinstance(v, torch.Tensor):  # an invalid device scale becomes NaN: the output is NaN
                    self._scales[i].copy_(torch.where(torch.isfinite(v) & (v > 0), v, torch.full_like(v, math.nan)))
                else:
                    self._scales[i].fill_(v)
            self._scales_host = None
        return self._scales

    def _run_kernel(self, p, q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, base_e):
        from .kernels import sparse_decode
        n = q_nope.shape[0]
        splits = _splits(p, n)
        part_o, part_lse = p.part_o, p.part_lse
        if splits > 1 and (part_o is None or part_o.shape[0] < n * splits):
            # only with a fixed split count (plan sized nothing). The batch-invariant mode keeps its workspace,
            # grown to a power of two of the largest call; a replaced one stays alive (a graph captured on it
            # replays on it, never on freed memory). A pinned num_splits allocates per call.
            rows = n * splits if not p.invariant else 1 << (n * splits - 1).bit_length()
            part_o = torch.empty(rows, p.num_heads, p.head_dim_ckv, dtype=torch.float32, device=p.device)
            part_lse = torch.empty(rows, p.num_heads, dtype=torch.float32, device=p.device)
            if p.invariant:
                p.retired.append((p.part_o, p.part_lse))
                p.part_o, p.part_lse = part_o, part_lse
        if p.backend == "gluon":
            from .kernels.sm90 import sparse as sm90_sparse
            sm90_sparse.sparse_mla(q_nope, q_pe, ckv, kpe, sa, indices, out, lse, part_o, part_lse,
                                   sm_scale=p.sm_scale, num_splits=splits, lse_scale=LN2 if base_e else 1.0)
            return
        sparse_decode.sparse_mla(q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, part_o, part_lse,
                                 page_size=p.page_size, sm_scale=p.sm_scale, num_splits=splits,
                                 lse_scale=LN2 if base_e else 1.0, **p.config)


def _gluon_support(requested: str, num_heads: int, fmt: KVFormat, q_dtype: torch.dtype, topk: int,
                   invariant: bool = False):
    """``choose_backend``'s check of the Hopper sparse build: for backend="gluon" always (a plan it cannot take
    raises, naming why), for "auto" while ``kernels.sm90.sparse.AUTO_SELECT`` is on (``choose_backend`` asks only
    on an sm_90 GPU with Gluon). Imported only when asked (a torch-only install has no triton). The
    batch-invariant mode: taken when named (its splits follow topk only, one CTA per token, head group and split;
    the merge's sizes are fixed), never by "auto" (its bits per token are checked on a GPU only)."""
    def check():
        if invariant and requested == "auto":
            return False, GLUON_AUTO
        from .kernels.sm90 import sparse as sm90_sparse
        if requested == "auto" and not sm90_sparse.AUTO_SELECT:
            return False, "the gluon sparse build is not auto-selected"
        return sm90_sparse.supports(num_heads, fmt.name, str(q_dtype).removeprefix("torch."), topk)
    return check


def _target_programs(p: _SparsePlan) -> int:
    return 2 * num_sms(p.device)


def _splits(p: _SparsePlan, n: int) -> int:
    """Programs per index row (``kernels.split.rows``): triton, enough that ``n x head tiles x splits`` reaches twice
    the SM count; gluon, one wave of its one-CTA-per-SM kernel; each split walking at least ``min_split`` entries.
    Fixed per (plan, n): the same inputs always split, and merge, the same way."""
    from .kernels.split import fill_splits, invariant_splits, wave_splits
    if p.backend not in ("triton", "gluon"):
        return 1
    if p.num_splits is not None:
        return min(p.num_splits, -(-p.topk // INDEX_BLOCK))
    if p.invariant:  # the same for every call: the row's cut never follows the call's size
        return invariant_splits(p.topk, SPARSE_INVARIANT_SPLIT)
    tiles = -(-p.num_heads // p.config["block_h"])   # (gluon: 64-head groups)
    if p.backend == "gluon":
        return wave_splits(num_sms(p.device), n, tiles, p.topk, p.min_split)
    return fill_splits(_target_programs(p), n, tiles, p.topk, p.min_split)


def _check_index_values(indices: torch.Tensor, num_slots: int) -> None:
    """``FP8MLA_CHECK=1``: index values on the host (one sync). The kernels skip out-of-pool entries like -1, so
    without this check a wrong slot id drops a token silently."""
    bad = (indices < -1) | (indices >= num_slots)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"indices: expected slots in [0, {num_slots}) or -1, got indices[{t}, {j}] = "
                         f"{int(indices[t, j])}")


def _run_torch(p, q_nope, q_pe, ckv, kpe, sa, scales, indices, out, lse, base_e) -> None:
    """fp32 torch path: gathers the selected tokens (never the pool), a few query tokens at a time."""
    n, H, Dc = q_nope.shape
    page = p.page_size
    num_slots = ckv.shape[0] * page
    c_scale, k_scale = scales[0], scales[1]
    step = max(1, (1 << 24) // (p.topk * (Dc + p.head_dim_kpe)))  # ~64 MB of gathered fp32 per chunk
    if p.invariant:
        step = 1  # row by row: every op's shapes follow the row, never the call's token count
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        ids = indices[t0:t1].long()
        valid = (ids >= 0) & (ids < num_slots)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        pg, sl = safe // page, safe % page
        c = ckv[pg, sl].float()
        k = kpe[pg, sl].float()
        if sa is not None:
            c = c * sa[pg, sl].repeat_interleave(128, dim=-1)
        else:
            c = c * c_scale
        k = k * k_scale
        vis = valid[:, None, :]
        c = torch.where(valid[..., None], c, torch.zeros_like(c))
        k = torch.where(valid[..., None], k, torch.zeros_like(k))
        s = (torch.einsum("thd,tkd->thk", q_nope[t0:t1].float(), c) +
             torch.einsum("thd,tkd->thk", q_pe[t0:t1].float(), k)) * p.sm_scale
        o, ls = softmax_rows(s, c, vis)
        out[t0:t1] = o.to(out.dtype)
        lse[t0:t1] = ls if base_e else ls * LOG2E
