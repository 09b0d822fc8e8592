"""``fp8mla.sentinel``: the runtime guard against pool-wide casts (lives in :mod:`fp8mla.tools.sentinel`)."""
from .tools.sentinel import PoolCastError, forbid_pool_casts

__all__ = ["PoolCastError", "forbid_pool_casts"]
