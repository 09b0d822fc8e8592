"""The batch-invariant cut of the Gluon dense builds (``kernels.split.tiles``: ``invariant_lists`` on the host,
``invariant_items_device`` on the device) and the plans ``gluon.build`` makes with it, on the CPU (the kernels are
never launched; their bits across batches are the GPU tests of tests/test_decode_sm90_invariant.py): a request's
work items are the same whatever the batch (its size, order, neighbours, the CTA count), host and device give the
same arrays, the cut is the Triton kernel's token cut, every tile is covered once; a plan's merge sizes are fixed
in the mode; the builds the mode takes and refuses, by name."""
from __future__ import annotations

import random

import pytest
import torch

import fp8mla
from fp8mla.kernels import split
from fp8mla.kernels.split.merge import INVARIANT_BLOCKS, SEQ_ALWAYS

CHUNK = 256
LENS = [0, 1, 63, 64, 65, 255, 256, 257, 700, 1024, 3001]


def items_of(res: dict, b: int) -> list:
    """Request b's work items (first tile, end tile), in merge order."""
    lo, hi = res["m_ptr"][b], res["m_ptr"][b + 1]
    return [(res["item_t0"][i], res["item_t1"][i]) for i in range(lo, hi)]


def as_lists(res: dict) -> dict:
    n = int(res["m_ptr"][-1])
    out = {key: v.tolist() for key, v in res.items()}
    for key in ("item_req", "item_t0", "item_t1"):
        out[key] = out[key][:n]
    out["m_list"] = out["m_list"][:n]
    return out


def test_a_requests_items_follow_its_length_only():
    """The same items for a request whatever the batch: alone, with neighbours of other lengths, in any order,
    repeated, on any CTA count; each item <= the chunk, the pieces of one size but the last, every tile once;
    the token boundaries are the Triton kernel's invariant cut (``chunk_bounds``)."""
    rng = random.Random(3)
    alone = {L: items_of(split.invariant_lists([L], CHUNK, 132), 0) for L in LENS}
    for L, items in alone.items():
        tiles = -(-L // 64)
        bounds = split.chunk_bounds(L, CHUNK) if L else [(0, 0)]
        assert items == [(a // 64, -(-e // 64)) for a, e in bounds], L
        assert items[0][0] == 0 and items[-1][1] == tiles and all(x[1] == y[0] for x, y in zip(items, items[1:]))
        assert all(t1 - t0 <= CHUNK // 64 for t0, t1 in items)
        assert len({t1 - t0 for t0, t1 in items[:-1]}) <= 1
    assert len(alone[3001]) == 12 and len(alone[1]) == 1 and alone[0] == [(0, 0)]
    for trial in range(40):
        batch = [rng.choice(LENS + [rng.randint(0, 5000)]) for _ in range(rng.randint(1, 40))]
        ctas = rng.choice([1, 7, 66, 132])
        res = split.invariant_lists(batch, CHUNK, ctas)
        for b, L in enumerate(batch):
            if L in alone:
                assert items_of(res, b) == alone[L], (trial, b, L)
        assert res["m_ptr"][-1] == len(res["item_req"]) and res["m_list"] == list(range(len(res["item_req"])))
        ptr = res["cta_ptr"]
        assert len(ptr) == ctas + 1 and ptr[0] == 0 and ptr[-1] == len(res["item_req"])
        assert all(x <= y for x, y in zip(ptr, ptr[1:]))


def test_device_cut_equals_the_host_cut():
    """``invariant_items_device`` (torch ops: device-only lengths, CUDA-graph buffers) gives ``invariant_lists``'s
    arrays, zero past the real count; into larger buffers the CTA slots past the count are empty."""
    rng = random.Random(5)
    for trial in range(40):
        batch = [rng.choice(LENS + [rng.randint(0, 9000)]) for _ in range(rng.randint(1, 30))]
        ctas = rng.choice([1, 7, 66, 132])
        want = split.invariant_lists(batch, CHUNK, ctas)
        cap = len(want["item_req"]) + rng.randint(0, 9)
        got, overflow = split.invariant_items_device(torch.tensor(batch, dtype=torch.int32), CHUNK, ctas, cap)
        assert overflow.tolist() == [0]
        lists = as_lists(got)
        assert lists == want, trial
        assert not got["item_t1"][len(want["item_req"]):].any()
        bufs = {key: torch.full((v.numel() + (3 if key == "cta_ptr" else 0),), 77, dtype=torch.int32)
                for key, v in got.items()}
        split.invariant_items_device(torch.tensor(batch, dtype=torch.int32), CHUNK, ctas, cap, out=bufs)
        assert bufs["cta_ptr"][ctas:].tolist() == [len(want["item_req"])] * 4


def test_device_cut_past_its_capacity_runs_whole_requests():
    """More pieces than the buffers hold (device-only lengths cannot raise without a sync): the requests past the
    capacity run as one item each (correct attention, not the invariant cut), counted; never an item past the
    arrays."""
    got, overflow = split.invariant_items_device(torch.tensor([600, 600, 600], dtype=torch.int32), CHUNK, 4, 5)
    assert overflow.tolist() == [2]
    assert got["m_ptr"].tolist() == [0, 3, 4, 5]
    assert list(zip(got["item_t0"].tolist(), got["item_t1"].tolist())) == [(0, 4), (4, 8), (8, 10), (0, 10),
                                                                          (0, 10)]


# -- plans (gluon.build on CPU tensors, never launched) -------------------------------------------------------------
def _plan(monkeypatch, lens, heads, graph, host, order_seed=0, **opts):
    from fp8mla.backends import AttentionSpec, gluon as gb
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)   # an sm_90 GPU, to the selector
    monkeypatch.setattr(gb, "num_sms", lambda device: 132)
    W = max(1, -(-max(lens) // 64))
    g = torch.Generator().manual_seed(order_seed)
    bt = torch.randperm(len(lens) * W, generator=g).to(torch.int32).view(len(lens), W)
    lay = PagedLayout.from_block_table(bt, torch.tensor(lens, dtype=torch.int32), 64)
    if not host:
        lay = PagedLayout(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.kv_len, 64, torch.device("cpu"),
                          lay.qo_lens)
    spec = AttentionSpec(heads, 512, 64, 64, True, 192 ** -0.5, torch.bfloat16, get_format("fp8_e4m3"),
                         torch.device("cpu"), graph)
    opts = dict(batch_invariant=True, invariant_chunk=CHUNK, **opts)
    if graph:
        opts.update(max_batch_size=64, max_kv_indices=4096, max_partials=256)
    return gb.build(lay, spec, opts)


@pytest.mark.parametrize("heads,heads_on_m", [(128, None), (128, False), (64, None), (32, None)])
def test_plans_cut_each_request_alike_with_fixed_merge_sizes(monkeypatch, heads, heads_on_m):
    """Plans of the wide and heads-on-M builds in the mode, host or device-only lengths, plain or CUDA-graph: each
    request's staged items are its own cut whatever the batch; the merge's block sizes are the mode's fixed ones
    and its sequential formula (never the batch's); the heads-on-M plan launches at least the items it has."""
    target = 3001
    seen = []
    for batch in ([target], [5, target, 700], [target] + [64] * 20 + [9000], [2000, 0, target, 1]):
        for host in (True, False):
            for graph in (False, True):
                p = _plan(monkeypatch, batch, heads, graph, host, heads_on_m=heads_on_m)
                assert p.build.heads_on_m == (heads_on_m is None and heads >= 64)
                assert (p.merge_p, p.merge_c) == INVARIANT_BLOCKS and p.t["merge_seq"] == SEQ_ALWAYS
                b = batch.index(target)
                m_ptr = p.t["m_ptr"].tolist()
                idx = [p.t["m_list"][j].item() for j in range(m_ptr[b], m_ptr[b + 1])]
                seen.append([(p.t["item_t0"][i].item(), p.t["item_t1"][i].item()) for i in idx])
                assert all(p.t["item_req"][i].item() == b for i in idx)
                n = m_ptr[-1]
                assert p.t["part_o"].shape[0] >= n and p.t["part_lse"].shape[0] >= n
                if p.build.heads_on_m:
                    assert p.n_items >= n
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 12


def test_graph_host_plan_past_max_partials_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="max_partials"):
        _plan(monkeypatch, [9000] * 10, 128, True, True)   # 10 x 36 pieces > 64 + 256


@pytest.mark.parametrize("heads,qo,taken", [(128, 1, True), (64, 1, True), (32, 1, True), (20, 1, True),
                                            (16, 1, False), (8, 1, False), (128, 2, False)])
def test_the_builds_the_mode_takes(monkeypatch, heads, qo, taken):
    """The wide builds (17..128 heads, both consumers over every tile) and heads-on-M (one CTA per item) compute
    an item alike wherever it runs: taken. The <= 16-head build splits an item's tiles between its consumers by
    its place in the CTA's tile stream, and multi-token plans run a variant chosen by the batch's longest query:
    refused by name (``backend="gluon"`` raises it)."""
    from fp8mla.backends import AttentionSpec
    from fp8mla.backends.select import Refusal, dense_question, select
    from fp8mla.formats import get_format
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)   # an sm_90 GPU, to the selector
    spec = AttentionSpec(heads, 512, 64, 64, True, 192 ** -0.5, torch.bfloat16, get_format("fp8_e4m3"),
                         torch.device("cpu"), False)

    def pick(options):
        choice = select(dense_question(spec, (qo, qo), options, qo), "gluon")
        return choice.reason if isinstance(choice, Refusal) else choice.build
    b = pick(dict(batch_invariant=True))
    assert isinstance(b, str) != taken, b
    if not taken:
        assert b.startswith("batch_invariant: ")
    assert not isinstance(pick({}), str)   # (the default mode takes them all)


def test_auto_keeps_triton_and_gluon_is_taken_by_name():
    """The mode's selection: ``backend="gluon"`` is accepted (its plans take the invariant cut or are refused by
    name), ``auto`` keeps the Triton kernel (the Gluon kernels' bits per request are checked on a GPU only)."""
    fp8mla.MLAPagedAttention(backend="gluon", batch_invariant=True, heads_on_m=True)
    from fp8mla.backends._invariant import GLUON_AUTO
    assert "auto" in GLUON_AUTO


def test_sparse_gluon_splits_follow_topk_only_in_the_mode():
    """The sparse Gluon build in the mode: every call splits a row in ``ceil(topk / 512)`` (its default split count
    is one wave of the SMs over the call's tokens), and the merge of those splits has fixed block sizes."""
    from types import SimpleNamespace

    from fp8mla.kernels.split import merge as mm
    from fp8mla.backends.sparse_gluon import GluonSparsePlan
    p = GluonSparsePlan.__new__(GluonSparsePlan)   # (its split rule only: no workspace)
    p.spec = SimpleNamespace(num_splits=None, batch_invariant=True, topk=2048, num_heads=64, min_split=64)
    p.n_sm, p.config = 132, {"block_h": 64}
    assert {p.splits_for(n) for n in (1, 7, 64, 4096)} == {4}
    p.spec.batch_invariant = False
    assert len({p.splits_for(n) for n in (1, 7, 64, 4096)}) > 1   # (the default follows the call)
    import inspect
    defaults = inspect.signature(mm.merge_splits).parameters
    assert (defaults["block_p"].default, defaults["block_c"].default) == INVARIANT_BLOCKS
