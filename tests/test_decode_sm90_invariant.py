"""The batch-invariant mode on the Gluon (sm_90) dense builds (``backend="gluon", batch_invariant=True``): a
request's output and lse are the same bits whatever shares its batch: batch sizes 1..N, orders, neighbours of other
lengths, its pages moved in the pool, plain and CUDA-graph plans (re-planned), host and device-only lengths, on the
wide build (17..128 heads) and heads-on-M; and they are the right attention. GPU only (an sm_90 device with
triton.experimental.gluon); the cut and the plans are CPU-tested in tests/test_split_invariant.py."""
from __future__ import annotations

import random

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close
from tests.test_batch_invariant import Requests, assert_same_bits, per_request, run_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
pytestmark = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")
DEVICE = "cuda"
CHUNK = 256   # requests below cut in 1..12 pieces
# kv_len 0, 1, one tile, a tile + 1, one chunk, a chunk + 1, pieces of 5 and 12 chunks
KV = [0, 1, 64, 65, 256, 257, 1200, 3001]
# (heads, page size, options): heads-on-M (64 and 128 heads, pages of 64), the wide build at 128 (heads_on_m off),
# 32 and 20 heads, pages of 16 and 1
BUILDS = [(128, 64, {}), (64, 64, {}), (128, 64, dict(heads_on_m=False)), (32, 16, {}), (20, 1, {})]
IDS = ["mh128", "mh64", "wide128", "wide32_p16", "wide20_p1"]


def orders(n_req: int, target: int, seed: int):
    """Batches holding ``target``: alone, then sizes 2..N of random neighbours in random orders (repeats too)."""
    rng = random.Random(seed)
    out = [[target]]
    for size in range(2, n_req + 3):
        others = [rng.randrange(n_req) for _ in range(size - 1)]
        o = others + [target]
        rng.shuffle(o)
        out.append(o)
    return out


def gluon(heads, page, graph=False, **opts):
    extra = dict(max_batch_size=16, max_kv_indices=1 << 16, max_partials=256) if graph else {}
    attn = fp8mla.MLAPagedAttention(backend="gluon", batch_invariant=True, invariant_chunk=CHUNK,
                                    use_cuda_graph=graph, **extra, **opts)
    return attn


@pytest.mark.parametrize("heads,page,opts", BUILDS, ids=IDS)
def test_same_bits_in_any_batch(heads, page, opts):
    reqs = Requests(KV, [1] * len(KV), num_heads=heads, page_size=page, seed=heads + page)
    attn = gluon(heads, page, **opts)
    for target in (7, 6, 0, 1):
        seen = {}
        for i, order in enumerate(orders(len(KV), target, seed=target)):
            out, lse = run_batch(attn, *reqs.batch(order, seed=100 * target + i))
            assert attn.backend == "gluon"
            got = {b: v for b, v in per_request(reqs, order, out, lse).items() if b == target}
            assert_same_bits(seen, got, f"batch {order}")
    out, lse = run_batch(attn, *reqs.batch(range(len(KV)), seed=7))
    ref_o, ref_lse = reqs.base.reference()
    assert_close(out, ref_o, 3e-3, "out")
    assert_close(lse, ref_lse, 1e-4, "lse")


@pytest.mark.parametrize("heads,page,opts", BUILDS, ids=IDS)
def test_graph_plans_and_replans_give_the_plain_bits(heads, page, opts):
    """A CUDA-graph wrapper (host lengths), re-planned for each batch into its fixed buffers, run captured in a CUDA
    graph and replayed: each request gets the plain plan's bits."""
    from fp8mla.testing import capture_then_replay
    reqs = Requests(KV, [1] * len(KV), num_heads=heads, page_size=page, seed=3 + heads)
    plain, graph = gluon(heads, page, **opts), gluon(heads, page, graph=True, **opts)
    seen = {}
    batches = [orders(len(KV), 7, seed=1)[k] for k in (0, 3, 6)] + [[7, 6, 5, 4, 3, 2, 1, 0]]
    for i, order in enumerate(batches):
        plan, run = reqs.batch(order, seed=200 + i)
        out, lse = run_batch(plain, plan, run)
        assert_same_bits(seen, per_request(reqs, order, out, lse), f"plain batch {order}")
    for i, order in enumerate(batches):
        plan, run = reqs.batch(order, seed=200 + i)
        graph.plan(**plan)
        n, H, Dc = run["q_nope"].shape
        out = torch.empty((n, H, Dc), dtype=plan["q_data_type"], device=DEVICE)
        lse = torch.empty((n, H), device=DEVICE)
        capture_then_replay(lambda: graph.run(**run, out=out, lse=lse, return_lse=True), out)
        assert_same_bits(seen, per_request(reqs, order, out, lse), f"graph batch {order}")


@pytest.mark.parametrize("heads,page,opts", BUILDS[:3], ids=IDS[:3])
def test_device_only_lengths_give_the_host_bits(heads, page, opts):
    """Lengths only on the device (vLLM's path; the cut runs on the GPU, ``invariant_items_device``): the host
    lengths' bits, plain and CUDA-graph plans."""
    from fp8mla.layout import PagedLayout
    reqs = Requests(KV, [1] * len(KV), num_heads=heads, page_size=page, seed=9)
    plain, graph = gluon(heads, page, **opts), gluon(heads, page, graph=True, **opts)
    seen = {}
    for i, order in enumerate([[7], [7, 2, 5, 0], [0, 1, 2, 3, 4, 5, 6, 7]]):
        plan, run = reqs.batch(order, seed=300 + i)
        for host, attn in ((True, plain), (False, plain), (False, graph)):
            lens = plan["kv_len_arr"].cpu() if host else plan["kv_len_arr"].to(DEVICE)
            layout = PagedLayout.from_csr(plan["qo_indptr"].cpu(), plan["kv_indptr"], plan["kv_indices"], lens,
                                          plan["page_size"], device=DEVICE)
            attn.plan_layout(layout, plan["num_heads"], plan["head_dim_ckv"], plan["head_dim_kpe"], True,
                             plan["sm_scale"], plan["q_data_type"], plan["kv_data_type"])
            out, lse = attn.run(**run, return_lse=True)
            assert_same_bits(seen, per_request(reqs, order, out, lse), f"batch {order}, host lengths {host}")
            if not host:
                assert attn._plan.impl.overflow.tolist() == [0]


def test_refused_builds_raise_by_name():
    """<= 16 heads (the alternating-tile build) and multi-token plans are refused in the mode, naming why."""
    reqs = Requests([300, 5], [1, 1], num_heads=16, page_size=64, seed=1)
    with pytest.raises(ValueError, match="batch_invariant: "):
        run_batch(gluon(16, 64), *reqs.batch([0, 1], seed=1))
    reqs = Requests([300, 5], [2, 1], num_heads=64, page_size=64, seed=2)
    with pytest.raises(ValueError, match="batch_invariant: "):
        run_batch(gluon(64, 64), *reqs.batch([0, 1], seed=2))
