"""The checks of :class:`~fp8mla.cache.PagedMLACache`'s arguments: its per-tensor scales, sequence ids and
device (each error names the argument, what was expected and what came), and the device's memory size."""
from __future__ import annotations

import torch

from ._checks import as_int, as_real
from .formats import KVFormat

__all__ = ["check_budget_bytes", "check_budget_fits", "check_cache_scale", "check_device", "check_unused_scales",
           "device_memory", "hashable_id", "id_list"]


def check_unused_scales(fmt: KVFormat, ckv_scale, kpe_scale) -> None:
    """A per-tensor scale the format does not use must stay 1.0 (the identity): anything else was meant to
    scale the stored values, and the format would drop it without a word."""
    if fmt.scale_kind != "tensor" and ckv_scale != 1.0:
        why = ("its c_kv scales are per token and 128 channels, computed on write"
               if fmt.scale_kind in ("group", "record") else "it stores values as they are")
        raise ValueError(f"ckv_scale: the {fmt.name} format takes no per-tensor c_kv scale ({why}); expected "
                         f"1.0 (the default), got {ckv_scale!r}")
    if (not fmt.is_fp8 or fmt.scale_kind == "record") and kpe_scale != 1.0:
        raise ValueError(f"kpe_scale: the {fmt.name} format takes no per-tensor scale (it stores k_pe as "
                         f"{'bf16' if fmt.is_fp8 else 'it is'}); expected 1.0 (the default), got {kpe_scale!r}")


def check_cache_scale(name: str, v) -> float:
    """A per-tensor scale of the cache: a positive finite float."""
    x = as_real(v)
    if x is None or not 0 < x < float("inf"):  # (NaN fails too)
        raise ValueError(f"{name}: expected a positive finite float, got {v!r}")
    return float(x)


def hashable_id(seq_id):
    """``seq_id`` as the sequence table's key, or an error naming it when it cannot key the table (a list, a set,
    ...). Integer scalars (numpy's, 0-d CPU tensors) become ints: a tensor hashes by identity, so as a key it would
    never be found again. A tuple is refused too: where one id or several are taken (``reserve``,
    ``plan_inputs``, ...), a tuple is a list of ids, so a tuple id would be read as the ids it holds (a misleading
    "no sequence" KeyError, or another sequence)."""
    i = as_int(seq_id)
    if i is not None:
        return i
    if isinstance(seq_id, torch.Tensor):
        raise TypeError(f"seq_id: expected an int or a str, got a tensor of shape {tuple(seq_id.shape)} on "
                        f"{seq_id.device} (one id: a 0-d integer tensor on the CPU, or int(t))")
    if isinstance(seq_id, tuple):
        raise TypeError(f"seq_id: expected an int or a str, got a tuple {seq_id!r} (seq_ids reads a tuple as a list "
                        f"of ids, so a tuple cannot be an id itself)")
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"seq_id: expected a hashable id (an int or a str), got a {type(seq_id).__name__}: "
                        f"{seq_id!r}") from None
    return seq_id


def check_device(device) -> torch.device:
    """The device as a torch.device, or an error naming ``device`` (torch's own is an assert about how it was
    compiled, or a parse error listing every device type it knows)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}") \
            from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}); expected 'cpu' here")
        if d.index is not None and d.index >= n:
            raise ValueError(f"device: expected cuda:0 .. cuda:{n - 1} ({n} CUDA device(s)), got {device!r}")
    elif d.type != "cpu":
        mod = getattr(torch, d.type, None)
        if mod is not None and hasattr(mod, "is_available") and not mod.is_available():
            raise ValueError(f"device: {device!r} asked for, but torch has no such device available")
    return d


def device_memory(device: torch.device):
    """Total bytes of ``device``'s memory, or None when it cannot be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            import os
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass
    return None


def id_list(seq_ids) -> list:
    """One id (an int, a str, ...) or an ordered collection of ids (list, tuple, range, 1-D tensor, any other
    iterable), as a list. Sets and dicts are refused: their order is not the caller's, and the rows of c_kv,
    the slots returned and the plan follow the order of ``seq_ids``."""
    if isinstance(seq_ids, (list, tuple, range)):
        return list(seq_ids)
    if isinstance(seq_ids, (set, frozenset, dict)):
        raise TypeError(f"seq_ids: expected one id or a list or tuple of ids (in the order of the rows), got "
                        f"a {type(seq_ids).__name__}")
    if isinstance(seq_ids, torch.Tensor):  # a tensor hashes by identity: never use one as an id itself
        return seq_ids.tolist() if seq_ids.dim() else [seq_ids.item()]
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        return [seq_ids]
    return list(seq_ids)


def check_budget_bytes(budget_bytes) -> float:
    """``PagedMLACache.from_memory_budget``'s budget: a positive finite number of bytes (numpy numbers and 0-d CPU
    tensors are numbers too)."""
    if as_real(budget_bytes) is None:
        raise TypeError(f"budget_bytes: expected a number of bytes (an int such as 2 * 1024**3), got "
                        f"{budget_bytes!r} ({type(budget_bytes).__name__})")
    budget_bytes = as_real(budget_bytes)
    if not 0 < budget_bytes < float("inf"):  # NaN fails too
        raise ValueError(f"budget_bytes: expected a positive finite number of bytes, got {budget_bytes!r}")
    return budget_bytes


def check_budget_fits(budget_bytes: float, device: torch.device) -> None:
    """A budget no larger than the device's memory (where it can be told)."""
    total = device_memory(device)
    if total is not None and budget_bytes > total:
        raise ValueError(f"budget_bytes: {budget_bytes:.4g} B is more than the memory of {device} "
                         f"({total:.4g} B); expected a budget that fits")
