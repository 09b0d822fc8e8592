"""The mbarrier protocols of the Hopper Gluon kernels' warp-specialized partitions, modelled on the CPU.

Three builds: heads-on-M (``kernels/sm90/heads_on_m.py``: converters A / B, the TMA ring, consumers 0 / 1), sparse
(``sparse_partitions.py``: converters A / B with cp.async rounds, ``tv``) and DeepSeek V4 (``v4_partitions.py``).
Each partition is a generator of the actions its code performs, in its order: mbarrier waits (parities as the
kernel computes them, skipped where the kernel's ``pred`` is false), arrivals, TMA / cp.async copies, commit groups
and ``wait_group``, shared-memory writes and reads. Barriers follow the hardware rule (a phase completes after
``count`` arrivals, counts from the kernels' ``mbarrier.init``; a parity wait passes once the phase of that parity
has completed, so a waiter two phases behind passes wrongly, as on the GPU). A seeded random scheduler interleaves
the partitions and lands copies in flight in any order. Every buffer carries a tag (the tile that wrote it); an
issued copy marks its target "in flight" until it lands, so a read racing with a refill is caught whatever the
timing. A reader checks the tag when its read starts and again where the read is known to be over: an async wgmma
at its ``warpgroup_mma_wait``, a converter's loads at the partition barrier before its arrival.

Modelled: the order of waits, arrivals, copies and reads; TMA transaction completion (the ready barrier's phase
completes when the tile's last box lands; the expect's own arrival is folded into it); cp.async groups
(``wait_group(k)``: all but the k newest groups of that partition landed); wgmma read windows (issue .. wait).
The barrier counts and the owners' chunk orders are checked against the kernels' source text. The V4 converters'
raw pieces are modelled per chunk with scale words (``fp8_v4`` / ``fp8_v41``; ``bf16`` has the same order, no words).
Not modelled: memory ordering beyond barrier semantics (``fence_async_shared`` and the partition barriers
``_cta_barrier`` are assumed to do their job, so each partition acts as one), the data itself, the masks, and the
TMA page arithmetic. Each build's controls drop one wait that matters (or shrink ``tv`` to one slot) and must
make the model report a stale read or a hang: the test can fail. The action sequences are written by hand from
the kernels' code: a kernel that reorders its waits, arrivals or copies needs its model here changed with it.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

SM90 = Path(__file__).resolve().parents[1] / "src" / "fp8mla" / "kernels" / "sm90"

NS = 2   # the heads-on-M build's FP8 stages (config.MH_STAGES)
SEEDS = range(60)                  # interleavings per build and tile count (seeded: the same on every run)
TILES = (0, 1, 2, 3, 4, 5, 7, 8)   # none, one, fewer than / as many as / more than the stages, odd and even


class Violation(Exception):
    """A read found a buffer written by another tile (or still in flight), or no partition can move (a hang)."""


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, 0, 0   # phase: completed phases

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def passed(self, parity):   # try_wait.parity: the phase of this parity has completed
        return (self.phase & 1) != parity


class Machine:
    """Barriers, tagged buffers, copies in flight and each partition's cp.async groups; ``run`` interleaves."""

    def __init__(self, barriers, seed):
        self.bars = {name: Barrier(count) for name, count in barriers.items()}
        self.rng = random.Random(seed)
        self.buf = {}
        self.flight = []   # copies issued, not landed: (buffer, tag, group or TMA record)
        self.groups = {}   # partition -> its committed cp.async groups (each a [copies in flight] counter)
        self.open = {}     # partition -> its group not yet committed

    def runnable(self, part, act):
        if act[0] == "wait":
            return self.bars[act[1]].passed(act[2])
        if act[0] == "wait_group":   # every group but the act[1] newest has landed
            done = self.groups.get(part, [])
            return all(g[0] == 0 for g in done[:max(len(done) - act[1], 0)])
        return True

    def perform(self, part, act):
        kind = act[0]
        if kind == "arrive":
            self.bars[act[1]].arrive()
        elif kind == "write":
            self.buf[act[1]] = act[2]
        elif kind == "read":
            if self.buf.get(act[1]) != act[2]:
                raise Violation(f"{part} read {act[1]} expecting tile {act[2]!r}, found {self.buf.get(act[1])!r}")
        elif kind == "tma":   # ("tma", boxes, tag, barrier): the barrier's phase completes when the last box lands
            record = [len(act[1]), act[3]]
            for box in act[1]:
                self.buf[box] = ("in flight", act[2])
                self.flight.append((box, act[2], record))
        elif kind == "cp_async":
            group = self.open.setdefault(part, [0])
            group[0] += 1
            self.buf[act[1]] = ("in flight", act[2])
            self.flight.append((act[1], act[2], group))
        elif kind == "commit":
            self.groups.setdefault(part, []).append(self.open.pop(part, [0]))

    def land(self):
        box, tag, record = self.flight.pop(self.rng.randrange(len(self.flight)))
        self.buf[box] = tag
        record[0] -= 1
        if record[0] == 0 and len(record) > 1:
            self.bars[record[1]].arrive()

    def run(self, parts):
        nxt = {a: next(g, None) for a, g in parts.items()}
        while True:
            ready = [a for a, act in nxt.items() if act is not None and self.runnable(a, act)]
            if self.flight and (not ready or self.rng.random() < 0.3):
                self.land()
                continue
            if not ready:
                if any(act is not None for act in nxt.values()):
                    raise Violation(f"hang: {({a: act for a, act in nxt.items() if act is not None})}")
                return
            a = self.rng.choice(ready)
            self.perform(a, nxt[a])
            nxt[a] = next(parts[a], None)


def free_wait(c, i, drop, name):
    # mbarrier.wait(k16_free[c], (i & 1) ^ 1, pred=i > 0): the consumer that read chunk c of tile i - 1 released it
    if i > 0 and name not in drop:
        yield ("wait", ("k16_free", c), (i & 1) ^ 1)


# -- the consumers (the three builds share their structure: fragments._pv_halves_release and the owner scheme) --
def consumer(cid, n, score_order, frees_kpe, owner_reads, drop=frozenset()):
    """Consumer cid: Q, then per tile either the owner's scores (i % 2 == cid) or the non-owner's p_bar wait, then
    the P.V over its chunks 4 cid .. 4 cid + 3 with each chunk released as its MMA completes; the row-sum exchange.
    score_order: the owner's chunk order; frees_kpe: the owner releases chunk 8 after its scores (dense, sparse);
    owner_reads: (buffer, slots) the owner reads after that release (sparse: T_t from tv[i % 2])."""
    for c in range(len(score_order)):
        if c % 2 == cid:
            yield ("write", ("q", c), "q")
    yield ("arrive", "q_bar")
    yield ("wait", "q_bar", 0)
    mine = [4 * cid + j for j in range(4)]
    for i in range(n):
        ph = i & 1
        if i % 2 == cid:
            for c in score_order:   # each score MMA issued after its chunk's ready wait ...
                yield ("wait", ("k16_ready", c), ph)
                yield ("read", ("k16", c), i)
                yield ("read", ("q", c), "q")
            for c in score_order:   # ... and reading until warpgroup_mma_wait(0)
                yield ("read", ("k16", c), i)
            if frees_kpe:
                yield ("arrive", ("k16_free", 8))
            for buf, slots in owner_reads:
                yield ("read", (buf, i % slots), i)
            yield ("write", ("p", 0), i)
            yield ("write", ("xm", 0), i)   # (the sparse build's xm[1], F, goes with it)
            yield ("arrive", "p_bar")
        else:
            if "p_bar" not in drop:
                yield ("wait", "p_bar", ph)
            for c in mine:   # (implied by p_bar: already complete)
                yield ("wait", ("k16_ready", c), ph)
            yield ("read", ("xm", 0), i)
        for c in mine:   # the four P.V MMAs issued ...
            yield ("read", ("p", 0), i)
            yield ("read", ("k16", c), i)
        for c in mine:   # ... waited on at depth 3, 2, 1, 0, each chunk released as its MMA completes
            yield ("read", ("p", 0), i)
            yield ("read", ("k16", c), i)
            yield ("arrive", ("k16_free", c))
    yield ("write", ("xm", 2 + cid), "l")
    yield ("arrive", "x_bar")
    yield ("wait", "x_bar", 0)
    yield ("read", ("xm", 3 - cid), "l")


CHUNK_ORDER = (8, 0, 4, 1, 5, 2, 6, 3, 7)   # fragments._chunk_order: the dense and sparse owners' score order
V4_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)         # v4_partitions: (k % 2) * 4 + k // 2


def common_barriers(nch):
    bars = {("k16_ready", c): 1 for c in range(nch)}   # its converter, once per tile
    bars.update({("k16_free", c): 1 for c in range(nch)})   # the chunk's last reader, once per tile
    bars.update(x_bar=2, p_bar=1, q_bar=2)   # row sums (both consumers), P (its owner), Q (both)
    return bars


# -- heads-on-M (heads_on_m.py) -----------------------------------------------------------------------------------
def mh_tma(i, s):
    # _load_tile: eight c_kv boxes and one k_pe box into stage s, completing ready8[s]'s transaction
    return ("tma", [("stage", s, c) for c in range(9)], i, ("ready8", s))


def mh_round(s, i, chunks, drop, name):
    # _convert_round: per chunk its free wait, the load of the FP8 stage piece, the fp16 store; the loads are over
    # at the round's partition barrier; then one arrival per chunk
    for c in chunks:
        yield from free_wait(c, i, drop, name)
        yield ("read", ("stage", s, c), i)
        yield ("write", ("k16", c), i)
    for c in chunks:
        yield ("read", ("stage", s, c), i)
    for c in chunks:
        yield ("arrive", ("k16_ready", c))


def mh_converter_a(n, drop):
    for i in range(min(NS, n)):   # prologue: the first NS tiles in flight
        yield mh_tma(i, i)
    for i in range(n):
        s = i % NS
        yield ("wait", ("ready8", s), (i // NS) & 1)
        for chunks in ((8,), (0, 1), (2, 3)):
            yield from mh_round(s, i, chunks, drop, "a_free")
        if i + NS < n:   # the refill of stage s once converter B has read its chunks of it
            if "stage_free" not in drop:
                yield ("wait", ("stage_free", s), (i // NS) & 1)
            yield mh_tma(i + NS, s)


def mh_converter_b(n, drop):
    for i in range(n):
        s = i % NS
        if "b_ready8" not in drop:
            yield ("wait", ("ready8", s), (i // NS) & 1)
        for chunks in ((4, 5), (6, 7)):
            yield from mh_round(s, i, chunks, drop, "b_free")
        if "b_stage_free_arrive" not in drop:
            yield ("arrive", ("stage_free", s))


def mh_barriers():
    bars = common_barriers(9)
    bars.update({("ready8", s): 1 for s in range(NS)})   # the TMA transaction (the expect's arrival folded in)
    bars.update({("stage_free", s): 1 for s in range(NS)})   # converter B done reading stage s
    return bars


def run_heads_on_m(n, seed, drop=frozenset()):
    m = Machine(mh_barriers(), seed)
    m.run({"converter A": mh_converter_a(n, drop), "converter B": mh_converter_b(n, drop),
           "consumer 0": consumer(0, n, CHUNK_ORDER, True, (), drop),
           "consumer 1": consumer(1, n, CHUNK_ORDER, True, (), drop)})


# -- sparse (sparse_partitions.py) --------------------------------------------------------------------------------
def sp_round_ckv(i, c0, ng, drop, name):
    # _round_ckv: chunks c0, c0 + 1: both free waits, wait_group(ng - 1), convert, arrive, then the next tile's
    # copies of the same pieces (one commit group)
    yield from free_wait(c0, i, drop, name)
    yield from free_wait(c0 + 1, i, drop, name)
    yield ("wait_group", ng - 1)
    for c in (c0, c0 + 1):
        yield ("read", ("raw_c", c), i)
        yield ("write", ("k16", c), i)
    for c in (c0, c0 + 1):   # every thread reads bytes it copied itself; over by the partition barrier
        yield ("read", ("raw_c", c), i)
    for c in (c0, c0 + 1):
        yield ("arrive", ("k16_ready", c))
    for c in (c0, c0 + 1):
        yield ("cp_async", ("raw_c", c), i + 1)
    yield ("commit",)


def sp_converter_a(n, drop, tv_slots):
    # prologue: tile 0's copies, one group per round: (k_pe + scales), (0, 1), (2, 3)
    yield ("cp_async", ("raw_k", 0), 0)
    yield ("cp_async", ("raw_sa", 0), 0)
    yield ("commit",)
    for c0 in (0, 2):
        yield ("cp_async", ("raw_c", c0), 0)
        yield ("cp_async", ("raw_c", c0 + 1), 0)
        yield ("commit",)
    for i in range(n):
        # round (8): the scales -> T_t into tv[i % 2] for the owner, k_pe / T_t into chunk 8
        yield from free_wait(8, i, drop, "a_free8")
        yield ("wait_group", 2)
        yield ("read", ("raw_sa", 0), i)
        yield ("write", ("tv", i % tv_slots), i)
        yield ("read", ("raw_k", 0), i)
        yield ("write", ("k16", 8), i)
        yield ("read", ("raw_sa", 0), i)   # the second partition barrier: every thread has read the scales
        yield ("read", ("raw_k", 0), i)
        yield ("arrive", ("k16_ready", 8))
        yield ("cp_async", ("raw_k", 0), i + 1)
        yield ("cp_async", ("raw_sa", 0), i + 1)
        yield ("commit",)
        yield from sp_round_ckv(i, 0, 3, drop, "a_free")
        yield from sp_round_ckv(i, 2, 3, drop, "a_free")
    yield ("wait_group", 0)


def sp_converter_b(n, drop):
    # prologue: (scales + 4, 5), (6, 7)
    yield ("cp_async", ("raw_sb", 0), 0)
    yield ("cp_async", ("raw_c", 4), 0)
    yield ("cp_async", ("raw_c", 5), 0)
    yield ("commit",)
    yield ("cp_async", ("raw_c", 6), 0)
    yield ("cp_async", ("raw_c", 7), 0)
    yield ("commit",)
    for i in range(n):
        # round (4, 5) with the scales (group 2), then the next tile's scales and pieces 4, 5
        yield from free_wait(4, i, drop, "b_free")
        yield from free_wait(5, i, drop, "b_free")
        yield ("wait_group", 2 if "b_group" in drop else 1)
        yield ("read", ("raw_sb", 0), i)
        for c in (4, 5):
            yield ("read", ("raw_c", c), i)
            yield ("write", ("k16", c), i)
        for b in (("raw_sb", 0), ("raw_c", 4), ("raw_c", 5)):
            yield ("read", b, i)
        yield ("arrive", ("k16_ready", 4))
        yield ("arrive", ("k16_ready", 5))
        yield ("cp_async", ("raw_sb", 0), i + 1)
        yield ("cp_async", ("raw_c", 4), i + 1)
        yield ("cp_async", ("raw_c", 5), i + 1)
        yield ("commit",)
        yield from sp_round_ckv(i, 6, 2, drop, "b_free")
    yield ("wait_group", 0)


def run_sparse(n, seed, drop=frozenset(), tv_slots=2):
    m = Machine(common_barriers(9), seed)
    m.run({"converter A": sp_converter_a(n, drop, tv_slots), "converter B": sp_converter_b(n, drop),
           "consumer 0": consumer(0, n, CHUNK_ORDER, True, (("tv", tv_slots),), drop),
           "consumer 1": consumer(1, n, CHUNK_ORDER, True, (("tv", tv_slots),), drop)})


# -- DeepSeek V4 (v4_partitions.py) -------------------------------------------------------------------------------
def v4_copy_tile(name, c0, tag):
    # _copy_tile: the converter's four pieces and its scale words (fp8_v4 / fp8_v41), one commit group
    for c in range(c0, c0 + 4):
        yield ("cp_async", ("raw", c), tag)
    yield ("cp_async", (name, 0), tag)
    yield ("commit",)


def v4_converter(c0, n, drop):
    """Converter A (c0 = 0) or B (c0 = 4): tile i's copies landed (wait_group(0)), the scale words read after a
    partition barrier, then per chunk its free wait, the dequantization into the bf16 slab, fence + barrier +
    arrival; the next tile's copies go into the same pieces after the last chunk's barrier."""
    scales = "raw_sa" if c0 == 0 else "raw_sb"
    who = "a" if c0 == 0 else "b"
    yield from v4_copy_tile(scales, c0, 0)
    for i in range(n):
        if f"{who}_group" not in drop:
            yield ("wait_group", 0)
        yield ("read", (scales, 0), i)
        for c in range(c0, c0 + 4):
            yield from free_wait(c, i, drop, f"{who}_free")
            yield ("read", ("raw", c), i)
            yield ("write", ("k16", c), i)
            yield ("read", ("raw", c), i)   # its loads are over at the chunk's partition barrier
            if c == c0 + 3:   # the last one also: every thread has read the scale words before the refill
                yield ("read", (scales, 0), i)
            yield ("arrive", ("k16_ready", c))
        yield from v4_copy_tile(scales, c0, i + 1)   # (tile n's copies are masked: zero-fill, still issued)
    yield ("wait_group", 0)


def run_v4(n, seed, drop=frozenset()):
    m = Machine(common_barriers(8), seed)
    m.run({"converter A": v4_converter(0, n, drop), "converter B": v4_converter(4, n, drop),
           "consumer 0": consumer(0, n, V4_ORDER, False, (), drop),
           "consumer 1": consumer(1, n, V4_ORDER, False, (), drop)})


BUILDS = {"heads_on_m": run_heads_on_m, "sparse": run_sparse, "v4": run_v4}
SOURCES = {"heads_on_m": ("heads_on_m.py", mh_barriers()), "sparse": ("sparse_partitions.py", common_barriers(9)),
           "v4": ("v4_partitions.py", common_barriers(8))}


@pytest.mark.parametrize("build", list(BUILDS))
def test_model_barriers_are_the_kernels(build):
    """The model's barriers and counts are the kernel's mbarrier.init lines (read from its source), so a changed
    count or a new barrier makes the model stale loudly."""
    name, model = SOURCES[build]
    text = (SM90 / name).read_text()
    inits = re.findall(r"mbarrier\.init\((\w+)\.index\((\w+)\), count=(\d+)\)", text)
    kernel = {}
    for array, index, count in inits:
        key = ("x_bar", "p_bar", "q_bar")[int(index)] if array == "bars" else array
        kernel[key] = int(count)
    modelled = {}
    for key, count in model.items():
        modelled[key if isinstance(key, str) else key[0]] = count
    assert modelled == kernel


def test_chunk_orders_are_the_kernels():
    # the owners' score orders: the kernels' formulas (their text in the source) evaluated here
    formula = "((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4"
    assert formula in (SM90 / "fragments.py").read_text()
    assert tuple(((c + 8) % 9) % 2 * 4 + ((c + 8) % 9) // 2 + (8 - c) // 8 * 4 for c in range(9)) == CHUNK_ORDER
    assert "(k % 2) * 4 + k // 2" in (SM90 / "v4_partitions.py").read_text()
    assert tuple((k % 2) * 4 + k // 2 for k in range(8)) == V4_ORDER


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("n", TILES)
def test_protocol_completes_without_stale_reads(build, n):
    """Every seeded interleaving of the build's partitions runs to the end: no hang, no read of a buffer another
    tile wrote (or that a copy is still filling)."""
    for seed in SEEDS:
        BUILDS[build](n, seed)


def violations(run, n=5, seeds=range(100), **kw):
    found = 0
    for seed in seeds:
        try:
            run(n, seed, **kw)
        except Violation:
            found += 1
    return found


@pytest.mark.parametrize("build,drop", [
    ("heads_on_m", "stage_free"),   # A refills stage s while converter B may still read it
    ("heads_on_m", "b_ready8"),     # B converts a stage the TMA has not filled yet
    ("heads_on_m", "a_free"),       # A overwrites chunks 0-3 under consumer 0's P.V (or the owner's scores)
    ("heads_on_m", "b_free"),
    ("heads_on_m", "p_bar"),        # the non-owner reads P and the row maximum before the owner wrote them
    ("sparse", "a_free8"),          # A overwrites k_pe and tv under the owner's scores
    ("sparse", "b_free"),
    ("sparse", "b_group"),          # B's wait_group(1) loosened to 2: it reads pieces still being copied
    ("sparse", "p_bar"),
    ("v4", "a_free"),
    ("v4", "b_free"),
    ("v4", "b_group"),              # no wait_group(0): the tile's copies may still be landing
    ("v4", "p_bar"),
])
def test_controls_dropping_a_wait_are_caught(build, drop):
    """The model can fail: without one wait that matters, some interleavings read a stale or in-flight buffer
    (or hang)."""
    assert violations(BUILDS[build], drop=frozenset({drop})) > 0


def test_sparse_tv_needs_two_slots():
    """The docstring's claim: with one tv slot converter A writes tile i + 1's T_t before tile i's owner read it."""
    assert violations(run_sparse, tv_slots=1) > 0


def test_a_missing_arrival_is_reported_as_a_hang():
    """The model's other failure: without converter B's stage_free arrival, converter A waits forever before its
    first refill (tile NS), and the scheduler says so instead of looping."""
    run_heads_on_m(NS, 0, frozenset({"b_stage_free_arrive"}))   # (no refill: nothing waits on it)
    with pytest.raises(Violation, match="hang.*stage_free"):
        run_heads_on_m(NS + 1, 0, frozenset({"b_stage_free_arrive"}))
