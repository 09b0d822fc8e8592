"""The ready / empty barrier ring between the producer and the consumers: its depth for a plan and the ready-barrier
rule (``ready_slot``), one function for the host and the kernel."""
from __future__ import annotations

from .config import HP, SMEM_LIMIT, gluon, smem_bytes


def ring_depth(ns: int, hpw: int = HP, wide: bool = False, qk8: int = 0, group: bool = False) -> int:
    """The ring depth a plan asking for ``ns`` stages gets. Any depth is safe: the alternating-tile kernel (H <= 16,
    not ``wide``) gives each consumer its own ready barrier per stage at an odd depth (with one barrier per stage,
    a stage's consecutive phases belong to alternating consumers and a parity wait can pass a phase early, a race
    seen on the H200). An odd request at H <= 16 still becomes the next even depth where that fits
    shared memory (4 for the default 3: the timed configuration), else it stays odd where it fits (the group
    build's 3, and the FP8-scores variant's, where 4 does not), else the even depth below."""
    if wide or ns % 2 == 0:
        return ns
    for d in (ns + 1, ns, ns - 1):   # the even depth above, the odd one asked for, the even one below
        if d >= 2 and smem_bytes(d, hpw, wide, qk8, group) <= SMEM_LIMIT:
            return d
    return 2


def ready_slot(g, s, NS, SPLIT):
    """(ready barrier, wait parity) of ring position ``g`` at stage ``s = g % NS``: THE ring rule, written once and
    run both on the host (``ready_barrier``, the CPU protocol test) and in the kernel (``ready_slot_dev``, the same
    source under gluon.jit: the producers' arrivals and the consumers' waits). One barrier per stage (parity
    ``(g // NS) & 1``), except for an odd ring of the alternating-tile kernel (``SPLIT``: H <= 16, not wide), where
    position g's consumer (g % 2) has its own barrier per stage: with one barrier a stage's consecutive phases
    would belong to alternating consumers and a parity wait could pass a phase early (a race seen on the H200);
    with two, every phase of a barrier is one consumer's, in order."""
    if SPLIT:
        return (g % 2) * NS + s, (g // (2 * NS)) & 1
    return s, (g // NS) & 1


def split_ring(ns: int, wide: bool = False) -> bool:
    """Whether a ring of ``ns`` stages has one ready barrier per stage and consumer (2 x ns barriers)."""
    return not wide and ns % 2 == 1


def ready_barrier(gg: int, ns: int, wide: bool = False) -> tuple[int, int]:
    """``ready_slot`` on the host for ring position ``gg`` of an ``ns``-stage ring (``wide``: the wide variant)."""
    return ready_slot(gg, gg % ns, ns, split_ring(ns, wide))


if gluon is not None:
    from .config import mbarrier
    ready_slot_dev = gluon.jit(ready_slot)

    # The ring of the wide build's partitions, ``ring`` = (kbuf, pbuf, sbuf, ready, empty) (kernel.py): one step
    # of each side. Ring position g is the g-th tile the CTA's partition walks; NS its depth (a constexpr in the
    # producer, a runtime value in the consumers).

    @gluon.jit
    def ring_acquire(ring, g, NS):
        """Producer: wait until position g's stage is free (from the second pass on); (stage, its ready barrier)."""
        kbuf, pbuf, sbuf, ready, empty = ring
        s = g % NS
        mbarrier.wait(empty.index(s), ((g // NS) & 1) ^ 1, pred=g >= NS)
        rb, ph = ready_slot_dev(g, s, NS, ready.shape[0] != empty.shape[0])
        return s, ready.index(rb)

    @gluon.jit
    def ring_wait(ring, g, NS):
        """Consumer: wait until position g's stage is filled; its stage."""
        kbuf, pbuf, sbuf, ready, empty = ring
        s = g % NS
        rb, ph = ready_slot_dev(g, s, NS, ready.shape[0] != empty.shape[0])
        mbarrier.wait(ready.index(rb), ph)
        return s

    @gluon.jit
    def ring_release(ring, s):
        """Consumer: stage s is read (after the partition's barrier: every warp is done with it)."""
        kbuf, pbuf, sbuf, ready, empty = ring
        mbarrier.arrive(empty.index(s), count=1)
