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

Row formats (``kv_format``): ``"bf16"`` / ``"fp16"`` / ``"float32"`` / ``"float64"`` keep the 512 values, or
``"fp8"``: 448 NoPE values in e4m3 with one power-of-two (ue8m0) scale per 64 of them and the 64 RoPE values in
bf16, 584 bytes a row, the content of vLLM's V4 record (see :func:`encode_fp8_rows`).
"""
from __future__ import annotations

import itertools

import torch

from ..cache import OutOfPagesError
from .v4_compress import CompressorState
from .v4_config import CSA, HCA, SLIDING, V4Config

__all__ = ["V4Cache", "ROW_FORMATS", "encode_fp8_rows", "decode_fp8_rows"]

ROW_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32, "float64": torch.float64,
               "fp8": torch.uint8}
NOPE, ROPE, SCALE_GROUP = 448, 64, 64
FP8_ROW_BYTES = NOPE + 2 * ROPE + NOPE // SCALE_GROUP + 1  # 584: values, bf16 rope, 7 ue8m0 scales, 1 pad byte
E4M3_MAX = 448.0
_STREAM_OF = {CSA: "csa", HCA: "hca"}


def encode_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """``[n, 512]`` -> ``[n, 584]`` uint8: bytes ``[0, 448)`` e4m3 NoPE values, ``[448, 576)`` the RoPE values as
    bf16, ``[576, 583)`` one ue8m0 exponent per 64 NoPE values (scale ``2 ** (byte - 127)``, the smallest power of
    two with ``amax / scale <= 448``, amax floored at 1e-4 as vLLM's writer), one zero pad byte. Saturating."""
    n = x.shape[0]
    nope = x[:, :NOPE].float().view(n, NOPE // SCALE_GROUP, SCALE_GROUP)
    amax = nope.abs().nan_to_num(nan=0.0, posinf=0.0).amax(-1).clamp_min(1e-4)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    vals = (nope / torch.exp2(exp)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(n, FP8_ROW_BYTES, dtype=torch.uint8, device=x.device)
    out[:, :NOPE] = vals.view(n, NOPE).view(torch.uint8)
    out[:, NOPE:NOPE + 2 * ROPE] = x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, NOPE + 2 * ROPE:FP8_ROW_BYTES - 1] = (exp + 127).to(torch.uint8)
    return out


def decode_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[n, 584]`` uint8 -> ``[n, 512]`` fp32 (see :func:`encode_fp8_rows`)."""
    n = rows.shape[0]
    vals = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(n, NOPE // SCALE_GROUP, SCALE_GROUP)
    scale = torch.exp2(rows[:, NOPE + 2 * ROPE:FP8_ROW_BYTES - 1].float() - 127)
    rope = rows[:, NOPE:NOPE + 2 * ROPE].contiguous().view(torch.bfloat16).float()
    return torch.cat([(vals * scale[..., None]).view(n, NOPE), rope], dim=1)


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
    """

    def __init__(self, cfg: V4Config, num_layers: int, num_pages: int, page_size: int, kv_format="bf16", *,
                 compressed_pages: int | None = None, index_dtype=torch.bfloat16, device="cpu"):
        if kv_format not in ROW_FORMATS:
            raise ValueError(f"kv_format: expected one of {sorted(ROW_FORMATS)}, got {kv_format!r}")
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        self.cfg, self.num_layers, self.page_size = cfg, num_layers, page_size
        self.kv_format, self.device = kv_format, torch.device(device)
        cpages = num_pages if compressed_pages is None else compressed_pages
        types = cfg.layer_types[:num_layers]
        self.streams = {"window": _RowStream("window", num_pages, page_size)}
        self.layer_rows = {}  # layer -> (stream, pool index) of its compressed rows
        for t in (CSA, HCA):
            layers = [i for i, lt in enumerate(types) if lt == t]
            if layers:
                self.streams[_STREAM_OF[t]] = _RowStream(_STREAM_OF[t], cpages, page_size)
            self.layer_rows.update({i: (_STREAM_OF[t], j) for j, i in enumerate(layers)})
        width = FP8_ROW_BYTES if kv_format == "fp8" else cfg.head_dim
        dt = ROW_FORMATS[kv_format]
        self.pools = {"window": torch.zeros(num_layers, num_pages * page_size, width, dtype=dt, device=device)}
        for name in ("csa", "hca"):
            if name in self.streams:
                n = sum(1 for s, _ in self.layer_rows.values() if s == name)
                self.pools[name] = torch.zeros(n, cpages * page_size, width, dtype=dt, device=device)
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
    def rows(self, stream: str, layer: int) -> torch.Tensor:
        """``[slots, width]`` storage rows of ``layer`` in ``stream`` (flat slot = page * page_size + offset)."""
        return self.pools[stream][layer if stream == "window" else self.layer_rows[layer][1]]

    def write_rows(self, stream: str, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x [n, 512]`` at ``slots`` (quantized on write in the ``"fp8"`` format)."""
        rows = self.rows(stream, layer)
        rows[slots] = encode_fp8_rows(x) if self.kv_format == "fp8" else x.to(rows.dtype)

    def read_rows(self, stream: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[n, 512]`` rows at ``slots`` (gathered, then dequantized: never the pool)."""
        raw = self.rows(stream, layer)[slots]
        return decode_fp8_rows(raw) if self.kv_format == "fp8" else raw

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index_pool[self.layer_rows[layer][1]]

    def layer_types(self):
        return [SLIDING if i not in self.layer_rows else self.cfg.layer_types[i] for i in range(self.num_layers)]
