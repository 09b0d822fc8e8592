"""gather_dequant: the tokens of given requests, gathered from the paged pool and dequantized into a contiguous
workspace sized by the tokens used (never by the pool).

This is the "gather-then-cast" strategy done right: a request's prefix chunk is read once from its pages and
written as 16-bit rows, e.g. to run :class:`fp8mla.ragged.MLARaggedPrefill` (after the up-projection) over it.
It replaces ``pool.to(torch.bfloat16)``, which converts every page of the pool on every layer.
"""
from __future__ import annotations

import torch

from ._checks import INDEX_DTYPES, check_indptr, check_kv_lengths, check_page_ids, check_tensor, plain_number
from .runtime import triton_usable

__all__ = ["gather_dequant", "token_slots"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STORAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16)


def token_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor, page_size: int,
                num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot ids (``page * page_size + slot``, int64 ``[T]``) of every request's tokens in order, and the
    int32 ``token_indptr [B + 1]`` of the rows. Runs on the tensors' device, no host sync."""
    dev = kv_len_arr.device
    B = kv_len_arr.numel()
    lens = kv_len_arr.long()
    token_indptr = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lens, 0, out=token_indptr[1:])
    req = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=num_tokens)
    pos = torch.arange(num_tokens, device=dev) - token_indptr[req]
    page = kv_indices.long()[kv_indptr.long()[req] + torch.div(pos, page_size, rounding_mode="floor")]
    return page * page_size + pos % page_size, token_indptr.to(torch.int32)


def gather_dequant(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, kv_len_arr: torch.Tensor, *, ckv_scale: float = 1.0,
                   kpe_scale: float = 1.0, ckv_scale_arr: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16, out_ckv: torch.Tensor | None = None,
                   out_kpe: torch.Tensor | None = None, backend: str = "auto"):
    """Gather and dequantize the ``kv_len_arr[b]`` tokens of each request b.

    Args:
        ckv_cache: ``[P, page, Dc]``, kpe_cache: ``[P, page, Dk]`` storage (fp8 e4m3/e5m2, bf16, fp16); strided views
            of one ``[P, page, Dc + Dk]`` pool are fine (the last dimension must be contiguous).
        kv_indptr: ``[B + 1]`` int32/int64 into ``kv_indices``; kv_indices: page ids; kv_len_arr: ``[B]`` tokens.
        ckv_scale, kpe_scale: per-tensor scales (real = stored x scale); ckv_scale_arr: ``[P, page, Dc // 128]``
            fp32 group scales (then ``ckv_scale`` must stay 1).
        dtype: output dtype (bf16, fp16 or fp32).
        out_ckv, out_kpe: optional ``[>= T, Dc]`` / ``[>= T, Dk]`` buffers of ``dtype`` (both or neither); the
            first T rows are written and returned.
        backend: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.
    Returns:
        ``(ckv [T, Dc], kpe [T, Dk], token_indptr [B + 1] int32)`` with T = ``sum(kv_len_arr)``; request b's
        tokens are rows ``token_indptr[b]:token_indptr[b+1]``.
    """
    check_tensor("ckv_cache", ckv_cache, dtype=STORAGE_DTYPES, ndim=3)
    P, page_size, Dc = ckv_cache.shape
    dev = ckv_cache.device
    check_tensor("kpe_cache", kpe_cache, dtype=ckv_cache.dtype, shape=(P, page_size, None), device=dev)
    Dk = kpe_cache.shape[2]
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.stride(-1) != 1 or t.stride(0) != page_size * t.stride(1):
            raise ValueError(f"{name}: expected contiguous pages of rows with a contiguous last dimension "
                             f"(a view of a [P, page, D] pool), got strides {t.stride()}")
    check_indptr("kv_indptr", kv_indptr)
    B = kv_indptr.numel() - 1
    check_tensor("kv_indices", kv_indices, dtype=INDEX_DTYPES, ndim=1, device=dev)
    check_tensor("kv_len_arr", kv_len_arr, dtype=INDEX_DTYPES, shape=(B,), device=dev)
    if kv_indptr.device != dev:
        raise ValueError(f"kv_indptr: expected a tensor on {dev}, got one on {kv_indptr.device}")
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype: expected one of {list(OUT_DTYPES)}, got {dtype}")
    fp8 = ckv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    ckv_scale = 1.0 if ckv_scale is None else plain_number(ckv_scale)  # None: no per-tensor scale (ckv_scale_arr)
    kpe_scale = plain_number(kpe_scale)
    for name, s in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale)):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
            raise ValueError(f"{name}: expected a positive finite float, got {s!r}")
        if not fp8 and s != 1.0:
            raise ValueError(f"{name}: a {ckv_cache.dtype} pool takes no scale (only 1.0), got {s!r}")
    if ckv_scale_arr is not None:
        if not fp8:
            raise ValueError(f"ckv_scale_arr: a {ckv_cache.dtype} pool takes no group scales")
        if Dc % 128:
            raise ValueError(f"ckv_scale_arr: group scales need head_dim_ckv a multiple of 128, got {Dc}")
        check_tensor("ckv_scale_arr", ckv_scale_arr, dtype=torch.float32, shape=(P, page_size, Dc // 128),
                     device=dev)
        if ckv_scale != 1.0:
            raise ValueError(f"ckv_scale: with ckv_scale_arr the c_kv scales are per group, got ckv_scale "
                             f"{ckv_scale!r}")

    # Host checks: a page id outside the pool or a kv_len past a request's pages would read garbage silently.
    lens = check_kv_lengths(kv_indptr, kv_indices.numel(), kv_len_arr, page_size)
    check_page_ids(kv_indptr, kv_indices, kv_len_arr, page_size, num_pages=P)
    T = sum(lens)

    if (out_ckv is None) != (out_kpe is None):
        raise ValueError("out_ckv/out_kpe: pass both buffers or neither")
    if out_ckv is None:
        out_ckv = torch.empty(T, Dc, dtype=dtype, device=dev)
        out_kpe = torch.empty(T, Dk, dtype=dtype, device=dev)
    else:
        for name, t, D in (("out_ckv", out_ckv, Dc), ("out_kpe", out_kpe, Dk)):
            check_tensor(name, t, dtype=dtype, shape=(None, D), device=dev)
            if t.shape[0] < T:
                raise ValueError(f"{name}: expected at least {T} rows (the requests' tokens), got {t.shape[0]}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")
        out_ckv, out_kpe = out_ckv[:T], out_kpe[:T]

    slots, token_indptr = token_slots(kv_indptr, kv_indices, kv_len_arr, page_size, T)
    gather_rows(ckv_cache, kpe_cache, slots, out_ckv, out_kpe, ckv_scale=ckv_scale, kpe_scale=kpe_scale,
                ckv_scale_arr=ckv_scale_arr, backend=backend)
    return out_ckv, out_kpe, token_indptr


def gather_rows(ckv_cache, kpe_cache, slots, out_ckv, out_kpe, *, ckv_scale=1.0, kpe_scale=1.0, ckv_scale_arr=None,
                backend: str = "auto") -> None:
    """The unchecked core of :func:`gather_dequant`: rows ``slots [T]`` (flat slot ids, e.g. from
    :func:`token_slots`) dequantized into ``out_ckv [T, Dc]`` / ``out_kpe [T, Dk]``. No host sync; callers that
    planned the slots once (MLAPagedAttention's gather_cast strategy) call it on every run."""
    T = slots.numel()
    if T == 0:
        return
    dense = ckv_cache.stride(0) == ckv_cache.shape[1] * ckv_cache.stride(1) and \
        kpe_cache.stride(0) == kpe_cache.shape[1] * kpe_cache.stride(1)
    if dense and _use_triton(backend, slots.device):
        from .kernels.gather_dequant import gather_dequant_rows
        gather_dequant_rows(ckv_cache, kpe_cache, slots, out_ckv, out_kpe, ckv_scale=float(ckv_scale),
                            kpe_scale=float(kpe_scale), ckv_scale_arr=ckv_scale_arr)
    else:
        Dc = ckv_cache.shape[-1]
        # Gather first, convert second: only the T referenced rows are ever converted.
        ckv = ckv_cache.flatten(0, 1).index_select(0, slots).float()
        if ckv_scale_arr is not None:
            g = ckv_scale_arr.flatten(0, 1).index_select(0, slots)
            ckv = (ckv.view(T, -1, 128) * g[..., None]).view(T, Dc)
        elif ckv_scale != 1.0:
            ckv = ckv * ckv_scale
        kpe = kpe_cache.flatten(0, 1).index_select(0, slots).float()
        if kpe_scale != 1.0:
            kpe = kpe * kpe_scale
        out_ckv.copy_(ckv)
        out_kpe.copy_(kpe)


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return False
    ok = triton_usable(device)
    if backend == "triton" and not ok:
        raise RuntimeError(f"backend: 'triton' cannot run on {device} here (needs triton and a CUDA device, or "
                           "TRITON_INTERPRET=1 on the CPU)")
    return ok and (backend == "triton" or device.type == "cuda")
