"""PagedMLACache: a paged pool of MLA latents per layer, its scales, and a page allocator.

Layout: ``pool [num_layers, num_pages, page_size, head_dim_ckv + head_dim_kpe]`` in the format's storage dtype
(see :mod:`fp8mla.formats` for the bytes of one token); with group scales also
``scale_arr [num_layers, num_pages, page_size, head_dim_ckv // 128]`` fp32. Token ``t`` of a sequence lives
in page ``pages[t // page_size]`` at slot ``t % page_size``; flat slot id = ``page * page_size + slot``.

A decode step::

    cache.reserve(seq_ids, 1)                     # reserve one slot per sequence (allocates pages as needed)
    for layer in range(num_layers):
        cache.append(layer, seq_ids, c_kv, k_pe)  # quantize-on-write into the reserved slots
    attn.plan(**cache.plan_inputs(seq_ids), num_heads=H, causal=True, sm_scale=s, q_data_type=torch.bfloat16)
    out = attn.run(q_nope, q_pe, **cache.run_inputs(layer))

Two ways to write tokens, one quantize-on-write underneath:

- ``append(layer, seq_ids, c_kv, k_pe)`` writes the tokens that the last :meth:`PagedMLACache.reserve` of
  those sequences reserved; the cache knows their slots, the caller gives rows in the order of ``seq_ids``.
- ``write(layer, slot_mapping, c_kv, k_pe)`` writes rows into any flat slot ids the caller gives (an engine's
  ``slot_mapping``); it knows nothing of sequences. ``append`` is ``write`` on ``pending_slots(seq_ids)``.

The sequence records and the batch page table are in :mod:`fp8mla.cache_records`, the argument checks in
:mod:`fp8mla.cache_checks`.

``reserve`` was called ``extend`` (a name it shared with the paged-prefill kernel, ``kernels/extend.py``, that
has nothing to do with allocation); ``extend`` stays as an alias.
"""
from __future__ import annotations

import itertools
from types import MappingProxyType

import torch

from ._checks import as_int, check_int, check_positive_int, check_tensor
from .cache_checks import (check_budget_bytes, check_budget_fits, check_cache_scale, check_device, check_unused_scales,
                           hashable_id, id_list)
from .cache_records import OutOfPagesError, SequenceState, batch_csr, page_array
from .formats import KVFormat, get_format


class PagedMLACache:
    """Paged MLA latent cache for ``num_layers`` layers.

    Args:
        num_layers, num_pages, page_size: pool geometry (page_size: tokens per page, any positive int).
        kv_format: a :mod:`fp8mla.formats` name or dtype (``"fp8_e4m3"``, ``"fp8_e4m3_group"``, ``"fp8_e5m2"``,
            ``"bf16"``, ``"fp16"``; ``"fp8_ds_mla"``: the 656-byte sparse record in a uint8 pool
            ``[num_layers, num_pages, page_size, 656]``, read by :class:`fp8mla.MLASparseAttention` only).
        head_dim_ckv, head_dim_kpe: latent and rope widths (512 and 64 for DeepSeek-V2/V3, Kimi-K2).
        ckv_scale, kpe_scale: per-tensor scales (real = stored x scale) of the FP8 formats; the group format uses
            ``kpe_scale`` only, its c_kv scales are computed per token on write. A scale other than 1.0 that
            the format has no use for (``ckv_scale`` of the group and 16-bit formats, ``kpe_scale`` of the
            16-bit formats) is an error: dropped silently, it would leave a caller who meant it to scale the
            values with unscaled ones.
        device: where the pool lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``); it must exist.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_format="fp8_e4m3", *,
                 head_dim_ckv: int = 512, head_dim_kpe: int = 64, device="cpu",
                 ckv_scale: float = 1.0, kpe_scale: float = 1.0):
        num_layers, num_pages, page_size, head_dim_ckv, head_dim_kpe = (
            check_positive_int(name, v) for name, v in (
                ("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                ("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)))
        ckv_scale, kpe_scale = (check_cache_scale(name, v) for name, v in (("ckv_scale", ckv_scale),
                                                                           ("kpe_scale", kpe_scale)))
        self.format: KVFormat = get_format(kv_format, arg="kv_format", sparse_ok=True)
        check_unused_scales(self.format, ckv_scale, kpe_scale)
        device = check_device(device)
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.head_dim_ckv, self.head_dim_kpe = head_dim_ckv, head_dim_kpe
        self.ckv_scale = float(ckv_scale) if self.format.scale_kind == "tensor" else 1.0
        self.kpe_scale = float(kpe_scale) if self.format.is_fp8 else 1.0
        self.is_record = self.format.scale_kind == "record"  # fp8_ds_mla: one 656-byte record per token
        width = self.format.bytes_per_token(head_dim_ckv, head_dim_kpe) if self.is_record else \
            head_dim_ckv + head_dim_kpe
        self.pool = torch.zeros(num_layers, num_pages, page_size, width, dtype=self.format.storage_dtype,
                                device=device)
        self.device = self.pool.device  # "cuda" resolved to "cuda:0": what the checks compare tensors with
        groups = self.format.num_groups(head_dim_ckv) if self.format.scale_kind == "group" else 0
        self.scale_arr = (torch.ones(num_layers, num_pages, page_size, groups, dtype=torch.float32,
                                     device=self.device) if groups else None)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._refs = [0] * num_pages
        self._forked = False  # a page may be shared (refs > 1) only after a fork: reserve's fast path checks this
        self._forks = 0  # forks made so far: a step planned before the last one checks that its pages are its own
        self._seqs: dict[int, SequenceState] = {}
        self._ids = itertools.count()

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, num_layers: int, page_size: int, kv_format="fp8_e4m3",
                           *, head_dim_ckv: int = 512, head_dim_kpe: int = 64, **kw) -> "PagedMLACache":
        """The largest cache whose pool and scales fit in ``budget_bytes`` (an int, or a finite float rounded
        down; at most the device's memory). ``kw`` as in the constructor (``device``, ``ckv_scale``, ...)."""
        num_layers, page_size = (check_positive_int(name, v) for name, v in (("num_layers", num_layers),
                                                                            ("page_size", page_size)))
        head_dim_ckv, head_dim_kpe = (check_positive_int(name, v) for name, v in (("head_dim_ckv", head_dim_ckv),
                                                                                 ("head_dim_kpe", head_dim_kpe)))
        budget_bytes = check_budget_bytes(budget_bytes)
        fmt = get_format(kv_format, arg="kv_format", sparse_ok=True)
        # Checked before any allocation: the constructor would build a Python free list of num_pages entries.
        check_unused_scales(fmt, kw.get("ckv_scale", 1.0), kw.get("kpe_scale", 1.0))
        check_budget_fits(budget_bytes, check_device(kw.get("device", "cpu")))
        per_page = num_layers * page_size * fmt.bytes_per_token(head_dim_ckv, head_dim_kpe)
        num_pages = int(budget_bytes) // per_page
        if num_pages < 1:
            raise ValueError(f"budget_bytes: {budget_bytes} B holds no page; one page of {num_layers} layers x "
                             f"{page_size} tokens of {fmt.name} takes {per_page} B")
        return cls(num_layers, num_pages, page_size, fmt, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                   **kw)

    # -- views ----------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        i = layer if type(layer) is int else as_int(layer)
        if i is None or not 0 <= i < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return i

    def _no_record(self, what: str) -> None:
        if self.is_record:
            raise ValueError(f"{what}: the {self.format.name} pool holds whole 656-byte records, not separate "
                             "c_kv / k_pe columns; use kv_cache(layer) (or sparse_run_inputs(layer))")

    def kv_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, width]`` view of one layer's pool (no copy): width = head_dim_ckv +
        head_dim_kpe values of the storage dtype, or 656 bytes (uint8) for ``fp8_ds_mla``."""
        return self.pool[self._layer(layer)]

    def ckv_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, head_dim_ckv]`` view of one layer's pool (no copy)."""
        self._no_record("ckv_cache")
        return self.pool[self._layer(layer), :, :, : self.head_dim_ckv]

    def kpe_cache(self, layer: int) -> torch.Tensor:
        """``[num_pages, page_size, head_dim_kpe]`` view of one layer's pool (no copy)."""
        self._no_record("kpe_cache")
        return self.pool[self._layer(layer), :, :, self.head_dim_ckv:]

    def ckv_scale_arr(self, layer: int):
        """``[num_pages, page_size, head_dim_ckv // 128]`` fp32 group scales, or None."""
        return None if self.scale_arr is None else self.scale_arr[self._layer(layer)]

    @property
    def bytes_per_token(self) -> int:
        return self.format.bytes_per_token(self.head_dim_ckv, self.head_dim_kpe)

    def memory_bytes(self) -> int:
        """Bytes held by the pool and its scales, all layers."""
        n = self.pool.numel() * self.pool.element_size()
        return n + (0 if self.scale_arr is None else self.scale_arr.numel() * 4)

    # -- allocator ------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return list(self._seqs)

    @property
    def seq_states(self):
        """Every live sequence's state, ``{seq_id: SequenceState}``: a read-only view that follows the cache
        (``seq_states.get(seq_id)`` is None for an id not here)."""
        return MappingProxyType(self._seqs)

    @property
    def fork_count(self) -> int:
        """Forks made so far: a step planned before the last fork checks that the pages it writes are its own
        (``shared_page``)."""
        return self._forks

    def shared_page(self, seq_id, start: int, num_tokens: int):
        """The first page holding tokens ``[start, start + num_tokens)`` of ``seq_id`` that another sequence
        shares too (a fork), or None: writing such a page would change the other sequence's tokens."""
        pages = self.seq_state(seq_id).pages
        if num_tokens <= 0:
            return None
        ps, refs = self.page_size, self._refs
        for i in range(start // ps, min((start + num_tokens - 1) // ps + 1, len(pages))):
            if refs[pages[i]] > 1:
                return pages[i]
        return None

    id_list = staticmethod(id_list)   # (cache_checks.id_list: one id or an ordered collection, as a list)

    def seq_state(self, seq_id) -> SequenceState:
        """The live state of ``seq_id`` (its pages and lengths); KeyError naming the id when it is not here."""
        if type(seq_id) is int and seq_id in self._seqs:
            return self._seqs[seq_id]
        key = hashable_id(seq_id)
        if key not in self._seqs:
            raise KeyError(f"seq_id: no sequence {seq_id!r} in the cache (live ids: {sorted(self._seqs)[:16]})")
        return self._seqs[key]

    def seq_len(self, seq_id) -> int:
        return self.seq_state(seq_id).length

    def pages(self, seq_id) -> list[int]:
        return list(self.seq_state(seq_id).pages)

    def add_sequence(self, seq_id=None, num_tokens: int = 0):
        """Register a new sequence (an id is chosen when ``seq_id`` is None) and reserve ``num_tokens`` slots."""
        if seq_id is None:
            seq_id = next(i for i in self._ids if i not in self._seqs)
        else:
            seq_id = hashable_id(seq_id)
            if seq_id in self._seqs:
                raise ValueError(f"seq_id: sequence {seq_id!r} already exists")
        self._seqs[seq_id] = SequenceState()
        if num_tokens:
            try:
                self.reserve(seq_id, num_tokens)
            except Exception:
                del self._seqs[seq_id]
                raise
        return seq_id

    def _take_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"the pool is full: {n} more pages needed, {len(self._free)} of "
                                  f"{self.num_pages} free (page_size {self.page_size})")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _pages_needed(self, seq: SequenceState, n: int) -> int:
        return max(0, -(-(seq.length + n) // self.page_size) - len(seq.pages))

    def reserve(self, seq_ids, num_tokens) -> torch.Tensor:
        """Reserve ``num_tokens`` more slots at the end of each sequence; returns their flat slot ids (int64).
        Nothing is written: :meth:`append` fills the reserved slots, layer by layer.

        ``seq_ids`` is one id or a list; ``num_tokens`` an int or one per sequence. All or nothing: when the
        pool cannot hold every request, nothing is reserved and :class:`OutOfPagesError` is raised.
        """
        slots = torch.tensor(self.reserve_slots(seq_ids, num_tokens), dtype=torch.int64)
        if self.device.type == "cuda":  # through pinned memory: no host-device sync
            return slots.pin_memory().to(self.device, non_blocking=True)
        return slots

    def reserve_slots(self, seq_ids, num_tokens) -> list:
        """:meth:`reserve`, the slot ids as a host list of ints (for callers that stage them with other arrays
        in one host -> device copy, as the decode runner does)."""
        if num_tokens == 1 and type(num_tokens) is int and type(seq_ids) is list and not self._forked:
            slots = self._reserve_decode(seq_ids)
            if slots is not None:
                return slots
        ids = self.id_list(seq_ids)
        if isinstance(num_tokens, (list, tuple)):
            counts = [check_int("num_tokens", c, 0, "non-negative ints") for c in num_tokens]
            if len(counts) != len(ids):
                raise ValueError(f"num_tokens: expected one count per sequence ({len(ids)}), got {len(counts)}")
        else:
            counts = [check_int("num_tokens", num_tokens, 0, "non-negative ints")] * len(ids)
        try:
            distinct = len(set(ids)) == len(ids)
        except TypeError:
            distinct = len(set(map(hashable_id, ids))) == len(ids)  # raises, naming the unhashable id
        if not distinct:
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}")
        table = self._seqs
        seqs = [table[i] if i in table else self.seq_state(i) for i in ids]  # (seq_state: the error for a bad id)
        ps, refs = self.page_size, self._refs
        # A shared (forked) partly filled last page must not be written: it is copied first, which takes a page
        # too. Count those copies before touching anything, so that a full pool leaves the state unchanged.
        unshare, copied = [], {}
        need = 0
        for s, c in zip(seqs, counts):
            if c and s.length % ps:
                last = s.pages[-1]
                if refs[last] - copied.get(last, 0) > 1:  # the last owner keeps it
                    unshare.append(s)
                    copied[last] = copied.get(last, 0) + 1
            need += max(0, -(-(s.length + c) // ps) - len(s.pages))
        need += len(unshare)
        if need > len(self._free):
            raise OutOfPagesError(f"the pool is full: {need} more pages needed, {len(self._free)} of "
                                  f"{self.num_pages} free (page_size {self.page_size})")
        for s in unshare:
            self._unshare_last_page(s)
        slots, free = [], self._free
        for s, c in zip(seqs, counts):
            pages, t = s.pages, s.length
            for _ in range(-(-(t + c) // ps) - len(pages)):  # new pages (a stack: low ids first)
                p = free.pop()
                refs[p] = 1
                pages.append(p)
            if c == 1:  # a decode token
                slots.append(pages[t // ps] * ps + t % ps)
            else:
                slots += [pages[u // ps] * ps + u % ps for u in range(t, t + c)]
            s.length = t + c
            s.pending = c
        return slots

    def _reserve_decode(self, ids: list):
        """``reserve_slots(ids, 1)`` while no page is shared (no fork yet): one token per sequence, the decode
        runner's every step, in two short passes. None when the general path must run (an unknown or repeated
        id, a full pool): it raises the error, naming the argument."""
        table = self._seqs
        try:
            seqs = [table[i] for i in ids]
        except (KeyError, TypeError):
            return None
        if len(set(ids)) != len(ids):  # a repeated id
            return None
        ps, free, refs = self.page_size, self._free, self._refs
        new = [s for s in seqs if not s.length % ps and len(s.pages) <= s.length // ps]  # at a page boundary
        if len(new) > len(free):
            return None
        for s in new:
            p = free.pop()
            refs[p] = 1
            s.pages.append(p)
        slots = []
        for s in seqs:
            t = s.length
            slots.append(s.pages[t // ps] * ps + t % ps)
            s.length = t + 1
            s.pending = 1
        return slots

    def free(self, seq_id) -> None:
        """Drop a sequence; its pages go back to the pool once no forked sequence shares them."""
        seq = self.seq_state(seq_id)
        for p in seq.pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        del self._seqs[hashable_id(seq_id)]

    def fork(self, seq_id, new_id=None):
        """A new sequence sharing ``seq_id``'s pages (a common prefix). Shared pages are never written: a
        partly filled shared last page is copied before either sequence appends to it.

        Append every layer of ``seq_id``'s reserved tokens before forking: the fork shares them, and an append
        of ``seq_id`` after the fork (without a new :meth:`extend`) is refused instead of writing shared pages.
        """
        src = self.seq_state(seq_id)
        new_id = self.add_sequence(new_id)
        dst = self._seqs[new_id]
        dst.pages, dst.length = page_array(src.pages), src.length
        for p in dst.pages:
            self._refs[p] += 1
        self._forked = True
        self._forks += 1
        src.pending = 0  # its pending slots now lie in shared pages
        return new_id

    def _unshare_last_page(self, seq: SequenceState) -> None:
        (new,) = self._take_pages(1)
        old = seq.pages[-1]
        self.pool[:, new] = self.pool[:, old]
        if self.scale_arr is not None:
            self.scale_arr[:, new] = self.scale_arr[:, old]
        self._refs[old] -= 1
        seq.pages[-1] = new

    # -- writes ---------------------------------------------------------------------------------------------
    def pending_slots(self, seq_ids) -> torch.Tensor:
        """Flat slot ids of the tokens reserved by the last :meth:`reserve` of each sequence, in order."""
        slots = []
        for i in self.id_list(seq_ids):
            s = self.seq_state(i)
            for t in range(s.length - s.pending, s.length):
                slots.append(s.pages[t // self.page_size] * self.page_size + t % self.page_size)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def append(self, layer: int, seq_ids, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Quantize and write the new tokens of ``seq_ids`` (reserved by the last :meth:`reserve`): the cache
        finds their slots. :meth:`write` is the same for slots the caller gives.

        Args:
            c_kv: ``[T, head_dim_ckv]``, k_pe: ``[T, head_dim_kpe]`` (any float dtype); T = tokens reserved by
                the last reserve() of these sequences, in the order of ``seq_ids``.
        """
        self.write(layer, self.pending_slots(self.id_list(seq_ids)), c_kv, k_pe)

    def write(self, layer: int, slot_mapping: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, *,
              use_triton: bool | None = None) -> None:
        """Quantize ``c_kv [T, Dc]``/``k_pe [T, Dk]`` into flat slots ``slot_mapping [T]`` of ``layer`` (any slots:
        an engine's slot mapping; :meth:`append` is this on the slots its sequences reserved).

        ``use_triton``: write with the Triton quantize-on-write kernel (default: when the pool is on CUDA and
        triton imports). It stores the same bytes and scales as the torch code below.
        """
        layer = self._layer(layer)
        check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
        T = slot_mapping.numel()
        floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        check_tensor("c_kv", c_kv, dtype=floats, shape=(T, self.head_dim_ckv), device=self.device)
        check_tensor("k_pe", k_pe, dtype=floats, shape=(T, self.head_dim_kpe), device=self.device)
        if T == 0:
            return
        total = self.num_pages * self.page_size
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < 0 or hi >= total:
            raise ValueError(f"slot_mapping: expected slot ids in [0, {total}), got values in [{lo}, {hi}]")
        rows = self.pool[layer].view(total, -1)
        scales = None if self.scale_arr is None else self.scale_arr[layer].view(total, -1)
        if use_triton is None:
            import importlib.util
            use_triton = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        if self.is_record:
            if use_triton:
                from .kernels.quant_ds_mla import quant_ds_mla
                quant_ds_mla(rows, slot_mapping, c_kv, k_pe)
            else:
                rows[slot_mapping.long()] = self.format.pack(c_kv, k_pe)
            return
        if use_triton:
            from .kernels.quant_append import quant_append
            quant_append(rows, scales, slot_mapping, c_kv, k_pe, self.format, self.ckv_scale, self.kpe_scale)
            return
        slot_mapping = slot_mapping.long()
        fmt, Dc = self.format, self.head_dim_ckv
        if scales is not None:
            g = fmt.group_scales(c_kv)
            rows[slot_mapping, :Dc] = fmt.quantize_groups(c_kv, g)
            scales[slot_mapping] = g
        else:
            rows[slot_mapping, :Dc] = fmt.quantize(c_kv, self.ckv_scale)
        rows[slot_mapping, Dc:] = fmt.quantize(k_pe, self.kpe_scale)

    # -- plan / run inputs ----------------------------------------------------------------------------------
    def plan_inputs(self, seq_ids, qo_lens=None, *, _device=None) -> dict:
        """The cache-side arguments of ``MLAPagedAttention.plan`` for a batch of sequences.

        ``seq_ids``: one id or a list (as the other methods). ``qo_lens``: query tokens per sequence (default 1:
        decode; an int for all). Returns ``qo_indptr, kv_indptr, kv_indices, kv_len_arr`` (int32, on the cache's
        device), ``head_dim_ckv, head_dim_kpe, page_size, kv_data_type`` (the format's name).
        """
        ids = self.id_list(seq_ids)
        if qo_lens is None or as_int(qo_lens) is not None:
            qo_lens = [1 if qo_lens is None else check_int("qo_lens", qo_lens, 0, "non-negative ints")] * len(ids)
        elif isinstance(qo_lens, (list, tuple, range)):
            qo_lens = [check_int("qo_lens", n, 0, "non-negative ints") for n in qo_lens]
        else:
            raise TypeError(f"qo_lens: expected an int or a list of ints (one per sequence), got "
                            f"{type(qo_lens).__name__}")
        if len(qo_lens) != len(ids):
            raise ValueError(f"qo_lens: expected one length per sequence ({len(ids)}), got {len(qo_lens)}")
        seqs = [self.seq_state(i) for i in ids]
        return dict(
            batch_csr(seqs, qo_lens, self.page_size, self.device if _device is None else _device),
            head_dim_ckv=self.head_dim_ckv, head_dim_kpe=self.head_dim_kpe, page_size=self.page_size,
            kv_data_type=self.format.name,
        )

    def layout(self, seq_ids, qo_lens=None):
        """The batch's page table as a :class:`~fp8mla.layout.PagedLayout` on the cache's device, with the host
        lengths filled in (built from host lists, checked on the host, copied to the device without a sync).
        Arguments as :meth:`plan_inputs`; pass it to ``MLAPagedAttention.plan_layout``."""
        from .layout import PagedLayout
        args = self.plan_inputs(seq_ids, qo_lens, _device="cpu")
        idx = args["kv_indices"]
        # The cache's page ids are valid by construction: the largest one is one vectorized max, which the layout
        # confirms with one min/max of the listed ids.
        return PagedLayout.from_csr(args["qo_indptr"], args["kv_indptr"], idx, args["kv_len_arr"], self.page_size,
                                    device=self.device, max_page_id=int(idx.max()) if idx.numel() else -1)

    def run_inputs(self, layer: int) -> dict:
        """The cache-side arguments of ``MLAPagedAttention.run`` for ``layer``: the caches and exactly one of
        ``ckv_scale`` (per tensor) / ``ckv_scale_arr`` (group format), as FlashInfer requires."""
        self._no_record("run_inputs")
        arr = self.ckv_scale_arr(layer)
        return dict(ckv_cache=self.ckv_cache(layer), kpe_cache=self.kpe_cache(layer),
                    ckv_scale=None if arr is not None else self.ckv_scale, kpe_scale=self.kpe_scale,
                    ckv_scale_arr=arr)

    def sparse_run_inputs(self, layer: int) -> dict:
        """The cache-side arguments of ``MLASparseAttention.run`` for ``layer``: ``kv_cache`` (the whole
        pool of the layer, records or joined c_kv | k_pe rows) and the scales its format needs."""
        arr = self.ckv_scale_arr(layer)
        if self.is_record:
            return dict(kv_cache=self.kv_cache(layer))
        fp8 = self.format.is_fp8
        return dict(kv_cache=self.kv_cache(layer), ckv_scale_arr=arr,
                    ckv_scale=self.ckv_scale if fp8 and arr is None else None,
                    kpe_scale=self.kpe_scale if fp8 else None)

    def unreserve(self, seq_ids) -> None:
        """Undo the last reservation of each sequence (a step that failed after reserving): its pending tokens are
        dropped and the pages they alone took go back to the pool. Tokens written before stay as they were.
        (A shared last page copied by that reservation stays the sequence's private copy, with equal contents.)"""
        ids = list(seq_ids) if isinstance(seq_ids, (list, tuple)) else [seq_ids]
        for s in [self.seq_state(i) for i in ids]:  # all ids checked before anything changes
            s.length -= s.pending
            s.pending = 0
            keep = -(-s.length // self.page_size)
            for p in s.pages[keep:]:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)
            del s.pages[keep:]
