"""The records of :class:`~fp8mla.cache.PagedMLACache`'s page allocator: one :class:`SequenceState` per live
sequence (its page ids as a C int32 array, its lengths), the batch page table built from them, and the error of a
full pool."""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

import torch

__all__ = ["OutOfPagesError", "SequenceState", "batch_csr", "page_array"]


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a request needs. Nothing was allocated."""


def page_array(pages=()) -> array:
    # Page ids as a C int32 array: appends are as cheap as a list's, and a batch's table is a memcpy of slices
    # (plan_inputs / layout), never a Python loop over pages.
    return array("i", pages)


assert array("i").itemsize == 4, "page tables are int32 (array typecode 'i')"


@dataclass
class SequenceState:
    """The cache's state of one sequence (``PagedMLACache.seq_state``): its pages, in token order, and its
    lengths. Read it, never change it (the cache does). One object per life of an id: a sequence freed and added
    again gets a new one, so a caller that kept the old one tells them apart by identity (``is``)."""
    pages: array = field(default_factory=page_array)
    length: int = 0          # tokens reserved, including the pending ones
    pending: int = 0         # tokens reserved by the last reserve(), written by append()


def batch_csr(seqs: list, qo_lens: list, page_size: int, device) -> dict:
    """The page table of a batch of sequence records as FlashInfer's CSR arrays (int32 on ``device``):
    ``qo_indptr`` (from ``qo_lens``), ``kv_indptr``, ``kv_indices`` (each sequence's pages that hold its tokens)
    and ``kv_len_arr``. O(batch) Python: the page ids are copied as array slices (memcpy)."""
    kv_pages, table = [], page_array()
    for s in seqs:
        n = min(len(s.pages), -(-s.length // page_size))
        kv_pages.append(n)
        table += s.pages[:n]
    i32 = dict(dtype=torch.int32, device=device)
    kv_indices = torch.frombuffer(table, dtype=torch.int32) if len(table) else torch.zeros(0, dtype=torch.int32)
    return dict(qo_indptr=torch.tensor([0] + list(itertools.accumulate(qo_lens)), **i32),
                kv_indptr=torch.tensor([0] + list(itertools.accumulate(kv_pages)), **i32),
                kv_indices=kv_indices.to(**i32),
                kv_len_arr=torch.tensor([s.length for s in seqs], **i32))
