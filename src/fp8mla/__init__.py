"""fp8mla: Multi-head Latent Attention over FP8 paged KV caches with BF16 queries, without casting the cache."""
from .formats import FORMATS, KVFormat, get_format
from .cache import OutOfPagesError, PagedMLACache
from .attention import MLAPagedAttention, available_backends
from .ragged import MLARaggedPrefill, merge_state, merge_state_in_place
from .gather import gather_dequant
from . import sentinel  # noqa: F401 - fp8mla.sentinel.forbid_pool_casts

__version__ = "0.1.0"
__all__ = ["FORMATS", "KVFormat", "get_format", "PagedMLACache", "OutOfPagesError", "MLAPagedAttention",
           "available_backends", "MLARaggedPrefill", "merge_state", "merge_state_in_place", "gather_dequant",
           "__version__"]
