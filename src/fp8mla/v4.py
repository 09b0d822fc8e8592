"""V4SparseAttention: DeepSeek V4 attention over paged K = V pools (shared-KV MQA, sliding window, compressed
rows, attention sinks). docs/v4.md has the contract and where it differs from FlashMLA's and vLLM's.

Every query token attends to two index segments, each over its own paged pool in one ``fp8mla.formats_v4``
format: the sliding window's slots and (for the layers that have them) the compressed rows' slots, each row
``-1``-padded and optionally cut by a per-token length. One call serves decode, MTP and prefill rows: rows are
independent. ``plan()`` fixes shapes, dtypes, format and the split workspace (O(1) host work); ``run()`` checks
its tensors against the plan and launches with no device-to-host sync (``FP8MLA_CHECK=1`` adds the host check of
the index and length values), so it can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._checks import ArgumentTypeError, check_positive_int, check_tensor
from ._scales import MAX_SM_SCALE, Q_DTYPES
from .backends._invariant import V4_INVARIANT_CHUNK, check_chunk
from .formats_v4 import HEAD_DIM, V4Format, get_v4_format, pool_geometry
from .layout import debug_checks
from .backends.select import Refusal, refusal_error, select, v4_question

__all__ = ["V4SparseAttention", "V4_BACKENDS", "write_v4_pool"]

V4_BACKENDS = ("auto", "torch", "triton", "gluon")
MAX_HEADS = 128
INVARIANT_BACKENDS = ("torch", "triton")   # the backends that honour batch_invariant=True


@dataclass
class V4Plan:
    """What ``plan()`` fixed; the backends read it."""

    num_heads: int
    sm_scale: float
    q_dtype: torch.dtype
    fmt: V4Format
    window_topk: int
    window_page_size: int
    compressed_topk: int
    compressed_page_size: int | None
    num_window_pages: int | None
    num_compressed_pages: int | None
    device: torch.device
    backend: str
    num_splits: int | None
    min_split: int
    config: dict | None = None
    part_o: torch.Tensor | None = None      # split workspace, fixed at plan (CUDA-graph safe)
    part_lse: torch.Tensor | None = None
    invariant_chunk: int | None = None      # the batch-invariant mode's cut (None: the default mode)
    retired: list = field(default_factory=list)   # the invariant mode's outgrown workspaces (kept alive)


@dataclass
class PoolSegment:
    """One checked segment of a run: its pool's page view, page size, index rows and lengths."""

    view: torch.Tensor
    page_size: int
    num_pages: int
    indices: torch.Tensor
    lengths: torch.Tensor | None


class V4SparseAttention:
    """DeepSeek V4 attention: each query token over its window slots and its compressed-row slots, with sinks.

    Args:
        backend: ``"auto"`` (gluon on Hopper for the plans it takes, else triton on CUDA, else torch),
            ``"torch"`` (fp32 torch code, any device), ``"triton"`` (the portable kernel
            ``fp8mla.kernels.v4_attention``; on the CPU under ``TRITON_INTERPRET=1``) or ``"gluon"`` (the Hopper
            build ``fp8mla.kernels.sm90.v4``: bf16 queries, sm_90 only; a plan it cannot take raises, naming why).

    Example:
        >>> import torch, fp8mla
        >>> from fp8mla.formats_v4 import get_v4_format
        >>> fmt = get_v4_format("fp8_v4")
        >>> window = fmt.new_pool(num_pages=2, page_size=64)
        >>> fmt.write(window, torch.arange(100), torch.randn(100, 512))
        >>> attn = fp8mla.V4SparseAttention(backend="torch")
        >>> attn.plan(num_heads=16, sm_scale=512 ** -0.5, q_data_type=torch.bfloat16, kv_format="fp8_v4",
        ...           window_topk=128, window_page_size=64)
        >>> idx = torch.full((1, 128), -1, dtype=torch.int32)
        >>> idx[0, :100] = torch.arange(100)
        >>> q = torch.randn(1, 16, 512).bfloat16()
        >>> out, lse = attn.run(q, window, idx, sinks=torch.zeros(16), return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 16, 512]), torch.Size([1, 16]))

    Batch-invariant mode (keyword-only constructor arguments):
        batch_invariant: each query row's output and lse are the same bits whatever else the call holds (its
            number of rows, their order, their index rows and lengths, the pools' page order) and whatever the
            SM count: a row's entries (window then compressed, up to its lengths) are cut in ``ceil(len /
            invariant_chunk)`` pieces of one size, merged in order; the torch code runs row by row. Backends
            torch and triton (``auto`` picks one of them); others are refused by name. docs/batch_invariance.md
            has the contract.
        invariant_chunk: entries a piece of that cut at most (default 512; a positive multiple of 64 and of the
            Triton kernel's ``block_n``); only with ``batch_invariant=True``.
    """

    def __init__(self, backend: str = "auto", *, batch_invariant: bool = False, invariant_chunk: int | None = None):
        if not isinstance(backend, str) or backend not in V4_BACKENDS:
            raise ValueError(f"backend: expected one of {V4_BACKENDS}, got {backend!r}")
        self._backend = backend
        self._plan: V4Plan | None = None
        self._invariant_chunk = _invariant_chunk(batch_invariant, invariant_chunk, backend)
        self._retired: list = []   # the invariant mode's replaced workspaces, kept alive across plans

    # -- plan -----------------------------------------------------------------------------------------------
    def plan(self, num_heads: int, sm_scale: float, q_data_type: torch.dtype, kv_format, *, window_topk: int,
             window_page_size: int, compressed_topk: int = 0, compressed_page_size: int | None = None,
             num_window_pages: int | None = None, num_compressed_pages: int | None = None, device=None,
             num_splits: int | None = None, min_split: int = 256, **kernel_options) -> None:
        """Fix what every following ``run()`` gets.

        Args:
            num_heads: query heads per token, 1 to 128 (V4-Flash 64, V4-Pro 128, or those over TP ranks).
            sm_scale: score scale (V4: ``512 ** -0.5``); a positive finite float.
            q_data_type: ``torch.bfloat16`` or ``torch.float16``; out has this dtype.
            kv_format: ``"fp8_v4"`` (584-byte, vLLM), ``"fp8_v41"`` (528-byte, FlashMLA V4.1) or ``"bf16"``;
                both pools have this format.
            window_topk: entries of a window index row (any positive number; V4: 128).
            window_page_size: tokens a page of the window pool.
            compressed_topk: entries of a compressed-row index row; 0 for a layer without compressed rows
                (``sliding_attention``): run() then takes no compressed arguments.
            compressed_page_size: tokens (compressed rows) a page of the compressed pool (default: the window's).
            num_window_pages, num_compressed_pages: pool pages, when known: run() then checks the pools.
            device: where run() gets its tensors (default: the current CUDA device, else the CPU).
            num_splits: fix the programs a token's keys are split over (default: chosen per call from the
                number of tokens, so that small batches fill the GPU). Not in the batch-invariant mode.
            min_split: fewest keys one split program walks (unused in the batch-invariant mode).
            **kernel_options: Triton tuning (``block_h``, ``block_n``, ``num_warps``, ``num_stages``).
        """
        check_positive_int("num_heads", num_heads)
        if num_heads > MAX_HEADS:
            raise ValueError(f"num_heads: expected 1 to {MAX_HEADS}, got {num_heads}")
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or \
                not (0 < sm_scale <= MAX_SM_SCALE):
            raise ValueError(f"sm_scale: expected a positive finite float <= {MAX_SM_SCALE:g}, got {sm_scale!r}")
        if q_data_type not in Q_DTYPES:
            raise ArgumentTypeError(f"q_data_type: expected one of {list(Q_DTYPES)}, got {q_data_type!r}")
        fmt = get_v4_format(kv_format)
        check_positive_int("window_topk", window_topk)
        check_positive_int("window_page_size", window_page_size)
        if isinstance(compressed_topk, bool) or not isinstance(compressed_topk, int) or compressed_topk < 0:
            raise ValueError(f"compressed_topk: expected an int >= 0 (0: no compressed rows), got {compressed_topk!r}")
        if compressed_topk == 0 and (compressed_page_size is not None or num_compressed_pages is not None):
            raise ValueError("compressed_page_size/num_compressed_pages: a plan without compressed rows "
                             "(compressed_topk=0) takes neither")
        if compressed_topk:
            compressed_page_size = window_page_size if compressed_page_size is None else compressed_page_size
            check_positive_int("compressed_page_size", compressed_page_size)
        for name, v in (("num_window_pages", num_window_pages), ("num_compressed_pages", num_compressed_pages),
                        ("num_splits", num_splits), ("min_split", min_split)):
            if v is not None:
                check_positive_int(name, v)
        if num_splits is not None and self._invariant_chunk is not None:
            raise ValueError(f"num_splits: the batch-invariant mode cuts each row by invariant_chunk "
                             f"({self._invariant_chunk} entries), not a split count; expected None, got {num_splits}")
        unknown = set(kernel_options) - {"block_h", "block_n", "num_warps", "num_stages"}
        if unknown:
            raise TypeError(f"plan: unknown keyword(s) {sorted(unknown)}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        choice = select(v4_question(num_heads, fmt, q_data_type, device, window_topk + compressed_topk,
                                    batch_invariant=self._invariant_chunk is not None), self._backend)
        if isinstance(choice, Refusal):
            raise refusal_error(choice)
        backend = choice.backend
        p = V4Plan(num_heads, float(sm_scale), q_data_type, fmt, window_topk, window_page_size, compressed_topk,
                   compressed_page_size, num_window_pages, num_compressed_pages, device, backend, num_splits,
                   min_split)
        if self._invariant_chunk is not None:
            if backend not in INVARIANT_BACKENDS:   # "auto" in this mode: only the builds that honour it
                backend = p.backend = "triton"
            self._keep_workspace(p)
        if backend == "triton":
            from .backends import v4_triton
            v4_triton.prepare(p, kernel_options)
        elif backend == "gluon":
            from .backends import v4_gluon
            v4_gluon.prepare(p, kernel_options)
        elif kernel_options:
            raise TypeError(f"plan: kernel options {sorted(kernel_options)} are for the triton backend, not "
                            f"{backend!r}")
        self._plan = p

    def _keep_workspace(self, p: V4Plan) -> None:
        """The batch-invariant mode: the new plan takes over the last plan's split workspace (same heads and
        device) and the list that keeps the replaced ones alive, so a CUDA graph captured before a re-plan still
        replays on live memory."""
        p.invariant_chunk = self._invariant_chunk
        p.retired = self._retired
        old = self._plan
        if old is not None and old.part_o is not None:
            if (old.num_heads, old.device) == (p.num_heads, p.device):
                p.part_o, p.part_lse = old.part_o, old.part_lse
            else:
                self._retired.append((old.part_o, old.part_lse))

    @property
    def batch_invariant(self) -> bool:
        """Whether this object runs in the batch-invariant mode (constructor's ``batch_invariant``)."""
        return self._invariant_chunk is not None

    @property
    def backend(self) -> str:
        """The backend the last plan chose."""
        return self._require_plan().backend

    def splits_for(self, num_tokens: int) -> int:
        """Programs each token's keys are split over in a call with ``num_tokens`` query tokens."""
        p = self._require_plan()
        if p.backend not in ("triton", "gluon"):
            return 1
        from .backends import v4_gluon, v4_triton
        return (v4_gluon if p.backend == "gluon" else v4_triton).splits(p, num_tokens)

    def _require_plan(self) -> V4Plan:
        if self._plan is None:
            raise RuntimeError("run: plan() has not been called")
        return self._plan

    # -- run ------------------------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, window_pool: torch.Tensor, window_indices: torch.Tensor, *,
            window_lengths: torch.Tensor | None = None, compressed_pool: torch.Tensor | None = None,
            compressed_indices: torch.Tensor | None = None, compressed_lengths: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, return_lse_base_on_e: bool = False):
        """Attention of every query token over the keys its two index rows name.

        Args:
            q: ``[n, H, 512]`` in the planned dtype (448 NoPE + 64 RoPE, RoPE already applied).
            window_pool: the window pool (shapes in ``fp8mla.formats_v4``); window_indices: int32
                ``[n, window_topk]`` global slots ``page * page_size + offset``, -1 = none; window_lengths: int32
                ``[n]`` (entries at or past a token's length are ignored, FlashMLA's ``topk_length``) or None.
            compressed_pool, compressed_indices ``[n, compressed_topk]``, compressed_lengths: the same for the
                compressed rows (FlashMLA's ``extra_k_cache`` / ``extra_indices`` / ``extra_topk_length``);
                all None for a plan with ``compressed_topk=0``.
            sinks: fp32 ``[H]`` per-head sink logits (natural-log units, as the checkpoint's ``sinks``) or None.
            out: ``[n, H, 512]`` query dtype, written in place; lse: ``[n, H]`` fp32.
            return_lse: return ``(out, lse)``; return_lse_base_on_e: lse in natural log (default base 2).
        Returns:
            ``out`` or ``(out, lse)``; lse is ``log sum exp`` over the keys *and the sink*. A row with no valid
            key gives out 0 and lse -inf, or with a sink out 0 and lse = the sink (in the reported base).
            Index entries outside a pool are skipped like -1 (``FP8MLA_CHECK=1`` raises instead).
        """
        p = self._require_plan()
        dev, H = p.device, p.num_heads
        check_tensor("q", q, dtype=p.q_dtype, ndim=3, device=dev)
        n = q.shape[0]
        check_tensor("q", q, shape=(n, H, HEAD_DIM))
        _contiguous_last("q", q)
        window = _segment("window", p, window_pool, window_indices, window_lengths, p.window_topk,
                          p.window_page_size, p.num_window_pages, n)
        compressed = None
        if p.compressed_topk == 0:
            for name, v in (("compressed_pool", compressed_pool), ("compressed_indices", compressed_indices),
                            ("compressed_lengths", compressed_lengths)):
                if v is not None:
                    raise ValueError(f"{name}: the plan has no compressed rows (compressed_topk=0); expected None")
        else:
            for name, v in (("compressed_pool", compressed_pool), ("compressed_indices", compressed_indices)):
                if v is None:
                    raise ValueError(f"{name}: the plan has compressed rows (compressed_topk={p.compressed_topk});"
                                     " expected a tensor, got None")
            compressed = _segment("compressed", p, compressed_pool, compressed_indices, compressed_lengths,
                                  p.compressed_topk, p.compressed_page_size, p.num_compressed_pages, n)
        if sinks is not None:
            check_tensor("sinks", sinks, dtype=torch.float32, shape=(H,), device=dev)
            if sinks.stride(0) != 1:
                sinks = sinks.contiguous()
        if out is None:
            out = torch.empty(n, H, HEAD_DIM, dtype=p.q_dtype, device=dev)
        else:
            check_tensor("out", out, dtype=p.q_dtype, shape=(n, H, HEAD_DIM), device=dev)
            _contiguous_last("out", out)
        if lse is None:
            lse = torch.empty(n, H, dtype=torch.float32, device=dev)
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(n, H), device=dev)
        if debug_checks() and n:
            for name, seg, topk in (("window", window, p.window_topk), ("compressed", compressed, p.compressed_topk)):
                if seg is not None:
                    _check_values(name, seg, topk)
        if n:
            from .backends import v4_gluon, v4_torch, v4_triton
            mod = {"triton": v4_triton, "gluon": v4_gluon}.get(p.backend, v4_torch)
            mod.run(p, q, window, compressed, sinks, out, lse, bool(return_lse_base_on_e))
        return (out, lse) if return_lse else out


def _invariant_chunk(batch_invariant, invariant_chunk, backend: str) -> int | None:
    """The constructor's batch-invariant arguments: the chunk of the mode's cut, or None (the default mode)."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
    if not batch_invariant:
        if invariant_chunk is not None:
            raise ValueError("invariant_chunk: an option of the batch-invariant mode; pass batch_invariant=True "
                             "with it")
        return None
    if backend != "auto" and backend not in INVARIANT_BACKENDS:
        raise ValueError(f"batch_invariant: backend {backend!r} does not cut a row by the row alone; use one of "
                         f"{INVARIANT_BACKENDS} (or 'auto', which picks one in this mode)")
    return check_chunk("invariant_chunk", V4_INVARIANT_CHUNK if invariant_chunk is None else invariant_chunk)


def _contiguous_last(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")


def _segment(name: str, p: V4Plan, pool, indices, lengths, topk: int, page_size: int, num_pages, n: int):
    check_tensor(f"{name}_pool", pool, device=p.device)
    try:
        _, view = pool_geometry(p.fmt, pool, page_size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}_pool: {str(e).removeprefix('pool: ')}") from None
    if num_pages is not None and view.shape[0] != num_pages:
        raise ValueError(f"{name}_pool: expected {num_pages} pages (plan's num_{name}_pages), got {view.shape[0]}")
    check_tensor(f"{name}_indices", indices, dtype=torch.int32, shape=(n, topk), device=p.device)
    _contiguous_last(f"{name}_indices", indices)
    if lengths is not None:
        check_tensor(f"{name}_lengths", lengths, dtype=torch.int32, shape=(n,), device=p.device)
        if lengths.numel() and lengths.stride(0) != 1:
            lengths = lengths.contiguous()
    return PoolSegment(view, page_size, view.shape[0], indices, lengths)


def _check_values(name: str, seg: PoolSegment, topk: int) -> None:
    """``FP8MLA_CHECK=1``: index and length values on the host (one sync). The kernels skip out-of-pool entries
    like -1 and clamp lengths to the row, so without this check a wrong value drops keys silently."""
    num_slots = seg.num_pages * seg.page_size
    bad = (seg.indices < -1) | (seg.indices >= num_slots)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"{name}_indices: expected slots in [0, {num_slots}) or -1, got {name}_indices[{t}, {j}] "
                         f"= {int(seg.indices[t, j])}")
    if seg.lengths is not None:
        badl = (seg.lengths < 0) | (seg.lengths > topk)
        if bool(badl.any()):
            t = int(torch.nonzero(badl)[0, 0])
            raise ValueError(f"{name}_lengths: expected lengths in [0, {topk}] ({name}_topk), got "
                             f"{name}_lengths[{t}] = {int(seg.lengths[t])}")



def write_v4_pool(kv_format, pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, *,
                  page_size: int | None = None, backend: str = "auto") -> None:
    """Quantize rows ``kv [T, 512]`` into ``pool`` at token slots ``slots [T]`` (saturating; the bytes of
    ``fp8mla.formats_v4``). ``backend``: ``"triton"`` (the write kernel ``kernels/quant_v4.py``), ``"torch"``
    (``V4Format.write``: the same bytes) or ``"auto"`` (triton where it runs, else torch). The slots are
    checked on the host (one sync): a write outside the pool would corrupt another layer's memory."""
    from .formats_v4 import _check_slots
    from .runtime import triton_usable
    fmt = get_v4_format(kv_format)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    page_size, view = pool_geometry(fmt, pool, page_size)
    use_triton = backend == "triton" or (backend == "auto" and triton_usable(pool.device))
    if not use_triton:
        fmt.write(pool, slots, kv, page_size=page_size)
        return
    check_tensor("kv", kv, device=pool.device)
    _check_slots(slots, kv, view.shape[0] * page_size)
    from .kernels.quant_v4 import quant_v4
    quant_v4(fmt, view, page_size, slots, kv)
