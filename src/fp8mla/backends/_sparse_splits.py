"""What the sparse kernels (triton, gluon) share: the rule that cuts an index row over split programs, and the
split workspace it needs, sized at plan time (CUDA-graph safe) and owned by the plan.

An index row of ``topk`` entries runs on ``splits`` programs, each walking at least ``min_split`` entries (a
multiple of the 64-entry block) and writing a normalized partial (o, lse) that a second kernel merges by
log-sum-exp in split order. The split count is fixed per (plan, number of query tokens): the same inputs always
split, and merge, the same way. A plan's ``num_splits`` pins it; the batch-invariant mode cuts every row in
``ceil(topk / SPARSE_INVARIANT_SPLIT)`` whatever the call holds; otherwise each kernel fills the GPU its own way
(``fill_splits``).
"""
from __future__ import annotations

import torch

from ..kernels.split.rows import invariant_splits
from ._invariant import SPARSE_INVARIANT_SPLIT

INDEX_BLOCK = 64  # the sparse kernels walk index rows 64 entries at a time (the Triton kernel's topk multiple)


class SplitPlan:
    """A sparse kernel plan's split rule and workspace. Subclasses give ``fill_splits(n)``: the splits that fill
    the GPU for ``n`` query tokens, which must be 1 once ``n`` reaches twice the SM count (what bounds the
    workspace by O(SMs), whatever the batch)."""

    def __init__(self, spec, n_sm: int):
        self.spec = spec
        self.n_sm = n_sm
        self.part_o = self.part_lse = None      # split workspace [rows, H(, 512)] fp32
        self.retired = []                       # the invariant mode's outgrown workspaces (kept alive)
        cap = self._capacity()
        if cap:
            self.part_o, self.part_lse = self._workspace(cap)

    def fill_splits(self, n: int) -> int:
        raise NotImplementedError

    def splits_for(self, n: int) -> int:
        """Programs each index row is split over for a call with ``n`` query tokens."""
        s = self.spec
        if s.num_splits is not None:
            return min(s.num_splits, -(-s.topk // INDEX_BLOCK))
        if s.batch_invariant:   # the same for every call: the row's cut never follows the call's size
            return invariant_splits(s.topk, SPARSE_INVARIANT_SPLIT)
        return self.fill_splits(n)

    def workspace(self, n: int, splits: int):
        """(part_o, part_lse) for a call of ``n`` tokens cut in ``splits``: the plan's, or (a pinned num_splits,
        or the invariant mode past its largest call so far) a larger one. The invariant mode keeps its workspace,
        grown to a power of two of the largest call; a replaced one stays alive (a graph captured on it replays on
        it, never on freed memory). A pinned num_splits allocates per call."""
        if splits <= 1 or (self.part_o is not None and self.part_o.shape[0] >= n * splits):
            return self.part_o, self.part_lse
        rows = n * splits if not self.spec.batch_invariant else 1 << (n * splits - 1).bit_length()
        part_o, part_lse = self._workspace(rows)
        if self.spec.batch_invariant:
            self.retired.append((self.part_o, self.part_lse))
            self.part_o, self.part_lse = part_o, part_lse
        return part_o, part_lse

    def _capacity(self) -> int:
        """Largest ``tokens x splits`` any call can need: splits > 1 only while tokens x head tiles is under the
        GPU's target program count, so this is bounded by O(SMs) and independent of the batch."""
        if self.spec.num_splits is not None or self.spec.batch_invariant:
            return 0   # a fixed split count: the workspace is sized per call (``workspace``)
        cap = 0
        for n in range(1, 2 * self.n_sm + 1):
            s = self.fill_splits(n)
            if s > 1:
                cap = max(cap, n * s)
        return cap

    def _workspace(self, rows: int):
        s = self.spec
        return (torch.empty(rows, s.num_heads, s.head_dim_ckv, dtype=torch.float32, device=s.device),
                torch.empty(rows, s.num_heads, dtype=torch.float32, device=s.device))
