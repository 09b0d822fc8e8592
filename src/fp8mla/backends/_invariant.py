"""The batch-invariant mode's constants and its refusal of the Hopper builds, shared by the dense and sparse APIs.

In this mode a request's output and lse are the same bits whatever shares its batch: its KV (or index row) is cut
at boundaries that follow from its own length and a fixed chunk size, never from the batch size, the other
requests or the GPU's SM count; the partials are merged in chunk order, and every chunk is reduced in one fixed
order by one kernel configuration (which follows the heads, the format, the device and the options, never the
batch). docs/batch_invariance.md states the contract. Every API with the mode (dense, sparse and V4) takes it as
the keyword ``batch_invariant=True`` and cuts with these constants. The dense Gluon builds take the mode when named
(``backend="gluon"``: the wide and heads-on-M builds, one query per request; ``backends.gluon`` refuses the others
by name), as does the sparse Gluon build; ``auto`` keeps the Triton kernel (``GLUON_AUTO``). The V4 API refuses
any backend outside ``fp8mla.v4.INVARIANT_BACKENDS``.
"""
from __future__ import annotations

# Tokens per KV chunk (dense). Each chunk past the first costs one fp32 partial of [heads, 512] (the bytes of ~57
# FP8 tokens per 16 heads) written and merged: 1024 keeps that under ~6% of the chunk's reads at 16 heads, and a
# 32k-token request still runs on 32 programs per row tile.
INVARIANT_CHUNK = 1024
# Index entries per split (sparse): a 2048-entry row runs on 4 programs.
SPARSE_INVARIANT_SPLIT = 512
# Entries per piece of a V4 row (window + compressed): a V4-Flash CSA row (128 + 512) runs on 2 programs, V4-Pro's
# (128 + 1024) on 3, an HCA row of 1M tokens' compressed rows (128 + 8192) on 17.
V4_INVARIANT_CHUNK = 512
# CUDA-graph plans: work items beyond one per request that the fixed buffers hold (fp32 partials of
# [heads x max_qo_len, 512] each: 2048 of them are 64 MB at 16 heads): 1M-2M tokens of requests over a chunk.
INVARIANT_PARTIALS = 2048
# Both chunk sizes are multiples of the kernels' 64-entry blocks.
CHUNK_MULTIPLE = 64

# backend="auto" in the mode: the Triton kernel, whose bits per request the CPU tests prove (the interpreter); the
# Gluon builds' are checked on a GPU only, so they run in the mode when named.
GLUON_AUTO = ("batch_invariant: backend='auto' keeps the triton kernel in this mode; the gluon builds (dense: wide "
              "and heads-on-M; sparse) take it when named (backend='gluon')")


def check_chunk(name: str, value) -> int:
    """A chunk size option: a positive multiple of 64 (whole kernel blocks per chunk)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % CHUNK_MULTIPLE:
        raise ValueError(f"{name}: expected a positive multiple of {CHUNK_MULTIPLE} (tokens per chunk), got {value!r}")
    return value
