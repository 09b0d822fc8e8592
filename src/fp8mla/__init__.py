"""fp8mla: Multi-head Latent Attention over FP8 paged KV caches with BF16 queries, without casting the cache."""
# Public names are imported on first access (PEP 562), so that `import fp8mla` and torch-free tools such as
# `fp8mla audit` do not pay for importing torch. name -> submodule that defines it.
import importlib

_LAZY = {"FORMATS": "formats", "KVFormat": "formats", "get_format": "formats",
         "OutOfPagesError": "cache", "PagedMLACache": "cache",
         "MLAPagedAttention": "attention", "available_backends": "attention",
         "MLARaggedPrefill": "ragged", "merge_state": "ragged", "merge_state_in_place": "ragged",
         "gather_dequant": "gather", "MLASparseAttention": "sparse",
         "V4SparseAttention": "v4", "write_v4_pool": "v4", "V4_FORMATS": "formats_v4", "get_v4_format": "formats_v4",
         "sentinel": None}  # fp8mla.sentinel.forbid_pool_casts: the submodule itself


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'fp8mla' has no attribute {name!r}")
    mod = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = mod if _LAZY[name] is None else getattr(mod, name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"
__all__ = ["FORMATS", "KVFormat", "get_format", "PagedMLACache", "OutOfPagesError", "MLAPagedAttention",
           "available_backends", "MLARaggedPrefill", "merge_state", "merge_state_in_place", "gather_dequant",
           "MLASparseAttention", "V4SparseAttention", "write_v4_pool", "V4_FORMATS", "get_v4_format", "__version__"]
