"""The ``plan()`` signatures of FlashInfer's attention wrappers, by class, across the versions serving engines pin
(0.2.0 to 0.7.x), for :mod:`fp8mla.tools.audit` to resolve positional and keyword arguments of a ``plan`` call.

Only what the audit needs is recorded: the parameter names in order (positional-or-keyword, then keyword-only),
how many are required, which parameter carries the query dtype and which the KV dtype, what the KV dtype
defaults to when it is not passed, and whether the KV is a paged pool (MLA paged, decode paged, prefill paged,
cascade) or fresh K/V tensors (ragged prefill: its ``kv_data_type`` is not the pool's and is never judged).

Written from FlashInfer's public sources and API docs (``flashinfer/mla.py``, ``decode.py``, ``prefill.py``,
``cascade.py``), read version by version. Where a version inserted a parameter in the middle (``head_dim_vo`` in
paged prefill early in 0.2.x, ``o_data_type`` after ``kv_data_type`` in decode in 0.6.0) each layout is a
separate row: a positional argument whose meaning differs between rows is not judged. (vLLM PR #32182 dates
the decode ``o_data_type`` to FlashInfer 0.6.0.) Not in the table: wrappers with other plan() shapes such as
0.6.13's ``BatchDecodeCuteDSLWrapper`` -- a call on one of those is simply not judged.

``begin_forward`` is the older name of ``plan``, still an alias of it, with the same parameters.
FlashInfer 0.1.x (``begin_forward`` with ``data_type`` -- the KV dtype -- before ``q_data_type``) is not in
this table: its positional dtype order is the reverse of 0.2's, and engines moved off it by 2025.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlanSignature", "SIGNATURES", "signatures_for", "all_signatures", "WRAPPER_CLASSES"]


@dataclass(frozen=True)
class PlanSignature:
    cls: str               # FlashInfer class name
    versions: str          # the FlashInfer releases with this layout (as read; informative)
    params: tuple          # positional-or-keyword parameter names, in order (without self)
    required: int          # how many leading params have no default
    q: tuple               # parameter(s) carrying the query dtype, first passed wins
    kv: tuple              # parameter(s) carrying the KV dtype, first passed wins
    kv_default_q: bool     # the KV dtype defaults to the query dtype when none is passed
    paged: bool            # reads a paged KV pool (False: fresh ragged K/V)
    kwonly: tuple = ()     # keyword-only parameter names

    def names(self) -> set:
        return set(self.params) | set(self.kwonly)


_MLA = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
        "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")
_DECODE_HEAD = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type")
_DECODE_TAIL = ("data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
                "fixed_split_size", "disable_split_kv")
_PREFILL_MID = ("custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
                "sm_scale", "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type",
                "kv_data_type")
_PREFILL_TAIL = ("o_data_type", "non_blocking", "prefix_len_ptr", "token_pos_in_items_ptr",
                 "token_pos_in_items_len", "max_item_len_ptr", "seq_lens", "seq_lens_q", "block_tables",
                 "max_token_per_sequence", "max_sequence_kv", "fixed_split_size", "disable_split_kv")

SIGNATURES = (
    # MLA paged (decode, multi-token decode, paged prefill over the latent pool); dtypes are arguments 11 and 12
    PlanSignature("BatchMLAPagedAttentionWrapper", "0.2.1-0.7.x", _MLA + ("use_profiler",), 12,
                  ("q_data_type",), ("kv_data_type",), False, True),
    # the first MLA decode wrapper (deprecated after 0.2.x): the KV dtype ("data_type") comes *before* q_data_type
    PlanSignature("BatchDecodeMlaWithPagedKVCacheWrapper", "0.2.0-0.7.x",
                  ("indptr", "indices", "last_page_len", "num_qo_heads", "head_dim_compressed_kv", "page_size",
                   "sm_scale", "window_left", "logits_soft_cap", "data_type", "q_data_type", "rope_scale",
                   "rope_theta"), 7, ("q_data_type", "data_type"), ("data_type",), False, True),
    # decode paged: data_type sets both dtypes when q_data_type/kv_data_type are not passed
    PlanSignature("BatchDecodeWithPagedKVCacheWrapper", "0.2.0-0.5.x", _DECODE_HEAD + _DECODE_TAIL, 7,
                  ("q_data_type", "data_type"), ("kv_data_type", "data_type"), True, True),
    PlanSignature("BatchDecodeWithPagedKVCacheWrapper", "0.6.0-0.7.x",
                  _DECODE_HEAD + ("o_data_type",) + _DECODE_TAIL, 7,
                  ("q_data_type", "data_type"), ("kv_data_type", "data_type"), True, True),
    # prefill / append over the paged pool; head_dim_vo was inserted after page_size early in 0.2.x
    PlanSignature("BatchPrefillWithPagedKVCacheWrapper", "0.2.0 (before head_dim_vo)",
                  ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                   "num_kv_heads", "head_dim", "page_size") + _PREFILL_MID + ("non_blocking",), 8,
                  ("q_data_type",), ("kv_data_type",), True, True),
    PlanSignature("BatchPrefillWithPagedKVCacheWrapper", "0.2.x-0.7.x",
                  ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "num_qo_heads",
                   "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo") + _PREFILL_MID + _PREFILL_TAIL, 8,
                  ("q_data_type",), ("kv_data_type",), True, True),
    # ragged prefill: fresh BF16 K/V, not the pool; recognised so that it is *not* judged
    PlanSignature("BatchPrefillWithRaggedKVCacheWrapper", "0.2.0-0.7.x",
                  ("qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
                   "custom_mask", "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
                   "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta", "q_data_type",
                   "kv_data_type", "o_data_type", "non_blocking", "fixed_split_size", "disable_split_kv"), 5,
                  ("q_data_type",), ("kv_data_type",), True, False),
    # cascade over several levels of paged KV
    PlanSignature("MultiLevelCascadeAttentionWrapper", "0.2.0-0.7.x",
                  ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr", "paged_kv_last_page_len",
                   "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "causal", "pos_encoding_mode",
                   "use_fp16_qk_reduction", "sm_scale", "window_left", "logits_soft_cap", "rope_scale",
                   "rope_theta", "q_data_type", "kv_data_type"), 8,
                  ("q_data_type",), ("kv_data_type",), True, True),
)

# subclasses with the parent's plan()
_ALIASES = {"CUDAGraphBatchDecodeWithPagedKVCacheWrapper": "BatchDecodeWithPagedKVCacheWrapper"}

WRAPPER_CLASSES = frozenset({s.cls for s in SIGNATURES} | set(_ALIASES))


def signatures_for(cls: str) -> tuple:
    """Every recorded layout of ``cls.plan`` (empty for a class that is not a FlashInfer wrapper)."""
    cls = _ALIASES.get(cls, cls)
    return tuple(s for s in SIGNATURES if s.cls == cls)


def all_signatures() -> tuple:
    return SIGNATURES
