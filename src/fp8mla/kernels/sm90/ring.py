"""The ready / empty barrier ring between the producer and the consumers: its depth for a plan and the odd-ring
ready-barrier rule (``ready_barrier``), whose formulas the producer and consumer partitions compute inline."""
from __future__ import annotations

from .config import HP, SMEM_LIMIT, smem_bytes


def ring_depth(ns: int, hpw: int = HP, wide: bool = False, qk8: int = 0, group: bool = False) -> int:
    """The ring depth a plan asking for ``ns`` stages gets. Any depth is safe: the alternating-tile kernel (H <= 16,
    not ``wide``) gives each consumer its own ready barrier per stage at an odd depth (with one barrier per stage,
    a stage's consecutive phases belong to alternating consumers and a parity wait can pass a phase early: kernel
    log 25, confirmed on the H200). An odd request at H <= 16 still becomes the next even depth where that fits
    shared memory (4 for the default 3: the configuration timed since), else it stays odd where it fits (the group
    build's 3, and the FP8-scores variant's, where 4 does not), else the even depth below."""
    if wide or ns % 2 == 0:
        return ns
    for d in (ns + 1, ns, ns - 1):   # the even depth above, the odd one asked for, the even one below
        if d >= 2 and smem_bytes(d, hpw, wide, qk8, group) <= SMEM_LIMIT:
            return d
    return 2


def ready_barrier(gg: int, ns: int, wide: bool = False) -> tuple[int, int]:
    """(ready barrier, wait parity) of ring position ``gg``, as the kernel computes them (producer and consumers):
    one barrier per stage (``gg % ns``, parity ``(gg // ns) & 1``), except for an odd ring of the alternating-tile
    kernel, where position gg's consumer (gg % 2) has its own barrier per stage (``(gg % 2) * ns + gg % ns``,
    parity ``(gg // (2 ns)) & 1``): every phase of a barrier is then one consumer's, in order. The
    kernel writes the same formulas inline (Gluon); this is their reference for the CPU protocol test."""
    if wide or ns % 2 == 0:
        return gg % ns, (gg // ns) & 1
    return (gg % 2) * ns + gg % ns, (gg // (2 * ns)) & 1
