"""KV storage formats of the MLA latent cache.

Each token of each layer stores one latent: ``c_kv`` (``head_dim_ckv``, 512 for DeepSeek) followed by ``k_pe``
(``head_dim_kpe``, 64). The pool is one tensor ``[num_pages, page_size, head_dim_ckv + head_dim_kpe]`` of the
storage dtype; ``ckv_cache``/``kpe_cache`` are strided views of it (columns ``[:512]`` and ``[512:]``).

Scale convention everywhere: ``real value = stored value * scale``.

Per-token byte layout (512 + 64 dims):

==================  =======================================================================  ==========
format              bytes of one token, in order                                             bytes/token
==================  =======================================================================  ==========
``bf16``            c_kv 512 x bf16 (1024 B) | k_pe 64 x bf16 (128 B)                        1152
``fp16``            c_kv 512 x fp16 (1024 B) | k_pe 64 x fp16 (128 B)                        1152
``fp8_e4m3``        c_kv 512 x e4m3 (512 B) | k_pe 64 x e4m3 (64 B); one fp32 scale for     576
                    all c_kv and one for all k_pe of the layer (SGLang / vLLM ``k_scale``)
``fp8_e4m3_group``  c_kv 512 x e4m3 | k_pe 64 x e4m3 in the pool (576 B) + 4 x fp32 in a     592
                    side tensor ``ckv_scale_arr [P, page, 4]`` (16 B): one scale per 128
                    channels of c_kv (FlashInfer's ``ckv_scale_arr``); k_pe keeps one
                    per-tensor scale
``fp8_e5m2``        as ``fp8_e4m3`` with e5m2 values (per-tensor scales)                     576
``fp8_ds_mla``      one 656-byte record per token in a uint8 pool ``[P, page, 656]`` (FlashMLA's  656
                    sparse FP8 record, vLLM's ``fp8_ds_mla``): bytes [0, 512) c_kv as 512 e4m3;
                    [512, 528) 4 x fp32 little-endian scales, scale g for c_kv channels
                    [128 g, 128 g + 128); [528, 656) k_pe as 64 x bf16, unquantized.
                    Sparse attention only (``fp8mla.sparse``); the dense kernels refuse it.
==================  =======================================================================  ==========

Quantization saturates: values beyond the format's range are clamped to +-max (448 for e4m3, 57344 for e5m2);
overflow never makes NaN or inf. NaN inputs stay NaN.

``fp8_ds_mla`` writes what vLLM's ``concat_and_cache_ds_mla`` kernel writes: scale = ``max(amax / 448, FLT_MIN)``
over the 128 channels of a group (stored as a plain fp32, not rounded to a power of two), values
``e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even; k_pe rounded to bf16. One difference, for
non-finite inputs only: NaN and +-inf do not count in the amax here (as in the group format), so one NaN does
not spoil its group's other values and +-inf saturates to +-448 x scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import plain_number

__all__ = ["KVFormat", "FORMATS", "get_format", "GROUP_SIZE", "DSMLAFormat", "FP8_DS_MLA", "SPARSE_FORMATS"]

GROUP_SIZE = 128  # channels of c_kv that share one scale in the group format


@dataclass(frozen=True)
class KVFormat:
    """One KV storage format. ``scale_kind`` is ``"none"``, ``"tensor"`` or ``"group"``."""

    name: str
    storage_dtype: torch.dtype
    scale_kind: str
    max_value: float  # largest finite stored magnitude (saturation bound)

    @property
    def is_fp8(self) -> bool:
        return self.storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    def num_groups(self, head_dim_ckv: int = 512) -> int:
        """Scales per token in ``ckv_scale_arr`` (0 unless the format has group scales)."""
        if self.scale_kind != "group":
            return 0
        if head_dim_ckv % GROUP_SIZE:
            raise ValueError(f"head_dim_ckv: the group format needs a multiple of {GROUP_SIZE}, got {head_dim_ckv}")
        return head_dim_ckv // GROUP_SIZE

    def bytes_per_token(self, head_dim_ckv: int = 512, head_dim_kpe: int = 64) -> int:
        """Bytes one token of one layer occupies, scales included (per-tensor scales cost nothing per token)."""
        return (head_dim_ckv + head_dim_kpe) * self.element_bytes + 4 * self.num_groups(head_dim_ckv)

    # -- quantize / dequantize ------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """Stored values of ``x`` (any float dtype): ``clamp(x / scale, -max, max)`` in the storage dtype.

        ``scale`` is a positive finite float, a 0-d tensor, or a tensor that broadcasts against ``x`` (group
        scales); zero, negative, NaN or inf is refused (``x / 0`` would store NaN and inf, saturated to
        plausible +-max values). A tensor scale is checked on the host: one device sync, so this is a host-side
        helper, not a hot path (the Triton write kernel has its own). ``x / scale``
        is an IEEE fp32 division (``fp32(x) / fp32(scale)``, rounded to nearest) on every device, so the stored
        bytes do not depend on where this runs (see ``_fp32_div``).
        """
        _check_scale(scale)
        unit = not isinstance(scale, torch.Tensor) and scale == 1.0
        y = x.float() if unit else _fp32_div(x.float(), scale)
        # clamp() keeps NaN and maps +-inf to +-max: saturating, never NaN or inf from overflow. The 16-bit
        # formats need it too: a plain cast turns fp16 values beyond 65504 into inf.
        return y.clamp(-self.max_value, self.max_value).to(self.storage_dtype)

    def dequantize(self, stored: torch.Tensor, scale: float | torch.Tensor = 1.0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Real values ``stored * scale`` in ``dtype``; ``scale`` as in :meth:`quantize` (checked the same way)."""
        _check_scale(scale)
        y = stored.to(dtype)
        if isinstance(scale, torch.Tensor):
            return y * scale.to(dtype)
        return y if scale == 1.0 else y * scale

    def group_scales(self, c_kv: torch.Tensor) -> torch.Tensor:
        """Per-token group scales for ``c_kv [..., D]``: ``amax(|finite values of the group|) / max`` as fp32
        ``[..., D // 128]``.

        NaN and +-inf do not count in the amax: one NaN must not turn the whole group's scale into NaN (or, as a
        fallback scale, clamp its finite values), and +-inf saturates to +-max like in the per-tensor formats.
        A group with no nonzero finite value (or whose scale underflows to 0) gets scale 1, so that quantizing
        never divides by zero.
        """
        g = self.num_groups(c_kv.shape[-1])
        a = c_kv.float().abs().reshape(*c_kv.shape[:-1], g, GROUP_SIZE)
        amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
        scale = _fp32_div(amax, self.max_value)
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def quantize_groups(self, c_kv: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Stored c_kv under group ``scales [..., D // 128]`` (from :meth:`group_scales`)."""
        return self.quantize(c_kv, expand_group_scales(scales, c_kv.shape[-1]))


def _check_scale(scale) -> None:
    """A scale must be positive and finite: real = stored x scale has no meaning for 0, < 0, NaN or inf."""
    if isinstance(scale, torch.Tensor):
        if not (scale.is_floating_point() and (scale.numel() == 0 or (bool(torch.isfinite(scale).all())
                and bool((scale > 0).all())))):
            bad = scale if scale.numel() <= 1 else f"a {scale.dtype} tensor of shape {list(scale.shape)} " \
                                                   "with zero, negative or non-finite values"
            raise ValueError(f"scale: expected positive finite values, got {bad}")
        return
    scale = plain_number(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a positive finite float or a float tensor, got {type(scale).__name__}")
    if not (0 < scale < float("inf")):  # NaN fails too
        raise ValueError(f"scale: expected a positive finite float, got {scale!r}")


def _fp32_div(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x / scale`` for fp32 ``x``: IEEE fp32 division rounded to nearest even, the same bits on every device.

    The divisor is an fp32 tensor on ``x``'s device, never a Python number: torch divides a tensor by a number
    differently per device and version (the CPU divides; CUDA multiplies by a reciprocal, computed in fp32 by some
    versions and in fp64 by others), which changes the last bit, and so an FP8 value now and then. A tensor
    divisor takes the elementwise division ``a / b`` everywhere, which is what the Triton write kernel computes
    (``div_rn``).
    """
    if isinstance(scale, torch.Tensor):
        s = scale.to(device=x.device, dtype=torch.float32)
    else:
        s = torch.full((), float(scale), dtype=torch.float32, device=x.device)
    return torch.div(x, s)


def expand_group_scales(scales: torch.Tensor, head_dim_ckv: int) -> torch.Tensor:
    """``[..., D // 128]`` scales repeated to ``[..., D]`` so they multiply c_kv elementwise."""
    return scales.repeat_interleave(head_dim_ckv // scales.shape[-1], dim=-1)


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("bf16", torch.bfloat16, "none", float(torch.finfo(torch.bfloat16).max)),
        KVFormat("fp16", torch.float16, "none", float(torch.finfo(torch.float16).max)),
        KVFormat("fp8_e4m3", torch.float8_e4m3fn, "tensor", 448.0),
        KVFormat("fp8_e4m3_group", torch.float8_e4m3fn, "group", 448.0),
        KVFormat("fp8_e5m2", torch.float8_e5m2, "tensor", 57344.0),
    )
}

_BY_DTYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def get_format(spec: str | torch.dtype | KVFormat, *, arg: str = "kv_data_type",
               sparse_ok: bool = False) -> KVFormat:
    """Resolve a format from its name, its storage dtype (per-tensor scales for FP8) or a :class:`KVFormat`.

    ``fp8_ds_mla`` (a record format only sparse attention reads) resolves only with ``sparse_ok``; otherwise it
    is refused by name, so the dense API never takes its uint8 pool for something else."""
    if isinstance(spec, KVFormat) or (isinstance(spec, str) and spec == FP8_DS_MLA.name):
        fmt = FP8_DS_MLA if isinstance(spec, str) else spec
        if fmt.name == FP8_DS_MLA.name and not sparse_ok:
            raise ValueError(f"{arg}: {fmt.name!r} is the sparse (DSA) record format; only "
                             "fp8mla.MLASparseAttention reads it, expected one of " + str(list(FORMATS)))
        return fmt
    if isinstance(spec, torch.dtype):
        if spec not in _BY_DTYPE:
            raise TypeError(f"{arg}: expected one of {list(_BY_DTYPE)} or a format name {list(FORMATS)}, got {spec}")
        return FORMATS[_BY_DTYPE[spec]]
    if isinstance(spec, str) and spec in FORMATS:
        return FORMATS[spec]
    raise ValueError(f"{arg}: expected a format name {list(FORMATS)} or a torch dtype, got {spec!r}")


class DSMLAFormat(KVFormat):
    """The 656-byte ``fp8_ds_mla`` record (see the module docstring for its bytes). The pool is uint8
    ``[..., 656]``; :meth:`pack` / :meth:`unpack` convert between records and ``(c_kv, k_pe)``."""

    CKV_BYTES, SCALE_BYTES, KPE_BYTES = 512, 16, 128
    SCALE_OFFSET, KPE_OFFSET, RECORD_BYTES = 512, 528, 656
    FLT_MIN = float(torch.finfo(torch.float32).tiny)

    @property
    def is_fp8(self) -> bool:
        return True

    def num_groups(self, head_dim_ckv: int = 512) -> int:
        self._check_dims(head_dim_ckv, 64)
        return 4

    def bytes_per_token(self, head_dim_ckv: int = 512, head_dim_kpe: int = 64) -> int:
        self._check_dims(head_dim_ckv, head_dim_kpe)
        return self.RECORD_BYTES

    @staticmethod
    def _check_dims(head_dim_ckv: int, head_dim_kpe: int) -> None:
        if (head_dim_ckv, head_dim_kpe) != (512, 64):
            raise ValueError(f"head_dim_ckv/head_dim_kpe: the fp8_ds_mla record holds 512 + 64, got "
                             f"{head_dim_ckv} + {head_dim_kpe}")

    def group_scales(self, c_kv: torch.Tensor) -> torch.Tensor:
        """``max(amax(|finite values of the group|) / 448, FLT_MIN)`` as fp32 ``[..., 4]`` (vLLM's rule)."""
        a = c_kv.float().abs().reshape(*c_kv.shape[:-1], 4, GROUP_SIZE)
        amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
        return _fp32_div(amax, self.max_value).clamp_min(self.FLT_MIN)

    def pack(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Records ``uint8 [..., 656]`` of ``c_kv [..., 512]`` and ``k_pe [..., 64]`` (any float dtype)."""
        self._check_dims(c_kv.shape[-1], k_pe.shape[-1])
        lead = c_kv.shape[:-1]
        scales = self.group_scales(c_kv)
        e4m3 = FORMATS["fp8_e4m3"]
        vals = e4m3.quantize(c_kv, expand_group_scales(scales, 512))
        # bf16 rounding of k_pe: a plain cast (round to nearest even); clamp keeps +-inf from fp32 overflow out
        kpe = k_pe.float().clamp(-FORMATS["bf16"].max_value, FORMATS["bf16"].max_value).to(torch.bfloat16)
        rec = torch.empty(*lead, self.RECORD_BYTES, dtype=torch.uint8, device=c_kv.device)
        rec[..., :512] = vals.view(torch.uint8)
        rec[..., 512:528] = scales.contiguous().view(torch.uint8).reshape(*lead, 16)
        rec[..., 528:] = kpe.contiguous().view(torch.uint8).reshape(*lead, 128)
        return rec

    def unpack(self, records: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(c_kv [..., 512], k_pe [..., 64])`` in ``dtype``: e4m3 x its group's scale, and the bf16 rope."""
        if records.dtype != torch.uint8 or records.shape[-1] != self.RECORD_BYTES:
            raise ValueError(f"records: expected uint8 [..., {self.RECORD_BYTES}], got {records.dtype} "
                             f"{list(records.shape)}")
        r = records.contiguous()
        vals = r[..., :512].view(torch.float8_e4m3fn).to(dtype)
        scales = r[..., 512:528].view(torch.float32).to(dtype)
        kpe = r[..., 528:].view(torch.bfloat16).to(dtype)
        return vals * expand_group_scales(scales, 512), kpe

    def quantize(self, x, scale=1.0):
        raise TypeError("quantize: an fp8_ds_mla record is not one stored dtype (e4m3 c_kv, fp32 scales, bf16 k_pe): "
                        "use pack(c_kv, k_pe)")

    def dequantize(self, stored, scale=1.0, dtype=torch.float32):
        raise TypeError("dequantize: an fp8_ds_mla record is not one stored dtype: use unpack(records)")

    def quantize_groups(self, c_kv, scales):
        raise TypeError("quantize_groups: an fp8_ds_mla record is written whole: use pack(c_kv, k_pe)")

    def scales_of(self, records: torch.Tensor) -> torch.Tensor:
        """The fp32 ``[..., 4]`` scales stored in records ``uint8 [..., 656]``."""
        return records.contiguous()[..., 512:528].view(torch.float32)


FP8_DS_MLA = DSMLAFormat("fp8_ds_mla", torch.uint8, "record", 448.0)
SPARSE_FORMATS: dict[str, KVFormat] = {**FORMATS, FP8_DS_MLA.name: FP8_DS_MLA}
