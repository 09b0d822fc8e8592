"""MLAPagedAttention: FlashInfer's ``BatchMLAPagedAttentionWrapper`` API for MLA over a paged latent cache.

``plan()`` turns its arguments into one :class:`~fp8mla.layout.PagedLayout` (validated once; O(batch) host
work; no device-to-host sync when ``qo_indptr`` is a CPU tensor, as the engine adapters pass it) and hands it to
one backend (``fp8mla.backends``: torch, triton, gluon, or the gather_cast strategy), chosen by
``fp8mla.backends.select`` from the records each build declares. ``run()`` checks its tensors against the plan
and launches. The query dtype and the KV dtype are planned separately, so BF16 queries read an FP8 pool
directly: nothing converts the pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import backends
from ._checks import check_int, check_positive_int, check_tensor, plain_number
from ._scales import DeviceScales, check_q_dtype, check_sm_scale
from .backends import AttentionSpec, PlanState
from .backends.select import Refusal, dense_question, qo_range, select
from .formats import FORMATS, KVFormat, get_format
from .layout import PagedLayout
from .paged_checks import (check_given_table, check_invariant_options, check_kernel_options, refusal_exception,
                           resolve_scales)
from .runtime import available_backends

__all__ = ["MLAPagedAttention", "available_backends"]

STRATEGIES = ("native", "gather_cast")
CAPACITY_OPTIONS = ("max_batch_size", "max_qo_len", "max_kv_indices", "max_partials")  # CUDA-graph buffer sizes
KERNEL_OPTIONS = ("block_m", "block_n", "num_warps", "num_stages", "ctas_per_sm", "min_chunk", "evict_first",
                  "index64", "v_convert", "fp8_math", "heads_on_m", "invariant_chunk") + CAPACITY_OPTIONS
FLASHINFER_BACKENDS = ("fa2", "fa3")


@dataclass
class _Plan:
    layout: PagedLayout
    spec: AttentionSpec
    backend: str
    impl: object                  # the backend's plan object (has .run)
    group_impl: object = None     # built on the first run that passes ckv_scale_arr under a plain FP8 dtype
    given_rows: int = 0           # requests plan() was given, where trailing ones without queries were left out


class MLAPagedAttention:
    """Batch MLA attention over a paged latent cache (decode, multi-token decode, paged prefill).

    Drop-in for FlashInfer's ``BatchMLAPagedAttentionWrapper`` (0.6.x / 0.7.x: same positional order of the
    constructor, ``plan()`` and ``run()``; see docs/flashinfer_compat.md). fp8mla's own options are keywords.

    Args:
        float_workspace_buffer: optional tensor; only its device is used (kernels size their own workspace).
        use_cuda_graph: keep every tensor run() reads in fixed buffers, so run() can be captured and replayed
            after a re-plan (triton / gluon backends).
        qo_indptr, kv_indptr, kv_indices, kv_len_arr: FlashInfer's CUDA-graph buffers. fp8mla keeps its own
            buffers; these only size them (batch = ``qo_indptr.numel() - 1``, ``kv_indices.numel()`` pages).
        backend: ``"auto"`` (gluon on Hopper for the plans it supports, else triton on CUDA, else torch),
            ``"torch"``, ``"triton"`` or ``"gluon"``.
        strategy: ``"native"`` (the kernel reads the pool's storage dtype directly) or ``"gather_cast"`` (gather
            the batch's tokens into a 16-bit workspace sized by those tokens, then run the 16-bit kernel on it; a
            baseline and a fallback, never a cast of the pool).
        **kernel_options: tuning (``block_m``, ``block_n``, ``num_warps``, ``num_stages``, ``ctas_per_sm``,
            ``min_chunk``, ``evict_first``, ``index64``, ``v_convert`` = "plain" | "asm"; ``fp8_math``: opt-in FP8
            tensor-core math on the gluon kernel (Q as e4m3 hi + lo terms, P x 2^8 as e4m3, both products e4m3 x
            e4m3 wgmma, no K/V conversion; error budget rel L2 <= 2e-2 instead of the default 3e-3; per-tensor
            e4m3 only; a plan that would run elsewhere raises); ``heads_on_m``: the gluon kernel's heads-on-M build
            (64 heads on the MMA's M side; 33..128 heads, one query per request, per-tensor e4m3, pages of a
            multiple of 64): None = the selector's choice (it wherever it takes the plan, plain or CUDA-graph,
            host or device-only lengths: the H200 measured it faster at every timed shape), False = the wide
            build,
            True = required (a plan it cannot take raises with the reason); and the CUDA-graph
            capacities (``max_batch_size`` 256, ``max_qo_len`` = the first plan's longest request,
            ``max_kv_indices`` 2^20; ``max_partials`` 2048, the batch-invariant mode's work items beyond one per
            request). ``invariant_chunk``: tokens per KV chunk in the batch-invariant mode (a multiple of 64,
            default 1024).
        batch_invariant: each request's output and lse are the same bits whatever shares its batch (its size,
            order, the other requests' lengths and pages): its KV is cut in chunks of ``invariant_chunk`` tokens
            (balanced within its own length), partials merged in chunk order, one kernel configuration per heads /
            format / device; long requests are still split. Backends torch and triton; the gluon builds are refused
            (``auto`` picks triton). docs/batch_invariance.md has the contract.

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
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto", *, strategy: str = "native", batch_invariant: bool = False,
                 **kernel_options):
        if backend in FLASHINFER_BACKENDS:
            backend = "auto"  # FlashInfer's kernel names: engines and FlashInfer's tests pass them as is
        if not isinstance(backend, str) or backend not in ("auto", "torch", "triton", "gluon"):
            raise ValueError(f"backend: expected one of ('auto', 'torch', 'triton', 'gluon') or FlashInfer's "
                             f"{FLASHINFER_BACKENDS} (= 'auto'), got {backend!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
        if strategy == "gather_cast" and use_cuda_graph:
            raise ValueError("strategy: 'gather_cast' sizes its workspace by each plan's tokens, so a captured "
                             "run() could not follow a re-plan (use_cuda_graph=True); use strategy='native'")
        if float_workspace_buffer is not None:
            check_tensor("float_workspace_buffer", float_workspace_buffer)
        unknown = set(kernel_options) - set(KERNEL_OPTIONS)
        if unknown:
            raise TypeError(f"MLAPagedAttention: unknown keyword(s) {sorted(unknown)}; kernel options are "
                            f"{sorted(KERNEL_OPTIONS)}")
        check_kernel_options(kernel_options)
        check_invariant_options(batch_invariant, backend, kernel_options)
        if kernel_options.get("fp8_math") and (backend in ("torch", "triton") or strategy != "native"):
            # never the default numerics under a flag that promises FP8 tensor-core math
            raise ValueError(f"fp8_math: FP8 tensor-core math runs on the gluon kernel only (sm_90; backend 'gluon' "
                             f"or 'auto', strategy 'native'); got backend {backend!r}, strategy {strategy!r}")
        if kernel_options.get("heads_on_m") and (backend in ("torch", "triton") or strategy != "native"):
            raise ValueError(f"heads_on_m: the heads-on-M build is a gluon kernel (sm_90; backend 'gluon' or 'auto', "
                             f"strategy 'native'); got backend {backend!r}, strategy {strategy!r}")
        # FlashInfer's graph buffers: they size fp8mla's, and (int32 ones) are the very tensors the kernels read,
        # as in FlashInfer: plan() copies into them and a captured run() reads their live contents (vLLM writes
        # page ids into the kv_indices buffer inside its captured forward).
        self._external = {}
        for name, key, t in (("qo_indptr", "qo_indptr", qo_indptr), ("kv_indptr", "kv_indptr", kv_indptr),
                             ("kv_indices", "kv_indices", kv_indices), ("kv_len_arr", "kv_len", kv_len_arr)):
            if t is not None:
                check_tensor(name, t, ndim=1)
                if use_cuda_graph and t.dtype == torch.int32 and t.is_contiguous():
                    self._external[key] = t
        if qo_indptr is not None:
            kernel_options.setdefault("max_batch_size", max(1, qo_indptr.numel() - 1))
        elif kv_len_arr is not None:
            kernel_options.setdefault("max_batch_size", max(1, kv_len_arr.numel()))
        if kv_indices is not None:
            kernel_options.setdefault("max_kv_indices", max(1, kv_indices.numel()))
        self._strategy = strategy
        self._workspace = float_workspace_buffer
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        if batch_invariant:
            kernel_options["batch_invariant"] = True
        self._kernel_options = kernel_options
        self._plan: _Plan | None = None
        self._rows_fast = None       # replan_rows' per-table constants
        self._selected = {}          # backends.select's choices, by (spec, the batch's qo_len range)
        self._state: dict[str, PlanState] = {}   # backend name -> what it keeps across plans (CUDA graphs)
        self._graph_backend = None   # CUDA graphs: the backend run() last launched (a capture holds its launches)
        self._scales = DeviceScales()   # the fp32 [2] device tensor (ckv_scale, kpe_scale) of the last run

    @property
    def backend(self) -> str | None:
        """The backend chosen by the last plan() (None before the first plan)."""
        return None if self._plan is None else self._plan.backend

    @property
    def batch_invariant(self) -> bool:
        """Whether this wrapper runs in the batch-invariant mode (constructor's ``batch_invariant``)."""
        return bool(self._kernel_options.get("batch_invariant"))

    @property
    def layout(self) -> PagedLayout | None:
        """The page table of the last plan()."""
        return None if self._plan is None else self._plan.layout

    # -- plan -----------------------------------------------------------------------------------------------
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type,
             use_profiler: bool = False) -> None:
        """Plan a batch (FlashInfer's arguments, in FlashInfer's order).

        Args:
            qo_indptr: ``[>= B + 1]`` int32/int64; request b owns queries ``qo_indptr[b]:qo_indptr[b+1]``. Read on
                the host: pass a CPU tensor and plan() never syncs (a CUDA one costs one small copy, as in
                FlashInfer).
            kv_indptr: ``[>= B + 1]`` int32/int64 into ``kv_indices``; only the first B + 1 entries are read.
            kv_indices: ``[>= kv_indptr[B]]`` int32/int64 page ids, in token order per request.
            kv_len_arr: ``[B]`` int32/int64 tokens per request (<= its pages x page_size); B comes from here.
                CPU tensors are checked on the host; CUDA ones are never read on the host (the kernels guard
                them on the device; ``FP8MLA_CHECK=1`` checks them with a sync).
            num_heads, head_dim_ckv, head_dim_kpe, page_size: ints (512 and 64 for DeepSeek; head_dim_kpe may be
                0 for MLA without a rope part).
            causal: queries are aligned to the end of their request's tokens.
            sm_scale: softmax scale (DeepSeek: ``1 / sqrt(192)`` times the YaRN factor).
            q_data_type: ``torch.bfloat16`` or ``torch.float16`` (fp16 queries over FP8 are an fp8mla superset).
            kv_data_type: pool storage — a dtype (``torch.float8_e4m3fn``/``float8_e5m2`` with per-tensor scales,
                or e4m3 with ``ckv_scale_arr`` group scales given to run(); ``bfloat16``, ``float16``) or a
                format name (``"fp8_e4m3_group"``).
            use_profiler: FlashInfer's profiler; not supported (must be False).
        """
        if use_profiler:
            raise ValueError("use_profiler: fp8mla has no intra-kernel profiler; pass use_profiler=False")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            check_tensor(name, t, ndim=1)
        device = self._workspace.device if self._workspace is not None else kv_indices.device
        if isinstance(qo_indptr, torch.Tensor) and qo_indptr.device.type != "cpu":
            qo_indptr = qo_indptr[: kv_len_arr.numel() + 1].cpu()  # O(batch) ints; FlashInfer copies it too
        layout = PagedLayout.from_csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr, page_size, device=device)
        self.plan_layout(layout, num_heads, head_dim_ckv, head_dim_kpe, causal, sm_scale, q_data_type,
                         kv_data_type)

    def plan_layout(self, layout: PagedLayout, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
                    causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type) -> None:
        """The same plan from a ready :class:`~fp8mla.layout.PagedLayout` (``PagedMLACache.layout()``, the model
        runner and the engine adapters)."""
        if not isinstance(layout, PagedLayout):
            raise TypeError(f"layout: expected a fp8mla.layout.PagedLayout, got {type(layout).__name__}")
        num_heads = check_positive_int("num_heads", num_heads)
        head_dim_ckv = check_positive_int("head_dim_ckv", head_dim_ckv)
        head_dim_kpe = check_int("head_dim_kpe", head_dim_kpe, 0, "a non-negative int (0: no rope part)")
        sm_scale = check_sm_scale(sm_scale)
        check_q_dtype(q_data_type)
        fmt = get_format(kv_data_type, arg="kv_data_type")
        fmt.num_groups(head_dim_ckv)  # validates head_dim_ckv for the group format
        spec = AttentionSpec(num_heads, head_dim_ckv, head_dim_kpe, layout.page_size, bool(causal),
                             float(sm_scale), q_data_type, fmt, layout.device, self._use_cuda_graph)
        given_rows = layout.batch_size
        if self._use_cuda_graph and layout.qo_lens:
            # Trailing requests without queries (an engine's padding rows of a captured batch size) produce no
            # output: planned without them, the batch keeps the backend of the wrapper's other plans (the Gluon
            # builds refuse rows without queries, and a captured launch reads only its own backend's buffers)
            rows = len(layout.qo_lens)
            while rows and not layout.qo_lens[rows - 1]:
                rows -= 1
            if 0 < rows < given_rows:
                layout = layout.head(rows)
        name, impl = self._build(layout, spec)
        ran = self._graph_backend
        if spec.use_cuda_graph and ran is not None and name != ran:
            raise ValueError(f"plan: this CUDA-graph wrapper has run the {ran!r} backend, and a captured run() "
                             f"replays only that backend's launches, which a plan on {name!r} would not update; "
                             f"plan this batch with another wrapper (or backend={ran!r} if it takes it)")
        prev, self._plan = self._plan, _Plan(layout, spec, name, impl)
        self._plan.given_rows = given_rows
        if spec.use_cuda_graph and prev is not None and prev.group_impl is not None and self._takes_group(fmt):
            # A CUDA-graph wrapper run with group scales FlashInfer's way (an e4m3 plan, ckv_scale_arr at run): its
            # captured run replays the group plan's kernels, which read the arrays a plan stages, and a replay calls
            # no run(): so plan() builds the group plan too, after the per-tensor one (its arrays are staged last;
            # the gluon kernels' shared schedule is then the group one, which both kernels read correctly).
            self._plan.group_impl = self._build_group(layout, spec)

    # -- the decode runner's re-plan: every step, trusted ---------------------------------------------------------
    @property
    def graph_buffers(self):
        """The CUDA-graph buffers of the last plan's backend when a caller can stage their small arrays with its
        own (they have ``rebase``: the decode runner moves them into its staging buffer, then re-plans through
        :meth:`replan_rows`), else None."""
        state = self._state.get(self.backend)
        buf = None if state is None else state.graph
        return buf if callable(getattr(buf, "rebase", None)) else None

    def _rows_buffers(self):
        """The backend's CUDA-graph buffers when :meth:`replan_rows` can re-plan this wrapper (the last plan used
        CUDA-graph buffers whose small arrays a caller can stage: ``rebase`` / ``sink``), else None."""
        p = self._plan
        if p is None or not p.spec.use_cuda_graph or self._strategy != "native":
            return None
        state = self._state.get(p.backend)
        buf = None if state is None else state.graph
        return buf if getattr(buf, "rebased", False) else None

    def replan_rows(self, lens: list, sink: list, fixed: bool = False) -> None:
        """Plan the last plan's block table again (its rows, one query each: ``PagedLayout.decode_rows``), with
        new lengths ``lens`` (a list of B ints, B = its rows), on the host only: the decode runner's every step.

        A trusted path for a caller that made the block table from the cache itself and staged the buffers
        (:attr:`graph_buffers`, ``rebase``; ``models.runner.DecodeRunner``): the spec (heads, dims, scale, dtypes,
        format) was validated by this wrapper's first :meth:`plan_layout`, so neither is re-validated; the
        lengths still are (O(batch), against the rows). The backend's small arrays are appended to ``sink`` as
        ``[(values, capacity), ...]`` in the order of its flat buffer, not copied: the caller copies them with its
        own arrays in one host -> device copy into the buffer it gave ``rebase``. The layout's device arrays are
        views of that buffer (they hold these values once the caller's copy ran). ``fixed``: the plan was
        captured in a CUDA graph (which replays right after any re-plan, with the launch configuration it holds):
        the backend may keep the plan object and only stage the new schedule."""
        p, buf = self._plan, self._rows_buffers()
        if buf is None:
            raise RuntimeError("replan_rows: plan once with CUDA-graph buffers and rebase them first")
        fast = self._rows_fast
        if fast is None or fast[0] is not p.layout.kv_indices:
            lay = p.layout
            B = lay.batch_size
            W = lay.kv_indices.numel() // max(1, B)
            qo, kvp = list(range(B + 1)), list(range(0, (B + 1) * W, W))
            h = lay.host
            if h is None or h["qo_indptr"].tolist() != qo or h["kv_indptr"].tolist() != kvp:  # (once per table)
                raise RuntimeError("replan_rows: the last plan must be the rows of a block table, one query each "
                                   "(PagedLayout.decode_rows / from_block_table)")
            views = (buf.buf["qo_indptr"][: B + 1], buf.buf["kv_indptr"][: B + 1], buf.buf["kv_len"][:B])
            mod = backends._module(p.backend)  # its replan_rows (only the schedule is new), else build
            fast = self._rows_fast = (lay.kv_indices, B, W * lay.page_size, qo, kvp, views,
                                      getattr(mod, "replan_rows", None), mod.build)
        kv_indices, B, cap, qo, kvp, views, replan, build = fast
        if len(lens) != B:
            raise ValueError(f"kv_len: expected {B} entries (one per block_table row), got {len(lens)}")
        if lens and not 0 <= min(lens) <= max(lens) <= cap:
            b = next(i for i, n in enumerate(lens) if not 0 <= n <= cap)
            raise ValueError(f"kv_len: request {b} has kv_len {lens[b]}, expected 0 <= kv_len <= its row's "
                             f"{cap // p.spec.page_size} pages x page_size {p.spec.page_size} = {cap}")
        layout = PagedLayout(views[0], views[1], kv_indices, views[2], p.spec.page_size, p.spec.device, [1] * B,
                             lens, None, {"lists": (qo, kvp, lens)})
        state = self._state[p.backend]
        buf.sink = sink
        try:
            impl = replan(p.impl, layout, state, fixed) if replan is not None else None
            if impl is None:
                impl = build(layout, p.spec, self._kernel_options, state)
        finally:
            buf.sink = None
        self._plan = _Plan(layout, p.spec, p.backend, impl)

    @staticmethod
    def _takes_group(fmt: KVFormat) -> bool:
        """A plain e4m3 plan, which FlashInfer runs with group scales when run() gets ckv_scale_arr."""
        return fmt.scale_kind == "tensor" and fmt.storage_dtype == torch.float8_e4m3fn

    def _build_group(self, layout: PagedLayout, spec: AttentionSpec):
        """The group-scale plan (format fp8_e4m3_group) of a plain e4m3 plan's layout and spec."""
        return self._build(layout, AttentionSpec(**{**spec.__dict__, "kv_format": FORMATS["fp8_e4m3_group"]}))[1]

    def _select(self, layout: PagedLayout, spec: AttentionSpec):
        """The build that runs this plan (``backends.select``), kept for the spec and the batch's query lengths,
        the only facts of a layout a build's support depends on: a wrapper's re-plans select once. A refusal is
        never kept (a later plan may fit)."""
        qo = qo_range(layout)
        key = (spec, qo)
        kept = self._selected.get(key)
        if kept is not None:
            return kept
        q = dense_question(spec, qo, self._kernel_options)
        choice = select(q, self._backend)
        if isinstance(choice, Refusal):
            raise refusal_exception(choice, q)
        if len(self._selected) >= 8:   # (a wrapper meets few specs and query-length ranges; keep the memo small)
            self._selected.clear()
        self._selected[key] = choice
        return choice

    def _build(self, layout: PagedLayout, spec: AttentionSpec):
        choice = self._select(layout, spec)
        name = choice.backend
        if self._strategy == "gather_cast":
            from .backends import gather_cast
            inner = "triton" if name in ("triton", "gluon") else "torch"
            return f"gather_cast+{inner}", gather_cast.build(layout, spec, self._kernel_options, PlanState(),
                                                             inner=inner)
        state = self._state.get(name)
        if state is None:
            state = self._state[name] = PlanState()
        if spec.use_cuda_graph:
            state.external = self._external
        return name, backends.build(choice.module, layout, spec, self._kernel_options, state)

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False, o_scale=None, *,
            ckv_scale=None, ckv_scale_arr: torch.Tensor | None = None, kpe_scale=None):
        """Attention for the planned batch (FlashInfer's arguments, in FlashInfer's order).

        Args:
            q_nope: ``[n, H, head_dim_ckv]``, q_pe: ``[n, H, head_dim_kpe]`` in the planned query dtype
                (n = ``qo_indptr[B]``; rows may be strided, the last dim contiguous).
            ckv_cache: ``[P, page_size, head_dim_ckv]``, kpe_cache: ``[P, page_size, head_dim_kpe]`` in the planned
                storage dtype: views of one ``[P, page_size, 576]`` pool or separate tensors.
            out: optional ``[n, H, head_dim_ckv]`` query-dtype buffer; lse: optional ``[n, H]`` fp32 buffer (both
                with a contiguous last dimension).
            return_lse: also return lse.
            profiler_buffer: FlashInfer's profiler; not supported (must be None).
            kv_len, page_table: FlashInfer's inputs of its trtllm-gen backend; fp8mla runs the planned page
                table: if given, they must describe it (they are not read otherwise).
            return_lse_base_on_e: natural-log lse instead of base 2.
            o_scale: optional float multiplying the output (FlashInfer's output scale).
            ckv_scale, kpe_scale: per-tensor scales (real = stored x scale): floats, or 1-element fp32 tensors
                on the plan's device (a tensor holding a non-positive or non-finite value makes the output NaN).
            ckv_scale_arr: ``[P, page_size, head_dim_ckv // 128]`` fp32 per-token group scales of c_kv.
            An FP8 pool needs exactly one of ``ckv_scale`` / ``ckv_scale_arr``, and ``kpe_scale`` (as FlashInfer):
            a missing scale is an error, never a silent 1.0.
        Returns:
            ``out`` or ``(out, lse)`` with ``return_lse``; lse is base 2 unless ``return_lse_base_on_e``.
            A query that sees no token gets 0 and lse ``-inf``; NaN in a query or in a token it sees gives NaN
            (NaN stored in a token of the same request that a causal query does not see may reach it too, as
            0 x NaN in P.V; it never reaches another request).
        """
        p = self._plan
        if p is None:
            raise RuntimeError("run: call plan() first")
        if profiler_buffer is not None:
            raise ValueError("profiler_buffer: fp8mla has no intra-kernel profiler; pass None")
        o_scale = plain_number(o_scale)
        if o_scale is not None and (isinstance(o_scale, bool) or not isinstance(o_scale, (int, float))
                                    or not math.isfinite(o_scale)):
            raise ValueError(f"o_scale: expected a finite float (the output's multiplier) or None, got {o_scale!r}")
        spec, layout = p.spec, p.layout
        H, Dc, Dk = spec.num_heads, spec.head_dim_ckv, spec.head_dim_kpe
        fmt = spec.kv_format
        n = layout.num_qo if layout.num_qo is not None else q_nope.shape[0]
        check_tensor("q_nope", q_nope, dtype=spec.q_dtype, shape=(n, H, Dc), device=spec.device)
        check_tensor("q_pe", q_pe, dtype=spec.q_dtype, shape=(n, H, Dk), device=spec.device)
        check_tensor("ckv_cache", ckv_cache, dtype=fmt.storage_dtype, shape=(None, spec.page_size, Dc),
                     device=spec.device)
        P = ckv_cache.shape[0]
        check_tensor("kpe_cache", kpe_cache, dtype=fmt.storage_dtype, shape=(P, spec.page_size, Dk),
                     device=spec.device)
        layout.check_pool(P)
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t.stride(-1) != 1 and t.shape[-1] > 1:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")
        check_given_table(kv_len, page_table, layout, p.given_rows or layout.batch_size)

        impl, fmt = p.impl, spec.kv_format
        if ckv_scale_arr is not None and self._takes_group(fmt):
            # FlashInfer plans group scales under the plain e4m3 dtype: build the group plan once, on first use.
            if p.group_impl is None:
                p.group_impl = self._build_group(layout, spec)
            impl, fmt = p.group_impl, FORMATS["fp8_e4m3_group"]
        scales = resolve_scales(self._scales, fmt, ckv_scale, kpe_scale, ckv_scale_arr, P, spec)
        if out is None:
            out = torch.empty(n, H, Dc, dtype=spec.q_dtype, device=spec.device)
        else:
            check_tensor("out", out, dtype=spec.q_dtype, shape=(n, H, Dc), device=spec.device)
            if out.stride(-1) != 1:
                raise ValueError(f"out: expected a contiguous last dimension, got strides {out.stride()}")
        if lse is None:
            lse = torch.empty(n, H, dtype=torch.float32, device=spec.device)
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(n, H), device=spec.device)
            if lse.stride(-1) != 1:
                raise ValueError(f"lse: expected a contiguous last dimension (heads), got strides {lse.stride()}")
        if hasattr(impl, "scale_values"):
            impl.scale_values = self._scales.host
        if spec.use_cuda_graph:
            self._graph_backend = p.backend   # (plan() keeps later plans of the wrapper on it)
        impl.run(q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, bool(return_lse_base_on_e))
        if o_scale is not None and o_scale != 1.0:
            out.mul_(o_scale)  # checked above: a finite float
        return (out, lse) if return_lse else out
