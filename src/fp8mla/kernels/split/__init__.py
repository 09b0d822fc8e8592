"""Split-KV for every decode path: how each request's KV (or index row) is cut into work items, and how the
partials of a cut request are merged back.

* ``chunks``: token chunks per request (the Triton dense kernel; the torch backend's batch-invariant cut):
  ``chunk_items`` (device) and ``chunk_items_host`` (host lengths), ``chunk_bounds`` (one request).
* ``tiles``: 64-token tile ranges per CTA (the Gluon dense builds): ``tile_items`` (lists),
  ``tile_items_device`` and ``tile_items_host``; the batch-invariant cut ``invariant_lists`` (host, also
  ``tile_items_host(fixed_chunk=...)``) and ``invariant_items_device``; ``merge_sizes``.
* ``rows``: index-row splits (sparse and V4 kernels): ``split_geometry`` and the split-count policies.
* ``merge``: the one merge kernel (Triton; imported on use: this package imports no triton) under all of them,
  ``merge_requests`` / ``launch_merge`` for work-item lists and ``merge_splits`` for index-row splits;
  ``merge_torch.merge_chunks`` the torch backend's.

Every cut is deterministic, and each merge combines a request's partials in a fixed order, so a rerun gives the same
bits. The default cuts follow the batch and the SM count (a share of the batch's tokens over one or two waves of
CTAs); the batch-invariant cuts follow each request's own length only.
"""
from __future__ import annotations

from .chunks import chunk_bounds, chunk_items, chunk_items_host, items_target, max_parts, safe_kv_len
from .merge_torch import merge_chunks
from .rows import fill_splits, invariant_splits, split_geometry, wave_splits
from .tiles import (ALIGNED_SLACK, BALANCE, ONE_WAVE_SLACK, TILE, UNBOUNDED_SLACK, aligned_lists, aligned_pieces,
                    invariant_items_device, invariant_lists, longest_first_slack, merge_sizes, tile_items,
                    tile_items_device, tile_items_host)

__all__ = ["ALIGNED_SLACK", "BALANCE", "ONE_WAVE_SLACK", "TILE", "UNBOUNDED_SLACK", "aligned_lists", "aligned_pieces",
           "chunk_bounds", "chunk_items", "chunk_items_host", "fill_splits", "invariant_items_device",
           "invariant_lists", "invariant_splits", "items_target",
           "longest_first_slack", "max_parts", "merge_chunks", "merge_sizes", "safe_kv_len", "split_geometry",
           "tile_items", "tile_items_device", "tile_items_host", "wave_splits"]
