"""A CPU model of the prototype's barrier protocol (kernel.py), to find a hang or a buffer read while it is being
overwritten before the GPU does: the converter, the two consumers and the TMA engine are generators of the actions
kernel.py performs, in its order; mbarriers have the hardware's rule (a phase completes after `count` arrivals; a
parity wait passes once the phase with that parity has completed, i.e. while the current phase's parity differs), and
a random scheduler interleaves the agents. Every buffer holds a tag (which tile wrote it); a reader checks the tag when
it starts reading and again when it releases the buffer (an async wgmma reads until it is waited on).

    python lab/many_heads/protocol_model.py         # both builds, many seeds and tile counts; and the controls

The controls drop one wait each (the converter's k16_free wait; the owner build's p_bar wait; conv2: converter A's
stage_free wait before the TMA refills a stage converter B may still read, converter B's ready8 or k16_free wait):
the model must then report a violation, so it can fail.
"""
from __future__ import annotations

import random
import sys

NCH, NS = 9, 2


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, 0, 0   # phase = completed phases

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def passed(self, parity):   # try_wait.parity: the phase with this parity has completed
        return (self.phase & 1) != parity


class Violation(Exception):
    pass


ORDER = (8, 0, 4, 1, 5, 2, 6, 3, 7)                     # the release builds' chunk order
ROUNDS_PAIR = ((8,), (0, 4), (1, 5), (2, 6), (3, 7))    # ... and the pair build's rounds
ROUNDS_CONV2_A = {2: ((8,), (0, 1), (2, 3)),            # conv2: converter A (and the TMA) ...
                  1: ((8,), (0,), (1,), (2,), (3,))}     # (conv2_chunks=1: one chunk per round)
ROUNDS_CONV2_B = {2: ((4, 5), (6, 7)), 1: ((4,), (5,), (6,), (7,))}   # ... and converter B, in parallel


def converter(st, n, drop_free_wait=False, release=False, pair=False, conv2=0, drop_stage_wait=False):
    def tma(i):   # the copy lands some time later: stage written, then the ready barrier's transaction completes
        st["pending"].append(("stage", i % NS, i, ("ready8", i % NS)))

    for i in range(min(NS, n)):
        tma(i)
    for i in range(n):
        s = i % NS
        yield ("wait", ("ready8", s), (i // NS) & 1)
        if not release:
            if i > 0 and not drop_free_wait:
                yield ("wait", "k16_free", (i & 1) ^ 1)
            rounds = [(c,) for c in range(NCH)]
        else:
            rounds = ROUNDS_CONV2_A[conv2] if conv2 else ROUNDS_PAIR if pair else [(c,) for c in ORDER]
        for rnd in rounds:
            for c in rnd:
                if release and i > 0 and not drop_free_wait:
                    yield ("wait", ("k16_free", c), (i & 1) ^ 1)
                yield ("read", ("stage", s), i)
                yield ("write", ("k16", c), i)
            for c in rnd:
                yield ("arrive", ("k16_ready", c))
        if i + NS < n:
            if conv2 and not drop_stage_wait:   # converter B has read its chunks of stage s
                yield ("wait", ("stage_free", s), (i // NS) & 1)
            tma(i + NS)


def converter_b(st, n, chunks, drop_free_wait=False, drop_ready_wait=False):
    """conv2's second converter: chunks 4-7 of every tile, then stage s back to converter A."""
    for i in range(n):
        s = i % NS
        if not drop_ready_wait:
            yield ("wait", ("ready8", s), (i // NS) & 1)
        for rnd in ROUNDS_CONV2_B[chunks]:
            for c in rnd:
                if i > 0 and not drop_free_wait:
                    yield ("wait", ("k16_free", c), (i & 1) ^ 1)
                yield ("read", ("stage", s), i)
                yield ("write", ("k16", c), i)
            for c in rnd:
                yield ("arrive", ("k16_ready", c))
        yield ("read", ("stage", s), i)   # its loads of the stage are complete only here (the round's barrier)
        yield ("arrive", ("stage_free", s))


def consumer(st, cid, n, owner, drop_p_wait=False, release=False):
    yield ("arrive", "q_bar")
    yield ("wait", "q_bar", 0)
    mine = [4 * cid + j for j in range(4)]
    for i in range(n):
        ph = i & 1
        if owner:
            if i % 2 == cid:
                order = ORDER if release else range(NCH)
                for c in order:
                    yield ("wait", ("k16_ready", c), ph)
                    yield ("read", ("k16", c), i)
                for c in order:   # the score MMAs are waited on here
                    yield ("read", ("k16", c), i)
                if release:   # chunk 8 is the scores' only
                    yield ("arrive", ("k16_free", 8))
                yield ("write", ("p", 0), i)
                yield ("write", ("xm", 0), i)
                yield ("arrive", "p_bar")
            else:
                if not drop_p_wait:
                    yield ("wait", "p_bar", ph)
                for c in mine:
                    yield ("wait", ("k16_ready", c), ph)
                yield ("read", ("xm", 0), i)
            p_bufs = [("p", 0)]
        else:
            for c in range(NCH):
                yield ("wait", ("k16_ready", c), ph)
                yield ("read", ("k16", c), i)
            for c in range(NCH):
                yield ("read", ("k16", c), i)
            yield ("write", ("xm", cid), i)
            yield ("arrive", "x_bar")
            yield ("wait", "x_bar", ph)
            yield ("read", ("xm", 1 - cid), i)
            yield ("write", ("p", cid), i)
            yield ("arrive", "p_bar")
            yield ("wait", "p_bar", ph)
            p_bufs = [("p", 0), ("p", 1)]
        for b in p_bufs + [("k16", c) for c in mine]:   # P.V issued
            yield ("read", b, i)
        if release:   # waited on one by one (depth 3, 2, 1, 0), each chunk released as its MMA completes
            for c in mine:
                for b in p_bufs + [("k16", c)]:
                    yield ("read", b, i)
                yield ("arrive", ("k16_free", c))
            continue
        for b in p_bufs + [("k16", c) for c in mine]:   # ... and waited on, then the tile is released
            yield ("read", b, i)
        yield ("arrive", "k16_free")
    yield ("write", ("xm", 2 + cid), "l")
    yield ("arrive", "x_bar")
    yield ("wait", "x_bar", 0 if owner else n & 1)
    yield ("read", ("xm", 3 - cid), "l")


def run(n, owner, seed, release=False, pair=False, conv2=0, **drop):
    """One interleaving; conv2: 0 (one converter) or the two converters' chunks per round (1, 2)."""
    rng = random.Random(seed)
    bars = {("ready8", s): Barrier(1) for s in range(NS)}
    bars.update({("k16_ready", c): Barrier(1) for c in range(NCH)})
    bars.update(k16_free=Barrier(2), x_bar=Barrier(2), p_bar=Barrier(1 if owner else 2), q_bar=Barrier(2))
    bars.update({("k16_free", c): Barrier(1) for c in range(NCH)})   # the release builds' per-chunk barriers
    bars.update({("stage_free", s): Barrier(1) for s in range(NS)})    # conv2: converter B done with stage s
    st = {"pending": [], "buf": {}}
    agents = {"converter": converter(st, n, drop.get("drop_free_wait", False), release, pair, conv2,
                                     drop.get("drop_stage_wait", False)),
              "c0": consumer(st, 0, n, owner, drop.get("drop_p_wait", False), release),
              "c1": consumer(st, 1, n, owner, drop.get("drop_p_wait", False), release)}
    if conv2:
        agents["converter B"] = converter_b(st, n, conv2, drop.get("drop_b_free_wait", False),
                                            drop.get("drop_b_ready_wait", False))
    nxt = {k: next(g, None) for k, g in agents.items()}

    def runnable(a):
        act = nxt[a]
        return act is not None and (act[0] != "wait" or bars[act[1]].passed(act[2]))

    steps = 0
    while True:
        steps += 1
        ready = [a for a in agents if runnable(a)]
        if st["pending"] and (not ready or rng.random() < 0.3):   # a TMA copy lands
            kind, s, tag, bar = st["pending"].pop(rng.randrange(len(st["pending"])))
            st["buf"][(kind, s)] = tag
            bars[bar].arrive()
            continue
        if not ready:
            if all(v is None for v in nxt.values()):
                return steps
            raise Violation(f"deadlock: waiting {({a: nxt[a] for a in agents if nxt[a] is not None})}")
        a = rng.choice(ready)
        act = nxt[a]
        if act[0] == "arrive":
            bars[act[1]].arrive()
        elif act[0] == "write":
            st["buf"][act[1]] = act[2]
        elif act[0] == "read" and st["buf"].get(act[1]) != act[2]:
            raise Violation(f"{a} read {act[1]} expecting {act[2]!r}, found {st['buf'].get(act[1])!r}")
        nxt[a] = next(agents[a], None)


def main():
    ok = True
    builds = {"token split": dict(owner=False), "owner": dict(owner=True),
              "owner release": dict(owner=True, release=True), "owner release pair": dict(owner=True, release=True, pair=True),
              "conv2": dict(owner=True, release=True, pair=True, conv2=2),
              "conv2 single": dict(owner=True, release=True, pair=True, conv2=1)}
    for name, kw in builds.items():
        runs = 0
        for n in range(0, 9):
            for seed in range(300):
                try:
                    run(n, seed=seed, **kw)
                    runs += 1
                except Violation as e:
                    ok = False
                    print(f"FAIL {name} n={n} seed={seed}: {e}")
                    break
        print(f"{name} build: {runs} interleavings, no hang, no stale read" if ok else "")
    for name, drop in (("token split", "drop_free_wait"), ("owner", "drop_free_wait"), ("owner", "drop_p_wait"),
                       ("owner release", "drop_free_wait"), ("owner release pair", "drop_free_wait"),
                       ("owner release", "drop_p_wait"), ("conv2", "drop_free_wait"), ("conv2", "drop_p_wait"),
                       ("conv2", "drop_stage_wait"), ("conv2", "drop_b_free_wait"), ("conv2", "drop_b_ready_wait"),
                       ("conv2 single", "drop_free_wait"), ("conv2 single", "drop_stage_wait"),
                       ("conv2 single", "drop_b_free_wait")):
        found = 0
        for seed in range(300):
            try:
                run(5, seed=seed, **builds[name], **{drop: True})
            except Violation:
                found += 1
        print(f"control ({name}, {drop}): violations in {found} of 300 interleavings")
        ok &= found > 0
    print("protocol model:", "all passed" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
