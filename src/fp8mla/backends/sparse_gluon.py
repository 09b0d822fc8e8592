"""The sparse API's "gluon" backend: the warp-specialized Hopper build over ``fp8_ds_mla`` records
(``kernels/sm90/sparse.py``). Its record: ``capabilities.GLUON_SPARSE`` (sm_90, fp8_ds_mla, bf16 queries,
H <= 128, any topk; no batch-invariant mode). It has no tuning options.

Splits: one wave of its one-CTA-per-SM kernel (``kernels.split.rows.wave_splits``): more would only add waves
and a longer merge.
"""
from __future__ import annotations

from ..kernels.split.rows import wave_splits
from ..runtime import LN2, num_sms
from ._sparse_splits import SplitPlan


class GluonSparsePlan(SplitPlan):
    def __init__(self, spec):
        from ..kernels.sm90 import sparse as sm90_sparse
        self.config = {"block_h": sm90_sparse.HEAD_GROUP}   # heads per CTA (the wgmma M side)
        super().__init__(spec, num_sms(spec.device))

    def fill_splits(self, n: int) -> int:
        s = self.spec
        return wave_splits(self.n_sm, n, -(-s.num_heads // self.config["block_h"]), s.topk, s.min_split)

    def run(self, q_nope, q_pe, ckv, kpe, scale_arr, scales, indices, out, lse, base_e: bool) -> None:
        from ..kernels.sm90 import sparse as sm90_sparse
        n = q_nope.shape[0]
        splits = self.splits_for(n)
        part_o, part_lse = self.workspace(n, splits)
        sm90_sparse.sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, indices, out, lse, part_o, part_lse,
                               sm_scale=self.spec.sm_scale, num_splits=splits, lse_scale=LN2 if base_e else 1.0)


def build(spec, options: dict, state: dict | None = None) -> GluonSparsePlan:
    if options:
        raise TypeError(f"plan: kernel options {sorted(options)} are for the triton backend, not 'gluon'")
    return GluonSparsePlan(spec)
