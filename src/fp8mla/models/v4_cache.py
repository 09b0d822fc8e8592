"""What a DeepSeek-V4 attention stack keeps per sequence: three paged row streams, the indexer keys and the
compressors' states.

- ``"window"``: one 512-wide K=V row per token, every layer. Only the last ``sliding_window`` tokens are ever
  read, so after each step the pages wholly before a sequence's window are given back (a sequence holds at most
  ``ceil((sliding_window - 1) / page_size) + 1`` window pages between steps, plus its step's new tokens).
- ``"csa"`` / ``"hca"``: one 512-wide row per ``compress_rates[...]`` tokens (4 / 128), on the CSA / HCA layers,
  kept for the whole sequence (every row stays selectable).
- the indexer keys (CSA layers): one ``index_head_dim`` row per CSA row, at the same slots, in ``index_dtype``.
- per sequence and compressing layer, the compressor's (and indexer's) :class:`~.v4_compress.CompressorState`.

Each stream has its own pages (``num_pages`` of ``page_size`` rows) and one pool per layer that uses it; a row's
flat slot is ``page * page_size + offset``, which is what the attention's index lists hold.

Row formats (``kv_format``): the V4 pool formats of :mod:`fp8mla.formats_v4` -- ``"fp8_v4"`` (vLLM's 584-byte
record: 448 e4m3 NoPE values with one power-of-two scale per 64, 64 bf16 RoPE values), ``"fp8_v41"`` (FlashMLA's
528-byte V4.1 record) or ``"bf16"`` -- read by :class:`fp8mla.V4SparseAttention`; or ``"float32"`` /
``"float64"``, kept as they are and read by the torch code of :mod:`.v4_attend` (exactness tests).
"""
from __future__ import annotations

import itertools

import torch

from ..cache import OutOfPagesError
from ..formats_v4 import HEAD_DIM, V4_FORMATS, get_v4_format
from ..v4 import write_v4_pool
from .v4_config import CSA, HCA, V4Config

__all__ = ["V4Cache", "ROW_FORMATS", "EXACT_FORMATS"]

EXACT_FORMATS = {"float32": torch.float32, "float64": torch.float64}
ROW_FORMATS = tuple(V4_FORMATS) + tuple(EXACT_FORMATS)
_STREAM_OF = {CSA: "csa", HCA: "hca"}


class _RowStream:
    """Pages of one row stream: a free list and, per sequence, its page ids (-1 for pages given back) and rows."""

    def __init__(self, name: str, num_pages: int, page_size: int):
        self.name, self.page_size = name, page_size
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages: dict = {}
        self.rows: dict = {}

    def add(self, sid) -> None:
        self.pages[sid], self.rows[sid] = [], 0

    def reserve(self, sid, n: int, device) -> torch.Tensor:
        """Slots (int64) of ``n`` new rows of ``sid``; all or nothing."""
        ps, pages, r = self.page_size, self.pages[sid], self.rows[sid]
        need = -(-(r + n) // ps) - len(pages)
        if need > len(self.free):
            raise OutOfPagesError(f"{self.name} rows: {need} more pages needed, {len(self.free)} free")
        pages.extend(self.free.pop() for _ in range(max(need, 0)))
        self.rows[sid] = r + n
        return self.slots(sid, r, r + n, device)

    def slots(self, sid, start: int, end: int, device) -> torch.Tensor:
        rows = torch.arange(start, end)
        pages = torch.tensor(self.pages[sid], dtype=torch.int64)
        if end > start and bool((pages[rows // self.page_size] < 0).any()):
            raise ValueError(f"{self.name} rows [{start}, {end}) of sequence {sid!r}: some were given back")
        return (pages[rows // self.page_size] * self.page_size + rows % self.page_size).to(device)

    def truncate(self, sid, rows: int) -> None:
        """Back to ``rows`` rows (a cancelled step), giving back pages past them."""
        pages = self.pages[sid]
        while len(pages) > -(-rows // self.page_size):
            p = pages.pop()
            if p >= 0:
                self.free.append(p)
        self.rows[sid] = rows

    def release_before(self, sid, row: int) -> None:
        """Give back the pages whose rows are all before ``row``."""
        pages = self.pages[sid]
        for i in range(min(row // self.page_size, len(pages))):
            if pages[i] >= 0:
                self.free.append(pages[i])
                pages[i] = -1

    def drop(self, sid) -> None:
        self.free.extend(p for p in self.pages.pop(sid) if p >= 0)
        del self.rows[sid]


class V4Cache:
    """The rows, indexer keys and compressor states of a V4 attention stack (see the module docstring).

    Args:
        cfg: the model's :class:`~.v4_config.V4Config`; num_layers: its first layers to keep rows for.
        num_pages, page_size: geometry of each stream's pages (``compressed_pages``: of the CSA / HCA streams,
            default ``num_pages``).
        kv_format: the rows' format (:data:`ROW_FORMATS`); index_dtype: of the indexer keys.
        write_backend: the quantize-on-write code of the V4 formats (:func:`fp8mla.v4.write_v4_pool`'s
            ``backend``: ``"auto"``, ``"torch"``, ``"triton"``).
    """

    def __init__(self, cfg: V4Config, num_layers: int, num_pages: int, page_size: int, kv_format="bf16", *,
                 compressed_pages: int | None = None, index_dtype=torch.bfloat16, device="cpu",
                 write_backend: str = "auto"):
        if kv_format not in ROW_FORMATS:
            raise ValueError(f"kv_format: expected one of {sorted(ROW_FORMATS)}, got {kv_format!r}")
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if num_layers > cfg.num_layers:
            raise ValueError(f"num_layers: the config has {cfg.num_layers} layers, got {num_layers}")
        self.cfg, self.num_layers, self.page_size = cfg, num_layers, page_size
        self.kv_format, self.device, self.write_backend = kv_format, torch.device(device), write_backend
        self.format = None if kv_format in EXACT_FORMATS else get_v4_format(kv_format)
        cpages = num_pages if compressed_pages is None else compressed_pages
        self.num_pages, self.num_compressed_pages = num_pages, cpages
        types = cfg.layer_types[:num_layers]
        self.streams = {"window": _RowStream("window", num_pages, page_size)}
        self.layer_rows = {}  # layer -> (stream, pool index) of its compressed rows
        for t in (CSA, HCA):
            layers = [i for i, lt in enumerate(types) if lt == t]
            if layers:
                self.streams[_STREAM_OF[t]] = _RowStream(_STREAM_OF[t], cpages, page_size)
            self.layer_rows.update({i: (_STREAM_OF[t], j) for j, i in enumerate(layers)})
        # one pool per layer and stream: [pages, page_size, ...] in the format's shape (fp8_v4: a view of padded
        # pages, which is why the layers are not stacked in one tensor)
        self.pools = {name: [self._new_pool(cpages if name != "window" else num_pages)
                             for _ in range(num_layers if name == "window" else
                                            sum(1 for s_, _ in self.layer_rows.values() if s_ == name))]
                      for name in self.streams}
        n_csa = sum(1 for s, _ in self.layer_rows.values() if s == "csa")
        self.index_pool = torch.zeros(n_csa, cpages * page_size, cfg.index_head_dim, dtype=index_dtype,
                                      device=device)
        self.states: dict = {}   # (seq, layer) -> (compressor state, indexer state or None)
        self.lengths: dict = {}
        self._ids = itertools.count()

    # -- sequences ------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id=None):
        sid = next(self._ids) if seq_id is None else seq_id
        if sid in self.lengths:
            raise ValueError(f"seq_id: {sid!r} is already in the cache")
        for s in self.streams.values():
            s.add(sid)
        self.lengths[sid] = 0
        return sid

    def free(self, seq_id) -> None:
        self._check_seq(seq_id)
        for s in self.streams.values():
            s.drop(seq_id)
        del self.lengths[seq_id]
        for key in [k for k in self.states if k[0] == seq_id]:
            del self.states[key]

    def seq_len(self, seq_id) -> int:
        self._check_seq(seq_id)
        return self.lengths[seq_id]

    def _check_seq(self, seq_id) -> None:
        if seq_id not in self.lengths:
            raise ValueError(f"seq_id: {seq_id!r} is not in the cache (add_sequence first)")

    def stream_of(self, layer: int) -> str | None:
        """The compressed-row stream of ``layer`` (``"csa"``, ``"hca"``) or None on a sliding layer."""
        return self.layer_rows.get(layer, (None,))[0]

    def state(self, seq_id, layer: int, compressor, indexer):
        """The compressor (and indexer) states of ``seq_id`` at ``layer``, empty ones for a new sequence."""
        got = self.states.get((seq_id, layer))
        if got is None:
            like = compressor.kv_proj.weight
            got = (compressor.empty_state(like), None if indexer is None else indexer.empty_state(like))
        return got

    # -- rows -----------------------------------------------------------------------------------------------
    def _new_pool(self, num_pages: int) -> torch.Tensor:
        if self.format is not None:
            return self.format.new_pool(num_pages, self.page_size, device=self.device)
        return torch.zeros(num_pages, self.page_size, HEAD_DIM, dtype=EXACT_FORMATS[self.kv_format],
                           device=self.device)

    def pool(self, stream: str, layer: int) -> torch.Tensor:
        """The pool of ``layer``'s rows in ``stream`` (a row's flat slot is ``page * page_size + offset``)."""
        return self.pools[stream][layer if stream == "window" else self.layer_rows[layer][1]]

    def write_rows(self, stream: str, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x [n, 512]`` at ``slots`` (quantize-on-write in the V4 formats)."""
        pool = self.pool(stream, layer)
        if self.format is not None:
            write_v4_pool(self.format, pool, slots, x, page_size=self.page_size, backend=self.write_backend)
        else:
            pool.view(-1, HEAD_DIM)[slots] = x.to(pool.dtype)

    def read_rows(self, stream: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[n, 512]`` rows at ``slots``, gathered, then dequantized (never the pool); fp32 for the V4 formats."""
        pool = self.pool(stream, layer)
        if self.format is not None:
            return self.format.read(pool, slots, torch.float32, page_size=self.page_size)
        return pool.view(-1, HEAD_DIM)[slots]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index_pool[self.layer_rows[layer][1]]
