"""The checks of ``MLAPagedAttention``'s arguments that need no wrapper state: its constructor's kernel options
and batch-invariant mode, the exception of a refused plan, and run()'s page-table and scale arguments (FlashInfer's
rules: an FP8 run needs its scales, never a silent 1.0)."""
from __future__ import annotations

import torch

from ._checks import as_int, check_positive_int, check_tensor
from ._scales import DeviceScales, check_scale
from .backends import AttentionSpec
from .backends._invariant import GLUON_AUTO, check_chunk
from .backends.select import Refusal, refusal_error, select, without_gluon
from .formats import KVFormat
from .layout import PagedLayout, debug_checks

__all__ = ["check_given_table", "check_invariant_options", "check_kernel_options", "refusal_exception",
           "resolve_scales"]


_WARPS = (1, 2, 4, 8, 16)


def check_kernel_options(opts: dict) -> None:
    """The constructor's kernel options, checked by name; counts (numpy or 0-d tensor ints too) become ints in place."""
    for name in ("block_m", "block_n", "ctas_per_sm", "min_chunk", "max_batch_size", "max_qo_len",
                 "max_kv_indices", "num_stages", "max_partials"):
        if opts.get(name) is not None:
            opts[name] = check_positive_int(name, opts[name])  # numpy / 0-d tensor counts become ints here
    if opts.get("num_warps") is not None:
        if as_int(opts["num_warps"]) not in _WARPS:
            raise ValueError(f"num_warps: expected one of {_WARPS}, got {opts['num_warps']!r}")
        opts["num_warps"] = as_int(opts["num_warps"])
    if opts.get("v_convert") is not None and opts["v_convert"] not in ("plain", "asm"):
        raise ValueError(f"v_convert: expected 'plain' or 'asm', got {opts['v_convert']!r}")
    for name in ("evict_first", "index64", "fp8_math", "heads_on_m"):
        if opts.get(name) is not None and not isinstance(opts[name], bool):
            raise ValueError(f"{name}: expected True, False or None, got {opts[name]!r}")


def refusal_exception(r: Refusal, q) -> Exception:
    """The exception of a refused plan. Under ``auto`` only an option that asks for a gluon build (``fp8_math``,
    ``heads_on_m=True``) leaves no build: named with where the plan would run without it, and what gluon misses."""
    if r.requested != "auto" or not (q.fp8_math or q.heads_on_m):
        return refusal_error(r)
    flag, what = ("fp8_math", "FP8 tensor-core math runs") if q.fp8_math else \
        ("heads_on_m", "the heads-on-M build runs")
    return ValueError(f"{flag}: {what} on the gluon kernel only, and this plan would run on "
                      f"{select(without_gluon(q)).backend!r}: {r.reason}")


def check_invariant_options(batch_invariant, backend: str, opts: dict) -> None:
    """The batch-invariant mode's arguments: the options that require the gluon builds need them named (``auto``
    keeps the triton kernel in the mode), and its tuning options are taken only with the mode on."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
    if not batch_invariant:
        for name in ("invariant_chunk", "max_partials"):
            if opts.get(name) is not None:
                raise ValueError(f"{name}: an option of the batch-invariant mode; pass batch_invariant=True with it")
        return
    for name in ("fp8_math", "heads_on_m"):
        if opts.get(name) and backend != "gluon":
            raise ValueError(f"{name}: runs on the gluon kernel only, and {GLUON_AUTO}")
    if opts.get("invariant_chunk") is not None:
        check_chunk("invariant_chunk", opts["invariant_chunk"])


def check_given_table(kv_len, page_table, layout: PagedLayout, given_rows: int) -> None:
    """FlashInfer's run() takes kv_len/page_table for another backend; fp8mla reads the planned table. A
    different table given here would be ignored silently, so it is compared where that costs no sync.
    (``given_rows``: the batch plan() was given; trailing requests without queries may not be in ``layout``.)"""
    B = layout.batch_size
    if kv_len is not None:
        check_tensor("kv_len", kv_len, ndim=1)
        if kv_len.numel() != given_rows:
            raise ValueError(f"kv_len: expected {given_rows} entries (the planned batch), got {kv_len.numel()}")
        if kv_len.device.type == "cpu" and layout.kv_lens is not None and kv_len[:B].tolist() != layout.kv_lens:
            raise ValueError("kv_len: differs from the planned kv_len_arr; re-plan to change lengths")
    if page_table is not None:
        check_tensor("page_table", page_table, ndim=2)
        if page_table.shape[0] != given_rows:
            raise ValueError(f"page_table: expected {given_rows} rows (the planned batch), got "
                             f"{page_table.shape[0]}")

def resolve_scales(scales: DeviceScales, fmt: KVFormat, ckv_scale, kpe_scale, ckv_scale_arr, P: int,
                   spec: AttentionSpec) -> torch.Tensor:
    """The fp32 [2] device tensor (ckv, kpe) the kernels read, set in ``scales`` (the wrapper's
    ``DeviceScales``): run()'s scale arguments checked against the plan's format (FlashInfer's rules)."""
    Dc = spec.head_dim_ckv
    if fmt.scale_kind == "group":
        if ckv_scale_arr is None:
            raise ValueError(f"ckv_scale_arr: the plan's kv_data_type {fmt.name!r} needs per-token group "
                             "scales, got None")
        check_tensor("ckv_scale_arr", ckv_scale_arr, dtype=torch.float32,
                     shape=(P, spec.page_size, fmt.num_groups(Dc)), device=spec.device)
        if ckv_scale_arr.stride(-1) != 1:
            raise ValueError(f"ckv_scale_arr: expected a contiguous last dimension, got strides "
                             f"{ckv_scale_arr.stride()}")
        if ckv_scale is not None:
            raise ValueError("ckv_scale: with ckv_scale_arr the c_kv scales are per group; pass exactly one "
                             f"of ckv_scale / ckv_scale_arr (as FlashInfer), got ckv_scale={ckv_scale!r}")
        ckv_scale = 1.0
    elif ckv_scale_arr is not None:
        raise ValueError(f"ckv_scale_arr: the plan's kv_data_type {fmt.name!r} has no group scales; plan "
                         "with kv_data_type torch.float8_e4m3fn or 'fp8_e4m3_group' to use ckv_scale_arr")
    elif fmt.is_fp8 and ckv_scale is None:
        # (FlashInfer's wording first: code written against its wrapper matches on it)
        raise ValueError(f"ckv_scale: ckv_scale and kpe_scale are required for an FP8 pool ({fmt.name}; real = "
                         "stored x scale): pass exactly one of ckv_scale (per tensor) / ckv_scale_arr (per-token "
                         "groups), and kpe_scale; got neither ckv_scale nor ckv_scale_arr")
    if fmt.is_fp8 and kpe_scale is None:
        raise ValueError(f"kpe_scale: ckv_scale and kpe_scale are required for an FP8 pool ({fmt.name}; real = "
                         "stored x scale; kpe_scale 1.0 when k_pe was stored unscaled), got kpe_scale=None")
    ckv = check_scale("ckv_scale", ckv_scale, fmt, spec.device, allowed=fmt.scale_kind == "tensor")
    kpe = check_scale("kpe_scale", kpe_scale, fmt, spec.device, allowed=fmt.is_fp8)
    return scales.set(ckv, kpe, spec.device, debug_checks())
