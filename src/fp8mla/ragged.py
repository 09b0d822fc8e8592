"""MLARaggedPrefill: varlen prefill attention over freshly computed (16-bit) K/V, and LSE merging of states.

DeepSeek-style MLA prefill decompresses the latents of the new tokens into per-head K (``head_dim_qk`` 192 =
128 nope + 64 rope) and V (``head_dim_vo`` 128), runs ordinary causal attention over them (this module), and
combines the result with attention over the cached prefix (paged, or gathered chunks) with :func:`merge_state`.

Drop-in for FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (plan()/run()) and ``merge_state``.
States are ``(v [n, H, D], s [n, H])`` with ``s`` the log-sum-exp in base 2 (FlashInfer's convention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_indptr, check_positive_int, check_tensor, plain_number
from ._softmax import softmax_rows
from .runtime import LOG2E, interpreting, triton_usable

__all__ = ["MLARaggedPrefill", "merge_state", "merge_state_in_place"]

Q_DTYPES = (torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton")
MAX_TRITON_HEAD_DIM = 256
_TORCH_SCORE_BYTES = 256 << 20  # fp32 scores held at once by the torch backend (queries are chunked to fit)


def _choose_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = triton_usable(device)
    if backend == "triton":
        if not usable:
            raise RuntimeError(f"backend: 'triton' cannot run on {device} here (needs triton and a CUDA device, "
                               "or TRITON_INTERPRET=1 on the CPU)")
        return "triton"
    return "triton" if usable and device.type == "cuda" else "torch"


def _fp32_dot() -> bool:
    # The interpreter computes tl.dot on bf16/fp16 wrongly without error: do the dots in fp32 there.
    return interpreting()


@dataclass
class _RaggedPlan:
    batch_size: int
    num_qo: int
    num_kv: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    backend: str
    qo: list           # host copies of the indptrs (torch backend)
    kv: list
    max_qo_len: int
    qo_indptr: torch.Tensor  # int32 on the device (triton backend)
    kv_indptr: torch.Tensor


class MLARaggedPrefill:
    """Batch prefill attention over ragged (concatenated, unpaged) 16-bit K/V.

    Args:
        float_workspace_buffer: optional tensor; only its device is used.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"torch"`` or ``"triton"``.

    Example:
        >>> import torch
        >>> from fp8mla.ragged import MLARaggedPrefill
        >>> w = MLARaggedPrefill(backend="torch")
        >>> indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
        >>> w.plan(indptr, indptr, 4, 4, 192, 128, causal=True, sm_scale=192 ** -0.5,
        ...        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        >>> q = torch.randn(8, 4, 192, dtype=torch.bfloat16)
        >>> k = torch.randn(8, 4, 192, dtype=torch.bfloat16)
        >>> v = torch.randn(8, 4, 128, dtype=torch.bfloat16)
        >>> out, lse = w.run(q, k, v, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([8, 4, 128]), torch.Size([8, 4]))
    """

    def __init__(self, float_workspace_buffer: torch.Tensor | None = None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if float_workspace_buffer is not None:
            check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._workspace = float_workspace_buffer
        self._backend = backend
        self._plan: _RaggedPlan | None = None

    @property
    def backend(self) -> str | None:
        """The backend chosen by the last plan() (None before the first plan)."""
        return None if self._plan is None else self._plan.backend

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, head_dim_vo: int | None = None, causal: bool = False,
             sm_scale: float | None = None, q_data_type: torch.dtype = torch.bfloat16,
             kv_data_type: torch.dtype | None = None) -> None:
        """Plan a batch.

        Args:
            qo_indptr: ``[B + 1]`` int32/int64; request b owns queries ``qo_indptr[b]:qo_indptr[b+1]``.
            kv_indptr: ``[B + 1]`` int32/int64; request b owns keys/values ``kv_indptr[b]:kv_indptr[b+1]``.
            num_qo_heads, num_kv_heads: heads of q and of k/v (GQA: num_qo_heads a multiple of num_kv_heads).
            head_dim_qk, head_dim_vo: widths of q/k and of v (DeepSeek: 192 and 128; default vo = qk).
            causal: query i of a request with q queries and L keys sees keys ``<= L - q + i`` (aligned to the end).
            sm_scale: softmax scale (default ``1 / sqrt(head_dim_qk)``).
            q_data_type, kv_data_type: ``torch.bfloat16`` or ``torch.float16`` (kv defaults to q's).
        """
        device = self._workspace.device if self._workspace is not None else qo_indptr.device
        check_indptr("qo_indptr", qo_indptr)
        B = qo_indptr.numel() - 1
        check_indptr("kv_indptr", kv_indptr, B + 1)  # host or device tensors: plan() copies them to the device
        num_qo_heads, num_kv_heads, head_dim_qk = (check_positive_int(name, v) for name, v in (
            ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim_qk", head_dim_qk)))
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        head_dim_vo = check_positive_int("head_dim_vo", head_dim_vo)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads: expected a multiple of num_kv_heads ({num_kv_heads}), got "
                             f"{num_qo_heads}")
        sm_scale = 1.0 / math.sqrt(head_dim_qk) if sm_scale is None else plain_number(sm_scale)
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
                or sm_scale <= 0:
            raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
        if q_data_type not in Q_DTYPES:
            raise TypeError(f"q_data_type: expected one of {list(Q_DTYPES)}, got {q_data_type}")
        kv_data_type = q_data_type if kv_data_type is None else kv_data_type
        if kv_data_type not in Q_DTYPES:
            raise TypeError(f"kv_data_type: expected one of {list(Q_DTYPES)} (fresh K/V; FP8 prefixes go through "
                            f"MLAPagedAttention or gather_dequant), got {kv_data_type}")
        backend = _choose_backend(self._backend, device)
        if backend == "triton" and max(head_dim_qk, head_dim_vo) > MAX_TRITON_HEAD_DIM:
            if self._backend == "triton":
                raise ValueError(f"head_dim_qk/head_dim_vo: the triton backend takes dims <= "
                                 f"{MAX_TRITON_HEAD_DIM}, got {head_dim_qk}/{head_dim_vo}")
            backend = "torch"
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        max_qo = max([qo[b + 1] - qo[b] for b in range(B)], default=0)
        i32 = dict(dtype=torch.int32, device=device)
        self._plan = _RaggedPlan(B, qo[-1], kv[-1], num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                                 bool(causal), float(sm_scale), q_data_type, kv_data_type, device, backend, qo, kv,
                                 max_qo, qo_indptr.to(**i32), kv_indptr.to(**i32))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False, return_lse_base_on_e: bool = False):
        """Attention for the planned batch.

        Args:
            q: ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` in the planned query dtype.
            k: ``[kv_indptr[-1], num_kv_heads, head_dim_qk]``, v: ``[kv_indptr[-1], num_kv_heads, head_dim_vo]``
                in the planned kv dtype. Rows may be strided; the last dimension must be contiguous.
            out: optional ``[n, num_qo_heads, head_dim_vo]`` query-dtype buffer; lse: optional ``[n, H]`` fp32.
        Returns:
            ``out`` or ``(out, lse)``; lse is base 2 unless ``return_lse_base_on_e``. A query that sees no key
            (kv_len 0, or causal with more queries than keys) gets 0 and lse ``-inf``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("run: call plan() first")
        n, Hq, Hk = p.num_qo, p.num_qo_heads, p.num_kv_heads
        check_tensor("q", q, dtype=p.q_dtype, shape=(n, Hq, p.head_dim_qk), device=p.device)
        check_tensor("k", k, dtype=p.kv_dtype, shape=(p.num_kv, Hk, p.head_dim_qk), device=p.device)
        check_tensor("v", v, dtype=p.kv_dtype, shape=(p.num_kv, Hk, p.head_dim_vo), device=p.device)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.numel() and t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")
        if out is None:
            out = torch.empty(n, Hq, p.head_dim_vo, dtype=p.q_dtype, device=p.device)
        else:
            check_tensor("out", out, dtype=p.q_dtype, shape=(n, Hq, p.head_dim_vo), device=p.device)
        if lse is None:
            lse = torch.empty(n, Hq, dtype=torch.float32, device=p.device)
        else:
            check_tensor("lse", lse, dtype=torch.float32, shape=(n, Hq), device=p.device)
        if n:
            if p.backend == "triton":
                from .kernels.ragged import ragged_prefill
                ragged_prefill(q, k, v, p.qo_indptr, p.kv_indptr, out, lse, sm_scale=p.sm_scale, causal=p.causal,
                               max_qo_len=p.max_qo_len, fp32_dot=_fp32_dot())
            else:
                _ragged_torch(p, q, k, v, out, lse)
            if return_lse_base_on_e:
                lse.mul_(1.0 / LOG2E)
        return (out, lse) if return_lse else out


def _ragged_torch(p: _RaggedPlan, q, k, v, out, lse) -> None:
    """fp32 attention per request; writes ``out`` and ``lse`` (base 2). Queries are chunked so the fp32 scores
    held at once stay under ``_TORCH_SCORE_BYTES``."""
    Hq, Hk = p.num_qo_heads, p.num_kv_heads
    G = Hq // Hk
    for b in range(p.batch_size):
        q0, q1, k0, k1 = p.qo[b], p.qo[b + 1], p.kv[b], p.kv[b + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0:
            continue
        if nk == 0:
            out[q0:q1] = 0
            lse[q0:q1] = -math.inf
            continue
        kb = k[k0:k1].float()                                               # [nk, Hk, Dqk]
        vb = v[k0:k1].float()                                               # [nk, Hk, Dvo]
        chunk = max(1, _TORCH_SCORE_BYTES // (4 * Hq * nk))
        for c0 in range(0, nq, chunk):
            c1 = min(nq, c0 + chunk)
            qc = q[q0 + c0: q0 + c1].float().view(c1 - c0, Hk, G, -1)      # [c, Hk, G, Dqk]
            s = torch.einsum("chgd,khd->chgk", qc, kb) * p.sm_scale
            if p.causal:
                last = nk - nq + torch.arange(c0, c1, device=s.device)   # last visible key per query
                hidden = torch.arange(nk, device=s.device)[None, :] > last[:, None]
                s = s.masked_fill(hidden[:, None, None, :], -math.inf)
            o, ls = softmax_rows(s, vb.permute(1, 0, 2)[None])                # [c, Hk, G, Dvo]
            ls = ls * LOG2E
            out[q0 + c0: q0 + c1] = o.reshape(c1 - c0, Hq, -1).to(out.dtype)
            lse[q0 + c0: q0 + c1] = ls.reshape(c1 - c0, Hq)


# -- merging states -------------------------------------------------------------------------------------------
def _check_state(v_a, s_a, v_b, s_b, names=("v_a", "s_a", "v_b", "s_b")):
    check_tensor(names[0], v_a, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    n, H, D = v_a.shape
    check_tensor(names[1], s_a, dtype=torch.float32, shape=(n, H), device=v_a.device)
    check_tensor(names[2], v_b, dtype=v_a.dtype, shape=(n, H, D), device=v_a.device)
    check_tensor(names[3], s_b, dtype=torch.float32, shape=(n, H), device=v_a.device)
    for name, t in zip(names, (v_a, s_a, v_b, s_b)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")


def _merge_torch(v_a, s_a, v_b, s_b, v_out, s_out) -> None:
    # An empty state (s = -inf) has weight 0; when both are empty the max is -inf, so shift by 0 instead.
    # A NaN s is not empty: its NaN weight makes the merged row NaN (fmax skips it, the weights carry it).
    m = torch.fmax(s_a, s_b)
    m = torch.where(m == -math.inf, 0.0, m)
    w_a, w_b = torch.exp2(s_a - m), torch.exp2(s_b - m)
    tot = w_a + w_b
    empty = tot == 0
    inv = 1.0 / torch.where(empty, 1.0, tot)
    # 0-weight x NaN/inf in an empty state's v must not leak: an empty state's v is ignored entirely.
    v = torch.where((s_a == -math.inf)[..., None], 0.0, v_a.float() * (w_a * inv)[..., None]) \
        + torch.where((s_b == -math.inf)[..., None], 0.0, v_b.float() * (w_b * inv)[..., None])
    s = torch.where(empty, -math.inf, m + torch.log2(torch.where(empty, 1.0, tot)))
    v_out.copy_(v)
    s_out.copy_(s)


def _merge(v_a, s_a, v_b, s_b, v_out, s_out, backend: str) -> None:
    if s_a.numel() == 0:
        return
    # A value dimension of 0 still has log-sum-exps to merge (returning early left them uninitialized); the
    # kernel's tiles need D >= 1, and with nothing to move the torch code is as fast.
    if v_a.shape[-1] and _choose_backend(backend, v_a.device) == "triton":
        from .kernels.merge_state import merge_state as _merge_triton
        _merge_triton(v_a, s_a, v_b, s_b, v_out, s_out)
    else:
        _merge_torch(v_a, s_a, v_b, s_b, v_out, s_out)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of the union of two disjoint key sets from the states over each.

    Args:
        v_a, v_b: ``[n, H, D]`` (bf16/fp16/fp32, same dtype) attention outputs over each key set.
        s_a, s_b: ``[n, H]`` fp32 log-sum-exp, base 2. ``-inf`` marks an empty state (no keys); merging with an
            empty state returns the other one, two empty states give ``v = 0, s = -inf``. A NaN in either state
            gives a NaN row (never the other state alone).
    Returns:
        ``(v [n, H, D] in v_a's dtype, s [n, H] fp32 base 2)``:
        ``s = log2(2^s_a + 2^s_b)``, ``v = (2^s_a v_a + 2^s_b v_b) / 2^s``.
    """
    _check_state(v_a, s_a, v_b, s_b)
    v = torch.empty_like(v_a)
    s = torch.empty_like(s_a)
    _merge(v_a, s_a, v_b, s_b, v, s, backend)
    return v, s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, *,
                         backend: str = "auto") -> None:
    """:func:`merge_state` of ``(v, s)`` with ``(v_other, s_other)``, written into ``v`` and ``s``."""
    _check_state(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    _merge(v, s, v_other, s_other, v, s, backend)
