"""What differs between the vLLM releases fp8mla's ``FP8MLA`` backend supports (0.26.x through 0.34.x): one
row per release where something the backend touches changed, and the function that picks the row.

Everything else the plugin and the backend use (module paths, base classes, the metadata fields, the
``forward_mqa`` call) is the same in all of them. Each row is checked against its releases' own source (the
call sites and signatures named in the fields) by ``tests/engines/test_vllm_conformance.py``; a release
outside the range gets the nearest row, used only under ``FP8MLA_SKIP_VERSION_CHECK=1``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .versions import SUPPORTED, _release

__all__ = ["ROWS", "VllmRelease", "release_row"]


@dataclass(frozen=True)
class VllmRelease:
    """How one span of vLLM releases (from ``first`` up to the next row) calls and registers a backend."""

    first: str
    # register_backend("FP8MLA", path) adds a member to AttentionBackendEnum (its AttentionBackendEnum.register);
    # before, the registry takes existing members only and the plugin adds the member the same way itself
    registry_takes_new_names: bool
    # MLACommonMetadataBuilder.build passes _build_decode(..., max_query_len=...)
    builder_passes_max_query_len: bool
    # MLAAttention passes do_kv_cache_update(..., k_scale, skip_scale) (True where the FP8 scale is 1.0)
    kv_update_passes_skip_scale: bool


ROWS: tuple[VllmRelease, ...] = (
    VllmRelease("0.26", registry_takes_new_names=False, builder_passes_max_query_len=False,
                kv_update_passes_skip_scale=False),
    VllmRelease("0.31", registry_takes_new_names=False, builder_passes_max_query_len=True,
                kv_update_passes_skip_scale=False),
    VllmRelease("0.32", registry_takes_new_names=True, builder_passes_max_query_len=True,
                kv_update_passes_skip_scale=False),
    VllmRelease("0.33", registry_takes_new_names=True, builder_passes_max_query_len=True,
                kv_update_passes_skip_scale=True),
)
assert ROWS[0].first == SUPPORTED["vllm"][0], "the table starts at the first supported release"


def release_row(version: str) -> VllmRelease:
    """The row for vLLM ``version`` ('0.26.0', '0.32.0+cpu', ...): the last row whose ``first`` is not newer."""
    rel = _release(version)[:2]
    row = ROWS[0]
    for candidate in ROWS:
        if _release(candidate.first)[:2] <= rel:
            row = candidate
    return row
