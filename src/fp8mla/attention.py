"""MLAPagedAttention: FlashInfer-compatible plan()/run() for MLA over a paged latent cache.

``plan()`` does the host work once per batch layout (checks, split scheduling, index tensors); ``run()`` only
checks its tensors against the plan and launches. The query dtype and the KV dtype are planned separately,
so BF16 queries read an FP8 pool directly: nothing converts the pool.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ._checks import INDEX_DTYPES, check_indptr, check_page_table, check_positive_int, check_tensor, same_device
from .formats import KVFormat, get_format
from ._torch_backend import LOG2E, TorchPlan, run_torch

__all__ = ["MLAPagedAttention", "available_backends"]

Q_DTYPES = (torch.bfloat16, torch.float16)
# Triton backend tuning and CUDA-graph capacities (defaults in _triton_backend.DEFAULTS).
STRATEGIES = ("native", "gather_cast")
KERNEL_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm", "min_chunk", "evict_first", "index64", "cvt_asm",
                  "max_batch_size",
                  "max_qo_len", "max_kv_indices")
BACKENDS = ("auto", "torch", "triton")


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def available_backends(device="cpu") -> list[str]:
    """Backends that can run on ``device`` here ("triton" on CPU only under ``TRITON_INTERPRET=1``)."""
    return ["torch"] + (["triton"] if _triton_usable(torch.device(device)) else [])


@dataclass
class _Plan:
    batch_size: int
    num_qo: int
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    page_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_format: KVFormat
    device: torch.device
    max_page_id: int
    backend: str
    impl: object  # backend-specific plan data


class MLAPagedAttention:
    """Batch MLA attention over a paged latent cache (decode, multi-token decode, paged prefill).

    Drop-in for FlashInfer's ``BatchMLAPagedAttentionWrapper``.

    Args:
        float_workspace_buffer: optional tensor; only its device is used (kernels size their own workspace).
        use_cuda_graph: keep plan data in fixed buffers so run() can be captured (Triton backend).
        backend: ``"auto"`` (Triton on CUDA when it can run the plan, else torch), ``"torch"`` or ``"triton"``.
        strategy: ``"native"`` (the kernel reads the pool's storage dtype directly) or ``"gather_cast"`` (gather
            the batch's tokens into a 16-bit workspace sized by those tokens, then run the 16-bit kernel on it; a
            baseline and a fallback, never a cast of the pool).
        **kernel_options: Triton tuning (``block_m``, ``block_n``, ``num_warps``, ``num_stages``, ``ctas_per_sm``,
            ``min_chunk``) and, with ``use_cuda_graph``, the capacities of the fixed buffers
            (``max_batch_size`` 256, ``max_qo_len`` 1, ``max_kv_indices`` 2^20; a larger ``max_qo_len`` for
            multi-token decode makes the decode tiles taller for every plan on those buffers).

    Example:
        >>> import torch, fp8mla
        >>> cache = fp8mla.PagedMLACache(num_layers=1, num_pages=8, page_size=16, kv_format="fp8_e4m3")
        >>> s = cache.add_sequence(num_tokens=20)
        >>> cache.append(0, [s], torch.randn(20, 512), torch.randn(20, 64))
        >>> attn = fp8mla.MLAPagedAttention(backend="torch")
        >>> attn.plan(**cache.plan_inputs([s]), num_heads=16, causal=True, sm_scale=192 ** -0.5,
        ...           q_data_type=torch.bfloat16)
        >>> q_nope = torch.randn(1, 16, 512, dtype=torch.bfloat16)
        >>> q_pe = torch.randn(1, 16, 64, dtype=torch.bfloat16)
        >>> out, lse = attn.run(q_nope, q_pe, **cache.run_inputs(0), return_lse=True)
        >>> out.shape, out.dtype, lse.shape
        (torch.Size([1, 16, 512]), torch.bfloat16, torch.Size([1, 16]))
    """

    def __init__(self, float_workspace_buffer: torch.Tensor | None = None, use_cuda_graph: bool = False,
                 backend: str = "auto", *, strategy: str = "native", **kernel_options):
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
        if strategy == "gather_cast" and use_cuda_graph:
            raise ValueError("strategy: 'gather_cast' sizes its workspace by each plan's tokens, so a captured "
                             "run() could not follow a re-plan (use_cuda_graph=True); use strategy='native'")
        self._strategy = strategy
        if float_workspace_buffer is not None:
            check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._workspace = float_workspace_buffer
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        unknown = set(kernel_options) - set(KERNEL_OPTIONS)
        if unknown:
            raise TypeError(f"MLAPagedAttention: unknown keyword(s) {sorted(unknown)}; kernel options are "
                            f"{sorted(KERNEL_OPTIONS)}")
        self._kernel_options = kernel_options
        self._plan: _Plan | None = None
        self._triton_state = None  # fixed buffers kept across plans for CUDA graphs

    @property
    def backend(self) -> str | None:
        """The backend chosen by the last plan() (None before the first plan)."""
        return None if self._plan is None else self._plan.backend

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type, *,
             use_profiler: bool = False) -> None:
        """Plan a batch.

        Args:
            qo_indptr: ``[B + 1]`` int32/int64; request b owns queries ``qo_indptr[b]:qo_indptr[b+1]``.
            kv_indptr: ``[B + 1]`` int32/int64 into ``kv_indices``.
            kv_indices: ``[>= kv_indptr[-1]]`` int32/int64 page ids, in token order per request.
            kv_len_arr: ``[B]`` int32/int64 tokens per request (<= its pages x page_size).
            num_heads, head_dim_ckv, head_dim_kpe, page_size: ints (512 and 64 for DeepSeek).
            causal: queries are aligned to the end of their request's tokens.
            sm_scale: softmax scale (DeepSeek: ``1 / sqrt(192)`` times the YaRN factor).
            q_data_type: ``torch.bfloat16`` or ``torch.float16``.
            kv_data_type: pool storage — a dtype (``torch.float8_e4m3fn``/``float8_e5m2`` with per-tensor scales,
                ``bfloat16``, ``float16``) or a format name (``"fp8_e4m3_group"`` for ``ckv_scale_arr``).
        """
        check_tensor("kv_indices", kv_indices, dtype=INDEX_DTYPES, ndim=1)
        device = self._workspace.device if self._workspace is not None else kv_indices.device
        check_indptr("qo_indptr", qo_indptr)
        B = qo_indptr.numel() - 1
        check_indptr("kv_indptr", kv_indptr, B + 1)
        check_tensor("kv_len_arr", kv_len_arr, dtype=INDEX_DTYPES, ndim=1)
        if kv_len_arr.numel() != B:
            raise ValueError(f"kv_len_arr: expected {B} entries (one per request of qo_indptr), "
                             f"got {kv_len_arr.numel()}")
        for name, v in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv),
                        ("head_dim_kpe", head_dim_kpe), ("page_size", page_size)):
            check_positive_int(name, v)
        if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
        if q_data_type not in Q_DTYPES:
            raise TypeError(f"q_data_type: expected one of {list(Q_DTYPES)}, got {q_data_type}")
        fmt = get_format(kv_data_type, arg="kv_data_type")
        fmt.num_groups(head_dim_ckv)  # validates head_dim_ckv for the group format

        qo = qo_indptr.tolist()
        kvp = kv_indptr.tolist()
        lens = kv_len_arr.tolist()
        pages = kv_indices.tolist()
        max_page = check_page_table(kvp, lens, pages, page_size)

        if self._strategy == "gather_cast":
            self._plan_gather_cast(qo_indptr, kv_indptr, kv_indices, kv_len_arr, lens, num_heads, head_dim_ckv,
                                   head_dim_kpe, page_size, causal, sm_scale, q_data_type, fmt, device, max_page)
            return
        backend = self._choose_backend(device)
        qo_lens = [qo[b + 1] - qo[b] for b in range(B)]
        kv_pages = [pages[kvp[b]: kvp[b + 1]] for b in range(B)]
        plan = _Plan(B, qo[-1], num_heads, head_dim_ckv, head_dim_kpe, page_size, bool(causal), float(sm_scale),
                     q_data_type, fmt, device, max_page, backend, None)
        if backend == "triton":
            from ._triton_backend import TritonPlan
            plan.impl = TritonPlan.build(self, plan, qo_indptr, kv_indptr, kv_indices, kv_len_arr, qo_lens, lens)
        else:
            plan.impl = TorchPlan(qo_lens, kv_pages, lens, page_size, bool(causal), device)
        self._plan = plan

    def _plan_gather_cast(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, lens, num_heads, head_dim_ckv,
                          head_dim_kpe, page_size, causal, sm_scale, q_data_type, fmt, device, max_page):
        """Plans the 16-bit kernel over a workspace of the batch's tokens (one token per 'page'), and the slots
        the gather reads, so that run() does no host work."""
        from .gather import token_slots
        inner = MLAPagedAttention(self._workspace, False, self._backend, **self._kernel_options)
        tok = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
        T = int(tok[-1])
        inner.plan(qo_indptr, tok, torch.arange(max(1, T), dtype=torch.int32, device=device),
                   kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, 1, causal, sm_scale, q_data_type,
                   q_data_type)
        slots, _ = token_slots(kv_indptr.to(device), kv_indices.to(device), kv_len_arr.to(device), page_size, T)
        ws = dict(dtype=q_data_type, device=device)  # sized by the tokens used, never by the pool
        p = inner._plan
        self._plan = _Plan(p.batch_size, p.num_qo, num_heads, head_dim_ckv, head_dim_kpe, page_size, p.causal,
                           p.sm_scale, q_data_type, fmt, device, max_page, "gather_cast+" + p.backend,
                           dict(inner=inner, slots=slots, ckv=torch.zeros(max(1, T), head_dim_ckv, **ws),
                                kpe=torch.zeros(max(1, T), head_dim_kpe, **ws)))

    def _run_gather_cast(self, q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_arr, out, lse,
                         base_e):
        from .gather import gather_rows  # same layer: the gather kernel's public entry
        g = self._plan.impl
        as_float = (lambda v: float(v) if isinstance(v, torch.Tensor) else v)  # a tensor scale costs a sync
        T = g["slots"].numel()
        gather_rows(ckv_cache, kpe_cache, g["slots"], g["ckv"][:T], g["kpe"][:T], ckv_scale=as_float(ckv_scale),
                    kpe_scale=as_float(kpe_scale), ckv_scale_arr=ckv_scale_arr,
                    backend="triton" if self._plan.backend.endswith("triton") else "torch")
        rows = g["ckv"].shape[0]
        g["inner"].run(q_nope, q_pe, g["ckv"].view(rows, 1, -1), g["kpe"].view(rows, 1, -1), out=out, lse=lse,
                       return_lse_base_on_e=base_e)

    def _choose_backend(self, device: torch.device) -> str:
        if self._backend == "torch":
            return "torch"
        usable = _triton_usable(device) and _triton_backend_exists()
        if self._backend == "triton" and not usable:
            raise RuntimeError(f"backend: 'triton' cannot run on {device} here (needs triton and a CUDA device, "
                               "or TRITON_INTERPRET=1 on the CPU)")
        if self._backend == "auto":
            return "triton" if usable and device.type == "cuda" else "torch"
        return "triton"

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            return_lse_base_on_e: bool = False, *, ckv_scale=None, kpe_scale=None,
            ckv_scale_arr: torch.Tensor | None = None):
        """Attention for the planned batch.

        Args:
            q_nope: ``[n, H, head_dim_ckv]``, q_pe: ``[n, H, head_dim_kpe]`` in the planned query dtype
                (n = ``qo_indptr[-1]``; rows may be strided, the last dim contiguous).
            ckv_cache: ``[P, page_size, head_dim_ckv]``, kpe_cache: ``[P, page_size, head_dim_kpe]`` in the planned
                storage dtype: views of one ``[P, page_size, 576]`` pool or separate tensors.
            out: optional ``[n, H, head_dim_ckv]`` query-dtype buffer; lse: optional ``[n, H]`` fp32 buffer.
            ckv_scale, kpe_scale: per-tensor scales (float or 0-d fp32 tensor; real = stored x scale).
            ckv_scale_arr: ``[P, page_size, head_dim_ckv // 128]`` fp32 for the ``fp8_e4m3_group`` format.
        Returns:
            ``out`` or ``(out, lse)`` with ``return_lse``; lse is base 2 unless ``return_lse_base_on_e``.
            A query that sees no token gets 0 and lse ``-inf``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("run: call plan() first")
        n, H, Dc, Dk = p.num_qo, p.num_heads, p.head_dim_ckv, p.head_dim_kpe
        fmt = p.kv_format
        check_tensor("q_nope", q_nope, dtype=p.q_dtype, shape=(n, H, Dc), device=p.device)
        check_tensor("q_pe", q_pe, dtype=p.q_dtype, shape=(n, H, Dk), device=p.device)
        check_tensor("ckv_cache", ckv_cache, dtype=fmt.storage_dtype, shape=(None, p.page_size, Dc),
                     device=p.device)
        P = ckv_cache.shape[0]
        check_tensor("kpe_cache", kpe_cache, dtype=fmt.storage_dtype, shape=(P, p.page_size, Dk), device=p.device)
        if p.max_page_id >= P:
            raise ValueError(f"kv_indices: the plan references page {p.max_page_id} but ckv_cache has {P} pages")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")
        ckv_scale = _check_scale("ckv_scale", ckv_scale, fmt, p.device, allowed=fmt.scale_kind == "tensor")
        kpe_scale = _check_scale("kpe_scale", kpe_scale, fmt, p.device, allowed=fmt.is_fp8)
        if fmt.scale_kind == "group":
            if ckv_scale_arr is None:
                raise ValueError("ckv_scale_arr: the plan's kv_data_type 'fp8_e4m3_group' needs per-token group "
                                 "scales, got None")
            check_tensor("ckv_scale_arr", ckv_scale_arr, dtype=torch.float32,
                         shape=(P, p.page_size, fmt.num_groups(Dc)), device=p.device)
        elif ckv_scale_arr is not None:
            raise ValueError(f"ckv_scale_arr: the plan's kv_data_type {fmt.name!r} has no group scales; plan with "
                             "kv_data_type='fp8_e4m3_group' to use ckv_scale_arr")
        if out is None:
            out = torch.empty(n, H, Dc, dtype=p.q_dtype, device=p.device)
        else:
            check_tensor("out", out, dtype=p.q_dtype, shape=(n, H, Dc), device=p.device)
        if lse is None:
            lse = torch.empty(n, H, dtype=torch.float32, device=p.device)
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(n, H), device=p.device)

        if p.backend.startswith("gather_cast"):
            self._run_gather_cast(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_arr, out, lse,
                                  return_lse_base_on_e)
        elif p.backend == "triton":
            from ._triton_backend import run_triton
            run_triton(p, q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_arr, out, lse,
                       base_e=return_lse_base_on_e)
        else:
            run_torch(p.impl, q_nope, q_pe, ckv_cache, kpe_cache, p.sm_scale, ckv_scale, kpe_scale,
                      ckv_scale_arr, out, lse)
            if not return_lse_base_on_e:
                lse.mul_(LOG2E)
        return (out, lse) if return_lse else out


def _check_scale(name: str, v, fmt: KVFormat, device, *, allowed: bool):
    """A per-tensor scale: None (= 1), a positive float, or a 0-d/1-element fp32 tensor on the plan's device."""
    if v is None:
        return 1.0
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype != torch.float32 or not same_device(v.device, device):
            raise ValueError(f"{name}: expected a float or a 1-element fp32 tensor on {device}, got a "
                             f"{v.dtype} tensor of shape {tuple(v.shape)} on {v.device}")
        if not allowed:
            raise ValueError(f"{name}: kv_data_type {fmt.name!r} takes no {name}, got a tensor")
        return v.reshape(())
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
        raise ValueError(f"{name}: expected a positive finite float, got {v!r}")
    if not allowed and v != 1.0:
        raise ValueError(f"{name}: kv_data_type {fmt.name!r} takes no {name} (only 1.0), got {v!r}")
    return float(v)


def _triton_backend_exists() -> bool:
    import importlib.util
    return importlib.util.find_spec("fp8mla._triton_backend") is not None
