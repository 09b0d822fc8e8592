"""Index-row splits: the sparse (and V4) kernels' work items. Each query token's index row (or its key list) is
cut into ``splits`` consecutive pieces of ``chunk`` entries (a multiple of the kernel's block), one program each;
partial ``t * splits + s`` is piece s of token t (``merge.merge_splits`` combines them in that order). Every
token of a call gets the same split count, which these policies choose:

* ``fill_splits`` (Triton sparse, default): enough that tokens x head tiles x splits reaches a target program
  count (twice the SMs);
* ``wave_splits`` (Gluon sparse, default): one wave of its one-CTA-per-SM kernel;
* ``invariant_splits`` (the batch-invariant mode): from the row's length only, never the call's token count;
* a pinned count (``plan(num_splits=...)``), capped by ``split_geometry`` to the pieces that are not empty.
"""
from __future__ import annotations


def split_geometry(entries: int, num_splits: int, block: int = 64) -> tuple[int, int]:
    """(chunk, splits): entries per split (a multiple of ``block``) and the splits that are not empty."""
    chunk = -(-max(1, entries) // max(1, num_splits))
    chunk = -(-chunk // block) * block
    return chunk, -(-max(1, entries) // chunk)


def fill_splits(target_programs: int, num_tokens: int, head_tiles: int, topk: int, min_split: int) -> int:
    """Splits per index row so that ``num_tokens x head_tiles x splits`` reaches ``target_programs``, each split
    walking at least ``min_split`` entries."""
    want = -(-target_programs // max(1, num_tokens * head_tiles))
    return max(1, min(want, max(1, topk // min_split)))


def wave_splits(num_sms: int, num_tokens: int, head_groups: int, topk: int, min_split: int) -> int:
    """Splits per index row: one wave of one CTA per SM, ``max(1, SMs // (tokens x head groups))``, each split
    walking at least ``min_split`` entries."""
    return max(1, min(num_sms // max(1, num_tokens * head_groups), topk // min_split))


def invariant_splits(topk: int, split: int) -> int:
    """The batch-invariant mode's splits: ``ceil(topk / split)``, the same for every call."""
    return -(-topk // split)
