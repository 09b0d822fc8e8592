"""DeepSeek V4 KV pools: one shared K = V row of 512 values per token (448 NoPE + 64 RoPE), three formats.

Scale convention as in :mod:`fp8mla.formats`: ``real value = stored value * scale``. The scales are ue8m0
bytes: byte ``e`` means ``2^(e - 127)`` (the OCP E8M0 code; 255 is not written).

==================  ==========================================================================================
format              bytes
==================  ==========================================================================================
``fp8_v4``          vLLM's V4 FP8 cache (FlashMLA's ``MODEL1_FP8Sparse`` layout), 584 bytes a token, laid out
(584 B / token)     per *page*, not per token: a page of ``page_size`` tokens holds first ``page_size`` data
                    rows of 576 bytes, then ``page_size`` scale rows of 8 bytes; the page is padded to a
                    multiple of 576 bytes (``page_bytes``). Data row of token ``s``, at byte ``576 s``:
                    [0, 448) the NoPE values as e4m3; [448, 576) the RoPE values as 64 bf16, unquantized.
                    Scale row of token ``s``, at byte ``576 page_size + 8 s``: bytes [0, 7) one ue8m0
                    scale per 64 NoPE values (byte g scales values [64 g, 64 g + 64)); byte 7 is padding
                    (written 0, never read).
``fp8_v41``         FlashMLA's V4.1 record, 528 bytes a token, data and scales together per token:
(528 B / token)     [0, 512) all 512 values (NoPE and RoPE) as e4m3; [512, 528) one ue8m0 scale per 32
                    values (byte g scales values [32 g, 32 g + 32)).
``bf16``            512 bf16 values a token (1024 B), no scales.
==================  ==========================================================================================

Pool tensors (the attention and the writers take each of these shapes):
  ``fp8_v4``: uint8 (or float8_e4m3fn, the same bytes) ``[P, page_bytes]``, or the per-token views
  ``[P, page_size, 584]`` / ``[P, page_size, 1, 584]`` whose page stride is ``page_bytes`` (FlashMLA and vLLM
  view the padded pages so); only the page stride and the byte offsets above are used.
  ``fp8_v41``: uint8 ``[P, page_size, 528]`` or ``[P, page_size, 1, 528]`` (records contiguous in a page).
  ``bf16``: bfloat16 ``[P, page_size, 512]`` or ``[P, page_size, 1, 512]``.
A token is named by its slot ``page * page_size + offset``, as in the sparse (DSA) API.

Scale choice, as FlashMLA's quantizer (``tests/quant.py``) writes both FP8 layouts: per group,
``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` (amax over the group's values), then
``e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even (dividing by a power of two is exact). The
ceiling keeps ``|x / scale| <= 448``: the clamp only matters for non-finite input. Differences, for non-finite
input only: NaN and +-inf do not count in the amax here (one NaN does not spoil its group's scale; +-inf saturates
to +-448 x scale; NaN is stored as NaN). RoPE values of ``fp8_v4`` are rounded to bf16 (saturating at the bf16
maximum, never inf). ``bf16`` stores ``bf16(clamp(x))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["V4Format", "V4_FORMATS", "get_v4_format", "HEAD_DIM", "NOPE_DIM", "ROPE_DIM"]

HEAD_DIM, NOPE_DIM, ROPE_DIM = 512, 448, 64
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4          # FlashMLA's lower bound on amax / 448 before the power-of-two ceiling
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@dataclass(frozen=True)
class V4Format:
    """One V4 pool format. ``kind``: 0 bf16, 1 fp8_v4 (page-separated scales), 2 fp8_v41 (per-token records)."""

    name: str
    kind: int
    token_bytes: int        # bytes one token takes (scales included, page padding not)
    group: int              # values per ue8m0 scale (0: no scales)
    fp8_dims: int           # leading values stored as e4m3 (the rest bf16)

    @property
    def is_fp8(self) -> bool:
        return self.kind != 0

    @property
    def num_scales(self) -> int:
        return self.fp8_dims // self.group if self.group else 0

    def page_bytes(self, page_size: int) -> int:
        """Bytes between pages: ``fp8_v4`` pads a page to a multiple of 576 bytes (as vLLM and FlashMLA)."""
        raw = page_size * self.token_bytes
        return -(-raw // 576) * 576 if self.kind == 1 else raw

    def new_pool(self, num_pages: int, page_size: int, device=None) -> torch.Tensor:
        """A zeroed pool: ``fp8_v4`` the uint8 view ``[P, page_size, 584]`` of padded ``[P, page_bytes]`` pages
        (as FlashMLA's and vLLM's), ``fp8_v41`` uint8 ``[P, page_size, 528]``, ``bf16`` ``[P, page_size, 512]``."""
        if self.kind == 1:
            flat = torch.zeros(num_pages, self.page_bytes(page_size), dtype=torch.uint8, device=device)
            return flat[:, :page_size * self.token_bytes].view(num_pages, page_size, self.token_bytes)
        if self.kind == 2:
            return torch.zeros(num_pages, page_size, self.token_bytes, dtype=torch.uint8, device=device)
        return torch.zeros(num_pages, page_size, HEAD_DIM, dtype=torch.bfloat16, device=device)

    # -- scales and values ----------------------------------------------------------------------------------
    def scale_bytes(self, kv: torch.Tensor) -> torch.Tensor:
        """ue8m0 scale bytes ``uint8 [..., num_scales]`` of rows ``kv [..., 512]`` (see the module docstring)."""
        a = kv[..., :self.fp8_dims].float().abs().reshape(*kv.shape[:-1], self.num_scales, self.group)
        amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
        r = torch.div(amax, torch.full((), E4M3_MAX, device=amax.device)).clamp_min(SCALE_FLOOR)
        return ue8m0_ceil(r)

    def encode(self, kv: torch.Tensor):
        """``(e4m3 codes [..., fp8_dims] uint8, scale bytes [..., num_scales] uint8, bf16 rest [..., 512 -
        fp8_dims])`` of rows ``kv [..., 512]``: what a write stores, before it is placed in the pool."""
        _check_rows("kv", kv)
        if not self.is_fp8:
            return None, None, _to_bf16(kv)
        sb = self.scale_bytes(kv)
        inv = ue8m0_value(254 - sb.to(torch.int32))  # 2^-(e - 127): an exact reciprocal of the scale
        x = kv[..., :self.fp8_dims].float().reshape(*kv.shape[:-1], self.num_scales, self.group)
        y = (x * inv[..., None]).reshape(*kv.shape[:-1], self.fp8_dims).clamp(-E4M3_MAX, E4M3_MAX)
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, sb, _to_bf16(kv[..., self.fp8_dims:])

    # -- pool access ----------------------------------------------------------------------------------------
    def write(self, pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, *,
              page_size: int | None = None) -> None:
        """Quantize rows ``kv [T, 512]`` into ``pool`` at token slots ``slots [T]`` (torch code; the Triton
        writer ``fp8mla.kernels.quant_v4`` stores the same bytes). Slots must be in the pool (checked).
        ``page_size``: needed only for a flat ``[P, page_bytes]`` ``fp8_v4`` pool."""
        page_size, view = pool_geometry(self, pool, page_size)
        slots = _check_slots(slots, kv, pool.shape[0] * page_size)
        codes, sb, rest = self.encode(kv)
        page, off = slots // page_size, slots % page_size
        if self.kind == 0:
            view[page, off] = rest
            return
        flat = view  # uint8 [P, page_bytes]
        if self.kind == 1:
            row = (off * 576)[:, None]
            srow = (page_size * 576 + off * 8)[:, None]
            flat[page[:, None], row + torch.arange(NOPE_DIM, device=pool.device)] = codes
            flat[page[:, None], row + NOPE_DIM + torch.arange(2 * ROPE_DIM, device=pool.device)] = \
                rest.contiguous().view(torch.uint8)
            flat[page[:, None], srow + torch.arange(8, device=pool.device)] = \
                torch.cat([sb, torch.zeros_like(sb[:, :1])], dim=1)
        else:
            row = (off * self.token_bytes)[:, None]
            flat[page[:, None], row + torch.arange(HEAD_DIM, device=pool.device)] = codes
            flat[page[:, None], row + HEAD_DIM + torch.arange(16, device=pool.device)] = sb

    def read(self, pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype = torch.float32, *,
             page_size: int | None = None) -> torch.Tensor:
        """Dequantized rows ``[T, 512]`` in ``dtype`` of the tokens at ``slots [T]`` (all in the pool)."""
        page_size, view = pool_geometry(self, pool, page_size)
        slots = slots.to(device=pool.device, dtype=torch.long)
        page, off = slots // page_size, slots % page_size
        if self.kind == 0:
            return view[page, off].to(dtype)
        if self.kind == 1:
            row = (off * 576)[:, None]
            srow = (page_size * 576 + off * 8)[:, None]
            codes = view[page[:, None], row + torch.arange(NOPE_DIM, device=pool.device)]
            rope = view[page[:, None], row + NOPE_DIM + torch.arange(2 * ROPE_DIM, device=pool.device)]
            sb = view[page[:, None], srow + torch.arange(7, device=pool.device)]
            rope = rope.contiguous().view(torch.bfloat16).to(dtype)
        else:
            row = (off * self.token_bytes)[:, None]
            codes = view[page[:, None], row + torch.arange(HEAD_DIM, device=pool.device)]
            sb = view[page[:, None], row + HEAD_DIM + torch.arange(16, device=pool.device)]
            rope = None
        vals = codes.contiguous().view(torch.float8_e4m3fn).to(dtype)
        scale = ue8m0_value(sb.to(torch.int32)).to(dtype).repeat_interleave(self.group, dim=-1)
        nope = vals * scale
        return nope if rope is None else torch.cat([nope, rope], dim=-1)


def ue8m0_ceil(r: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte of ``2^ceil(log2(r))`` for positive normal fp32 ``r``, from its bits (exact; the same
    integer rule as the Triton writer): the exponent field, plus one when any mantissa bit is set."""
    b = r.float().contiguous().view(torch.int32)
    e = (b >> 23) & 0xFF
    return (e + ((b & 0x7FFFFF) != 0).to(torch.int32)).to(torch.uint8)


def ue8m0_value(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(e - 127)`` of ue8m0 bytes ``e`` (int tensor) from the exponent bits (byte 0 reads as 0)."""
    return (e.to(torch.int32) << 23).view(torch.float32)


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)


def _check_rows(name: str, kv) -> None:
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point() or kv.shape[-1:] != (HEAD_DIM,):
        got = f"{kv.dtype} {list(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"{name}: expected a float tensor [..., {HEAD_DIM}] (448 NoPE + 64 RoPE), got {got}")


def _check_slots(slots, kv, num_slots: int) -> torch.Tensor:
    _check_rows("kv", kv)
    if kv.dim() != 2:
        raise ValueError(f"kv: expected [T, {HEAD_DIM}], got {list(kv.shape)}")
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or \
            slots.shape != (kv.shape[0],):
        got = f"{slots.dtype} {list(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots: expected int32/int64 [{kv.shape[0]}], got {got}")
    s = slots.to(device=kv.device, dtype=torch.long)
    if s.numel() and bool(((s < 0) | (s >= num_slots)).any()):
        raise ValueError(f"slots: expected values in [0, {num_slots}), got min {int(s.min())} max {int(s.max())}")
    return s


def pool_geometry(fmt: V4Format, pool: torch.Tensor, page_size: int | None = None):
    """``(page_size, view)`` of a pool in any accepted shape: ``view`` is uint8 ``[P, page_bytes]`` (FP8 formats;
    a view of the same bytes) or bf16 ``[P, page_size, 512]``. Raises ValueError naming what does not fit."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool: expected a tensor, got {type(pool).__name__}")
    if pool.dim() == 4:
        if pool.shape[2] != 1:
            raise ValueError(f"pool: a 4-d pool is [P, page_size, 1, width] (one KV head), got {list(pool.shape)}")
        pool = pool[:, :, 0]
    if fmt.kind == 0:
        if pool.dtype != torch.bfloat16 or pool.dim() != 3 or pool.shape[-1] != HEAD_DIM:
            raise ValueError(f"pool: format 'bf16' expects bfloat16 [P, page_size, {HEAD_DIM}], got {pool.dtype} "
                             f"{list(pool.shape)}")
        if page_size is not None and pool.shape[1] != page_size:
            raise ValueError(f"pool: expected page_size {page_size} tokens a page, got {pool.shape[1]}")
        if pool.stride(-1) != 1:
            raise ValueError(f"pool: expected a contiguous last dimension, got strides {tuple(pool.stride())}")
        return pool.shape[1], pool
    if pool.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"pool: format {fmt.name!r} expects uint8 bytes (or float8_e4m3fn), got {pool.dtype}")
    pool = pool.view(torch.uint8)
    if pool.dim() == 3:
        width = pool.shape[2]
        if width != fmt.token_bytes:
            raise ValueError(f"pool: format {fmt.name!r} has {fmt.token_bytes}-byte records, got a record width "
                             f"of {width} ({list(pool.shape)})")
        if page_size is not None and pool.shape[1] != page_size:
            raise ValueError(f"pool: expected page_size {page_size} tokens a page, got {pool.shape[1]}")
        page_size = pool.shape[1]
        if pool.stride(2) != 1 or (page_size > 1 and pool.stride(1) != width):
            raise ValueError(f"pool: expected the records of a page contiguous, got strides {tuple(pool.stride())}")
        need = page_size * width
        if pool.shape[0] > 1 and pool.stride(0) < need:
            raise ValueError(f"pool: pages overlap: stride {pool.stride(0)} bytes, a page needs {need}")
        flat = torch.as_strided(pool, (pool.shape[0], need), (pool.stride(0), 1), pool.storage_offset())
        return page_size, flat
    if pool.dim() == 2:  # flat pages [P, page_bytes] (fp8_v4's own shape; fp8_v41 as the kernels view it)
        if page_size is None:
            raise ValueError(f"pool: a flat [P, page_bytes] {fmt.name} pool needs the page size (plan's page_size)")
        if pool.shape[1] < page_size * fmt.token_bytes or pool.stride(1) != 1:
            raise ValueError(f"pool: format {fmt.name!r} with {page_size} tokens a page needs >= "
                             f"{page_size * fmt.token_bytes} contiguous bytes a page, got {list(pool.shape)} "
                             f"strides {tuple(pool.stride())}")
        return page_size, pool
    raise ValueError(f"pool: format {fmt.name!r} expects {_SHAPES[fmt.kind]}, got {list(pool.shape)}")


_SHAPES = {1: "[P, page_bytes], [P, page_size, 584] or [P, page_size, 1, 584]",
           2: "[P, page_size, 528], [P, page_size, 1, 528] or [P, page_bytes]"}

V4_FORMATS: dict[str, V4Format] = {f.name: f for f in (
    V4Format("fp8_v4", 1, 584, 64, NOPE_DIM),
    V4Format("fp8_v41", 2, 528, 32, HEAD_DIM),
    V4Format("bf16", 0, 1024, 0, 0),
)}


def get_v4_format(spec, *, arg: str = "kv_format") -> V4Format:
    """A :class:`V4Format` from its name (``"fp8_v4"``, ``"fp8_v41"``, ``"bf16"``) or itself."""
    if isinstance(spec, V4Format):
        return spec
    if isinstance(spec, str) and spec in V4_FORMATS:
        return V4_FORMATS[spec]
    if spec is torch.bfloat16:
        return V4_FORMATS["bf16"]
    raise ValueError(f"{arg}: expected one of {list(V4_FORMATS)}, got {spec!r}")
