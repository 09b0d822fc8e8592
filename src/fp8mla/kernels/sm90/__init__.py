"""Hopper (sm_90) MLA decode in Gluon: BF16/FP16 queries x FP8 e4m3 paged KV, warp-specialized, split-KV.

Design ("swap-AB with register operands"; the full design: docs/kernels/sm90.md): one persistent CTA per SM, 12 warps.
  * producer (default partition, 4 warps): walks the CTA's work items, reads each tile's page id and issues
    TMA copies of one 64-token tile (4 boxes [64 x 128 B] of c_kv + 1 box [64 x 64 B] of k_pe) into an
    NS-stage ring guarded by ready/empty mbarriers.
  * two consumer warpgroups (worker partitions): take alternate tiles of the ring. Tokens are the MMA's M
    side (64), heads its N side (16, padded):
        S^T [64, 16] = K [64, 576] . Q^T        K: LDS.128 of FP8 in a relabelled k order, one packed cvt to
                                                fp16 in registers (Q^T stored in smem in the same k order)
        O^T [512, 16] += V^T [512, 64] . P^T     V^T: the stage read as int16 pairs with ldmatrix.trans, split
                                                with PRMT and converted (cvt.rn.f16x2.e4m3x2), output dims
                                                relabelled (undone in the epilogue)
    fp16 MMAs with fp32 accumulation, online softmax in fp32 (exp2). The per-tensor scales and a power-of-two
    range factor are folded into Q before its fp16 rounding (as the Triton kernel does), so FP8 -> fp16 is
    exact and Q keeps fp16 precision without overflow.
  * each consumer writes its own normalized partial (o, lse base 2) per work item; a small Triton kernel merges
    a request's partials by log-sum-exp in a fixed order (bit-identical reruns).

Work items come from the plan (``kernels.split.tiles``): the concatenated 64-token tiles of all requests are cut into
one range per CTA, either request-aligned pieces (``aligned_pieces``: one item per CTA, where that balances) or
contiguous ranges (FlashMLA-style), a range split at request boundaries into items ``(request, first tile, end
tile)``. Every device array the kernels read is sized at plan time; ``run`` only
launches (CUDA-graph safe).

Tail tiles (kv_len not a multiple of 64): the consumer zeroes the stage's rows past kv_len in shared memory
before using it (unused slots may hold NaN, and 0 x NaN in P.V would poison the output), then masks the scores.

Wide-heads variant (``WIDE``, H 17..128; ``head_config``): a CTA owns a head group of 2 x HPW heads (HPW = 16 for
H <= 32, else 32; 16 at every H in the group-scale build) and BOTH consumers take every tile, each for its own HPW
heads (S^T [64, HPW], O^T [512, HPW]; at HPW 32 that is 128 fp32 registers), so there is no cross-consumer softmax
state and no exchange; a stage is released after both consumers arrive. H > 2 x HPW: NHG = ceil(H / (2 x HPW))
CTAs per schedule slot, adjacent in the grid, so
the later reads of a tile should hit L2. Each consumer writes its own normalized partial (padded heads: zero Q
rows, never written).

Page size 1 (``_producer_page1``): the producer copies each tile's 64 arbitrary pool rows with 16-byte cp.async
into the same swizzled stages the TMA boxes fill (the consumers are unchanged) and each producer thread arrives on
the stage's ``ready`` barrier (128 arrivals at page 1, one expect-tx arrival otherwise).

Multi-token decode (``MTP`` constexpr, 1 causal / 2 not; MTP / speculative, qo_len 1..8, ``mtp_config``): the
(query token, head) pairs of a request are rows, "virtual heads" Hv = max_qo x H <= 512, on the wide variant: row
r is token r // H, head r % H (Q from q[qo_indptr[b] + r // H, r % H]; out/lse and the merge likewise; the
partials are indexed by row); rows >= qo_len x H of a request are padding (zero Q, never written). The request's
qo_len is read from qo_indptr on the device. Causal (aligned to the end, as the Triton kernel): token i sees kv
positions < lim = min(L - qo_len + i + 1, L), a per-row limit that replaces the tail mask in the tiles some row
does not see whole (the last one or two of a request; computed there, not kept across the loop); a row may see
nothing of
a tile, an item or the whole request (kv_len < qo_len), so the softmax subtracts 0 where the running max is -inf
(alpha and P exactly 0, not NaN) and an empty row's output is written as 0 by a select. NaN: slots past kv_len are
zeroed as for one query; a NaN stored in a token of the request that a row causally does not see still meets
P = 0 in the P.V MMA (0 x NaN = NaN) and makes that row NaN, as in the Triton kernel (a NaN in a used token is bad
input; the rows that see it are NaN either way). MTP = 0 compiles the one-query kernels unchanged (same SASS).

FP8 tensor-core math (``fp8_math``, opt-in: ``QK8`` = 2 e4m3 terms of Q with ``PV8``; ``QKC`` one score
accumulator per 128-column chunk at H <= 16): S^T = K.Q^T runs as e4m3 x e4m3 wgmma with both operands in shared
memory, K straight from the stage, Q x f (f a power of two, largest |q| of a head near 2^8) split into a hi and a lo
term; O^T += V^T.P^T as e4m3 x e4m3 wgmma with V^T's bytes moved from the stage and P x 2^8 in e4m3. The per-tensor
scales multiply the two score parts (c_kv, k_pe) instead of Q. Error budget rel L2 <= 2e-2 (the default: 3e-3).

Per-token group scales (``GROUP``; format fp8_e4m3_group, one fp32 scale per token and 128 c_kv columns): the
producer brings each tile's [64, 4] scales into the stage with its rows (a TMA box of 16-byte rows per page, or one
cp.async per row at page 1, counted in the same ``ready`` barrier). The consumer reads them in the accumulator's row
layout; rows past kv_len read 0. Scores: one fp32 product per 128-column slab (= one group) times the tokens'
scales, plus the k_pe product (its per-tensor scale folded into Q). P.V: one P^T per group, P x scale / the group's
largest scale in the tile (<= 1, so fp16 keeps its precision whatever the scales' magnitude), and each group's two
O^T chunks are kept in units of that maximum (rescaled by alpha x f_old / f_new with the online softmax, multiplied
back at the end of the item): the Triton kernel's KV_GROUP numerics; the stored values still convert exactly to fp16
and never meet their scale element-wise. The group build has 16 rows per consumer at any head count
(``GROUP_MAX_HPW``; H > 32: ceil(H / 32) head-group CTAs per schedule slot): at 32 per consumer its consumers spill
~1.4 KB (triton 3.6) or serialize their wgmma (3.9).

Supported here: H <= 128, qo_len 1 (1..8 with MTP, max_qo x H <= 512), pages of 1, 16, 32 or a multiple of 64,
FP8 e4m3 with per-tensor (or, with GROUP, per-token group) scales, c_kv 512 + k_pe 64. Anything else:
the builds' records (``backends/capabilities.py``) refuse it and ``auto`` falls back to the Triton kernel.

Heads-on-M build (``heads_on_m``, 33..128 heads, one query per request, per-tensor e4m3, pages of a multiple of
64; ``Sm90Build.for_heads_on_m``): 64 heads on the MMA's M side, the FP8 tile converted once into a 16-bit shared
tile read by both products, one CTA per (work item, 64-head group) of the same schedule; ``heads_on_m.py``.

Modules, by role: ``config`` (sizes, variant geometry, the Gluon API), ``ring`` (depth and ready-barrier rule),
``fragments`` (operand helpers), ``producer``, ``consumer``, ``merge`` (each item's partial), ``kernel``
(allocation, barriers, warp_specialize, ``launch``). The work items per CTA and the split merge are every decode
path's: ``kernels.split``.
"""
from __future__ import annotations

from .config import (DC, DK, FP8_MATH_TERMS, GLUON_IMPORT_ERROR, GROUP_MAX_HPW, GROUPS, HP, KNOWN_BUILDS,
                     MAX_MTP_QO, MAX_MTP_ROWS, MAX_WIDE_HEADS, MH_HEADS, MH_MIN_HEADS, MH_REGS, MH_STAGES, P8_SCALE,
                     ROW_BYTES, SMEM_LIMIT, STAGE_BYTES, TILE, Sm90Build, gluon,
                     head_config, mh_smem_bytes, mtp_config, mtp_row, mtp_visible, padded_heads, row_config,
                     smem_bytes)
from .kernel import kv_descriptors, launch, scale_descriptor, scale_rows_ok
from .merge import launch_merge
from .ring import ready_barrier, ring_depth

from .heads_on_m import launch_heads_on_m

if gluon is not None:
    from .heads_on_m import heads_on_m_kernel, mh_kv_descriptors
    from .kernel import mla_decode_sm90_kernel

__all__ = ["DC", "DK", "FP8_MATH_TERMS", "GLUON_IMPORT_ERROR", "GROUP_MAX_HPW", "GROUPS", "HP",
           "KNOWN_BUILDS", "Sm90Build",
           "MAX_MTP_QO", "MAX_MTP_ROWS", "MAX_WIDE_HEADS", "MH_HEADS", "MH_MIN_HEADS", "MH_REGS", "MH_STAGES",
           "P8_SCALE", "ROW_BYTES", "SMEM_LIMIT",
           "STAGE_BYTES", "TILE", "gluon", "head_config", "kv_descriptors",
           "launch", "launch_heads_on_m", "launch_merge", "mh_smem_bytes", "mtp_config", "mtp_row", "mtp_visible",
           "padded_heads", "ready_barrier", "ring_depth", "row_config", "scale_descriptor", "scale_rows_ok",
           "smem_bytes"]
