"""The sparse API's "triton" backend: the portable sparse kernel (``kernels/sparse_decode.py``; every GPU Triton
supports, the CPU interpreter in CI). Its record: ``capabilities.TRITON_SPARSE`` (topk a multiple of 64).

``build(spec, options)`` fixes the launch configuration (the dense decode's tile choice for the head count,
overridable by ``options``: ``block_h``, ``block_n``, ``num_warps``, ``num_stages``, ``v_convert``) and the split
workspace; ``run`` only launches. Splits: enough programs per row that ``tokens x head tiles x splits`` reaches
twice the SM count.
"""
from __future__ import annotations

from ..kernels.split.rows import fill_splits
from ..runtime import LN2, num_sms
from ._sparse_splits import SplitPlan


class TritonSparsePlan(SplitPlan):
    def __init__(self, spec, config: dict):
        self.config = config
        super().__init__(spec, num_sms(spec.device))

    def fill_splits(self, n: int) -> int:
        s = self.spec
        return fill_splits(2 * self.n_sm, n, -(-s.num_heads // self.config["block_h"]), s.topk, s.min_split)

    def run(self, q_nope, q_pe, ckv, kpe, scale_arr, scales, indices, out, lse, base_e: bool) -> None:
        from ..kernels import sparse_decode
        n = q_nope.shape[0]
        splits = self.splits_for(n)
        part_o, part_lse = self.workspace(n, splits)
        sparse_decode.sparse_mla(q_nope, q_pe, ckv, kpe, scale_arr, scales, indices, out, lse, part_o, part_lse,
                                 page_size=self.spec.page_size, sm_scale=self.spec.sm_scale, num_splits=splits,
                                 lse_scale=LN2 if base_e else 1.0, **self.config)


def build(spec, options: dict, state: dict | None = None) -> TritonSparsePlan:
    from ..kernels import sparse_decode
    return TritonSparsePlan(spec, sparse_decode.launch_config(spec.num_heads, spec.kv_format, spec.device, **options))
