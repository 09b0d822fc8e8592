"""The software-pipelined H <= 16 decode kernel (``decode_sm90_pipe``, behind ``GLUON_PIPELINED`` / FP8MLA_GLUON_PIPE).

CPU: the compile for sm_90a with triton's ptxas (no C7512 wgmma serialization, spills bounded, 68 HGMMA per
steady-state iteration of each consumer, no byte-wise shared loads in the loops), the ring protocol emulated with
the kernel's exact mbarrier parity waits (NS 3..5 never deadlock and never refill a stage in use; NS 2 deadlocks,
which the launch refuses), the switch (the gluon plan launches the pipelined kernel only when on, one query per
request, H <= 16, with the kernel's own NS), the refusals.
GPU (sm_90 with Gluon; skipped here): float64 reference over NaN-poisoned shuffled pools with odd lengths, H 1/8/16,
pages 1/16/64, many splits with bit-identical reruns, bit-identical to decode_sm90 with the merge off, CUDA-graph
replay after a re-plan; each asserts the pipelined kernel actually ran.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import fp8mla
from fp8mla.kernels import decode_sm90 as k
from fp8mla.kernels import decode_sm90_pipe as kp
from conftest import compile_report_in_child
from test_decode_sm90 import run_case  # the Gluon tests' one plan/run into NaN-poisoned buffers
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")
DEVICE = "cuda" if ON_SM90 else "cpu"


# -- CPU --------------------------------------------------------------------------------------------------------
def _sass_loops(sass: str) -> list[dict]:
    """Backward branches whose body holds HGMMA: per loop (outermost ones included) HGMMA, LDL, STL counts."""
    import re
    ops = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    out = []
    for addr, op, rest in ops:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            body = [o for a, o, _ in ops if int(t.group(1), 16) <= a <= addr]
            n = sum(o.startswith("HGMMA") for o in body)
            if n:
                out.append({"HGMMA": n, "LDL": sum(o.startswith("LDL") for o in body),
                            "STL": sum(o.startswith("STL") for o in body),
                            "LDS.U8": sum(o == "LDS.U8" for o in body)})
    return out


@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("page,ns,depth", [(64, 5, 11), (1, 5, 11), (64, 4, 11), (64, 5, 22)])
def test_compiles_for_sm90a(page, ns, depth):
    r, sass_text = compile_report_in_child("fp8mla.kernels.decode_sm90_pipe", page=page, ns=ns, depth=depth)
    assert not r["serialized_wgmma"], r["ptxas"]
    # triton 3.6 (the H200's): 48 B of spill at page 64 (depth 22: 236 B); triton 3.9: ~350 B (depth 22: 672 B)
    assert sum(st for st, _ in r["spills"]) <= (512 if depth == 11 else 1024), r["spills"]
    # per consumer, from its first to its last HGMMA: prologue QK 36 + steady 68 + last tile P.V 32
    assert [x["HGMMA"] for x in r["loops"]] == [136, 136], r["loops"]
    assert all(x["LDS.U8"] == 0 for x in r["loops"]), r["loops"]
    # the steady-state loop of each consumer: QK (36) of the next tile + P.V (32) of the current one
    steady = [x for x in _sass_loops(sass_text) if x["HGMMA"] == 68]
    assert len(steady) >= 2, _sass_loops(sass_text)
    assert all(x["LDS.U8"] == 0 for x in steady)
    import triton
    if triton.__version__.startswith("3.6"):   # the H200's compiler: no spill code in the steady-state loops,
        # but one reload per steady iteration at an odd depth: the per-consumer ready barriers (kernel log 29; the
        # H200's GPU suite found it, 2026-12-01 06:00 UTC, the first 3.6 compile of them); none at an even depth
        most = 1 if ns % 2 else 0
        assert all(x["LDL"] <= most and x["STL"] == 0 for x in steady), steady
        if depth == 11:                          # and no more between a consumer's first and last HGMMA
            assert all(x["LDL"] <= most and x["STL"] == 0 for x in r["loops"]), r["loops"]
    assert r["smem"] <= k.SMEM_LIMIT
    assert r["ops"].get("LDS.U8", 0) <= 2, r["ops"]


def test_shared_memory_and_stages():
    assert kp.smem_bytes(5) <= k.SMEM_LIMIT < kp.smem_bytes(5, global_exchange=False)
    assert kp.smem_bytes(4, global_exchange=False) <= k.SMEM_LIMIT
    assert kp.smem_bytes(6) > k.SMEM_LIMIT
    assert kp._check_ns(5, None) is True and kp._check_ns(4, None) is False and kp._check_ns(4, True) is True
    for bad, xg in ((2, None), (6, None), (5, False)):
        with pytest.raises(ValueError, match="ns"):
            kp._check_ns(bad, xg)


# ---- the ring protocol with the kernel's exact mbarrier parity waits ----------------------------------------
_PROGRESS = [0]   # arrivals so far (the emulation's progress measure)


class _Bar:
    """An mbarrier: ``count`` arrivals complete a phase; wait(parity) passes once the phase of that parity has
    completed, i.e. while the current (incomplete) phase's parity differs (PTX try_wait.parity)."""

    def __init__(self, count):
        self.count, self.arrived, self.phases = count, 0, 0

    def arrive(self):
        _PROGRESS[0] += 1
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.phases = 0, self.phases + 1

    def passed(self, parity):
        return (self.phases & 1) != parity


def _producer(items, NS, ready, empty, state):
    g = 0
    for _, t0, t1 in items:
        for _t in range(t0, t1):
            s = g % NS
            if g >= NS:
                while not empty[s].passed(((g // NS) & 1) ^ 1):
                    yield
            assert not state["held"][s], f"stage {s} refilled while consumer(s) {state['held'][s]} hold it"
            state["stage_pos"][s] = g
            ready[s].arrive()
            g += 1


def _consumer(cid, items, NS, ready, empty, xbar, state):
    # decode_sm90_pipe._consumer_pipe's barrier ops, in its order
    g = 0

    def take(gg):
        s = gg % NS
        while not ready[s].passed((gg // NS) & 1):
            yield
        assert state["stage_pos"][s] == gg, f"consumer {cid} at position {gg} sees stage {s} of {state['stage_pos'][s]}"
        state["held"][s].add(cid)

    def give(gg):
        s = gg % NS
        assert state["stage_pos"][s] == gg
        state["held"][s].discard(cid)
        empty[s].arrive()

    for n_it, (_, t0, t1) in enumerate(items):
        n = t1 - t0
        j0 = (cid + g) % 2
        if j0 < n:
            yield from take(g + j0)
        for j in range(j0, n - 2, 2):
            yield from take(g + j + 2)
            yield
            give(g + j)
        if j0 < n:
            give(g + j0 + ((n - 1 - j0) // 2) * 2)
        if cid == 1:
            while n_it > 0 and not xbar[1].passed((n_it & 1) ^ 1):
                yield
            xbar[0].arrive()
        else:
            while not xbar[0].passed(n_it & 1):
                yield
            xbar[1].arrive()
        g += n


def _simulate(items, NS, seed):
    rng = random.Random(seed)
    ready = [_Bar(1) for _ in range(NS)]
    empty = [_Bar(1) for _ in range(NS)]
    xbar = [_Bar(1), _Bar(1)]
    state = {"held": [set() for _ in range(NS)], "stage_pos": [-1] * NS}
    actors = [_producer(items, NS, ready, empty, state), _consumer(0, items, NS, ready, empty, xbar, state),
              _consumer(1, items, NS, ready, empty, xbar, state)]
    live = list(actors)
    stuck, seen = 0, _PROGRESS[0]
    while live:
        a = rng.choice(live)
        try:
            next(a)
        except StopIteration:
            live.remove(a)
        stuck = 0 if _PROGRESS[0] != seen else stuck + 1
        seen = _PROGRESS[0]
        if stuck > 2000:
            return False   # no arrival in 2000 steps: every live actor is blocked on a wait (deadlock)
    return True


def _items(rng):
    out = []
    for _ in range(rng.randint(1, 5)):
        n = rng.choice([0, 1, 2, 3, 4, 5, 8, 13])
        t0 = rng.randint(0, 3)
        out.append((0, t0, t0 + n))
    return out


@pytest.mark.parametrize("NS", [3, 4, 5])
def test_ring_protocol_never_deadlocks_nor_overwrites(NS):
    rng = random.Random(NS)
    for trial in range(60):
        items = _items(rng)
        assert _simulate(items, NS, seed=trial), f"deadlock at NS {NS}, items {items}"


def test_ring_protocol_deadlocks_at_two_stages():
    # each consumer holds two stages: at NS 2 the release of tile t waits for ready(t + 2), which waits for the
    # release of t itself (the launch refuses ns 2; this shows why the emulation can tell)
    assert not _simulate([(0, 0, 6)], 2, seed=0)


# ---- switch and refusals ----------------------------------------------------------------------------------
def _t(rows=16, items=4):
    i32 = dict(dtype=torch.int32)
    return dict(part_o=torch.empty(items, rows, 512), part_lse=torch.empty(items, rows),
                qo_indptr=torch.zeros(2, **i32))


def test_launch_refuses_before_launching():
    kw = dict(grid=4, grid_batch=1, num_heads=16, sm_scale=0.1, page_size=64)
    q = torch.empty(1, 16, 512)
    with pytest.raises(ValueError, match="max_qo"):
        kp.launch(None, None, q, q, None, _t(), q, None, **kw, max_qo=2)
    for h in (0, 17, 128):
        with pytest.raises(ValueError, match="num_heads"):
            kp.launch(None, None, q, q, None, _t(), q, None, **dict(kw, num_heads=h))
    with pytest.raises(ValueError, match="mode"):
        kp.launch(None, None, q, q, None, _t(), q, None, **kw, mode=1)
    for ns, xg in ((2, None), (6, None), (5, False)):
        with pytest.raises(ValueError, match="ns"):
            kp.launch(None, None, q, q, None, _t(), q, None, **kw, ns=ns, global_exchange=xg)
    with pytest.raises(ValueError, match="part_o"):
        kp.launch(None, None, q, q, None, _t(rows=8), q, None, **kw)
    t = _t()
    t["part_o"] = torch.empty(4, 16, 256)
    with pytest.raises(ValueError, match="part_o"):
        kp.launch(None, None, q, q, None, t, q, None, **kw)


@pytest.mark.parametrize("switch,env,H,max_qo,want", [
    (False, None, 16, 1, "current"), (True, None, 16, 1, "pipe"), (False, "1", 16, 1, "pipe"),
    (True, "0", 16, 1, "current"), (False, "1", 1, 1, "pipe"), (False, "1", 8, 1, "pipe"),
    (False, "1", 17, 1, "current"), (False, "1", 128, 1, "current"), (False, "1", 16, 2, "current")])
def test_switch_routes_the_launch(monkeypatch, switch, env, H, max_qo, want):
    """GluonPlan.run launches the pipelined kernel only with the switch on (GLUON_PIPELINED or FP8MLA_GLUON_PIPE=1;
    =0 wins), one query per request and H <= 16; the same arguments but its own NS."""
    from fp8mla.backends import gluon as gb
    monkeypatch.setattr(gb, "GLUON_PIPELINED", switch)
    monkeypatch.delenv("FP8MLA_GLUON_SPLIT", raising=False)
    if env is None:
        monkeypatch.delenv("FP8MLA_GLUON_PIPE", raising=False)
    else:
        monkeypatch.setenv("FP8MLA_GLUON_PIPE", env)
    calls = []
    monkeypatch.setattr(k, "kv_descriptors", lambda a, b: ("kv", "kpe"))
    monkeypatch.setattr(k, "launch", lambda *a, **kw: calls.append(("current", kw)))
    monkeypatch.setattr(kp, "launch", lambda *a, **kw: calls.append(("pipe", kw)))
    spec = SimpleNamespace(num_heads=H, sm_scale=0.1, page_size=64, causal=True)
    plan = gb.GluonPlan(spec, 132, 8, 2, 256, 3, {}, max_qo)
    pool = torch.zeros(4, 64, 576, dtype=torch.uint8)
    plan.run(None, None, pool[..., :512], pool[..., 512:], None, None, None, None, base_e=False)
    assert [c[0] for c in calls] == [want]
    assert calls[0][1]["num_heads"] == H and calls[0][1]["grid"] == 132
    assert calls[0][1]["ns"] == (kp.NS_DEFAULT if want == "pipe" else 3)


# -- GPU --------------------------------------------------------------------------------------------------------
@pytest.fixture
def pipe(monkeypatch):
    """The switch on, and a count of the pipelined kernel's launches (the backend looks it up per run)."""
    monkeypatch.setenv("FP8MLA_GLUON_PIPE", "1")
    monkeypatch.setenv("FP8MLA_GLUON_PAGE1", "1")
    n = {"launches": 0}
    real = kp.launch_for_plan

    def counted(*a, **kw):
        n["launches"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(kp, "launch_for_plan", counted)
    return n


@gpu
@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_pipe_odd_lengths_nan_pools(pipe, H, page):
    b = make_paged_batch([0, 1, 63, 64, 65, 97, 514, page + 1, 1000, 3000], [1] * 10, H, page, "fp8_e4m3",
                         device=DEVICE, seed=H + page, extra_pages=1)
    _, out, lse = run_case(b)
    assert pipe["launches"] == 1
    ref_o, ref_lse = b.reference()
    assert_close(out, ref_o, 3e-3, "out")
    assert_close(lse, ref_lse, 1e-4, "lse")
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()   # kv_len 0: 0 and -inf


@gpu
@pytest.mark.parametrize("min_chunk", [64, 256])
def test_pipe_many_splits_bit_identical_reruns_and_matches_current(pipe, monkeypatch, min_chunk):
    b = make_paged_batch([32768, 65, 4097], [1] * 3, 16, 64, "fp8_e4m3", device=DEVICE, seed=min_chunk)
    attn, out, lse = run_case(b, min_chunk=min_chunk)
    assert_close(out, b.reference()[0], 3e-3, "out")
    o1, l1 = out.clone(), lse.clone()
    attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
    assert torch.equal(out, o1) and torch.equal(lse, l1)
    assert pipe["launches"] == 2
    # the current kernel on the same plan: the same per-tile ops, so the same outputs up to the merge (both
    # merges are deterministic; decode_sm90's is being reworked, so only closeness is asserted here; the device
    # script compares the partials bit for bit)
    monkeypatch.setenv("FP8MLA_GLUON_PIPE", "0")
    _, out2, _ = run_case(b, min_chunk=min_chunk)
    assert_close(out2, out, 1e-3, "current vs pipe")


@gpu
def test_pipe_cuda_graph_capture_then_replan(pipe):
    H = 16
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 64, "fp8_e4m3", device=DEVICE, seed=5, spare_pages=60)
    attn.plan(**b1.plan_args)
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(3, H, device=DEVICE)
    kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    assert pipe["launches"] >= 1
    assert_close(out, b1.reference()[0], 3e-3, "out")
    from fp8mla.reference import mla_reference
    a = dict(b1.plan_args)
    pages = a["kv_indices"]
    a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEVICE)
    a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEVICE)
    a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
    attn.plan(**a)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                           a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    assert_close(out[:2], ref[:2], 3e-3, "out after re-plan")
    assert (out[2] == 0).all()
