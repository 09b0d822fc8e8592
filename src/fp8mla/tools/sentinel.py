"""A runtime guard: fail loudly when any torch op converts (most of) a registered KV pool to another dtype.

>>> import torch
>>> from fp8mla.tools.sentinel import forbid_pool_casts, PoolCastError
>>> pool = torch.zeros(64, 16, 576).to(torch.float8_e4m3fn)
>>> with forbid_pool_casts(pool):
...     ok = pool[:2].to(torch.bfloat16)       # gather-then-cast: 2 of 64 pages
>>> try:
...     with forbid_pool_casts(pool):
...         pool.to(torch.bfloat16)             # the whole pool
... except PoolCastError as e:
...     print("caught")
caught

It is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, so it sees every ATen op that runs on
tensors (``.to``, ``.float()``, ``.type_as``, ``copy_`` into a buffer of another dtype, ...), whatever Python
code issued it. An op *reads a pool* when one of its tensor arguments overlaps the pool's memory (the pool
itself or any view of it); it is a *pool cast* when it also returns a tensor of another dtype, not in the
pool's memory (views such as ``pool.view(torch.uint8)`` reinterpret and move nothing), with more than
``max_fraction`` of the pool's elements. Triton kernels launched directly are not ATen ops and are not seen:
the guard checks the glue around them, which is where the cast bug lives.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._checks import plain_number

__all__ = ["PoolCastError", "forbid_pool_casts", "pool_tensors"]


# ops that take the pool only for its shape/dtype/device and read none of its values
_METADATA_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
                  "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full"}


class PoolCastError(RuntimeError):
    """An op converted more than ``max_fraction`` of a registered KV pool to another dtype."""


def _span(t: torch.Tensor):
    """(start, end) byte addresses a tensor can touch; None when it has no storage we can see."""
    try:
        if t.numel() == 0 or t.device.type == "meta":
            return None
        start = t.data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses / tensors without storage
        return None
    extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def pool_tensors(*pools) -> list:
    """Tensors to register: tensors as given; a :class:`~fp8mla.cache.PagedMLACache` as one tensor per layer,
    because a per-layer cast of a ``[L, ...]`` pool moves 1/L of it and must still count as a whole pool."""
    out = []
    for p in pools:
        if isinstance(p, torch.Tensor):
            out.append(p)
        elif isinstance(p, (list, tuple)):
            out += pool_tensors(*p)
        elif hasattr(p, "pool") and isinstance(p.pool, torch.Tensor) and hasattr(p, "num_layers"):
            out += [p.pool[i] for i in range(p.num_layers)]
        else:
            raise TypeError(f"pools: expected tensors or a PagedMLACache, got {type(p).__name__}")
    return out


class forbid_pool_casts(TorchDispatchMode):
    """Context manager that raises :class:`PoolCastError` when an op reads one of ``pools`` (or a view of it)
    and writes a tensor of another dtype holding more than ``max_fraction`` of that pool's elements.

    Args:
        *pools: KV pool tensors (one per layer), lists of them, or a ``PagedMLACache``.
        max_fraction: largest allowed size of a converted copy, as a fraction of the pool's elements (default
            0.5). Gathering the active tokens and converting those passes while they are under this fraction.
    """

    def __init__(self, *pools, max_fraction: float = 0.5):
        super().__init__()
        max_fraction = plain_number(max_fraction)
        if not isinstance(max_fraction, (int, float)) or isinstance(max_fraction, bool) or not 0 <= max_fraction:
            raise ValueError(f"max_fraction: expected a non-negative float, got {max_fraction!r}")
        self.pools = pool_tensors(*pools)
        if not self.pools:
            raise ValueError("pools: expected at least one pool tensor")
        self.max_fraction = float(max_fraction)
        # address ranges are taken now: a pool must not be reallocated while the guard is on
        self._spans = [(p, _span(p)) for p in self.pools]
        self.ops_checked = 0   # how many ops read a pool (tests assert the guard actually saw the path)

    def _overlaps(self, t: torch.Tensor):
        s = _span(t)
        if s is None:
            return []
        return [(i, p) for i, (p, ps) in enumerate(self._spans)
                if ps is not None and p.device == t.device and s[0] < ps[1] and ps[0] < s[1]]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ in _METADATA_ONLY:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        read, seen = {}, {}
        for t in inputs:
            for i, p in self._overlaps(t):
                read[i] = p
                seen.setdefault(i, set()).add(t.dtype)   # the dtypes the op read the pool as (views included)
        if not read:
            return out
        self.ops_checked += 1
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                continue
            in_pool = self._overlaps(o)
            for i, p in read.items():
                if o.dtype == p.dtype or o.dtype in seen[i] or any(j == i for j, _ in in_pool):
                    # same dtype (a gather or a copy), a gather through a view that reinterprets the pool's bytes
                    # (an engine's uint8 FP8 pool read as e4m3: nothing is converted), or a view / in-place write
                    continue
                if o.numel() > self.max_fraction * p.numel():
                    raise PoolCastError(
                        f"{func} converted {o.numel()} elements ({o.numel() / p.numel():.0%}) of KV pool #{i} "
                        f"({p.dtype}, shape {list(p.shape)}, {p.numel()} elements) to {o.dtype} (output shape "
                        f"{list(o.shape)}); the limit is {self.max_fraction:.0%}. Read the pool in its own dtype "
                        "(plan kv_data_type = the pool's dtype) or gather the active tokens before converting.")
        return out
