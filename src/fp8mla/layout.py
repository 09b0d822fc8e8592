"""PagedLayout: one batch's page table, validated once, held as device tensors.

Where a page table is made, checked and read (data flows one way: cache -> layout -> backend -> kernel):

- made by :meth:`PagedLayout.from_csr` (FlashInfer's ``qo_indptr, kv_indptr, kv_indices, kv_len_arr``, what
  :meth:`MLAPagedAttention.plan` receives), :meth:`PagedLayout.from_block_table` (vLLM's padded
  ``block_table [B, max_pages]``, used as is) or :meth:`fp8mla.PagedMLACache.layout` (the cache's own sequences);
- checked here, once: shapes and dtypes always; the values only where reading them costs no device-to-host
  sync (CPU tensors, which is what the cache and the engine adapters pass for the O(batch) arrays). Device-only
  tables are guarded on the device instead: the kernels never read a page id outside the pool, and
  ``FP8MLA_CHECK=1`` checks them fully (with a sync) for debugging;
- read by the backends (``fp8mla.backends``): each takes the device tensors, and the host facts when they are
  known (``qo_lens``, ``kv_lens``, ``max_qo_len``). Token slots (page * page_size + offset) are computed only when
  a backend asks (:meth:`token_slots`).

Host work is O(batch) Python plus vectorized torch ops; nothing here loops over tokens or pages in Python.
"""
from __future__ import annotations

import functools
import os
import struct
from array import array
from dataclasses import dataclass, field

import torch

from ._checks import (INDEX_DTYPES, INT32_MAX, as_int, check_indptr_values, check_kv_lengths, check_page_ids,
                      check_positive_int, check_tensor)

__all__ = ["PagedLayout"]


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without a sync: CUDA gets it through pinned memory, asynchronously (the caching
    host allocator keeps the pinned block until the copy has run, so the caller may drop it)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def host_ints(values: list, dtype=torch.int32, pin: bool = False) -> torch.Tensor:
    """A 1-D int32/int64 host tensor of a list of ints, pinned when ``pin`` (to stage it for an asynchronous
    host -> device copy). Through ``array``: ~3x faster than ``torch.tensor(list)`` (which converts int by int),
    and this runs on every decode step's plan."""
    if not values:
        return torch.zeros(0, dtype=dtype, pin_memory=pin)
    t = torch.frombuffer(array("i" if dtype == torch.int32 else "q", values), dtype=dtype)
    return t.pin_memory() if pin else t


def pack_ints(segments, code: str = "i", fmt: list | None = None, vals: list | None = None) -> tuple[list, list]:
    """Add ``[(list of ints, capacity), ...]`` to a ``struct`` format and its values, each list zero-padded to its
    capacity (pad bytes, never ints); ``code`` is "i" (int32) or "q" (int64). Returns ``(fmt, vals)``: continue
    with more segments, then :func:`packed`. ``struct`` converts ~3x faster than ``array(code, list)`` (which
    converts int by int): the decode runner stages ~1,000 ints every step this way."""
    fmt = ["="] if fmt is None else fmt
    vals = [] if vals is None else vals
    size = 4 if code == "i" else 8
    for v, cap in segments:
        n = len(v)
        if n > cap:
            raise ValueError(f"pack_ints: {n} values for a segment of capacity {cap}")
        if n:
            fmt.append(f"{n}{code}")
            vals += v
        if cap > n:
            fmt.append(f"{(cap - n) * size}x")
    return fmt, vals


def packed(fmt: list, vals: list, dtype=torch.int32, pin: bool = False) -> torch.Tensor:
    """The host tensor (``dtype``, pinned when ``pin``) of a :func:`pack_ints` format and values."""
    f = "".join(fmt)
    buf = bytearray(struct.calcsize(f))
    if not buf:
        return torch.zeros(0, dtype=dtype)
    struct.pack_into(f, buf, 0, *vals)
    t = torch.frombuffer(buf, dtype=dtype)
    return t.pin_memory() if pin else t


def stage_ints(segments, dtype=torch.int32, pin: bool = False) -> torch.Tensor:
    """``[(list of ints, capacity), ...]`` -> one flat host tensor, each list zero-padded to its capacity (the
    layout of a backend's flat graph buffer), pinned when ``pin``. The padding is written as bytes, not ints."""
    return packed(*pack_ints(segments, "i" if dtype == torch.int32 else "q"), dtype=dtype, pin=pin)


def int32_saturated(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32, values outside int32 clamped to its range instead of wrapped: a page id ``p + 2**32`` stays
    out of the pool (the kernels never read it) instead of becoming page ``p``. No sync; int32 comes as it is."""
    if t.dtype == torch.int32:
        return t
    return t.clamp(-INT32_MAX - 1, INT32_MAX).to(torch.int32)


@functools.lru_cache(maxsize=1)
def _cuda_devices() -> int:
    # Asked once: the cache's host tables plan onto its CUDA device every step.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device, tensor: torch.Tensor) -> torch.device:
    """The layout's device: ``device`` (``tensor``'s when None), ``"cuda"`` resolved to the current index. A CUDA
    device asked for where torch has none is refused by name (torch's own error is a bare assert about how it was
    built); the check costs nothing when ``tensor`` is on CUDA already (the per-step paths)."""
    if device is None:
        d = tensor.device
    else:
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") \
                from None
    if d.type == "cuda" and (d.index is None or tensor.device.type != "cuda"):
        n = _cuda_devices()
        if n == 0:
            raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda}); expected 'cpu' (or None: the tables' own device)")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        elif d.index >= n:
            raise ValueError(f"device: expected cuda:0 .. cuda:{n - 1} ({n} CUDA device(s)), got {device!r}")
    return d


def debug_checks() -> bool:
    """``FP8MLA_CHECK=1``: check device-only page tables too, at the price of a device-to-host sync."""
    return os.environ.get("FP8MLA_CHECK") == "1"


@dataclass(eq=False)
class PagedLayout:
    """One batch's paged KV table.

    Device tensors (int32, on ``device``):
        qo_indptr ``[B + 1]``: request b owns query tokens ``qo_indptr[b]:qo_indptr[b+1]``.
        kv_indptr ``[B + 1]``: request b's pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, in token order.
        kv_indices ``[N]``: page ids.
        kv_len ``[B]``: tokens per request (<= its pages x page_size).
    Host facts (``None`` when only device tensors were given, since reading them would sync):
        qo_lens, kv_lens: lists of B ints; num_qo = total query tokens; max_qo_len.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor
    page_size: int
    device: torch.device
    qo_lens: list | None = None
    kv_lens: list | None = None
    max_page_id: int | None = None      # largest page id a token uses (-1: none), when checked on the host
    # Host copies (int32 CPU tensors) of qo_indptr[:B + 1], kv_indptr[:B + 1] and kv_len, when all three were
    # given on the host: a backend can then schedule on the host and stage its arrays in one copy (no device op).
    host: dict | None = field(default=None, repr=False)
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.kv_len.numel()

    @property
    def num_qo(self) -> int | None:
        return None if self.qo_lens is None else sum(self.qo_lens)

    @property
    def max_qo_len(self) -> int | None:
        return None if self.qo_lens is None else max(self.qo_lens, default=0)

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_len: torch.Tensor, page_size: int, *, device=None,
                 len_name: str = "kv_len_arr", max_page_id: int | None = None,
                 indices_name: str = "kv_indices") -> "PagedLayout":
        """A layout from FlashInfer's arrays.

        Host page ids are checked in full, vectorized (``fp8mla._checks.check_page_ids``): every id a token uses
        must be >= 0 and < 2**31, and the largest is kept for the pool check of ``run()``; ids that no token uses
        (past a request's kv_len, rows without queries) are not read. One min/max pass over the ids when each
        request lists exactly its pages, a masked pass otherwise; a bad id is then located and named.

        ``max_page_id``: the largest page id in ``kv_indices``, when the caller knows it (the cache, from its own
        tables). A hint is still checked, by one vectorized min/max of the listed ids (the full check runs only
        when that bound says the hint may be low): an understated hint would pass the pool check and let a kernel
        meet a page past the pool (NaN rows) or a torch index error. With CUDA page ids the hint is taken as given
        (reading them would sync; ``FP8MLA_CHECK=1`` checks it).

        Page ids and lengths may be int64; values past int32 are refused on the host (they used to wrap around:
        page ``p + 2**32`` read as page ``p``) and clamped, never wrapped, on the device.

        ``qo_indptr`` and ``kv_indptr`` may be longer than B + 1 (slices of larger buffers, as FlashInfer
        allows): B = ``kv_len.numel()`` and only their first B + 1 entries are read. CPU tensors are checked
        on the host; CUDA tensors are never read on the host (no sync), unless ``FP8MLA_CHECK=1``.
        """
        page_size = check_positive_int("page_size", page_size)
        check_tensor(len_name, kv_len, dtype=INDEX_DTYPES, ndim=1)
        B = kv_len.numel()
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            check_tensor(name, t, dtype=INDEX_DTYPES, ndim=1)
            if t.numel() < B + 1:
                raise ValueError(f"{name}: expected at least {B + 1} entries (batch size {B} from {len_name}, "
                                 f"+ 1), got {t.numel()}")
        check_tensor("kv_indices", kv_indices, dtype=INDEX_DTYPES, ndim=1)
        device = resolve_device(device, kv_indices)
        qo_indptr, kv_indptr = qo_indptr[: B + 1], kv_indptr[: B + 1]

        qo_lens = kv_lens = max_page = active = None
        checked = False  # the page ids a token uses were checked (and max_page is their largest)
        if _on_host(qo_indptr):
            check_indptr_values("qo_indptr", qo_indptr)
            qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
            # Rows without queries are never read: engines pad them with any kv_len (vLLM's sparse backend).
            active = (qo_indptr[1:] - qo_indptr[:-1]) > 0
        if _on_host(kv_indptr) and _on_host(kv_len):  # lengths against pages: needs only these two
            kv_lens = check_kv_lengths(kv_indptr, kv_indices.numel(), kv_len, page_size, active, len_name)
            if _on_host(kv_indices):
                max_page = cls._check_hint(max_page_id, kv_indptr, kv_indices, kv_len, page_size, active,
                                           indices_name)
                checked = True
            else:
                max_page = max_page_id
        elif _on_host(kv_len):
            kv_lens = kv_len.tolist()
            if any(L < 0 for L in kv_lens):
                raise ValueError(f"{len_name}: expected non-negative lengths, got {min(kv_lens)}")
        if not checked and debug_checks():
            h = [t.cpu() for t in (kv_indptr, kv_indices, kv_len)]
            check_kv_lengths(h[0], h[1].numel(), h[2], page_size, active, len_name)
            max_page = cls._check_hint(max_page_id, h[0], h[1], h[2], page_size, active, indices_name)

        i32 = dict(dtype=torch.int32, device=device, non_blocking=True)  # host -> device never syncs
        host = None
        if _on_host(qo_indptr) and _on_host(kv_indptr) and _on_host(kv_len):
            # The three small arrays in one host -> device copy (each copy is a launch's worth of host time).
            packed = torch.cat([int32_saturated(qo_indptr), int32_saturated(kv_indptr), int32_saturated(kv_len)])
            host = dict(qo_indptr=packed[: B + 1], kv_indptr=packed[B + 1: 2 * B + 2], kv_len=packed[2 * B + 2:])
            d = to_device(packed, device)
            qo_d, kv_d, len_d = d[: B + 1], d[B + 1: 2 * B + 2], d[2 * B + 2:]
        else:
            qo_d, kv_d, len_d = (int32_saturated(t).to(**i32) for t in (qo_indptr, kv_indptr, kv_len))
        return cls(qo_d, kv_d, int32_saturated(kv_indices).to(**i32), len_d, page_size, device, qo_lens, kv_lens,
                   max_page, host)

    @classmethod
    def from_block_table(cls, block_table: torch.Tensor, kv_len: torch.Tensor, page_size: int, *,
                         qo_indptr: torch.Tensor | None = None, device=None) -> "PagedLayout":
        """A layout over a padded block table ``[B, max_pages]`` (vLLM's ``block_table``) and ``kv_len [B]``.

        The table is used as is: request b's pages are row b (``kv_indptr = b * row stride``), no copy when the
        table is int32 with contiguous rows. ``qo_indptr`` defaults to one query per request (decode).
        """
        check_tensor("block_table", block_table, dtype=INDEX_DTYPES, ndim=2)
        check_tensor("kv_len", kv_len, dtype=INDEX_DTYPES, ndim=1)
        page_size = check_positive_int("page_size", page_size)
        resolve_device(device, block_table)  # (the error naming ``device``, before any copy)
        B, W = block_table.shape
        if kv_len.numel() != B:
            raise ValueError(f"kv_len: expected {B} entries (one per block_table row), got {kv_len.numel()}")
        dev = block_table.device
        block_table = block_table.contiguous()  # no copy for vLLM's int32 table (row slices)
        if qo_indptr is None and _on_host(kv_len) and not _on_host(block_table) and not debug_checks():
            return cls.decode_rows(int32_saturated(block_table), kv_len.tolist(), page_size, device=device)
        # Row b starts at b * W. Built on the host when the lengths are there too: checked there in O(batch), and
        # staged with them in one copy (a device arange would be two launches).
        kv_indptr = torch.arange(B + 1, dtype=torch.int32, device="cpu" if _on_host(kv_len) else dev) * W
        if qo_indptr is None:
            qo_indptr = torch.arange(B + 1, dtype=torch.int32)  # host: decode, one query per request
        try:
            # int64 ids are checked before they become int32 (from_csr): page p + 2**32 is refused, not page p
            return cls.from_csr(qo_indptr, kv_indptr, block_table.view(-1), kv_len, page_size, device=device,
                                len_name="kv_len", indices_name="block_table")
        except ValueError as e:
            if str(e).startswith("kv_len:"):
                raise ValueError(f"{e} (block_table has {W} pages per row)") from None
            raise

    @classmethod
    def decode_rows(cls, block_table: torch.Tensor, lens: list, page_size: int, *, device=None) -> "PagedLayout":
        """:meth:`from_block_table` for an int32 device table with contiguous rows, host lengths (a list of ints)
        and one query per row: the decode runner's path, every step. The index pointers are known by
        construction, so only the lengths are checked, in O(batch) Python, and the three small arrays reach the
        device in one copy. The same layout as the general path."""
        if _on_host(block_table) or debug_checks():  # the page ids can be checked: the general path does
            return cls.from_block_table(block_table, torch.tensor(lens, dtype=torch.int32), page_size, device=device)
        B, W = block_table.shape
        if len(lens) != B:
            raise ValueError(f"kv_len: expected {B} entries (one per block_table row), got {len(lens)}")
        cap = W * page_size
        for b, n in enumerate(lens if lens and not 0 <= min(lens) <= max(lens) <= cap else ()):  # names the first
            if not 0 <= n <= cap:
                raise ValueError(f"kv_len: request {b} has kv_len {n}, expected 0 <= kv_len <= its {W} pages x "
                                 f"page_size {page_size} = {cap} (block_table has {W} pages per row)")
        device = resolve_device(device, block_table)
        qo, kvp = list(range(B + 1)), list(range(0, (B + 1) * W, W)) if W else [0] * (B + 1)
        packed = host_ints(qo + kvp + lens, pin=device.type == "cuda")
        # "lists": the same arrays as lists, lengths checked against their rows, one query per row: the backends'
        # host schedules skip their clamping pass (and the tolist) for these
        host = dict(qo_indptr=packed[: B + 1], kv_indptr=packed[B + 1: 2 * B + 2], kv_len=packed[2 * B + 2:],
                    lists=(qo, kvp, lens))
        d = packed.to(device, non_blocking=True) if device.type == "cuda" else packed
        return cls(d[: B + 1], d[B + 1: 2 * B + 2], block_table.view(-1).to(device, non_blocking=True),
                   d[2 * B + 2:], page_size, device, [1] * B, lens, None, host)

    def head(self, rows: int) -> "PagedLayout":
        """The layout of the first ``rows`` requests (the same page ids; no copy). A CUDA-graph wrapper plans a
        batch whose trailing requests have no queries (an engine's padding rows: they produce no output) as this,
        so every plan of the wrapper stays on the backend its captured launches read."""
        if not 0 <= rows <= self.batch_size:
            raise ValueError(f"rows: expected 0..{self.batch_size}, got {rows}")
        host = None
        if self.host is not None:
            host = dict(qo_indptr=self.host["qo_indptr"][: rows + 1], kv_indptr=self.host["kv_indptr"][: rows + 1],
                        kv_len=self.host["kv_len"][:rows])
            if "lists" in self.host:
                qo, kvp, lens = self.host["lists"]
                host["lists"] = (qo[: rows + 1], kvp[: rows + 1], lens[:rows])
        return PagedLayout(self.qo_indptr[: rows + 1], self.kv_indptr[: rows + 1], self.kv_indices,
                           self.kv_len[:rows], self.page_size, self.device,
                           None if self.qo_lens is None else self.qo_lens[:rows],
                           None if self.kv_lens is None else self.kv_lens[:rows], self.max_page_id, host)

    # -- checks ---------------------------------------------------------------------------------------------
    @classmethod
    def _check_hint(cls, hint, kv_indptr, kv_indices, kv_len, page_size, active=None,
                    name: str = "kv_indices") -> int:
        """The largest page id a token uses (host tables): ``hint`` when it holds (a caller's ``max_page_id``,
        confirmed by one vectorized min/max of the listed ids), else from the full check, which refuses a low
        hint."""
        if hint is None:
            return check_page_ids(kv_indptr, kv_indices, kv_len, page_size, active, name=name)
        if as_int(hint) is None:
            raise TypeError(f"max_page_id: expected an int (the largest page id in {name}) or None, got "
                            f"{type(hint).__name__}: {hint!r}")
        hint = as_int(hint)
        n = min(int(kv_indptr[-1]), kv_indices.numel())
        if n:
            lo, hi = torch.aminmax(kv_indices[:n])
            if int(lo) >= 0 and int(hi) <= hint:  # every listed id is within the hint: so is every used one
                return hint
        top = check_page_ids(kv_indptr, kv_indices, kv_len, page_size, active, name=name)
        if top > hint:
            raise ValueError(f"max_page_id: {hint} was given as the largest page id, but {name} has a token in page "
                             f"{top}; expected a hint >= every page id in use (or None: the layout finds it)")
        return hint

    def check_pool(self, num_pages: int) -> None:
        """Every page a token uses is < ``num_pages`` (known on the host; device-only tables are guarded in the
        kernels, which never read outside the pool)."""
        if self.max_page_id is not None and self.max_page_id >= num_pages:
            raise ValueError(f"kv_indices: the plan references page {self.max_page_id} but ckv_cache has "
                             f"{num_pages} pages")

    # -- derived, on demand -----------------------------------------------------------------------------------
    def used_kv_len(self) -> torch.Tensor:
        """int64 ``[B]``: kv_len of rows with queries, 0 for rows without (engines pad those with any length)."""
        q = self.qo_indptr[1:] - self.qo_indptr[:-1]
        return torch.where(q > 0, self.kv_len.long(), 0)

    def token_slots(self) -> torch.Tensor:
        """Flat slot ids (``page * page_size + offset``, int64 ``[T]``) of every request's tokens in order (rows
        without queries contribute none), computed on the device on first use and kept. Needs the total token
        count on the host (known when the lengths were given on the host; otherwise one sync, once)."""
        if self._slots is None:
            lens = self.used_kv_len()
            if self.kv_lens is not None and self.qo_lens is not None:
                T = sum(L for L, q in zip(self.kv_lens, self.qo_lens) if q)
            else:
                T = int(lens.sum())
            dev = self.device
            start = torch.zeros(self.batch_size + 1, dtype=torch.long, device=dev)
            torch.cumsum(lens, 0, out=start[1:])
            req = torch.repeat_interleave(torch.arange(self.batch_size, device=dev), lens, output_size=T)
            pos = torch.arange(T, device=dev) - start[req]
            page = self.kv_indices.long()[self.kv_indptr.long()[req]
                                          + torch.div(pos, self.page_size, rounding_mode="floor")]
            self._slots = page * self.page_size + pos % self.page_size
        return self._slots

    def token_indptr(self) -> torch.Tensor:
        """int32 ``[B + 1]``: request b's tokens are rows ``token_indptr[b]:token_indptr[b+1]`` of
        :meth:`token_slots`."""
        out = torch.zeros(self.batch_size + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(self.used_kv_len(), 0, out=out[1:])
        return out
