"""Argument checks shared by every public entry: each raises with the argument's name, what was expected and
what came, so that a wrong call fails loudly instead of returning a silent wrong answer."""
from __future__ import annotations

import numbers

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


def as_int(v) -> int | None:
    """``v`` as a Python int when it is an integer scalar: an int, a numpy integer (``np.int64(3)``, what numpy
    arithmetic and ``array[i]`` give) or a 0-d integer tensor on the CPU (``t.sum()``, ``t[0]``); None otherwise.
    Bools are not counts (True is refused). A CUDA scalar is refused too: reading it would sync with the device,
    and the caller should see that cost (``int(t)``)."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral):  # int subclasses and numpy's integers (np.bool_ is not Integral)
        return int(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" and v.dtype != torch.bool \
            and not v.dtype.is_floating_point and not v.dtype.is_complex:
        return int(v)
    return None


def as_real(v) -> float | int | None:
    """``v`` as a Python number when it is a real scalar: an int or float, a numpy number (``np.float32``,
    ``np.int64``) or a 0-d real tensor on the CPU; None otherwise (bools, CUDA scalars, strings)."""
    if type(v) is float or type(v) is int:
        return v
    i = as_int(v)
    if i is not None:
        return i
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu" and v.dtype.is_floating_point:
        return float(v)
    return None


def plain_number(v):
    """``v`` as a Python int or float when it is a real scalar (:func:`as_real`), else ``v`` itself, for the check
    that follows to refuse in its own words."""
    r = as_real(v)
    return v if r is None else r


def check_int(name: str, v, lo: int = 0, what: str = "a non-negative int") -> int:
    """``v`` as a Python int >= ``lo`` (ints, numpy integers and 0-d CPU integer tensors), else a ValueError
    naming ``name``: ``expected {what}, got {v!r}``."""
    i = as_int(v)
    if i is None or i < lo:
        raise ValueError(f"{name}: expected {what}, got {v!r}")
    return i


def check_positive_int(name: str, v) -> int:
    return check_int(name, v, 1, "a positive int")


INT32_MAX = 2**31 - 1


def check_indptr_values(name: str, h: torch.Tensor) -> None:
    """The values of an index pointer tensor (vectorized): starts at 0, never decreases."""
    if int(h[0]) != 0:
        raise ValueError(f"{name}: expected to start at 0, got {int(h[0])}")
    d = h[1:] - h[:-1]
    if bool((d < 0).any()):
        i = int(torch.nonzero(d < 0)[0])
        raise ValueError(f"{name}: expected non-decreasing values, got {name}[{i}]={int(h[i])} > "
                         f"{name}[{i + 1}]={int(h[i + 1])}")


def check_kv_lengths(kv_indptr: torch.Tensor, num_indices: int, kv_len: torch.Tensor, page_size: int,
                     active: torch.Tensor | None = None, len_name: str = "kv_len_arr") -> list:
    """A page table's shape of values (vectorized): kv_indptr is an index pointer into the ``num_indices`` page
    ids, and every kv_len fits its pages (rows where ``active``, when given). A kv_len past a request's pages would
    read another request's pages silently. Returns kv_len as a list (O(batch))."""
    check_indptr_values("kv_indptr", kv_indptr)
    if int(kv_indptr[-1]) > num_indices:
        raise ValueError(f"kv_indices: kv_indptr[-1]={int(kv_indptr[-1])} but kv_indices has "
                         f"{num_indices} entries")
    have = (kv_indptr[1:] - kv_indptr[:-1]).long()
    L = kv_len.long()
    bad = (L < 0) | (L > have * page_size)
    if active is not None:
        bad &= active.to(bad.device)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"{len_name}: request {b} has kv_len {int(L[b])}, expected 0 <= kv_len <= its "
                         f"{int(have[b])} pages x page_size {page_size} = {int(have[b]) * page_size}")
    return L.tolist()


def _pages_needed(kv_len: torch.Tensor, page_size: int, active) -> torch.Tensor:
    need = torch.div(kv_len.long() + page_size - 1, page_size, rounding_mode="floor")
    return need if active is None else need * active.to(need.device)


def used_page_bounds(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, page_size: int,
                     active: torch.Tensor | None = None) -> tuple[int, int] | None:
    """(smallest, largest) page id that a token uses (rows where ``active``), None when no token uses a page.
    For a table that passed :func:`check_kv_lengths`.

    Vectorized over the listed ids, in as few passes as the table allows: one min/max when every request lists
    exactly the pages its tokens need (the usual table: ~0.03 ms for 524K int32 ids on one CPU core); otherwise the
    listed ids past each kv_len (a padded block table's tails, rows without queries) are masked first, by a running
    sum of +1 at each request's first page and -1 past its last used one. Ids that no token uses are never
    bounded: engines leave any value there."""
    need = _pages_needed(kv_len, page_size, active)
    starts = kv_indptr.long()
    n = int(starts[-1])
    if n == 0 or not bool(need.any()):
        return None
    listed = kv_indices[:n]
    if bool((need == starts[1:] - starts[:-1]).all()):
        lo, hi = torch.aminmax(listed)
    else:
        # int8 marks: the ranges are disjoint, so the running sum is 0 or 1 and reads as the bool mask as it is
        # (small temporaries: on a busy CPU their first touch, page by page, is what costs)
        ones = torch.ones_like(need, dtype=torch.int8)
        mark = torch.zeros(n + 1, dtype=torch.int8, device=listed.device)
        mark.index_add_(0, torch.cat([starts[:-1], starts[:-1] + need]), torch.cat([ones, -ones]))
        used = torch.cumsum(mark[:n], 0, dtype=torch.int8).view(torch.bool)
        # unused ids read as 0: at least one id is used, so a used id < 0 still sets the minimum, and when none
        # is, the maximum is the largest used id
        lo, hi = torch.aminmax(torch.where(used, listed, 0))
    return int(lo), int(hi)


def used_pages(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, page_size: int,
               active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id of every token's page, the request of each), vectorized; O(pages used) int64 work, so only the
    error path of :func:`check_page_ids` runs it (to name the request)."""
    dev = kv_indices.device
    need = _pages_needed(kv_len, page_size, active).to(dev)
    total = int(need.sum())
    B = kv_len.numel()
    req = torch.repeat_interleave(torch.arange(B, device=dev), need, output_size=total)
    start = torch.zeros(B + 1, dtype=torch.long, device=dev)
    torch.cumsum(need, 0, out=start[1:])
    pos = kv_indptr.long().to(dev)[req] + torch.arange(total, device=dev) - start[req]
    return kv_indices.long()[pos], req


def check_page_ids(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, page_size: int,
                   active: torch.Tensor | None = None, *, num_pages: int | None = None,
                   name: str = "kv_indices") -> int:
    """Every page id a token uses is >= 0 and < 2**31 (int32), and < ``num_pages`` when given (vectorized; for a
    table that passed :func:`check_kv_lengths`). Returns the largest page id used (-1 when none), for a later
    bound against the pool. A page id outside the pool would read another request's data or garbage silently."""
    limit = INT32_MAX + 1 if num_pages is None else min(num_pages, INT32_MAX + 1)
    bounds = used_page_bounds(kv_indptr, kv_indices, kv_len, page_size, active)
    if bounds is None:
        return -1
    lo, hi = bounds
    if lo >= 0 and hi < limit:
        return hi
    used, req = used_pages(kv_indptr, kv_indices, kv_len, page_size, active)
    i = int(torch.nonzero((used < 0) | (used >= limit))[0])
    bound = "< 2**31 (int32)" if num_pages is None or num_pages > INT32_MAX else f"< {num_pages} (the pool's pages)"
    raise ValueError(f"{name}: request {int(req[i])} references page {int(used[i])}, expected page ids >= 0 and "
                     f"{bound}")
