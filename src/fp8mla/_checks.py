"""Argument checks shared by every public entry: each raises with the argument's name, what was expected and
what came, so that a wrong call fails loudly instead of returning a silent wrong answer."""
from __future__ import annotations

import torch


class ArgumentTypeError(TypeError, ValueError):
    """A wrong dtype or type of an argument. Both a TypeError and a ValueError: FlashInfer raises ValueError for
    dtype mismatches, Python code usually TypeError; code that catches either one catches this."""


def check_tensor(name: str, t, *, dtype=None, ndim: int | None = None, shape=None, device=None) -> torch.Tensor:
    """``shape`` may hold ``None`` for dimensions that are free."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list, set)) else (dtype,)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else f"one of {list(allowed)}"
            raise ArgumentTypeError(f"{name}.dtype={t.dtype} does not match: {name}: expected dtype {want}, "
                                    f"got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def same_device(actual, expected) -> bool:
    """Device equality where an index-less device (``"cuda"``) means the current one of its type: a tensor made
    with ``device="cuda"`` reports ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``."""
    a, e = torch.device(actual), torch.device(expected)
    if a.type != e.type:
        return False
    if a.type == "cpu" or a.index == e.index:  # CPU tensors report no index even when made on "cpu:0"
        return True
    current = getattr(getattr(torch, a.type, None), "current_device", lambda: 0)()
    return (a.index if a.index is not None else current) == (e.index if e.index is not None else current)


INDEX_DTYPES = (torch.int32, torch.int64)


def check_indptr(name: str, t, length: int | None = None) -> torch.Tensor:
    """A 1-D int index pointer starting at 0 and never decreasing."""
    check_tensor(name, t, dtype=INDEX_DTYPES, ndim=1)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: expected {length} entries (batch size + 1), got {t.numel()}")
    if t.numel() == 0:
        raise ValueError(f"{name}: expected at least 1 entry (batch size + 1), got 0")
    h = t.tolist()
    if h[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {h[0]}")
    for i in range(1, len(h)):
        if h[i] < h[i - 1]:
            raise ValueError(f"{name}: expected non-decreasing values, got {name}[{i - 1}]={h[i - 1]} > "
                             f"{name}[{i}]={h[i]}")
    return t


def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


def check_page_table(kv_indptr: list, kv_len: list, kv_indices: list, page_size: int,
                     num_pages: int | None = None) -> int:
    """Host check of a page table (plain lists): every request's kv_len fits its pages, and the page ids its
    tokens use are >= 0 (and < ``num_pages`` when given). Returns the largest page id used (-1 when none), for a
    later bound against the pool. A kv_len past a request's pages would read another request's data silently.
    """
    if kv_indptr[-1] > len(kv_indices):
        raise ValueError(f"kv_indices: kv_indptr[-1]={kv_indptr[-1]} but kv_indices has {len(kv_indices)} entries")
    top = -1
    for b, L in enumerate(kv_len):
        have = kv_indptr[b + 1] - kv_indptr[b]
        if L < 0 or L > have * page_size:
            raise ValueError(f"kv_len_arr: request {b} has kv_len {L}, expected 0 <= kv_len <= its {have} pages "
                             f"x page_size {page_size} = {have * page_size}")
        used = kv_indices[kv_indptr[b]: kv_indptr[b] + -(-L // page_size)]
        if used:
            lo, hi = min(used), max(used)
            if lo < 0 or (num_pages is not None and hi >= num_pages):
                bound = ">= 0" if num_pages is None else f"in [0, {num_pages})"
                raise ValueError(f"kv_indices: request {b} references pages in [{lo}, {hi}], expected page ids "
                                 f"{bound}")
            top = max(top, hi)
    return top
