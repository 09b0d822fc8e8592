"""Verification tools for the KV-cast bug class, for fp8mla's users' own serving code:

- :mod:`~fp8mla.tools.doctor`: ``fp8mla doctor TRACE`` diagnoses a torch profiler trace (where a step's time
  goes; dtype casts of a KV pool repeated once per layer, their cost per step and the fix);
- :mod:`~fp8mla.tools.audit`: ``fp8mla audit PATH...`` checks attention-backend sources statically;
- :mod:`~fp8mla.tools.sentinel`: :func:`forbid_pool_casts`, a runtime guard for tests.

Tools may import formats, cache and attention; nothing in the core imports the tools.
"""


def __getattr__(name):
    # imported on first access (PEP 562): the sentinel needs torch, `fp8mla audit` must not load it
    if name in ("PoolCastError", "forbid_pool_casts"):
        from . import sentinel
        return getattr(sentinel, name)
    raise AttributeError(f"module 'fp8mla.tools' has no attribute {name!r}")


__all__ = ["PoolCastError", "forbid_pool_casts"]
