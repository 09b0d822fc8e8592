"""The batch-invariant mode (``batch_invariant=True``): a request's output and lse are the same bits whatever
shares its batch: batch sizes 1..N, orders, neighbours of other lengths, its pages moved elsewhere in the pool,
plain and CUDA-graph plans (re-planned), one or several queries per request. Torch and the Triton kernel (the
interpreter on the CPU); ``auto`` keeps the Triton kernel in the mode (the Gluon builds: test_decode_sm90_invariant.py
on a GPU, test_split_invariant.py on the CPU). And the default mode is not claimed invariant:
its cut of a request follows the batch."""
from __future__ import annotations

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close, capture_then_replay, make_paged_batch
from tests.conftest import BACKEND_PARAMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 64  # small chunks: the requests below are cut in 1..5 pieces


class Requests:
    """Fixed requests (KV tokens and queries) that any batch can be built from, each time in freshly shuffled
    pages of a NaN-filled pool."""

    def __init__(self, kv_lens, qo_lens, num_heads=16, page_size=16, fmt="fp8_e4m3", seed=0):
        self.base = make_paged_batch(kv_lens, qo_lens, num_heads, page_size, fmt, device=DEVICE, seed=seed)
        a = self.base.plan_args
        self.kv_lens, self.qo_lens, self.page = list(kv_lens), list(qo_lens), page_size
        self.qo = a["qo_indptr"].tolist()
        kvp, idx = a["kv_indptr"].tolist(), a["kv_indices"].tolist()
        self.pages = [idx[kvp[b]: kvp[b + 1]] for b in range(len(kv_lens))]

    def batch(self, order, seed, extra_pages=2):
        """(plan kwargs, run kwargs) of the requests ``order`` (indices, repeats allowed), their pages copied to
        random other pages of a larger pool."""
        g = torch.Generator().manual_seed(seed)
        a, r = self.base.plan_args, self.base.run_args
        pool = self.base.pool
        need = sum(len(self.pages[b]) for b in order)
        P = need + extra_pages + int(torch.randint(0, 5, (1,), generator=g))
        new_pool = torch.full((P,) + tuple(pool.shape[1:]), float("nan"), dtype=torch.float32).to(pool.dtype)
        new_pool = new_pool.to(DEVICE)
        sa = r["ckv_scale_arr"]
        new_sa = None if sa is None else torch.full((P,) + tuple(sa.shape[1:]), float("nan"), device=DEVICE)
        perm = torch.randperm(P, generator=g).tolist()
        kv_indices, kv_indptr, qo_indptr, rows = [], [0], [0], []
        for b in order:
            for p in self.pages[b]:
                q = perm.pop()
                new_pool[q] = pool[p]
                if sa is not None:
                    new_sa[q] = sa[p]
                kv_indices.append(q)
            kv_indptr.append(len(kv_indices))
            qo_indptr.append(qo_indptr[-1] + self.qo_lens[b])
            rows += range(self.qo[b], self.qo[b + 1])
        i32 = dict(dtype=torch.int32, device=DEVICE)
        plan = dict(a, qo_indptr=torch.tensor(qo_indptr, **i32), kv_indptr=torch.tensor(kv_indptr, **i32),
                    kv_indices=torch.tensor(kv_indices, **i32),
                    kv_len_arr=torch.tensor([self.kv_lens[b] for b in order], **i32))
        Dc = a["head_dim_ckv"]
        run = dict(r, q_nope=r["q_nope"][rows], q_pe=r["q_pe"][rows], ckv_cache=new_pool[..., :Dc],
                   kpe_cache=new_pool[..., Dc:], ckv_scale_arr=new_sa)
        return plan, run

    def rows_of(self, order):
        """Each position's (first row, query count) in a batch of ``order``."""
        out, r = [], 0
        for b in order:
            out.append((r, self.qo_lens[b]))
            r += self.qo_lens[b]
        return out


def run_batch(attn, plan, run):
    attn.plan(**plan)
    n, H, Dc = run["q_nope"].shape
    out = torch.full((n, H, Dc), float("nan"), dtype=plan["q_data_type"], device=DEVICE)
    lse = torch.full((n, H), float("nan"), device=DEVICE)
    attn.run(**run, out=out, lse=lse, return_lse=True)
    return out, lse


def per_request(reqs, order, out, lse):
    res = {}
    for b, (r0, q) in zip(order, reqs.rows_of(order)):
        res.setdefault(b, []).append((out[r0: r0 + q].clone(), lse[r0: r0 + q].clone()))
    return res


def assert_same_bits(seen: dict, got: dict, where: str):
    for b, items in got.items():
        for o, ls in items:
            if b not in seen:
                seen[b] = (o, ls)
                continue
            o0, l0 = seen[b]
            assert torch.equal(o.view(torch.int16), o0.view(torch.int16)), f"request {b}: out differs in {where}"
            assert torch.equal(ls.view(torch.int32), l0.view(torch.int32)), f"request {b}: lse differs in {where}"


# kv_len 0 (a request with no token), 1, one chunk exactly, just over it (a page + 1), three chunks
KV = [0, 1, 64, 65, 130, 150]
# alone, with short neighbours, the whole batch reversed, twice in one batch, with others
ORDERS = [[5], [5, 0, 1], [5, 4, 3, 2, 1, 0], [2, 5, 5, 4], [4], [1, 5, 3]]
# Options under which the default mode would cut these small batches by the batch (a mutation check: with the
# mode ignored, these tests fail): few work items per GPU, small chunks.
SMALL = dict(ctas_per_sm=1, min_chunk=64)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("mtp", [False, True], ids=["decode", "mtp"])
def test_same_bits_in_any_batch(backend, mtp):
    qo = [1 + (i % 3) if mtp else 1 for i in range(len(KV))]
    reqs = Requests(KV, qo, seed=11 + mtp)
    attn = fp8mla.MLAPagedAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK, **SMALL)
    seen = {}
    for i, order in enumerate(ORDERS if not mtp else [ORDERS[k] for k in (0, 2, 3, 4)]):
        plan, run = reqs.batch(order, seed=100 + i)
        out, lse = run_batch(attn, plan, run)
        assert_same_bits(seen, per_request(reqs, order, out, lse), f"batch {order}")
    # and the bits are the right attention
    out, lse = run_batch(attn, *reqs.batch(range(len(KV)), seed=7))
    ref_o, ref_lse = reqs.base.reference()
    assert_close(out, ref_o, 5e-3, "out")
    assert_close(lse, ref_lse, 1e-4, "lse")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_graph_plans_and_replans_give_the_same_bits(backend):
    reqs = Requests(KV, [1, 2, 1, 1, 3, 2], seed=5)
    plain = fp8mla.MLAPagedAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK, **SMALL)
    graph = fp8mla.MLAPagedAttention(backend=backend, use_cuda_graph=True, batch_invariant=True,
                                     invariant_chunk=CHUNK, max_batch_size=8, max_qo_len=3, max_kv_indices=64,
                                     max_partials=32, **SMALL)
    seen = {}
    for i, order in enumerate(ORDERS[2:4]):
        plan, run = reqs.batch(order, seed=200 + i)
        for attn in (plain, graph):
            out, lse = run_batch(attn, plan, run)
            assert_same_bits(seen, per_request(reqs, order, out, lse), f"batch {order}, graph {attn is graph}")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_device_only_lengths(backend):
    """Lengths only on the device (the kernels schedule there; vLLM's path): the same bits as host lengths, plain
    and CUDA-graph plans."""
    reqs = Requests(KV, [1] * len(KV), seed=9)
    plain = fp8mla.MLAPagedAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK, **SMALL)
    graph = fp8mla.MLAPagedAttention(backend=backend, use_cuda_graph=True, batch_invariant=True,
                                     invariant_chunk=CHUNK, max_batch_size=8, max_qo_len=1, max_kv_indices=64,
                                     max_partials=32, **SMALL)
    seen = {}
    for i, order in enumerate(ORDERS[2:4]):
        plan, run = reqs.batch(order, seed=300 + i)
        from fp8mla.layout import PagedLayout
        dev_len = plan["kv_len_arr"].to(DEVICE)
        for host, attn in ((True, plain), (False, plain), (False, graph)):
            layout = PagedLayout.from_csr(plan["qo_indptr"].cpu(), plan["kv_indptr"], plan["kv_indices"],
                                          plan["kv_len_arr"].cpu() if host else dev_len, plan["page_size"],
                                          device=DEVICE)
            if not host and DEVICE == "cpu":
                layout.kv_lens = None  # what a CUDA length tensor gives: no host lengths
                layout.host = None
            attn.plan_layout(layout, plan["num_heads"], plan["head_dim_ckv"], plan["head_dim_kpe"], True,
                             plan["sm_scale"], plan["q_data_type"], plan["kv_data_type"])
            out, lse = attn.run(**run, return_lse=True)
            assert_same_bits(seen, per_request(reqs, order, out, lse), f"batch {order}, host lengths {host}")


def test_default_mode_is_not_claimed_invariant():
    """Without the mode the triton schedule cuts a request by its batch: a 1000-token request alone is split,
    beside seven like it it is not (the chunk is a share of the batch's tokens); the mode cuts it the same in
    both."""
    from fp8mla.kernels.split import chunk_items_host

    def cuts(lens, fixed=None):
        B = len(lens)
        host = dict(qo_indptr=torch.arange(B + 1), kv_indptr=torch.arange(B + 1) * 64,
                    kv_len=torch.tensor(lens))
        s = chunk_items_host(host, 16, num_indices=64 * B, target=8, block_n=64, min_chunk=256,
                             fixed_chunk=fixed)
        first = s["split_indptr"][1]
        return list(zip(s["item_start"][:first], s["item_end"][:first]))
    assert not fp8mla.MLAPagedAttention().batch_invariant
    assert len(cuts([1000])) > len(cuts([1000] * 8)) == 1
    assert cuts([1000], 256) == cuts([1000] * 8, 256) == cuts([1000, 5, 3000], 256) == [
        (0, 256), (256, 512), (512, 768), (768, 1000)]


def test_device_schedule_overflow_runs_whole_requests():
    """A device-scheduled batch that needs more chunks than the workspace holds: the requests past it run as one
    item each (correct attention, not the invariant cut), counted; never an item past the arrays."""
    from fp8mla.kernels.split import chunk_items
    lens = torch.tensor([300, 300, 300], dtype=torch.int32)
    s = chunk_items(torch.arange(4), torch.arange(4) * 32, lens, 16, num_indices=96, target=4, max_items=7,
                    block_n=64, min_chunk=64, fixed_chunk=64)
    split = s["split_indptr"].tolist()
    assert s["overflow"].tolist() == [2]
    assert split == [0, 5, 6, 7]   # the first keeps its 5 chunks (64 x 4 + 44), the others run whole
    assert s["item_end"][:7].tolist() == [64, 128, 192, 256, 300, 300, 300]
    assert s["item_start"][:7].tolist() == [0, 64, 128, 192, 256, 0, 0]
    assert s["item_part"][:7].tolist() == [0, 1, 2, 3, 4, -1, -1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_invariant=True, heads_on_m=True), "heads_on_m: runs on the gluon kernel only"),
    (dict(batch_invariant=True, fp8_math=True), "fp8_math: runs on the gluon kernel only"),
    (dict(batch_invariant=1), "batch_invariant: expected True or False"),
    (dict(batch_invariant=True, invariant_chunk=100), "invariant_chunk: expected a positive multiple of 64"),
    (dict(invariant_chunk=128), "invariant_chunk: an option of the batch-invariant mode"),
    (dict(max_partials=128), "max_partials: an option of the batch-invariant mode"),
    (dict(batch_invariant=True, max_partials=0), "max_partials: expected a positive"),
])
def test_refusals_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8mla.MLAPagedAttention(**kwargs)


def test_auto_never_picks_gluon_in_the_mode(monkeypatch):
    """``auto`` passes the gluon builds over in the mode (they take it only when named), naming why, on an sm_90
    GPU too (described to the selector)."""
    from fp8mla.backends import AttentionSpec
    from fp8mla.backends._invariant import GLUON_AUTO
    from fp8mla.formats import get_format
    from fp8mla.layout import PagedLayout
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)
    monkeypatch.setattr(fp8mla.runtime, "triton_usable", lambda device: True)
    attn = fp8mla.MLAPagedAttention(batch_invariant=True)
    b = make_paged_batch([5], [1], 16, 16, "fp8_e4m3", device="cpu", seed=1)
    spec = AttentionSpec(16, 512, 64, 16, True, 0.1, torch.bfloat16, get_format("fp8_e4m3"), torch.device("cuda"))
    a = b.plan_args
    choice = attn._select(PagedLayout.from_csr(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], 16),
                          spec)
    assert choice.backend == "triton"
    assert choice.passed_over == (("gluon-heads-on-m", GLUON_AUTO), ("gluon-wide", GLUON_AUTO))


def test_engine_switches(monkeypatch):
    from types import SimpleNamespace

    from fp8mla.integrations._options import sglang_deterministic, vllm_batch_invariant
    assert sglang_deterministic(SimpleNamespace(enable_deterministic_inference=True))
    assert not sglang_deterministic(SimpleNamespace()) and not sglang_deterministic(None)
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: its own envs module answers")
    for value, on in (("1", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
        assert vllm_batch_invariant() is on
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert vllm_batch_invariant() is False


def test_the_docs_example_runs():
    """docs/batch_invariance.md's example runs as written and prints what it says."""
    import contextlib
    import io
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "batch_invariance.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "batch_invariance.md", "exec"), {})
    assert buf.getvalue().split() == ["True"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graph_replays_the_same_bits_after_replans():
    """A graph captured once and replayed after re-plans with other batches (other orders, neighbours and page
    tables; the same number of query rows) gives each request the bits of its plain plan alone."""
    reqs = Requests([0, 1, 64, 65, 130, 3000], [1] * 6, seed=21)
    orders = [[5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], [5, 5, 4, 2, 1, 0], [4, 5, 3, 2, 2, 2]]
    plain = fp8mla.MLAPagedAttention(backend="triton", batch_invariant=True)
    graph = fp8mla.MLAPagedAttention(backend="triton", use_cuda_graph=True, batch_invariant=True, max_batch_size=8,
                                     max_kv_indices=4096)
    alone = {}
    for b in range(6):
        out, lse = run_batch(plain, *reqs.batch([b], seed=b))
        alone[b] = [(out.clone(), lse.clone())]
    pool = torch.full((1024, 16, 576), float("nan"), device=DEVICE).to(reqs.base.pool.dtype)
    q_nope = torch.empty(6, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    q_pe = torch.empty(6, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty_like(q_nope)
    lse = torch.empty(6, 16, device=DEVICE)
    g = None
    for i, order in enumerate(orders):
        plan, run = reqs.batch(order, seed=400 + i)
        P = run["ckv_cache"].shape[0]
        pool[:P] = torch.cat([run["ckv_cache"], run["kpe_cache"]], dim=-1)
        q_nope.copy_(run["q_nope"])
        q_pe.copy_(run["q_pe"])
        graph.plan(**plan)
        kw = dict(ckv_cache=pool[..., :512], kpe_cache=pool[..., 512:], ckv_scale=run["ckv_scale"],
                  kpe_scale=run["kpe_scale"])
        if g is None:
            g = capture_then_replay(lambda: graph.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
        else:
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
        seen = {b: v[0] for b, v in alone.items()}
        assert_same_bits(seen, per_request(reqs, order, out, lse), f"replay of batch {order}")


def test_graph_replan_keeps_the_invariant_cut_and_names_the_capacity():
    """The decode runner's re-plan of a CUDA-graph plan (``backends.triton.replan_rows``) stages the same
    invariant cut as a fresh schedule; a batch past the work-item capacity is refused naming ``max_partials``."""
    tb = pytest.importorskip("fp8mla.backends.triton")
    if "triton" not in fp8mla.available_backends(DEVICE):
        pytest.skip("triton backend unavailable here")
    from fp8mla.layout import PagedLayout
    table = torch.arange(32, dtype=torch.int32, device=DEVICE).reshape(4, 8)   # (a CPU table would plan on the CPU)
    attn = fp8mla.MLAPagedAttention(backend="triton", use_cuda_graph=True, batch_invariant=True, invariant_chunk=64,
                                    max_batch_size=4, max_kv_indices=32, max_partials=2)

    def plan(lens):
        attn.plan_layout(PagedLayout.from_block_table(table, torch.tensor(lens), 16), 16, 512, 64, True, 0.1,
                         torch.bfloat16, "fp8_e4m3")
    plan([100, 5, 64, 0])
    impl, state = attn._plan.impl, attn._state["triton"]
    layout = PagedLayout.from_block_table(table, torch.tensor([128, 6, 65, 1]), 16)
    assert tb.replan_rows(impl, layout, state) is impl
    from fp8mla.kernels.split import chunk_items_host
    want = chunk_items_host(layout.host, 16, num_indices=32, target=1, block_n=impl.cfg["block_n"], min_chunk=1,
                            fixed_chunk=64)
    buf, n = state.graph.buf, want["num_items"][0]
    assert n == 6 and buf["num_items"].tolist() == [6]
    for key in ("item_req", "item_start", "item_end", "item_part"):
        assert buf[key][:n].tolist() == want[key][:n], key
    assert buf["item_start"][:n].tolist() == [0, 64, 0, 0, 64, 0]
    with pytest.raises(ValueError, match="batch_invariant: this batch cuts into 7 KV chunks .* max_partials"):
        plan([128, 128, 128, 0])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_long_query_block_neighbour(backend):
    """A neighbour with a long query block (which sends a default plan to the extend kernel) leaves a decode
    request's bits as they are alone."""
    reqs = Requests([65, 20], [2, 9], seed=13)
    attn = fp8mla.MLAPagedAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK, **SMALL)
    seen = {}
    for i, order in enumerate([[0], [1, 0]]):
        out, lse = run_batch(attn, *reqs.batch(order, seed=500 + i))
        assert_same_bits(seen, per_request(reqs, order, out, lse), f"batch {order}")
