"""plan() does O(batch) host work and never syncs with the device.

On the CPU: the number of Python-level calls plan() makes is the same for 1,000 and 200,000 tokens at page size 1
(the page table is checked with vectorized ops, never walked in Python), and a device-only table is never
read on the host (``tolist``/``item`` are not called on it). On a GPU: plan() runs under
``torch.cuda.set_sync_debug_mode("error")`` with the engines' argument placement (qo_indptr on the host,
the page table and lengths on the device), and a captured run() replays correctly after a re-plan.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

import fp8mla
from fp8mla.layout import PagedLayout
from fp8mla.testing import assert_close, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _page1_args(B: int, L: int, device="cpu"):
    i32 = dict(dtype=torch.int32, device=device)
    return dict(qo_indptr=torch.arange(B + 1, dtype=torch.int32), kv_indptr=torch.arange(B + 1, **i32) * L,
                kv_indices=torch.randperm(B * L + 7, **i32)[: B * L], kv_len_arr=torch.full((B,), L, **i32),
                num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=1, causal=True,
                sm_scale=192 ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)


def _count_python_calls(fn) -> int:
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _count_python_lines(fn) -> int:
    """Python lines executed by ``fn`` (a loop or comprehension over pages counts once per page)."""
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines


@pytest.mark.parametrize("backend", ["triton"] if "triton" in fp8mla.available_backends("cpu") else [])
def test_plan_python_work_does_not_grow_with_tokens(backend):
    fp8mla.MLAPagedAttention(backend=backend).plan(**_page1_args(2, 10))  # imports and caches, once
    counts = []
    for L in (1000, 200_000):
        args = _page1_args(4, L)
        attn = fp8mla.MLAPagedAttention(backend=backend)
        counts.append(_count_python_calls(lambda: attn.plan(**args)))
    assert counts[0] == counts[1], f"Python calls in plan() grew with the tokens: {counts}"


@pytest.mark.skipif("triton" not in fp8mla.available_backends("cpu"), reason="needs the triton backend here")
def test_device_only_table_is_never_read_on_host(monkeypatch):
    """Stand-ins for device tensors (the layout treats everything but qo_indptr as device-resident): planning
    reads none of them on the host, so on a GPU it cannot sync."""
    args = _page1_args(3, 50)
    qo = args["qo_indptr"]
    monkeypatch.setattr(fp8mla.layout, "_on_host", lambda t: t.data_ptr() == qo.data_ptr())
    lay = PagedLayout.from_csr(qo, args["kv_indptr"], args["kv_indices"], args["kv_len_arr"], 1)
    assert lay.kv_lens is None and lay.max_page_id is None and lay.qo_lens == [1, 1, 1]
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, (lambda real, name: lambda t, *a: (reads.append(name),
                                                                                   real(t, *a))[1])(real, name))
    attn = fp8mla.MLAPagedAttention(backend="triton")
    attn.plan_layout(lay, 16, 512, 64, True, 192 ** -0.5, torch.bfloat16, torch.float8_e4m3fn)
    assert reads == [], f"plan read tensors on the host: {reads}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plan_never_syncs_and_graph_replays_after_replan():
    torch.manual_seed(0)
    attn = fp8mla.MLAPagedAttention(torch.empty(1, device="cuda"), True, max_batch_size=8, max_kv_indices=4096)
    outs = []
    for lens in ([97, 1, 514], [300, 17, 64]):
        pb = make_paged_batch(lens, [1] * 3, 16, 16, "fp8_e4m3", device="cuda", ckv_scale=0.02, kpe_scale=0.03)
        a = dict(pb.plan_args, qo_indptr=pb.plan_args["qo_indptr"].cpu())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            attn.plan(**a)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append(pb)
    # Capture with the second plan's tensors, re-plan the first batch's lengths into the same buffers, replay.
    first, second = outs
    r = second.run_args
    out = torch.full((3, 16, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    attn.run(**r, out=out)  # warm-up (compiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(**r, out=out)
    g.replay()
    assert_close(out, second.reference()[0], 3e-3)
    pool = second.pool  # same pool tensor: write the first batch's values into it before replaying
    a = dict(first.plan_args, qo_indptr=first.plan_args["qo_indptr"].cpu())
    if first.pool.shape[0] <= pool.shape[0]:
        pool[: first.pool.shape[0]].copy_(first.pool)
        attn.plan(**a)
        r["q_nope"].copy_(first.run_args["q_nope"])
        r["q_pe"].copy_(first.run_args["q_pe"])
        g.replay()
        ref = fp8mla.reference.mla_reference(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"],
                                             a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"],
                                             sm_scale=a["sm_scale"], causal=True, ckv_scale=0.02, kpe_scale=0.03)
        assert_close(out, ref[0], 3e-3)


def test_torch_backend_cost_follows_tokens():
    """One long request among many short ones: the torch backend pads each length bucket to its own longest
    request (<= 2x the tokens), not every request to the longest (B x 16,384 here)."""
    lens = [16_384] + [16] * 31
    pb = make_paged_batch(lens, [1] * 32, 16, 64, "fp8_e4m3", seed=1, spare_pages=0)
    attn = fp8mla.MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    impl = attn._plan.impl
    padded = sum(b.kv_valid.numel() for b in impl.buckets)
    assert padded <= 2 * sum(lens), f"{padded} padded token slots for {sum(lens)} tokens"
    out = attn.run(**pb.run_args)
    assert_close(out, pb.reference()[0], 1e-2)


def test_host_schedule_matches_device_schedule():
    """The O(batch) host schedule (plans with host lengths) gives the device schedule's work items: random
    lengths, rows without queries, empty rows, a table that claims more tokens than its pages, odd sizes."""
    from fp8mla.kernels.split import chunk_items as schedule, chunk_items_host as schedule_host
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        B = int(torch.randint(1, 40, (1,), generator=g))
        ps = int(torch.randint(1, 70, (1,), generator=g))
        qo_lens = torch.randint(0, 3, (B,), generator=g) * (trial % 3 != 0) + (trial % 3 == 0)
        pages = torch.randint(0, 40, (B,), generator=g)
        kv_len = (pages * ps - torch.randint(0, ps, (B,), generator=g)).clamp(min=0)
        kv_len[torch.rand(B, generator=g) < 0.2] += ps * 3   # lengths past their pages: clamped
        qo = torch.zeros(B + 1, dtype=torch.int32)
        kv = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(qo_lens, 0, out=qo[1:])
        torch.cumsum(pages, 0, out=kv[1:])
        num_indices = int(kv[-1]) - int(torch.randint(0, 3, (1,), generator=g))  # the last row may lose pages
        kw = dict(target=int(torch.randint(1, 300, (1,), generator=g)), block_n=[16, 32, 64][trial % 3],
                  min_chunk=[64, 256, 512][trial % 3])
        dev = schedule(qo, kv, kv_len.to(torch.int32), ps, num_indices=num_indices, max_items=kw["target"] + B,
                       **kw)
        host = schedule_host(dict(qo_indptr=qo, kv_indptr=kv, kv_len=kv_len.to(torch.int32)), ps,
                             num_indices=num_indices, **kw)
        n = int(dev["num_items"])
        assert host["num_items"] == [n] and host["batch_size"] == [B]
        for k in ("split_indptr", "kv_len"):
            assert host[k] == dev[k].tolist(), (trial, k)
        for k in ("item_req", "item_start", "item_end", "item_part"):
            assert host[k] == dev[k][:n].tolist(), (trial, k)


class _OpCount:
    """Torch ops dispatched (aten level) inside the block, by name."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        ops = self.ops = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                ops[name] = ops.get(name, 0) + 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


# Ops that only make views or host tensors: no launch on a GPU.
_NO_LAUNCH = {"slice", "select", "view", "lift_fresh", "alias", "as_strided", "detach", "unsqueeze", "expand"}


@pytest.mark.skipif("triton" not in fp8mla.available_backends("cpu"), reason="needs the triton backend here")
def test_runner_begin_step_host_work_is_o_batch(monkeypatch):
    """The CUDA-graph runner's begin_step at B=64: the torch ops it dispatches (and the few that would launch on a
    GPU) and the Python lines it runs are the same for short and long contexts and for page 64 and page 1 (nothing
    O(pages)), and it reads nothing back from the device. The runner's tables count as device tensors here (as on
    a GPU), so the plan takes the graph path's host-scheduled route."""
    from fp8mla.models import DeepseekMLAModel
    from fp8mla.models.runner import DecodeRunner
    B = 64
    model = DeepseekMLAModel("tiny", 1, dtype=torch.bfloat16, backend="triton", fused=True)
    on_host = fp8mla.layout._on_host
    device_ptrs: set = set()
    monkeypatch.setattr(fp8mla.layout, "_on_host",
                        lambda t: t.untyped_storage().data_ptr() not in device_ptrs and on_host(t))
    seen, keep = {}, []
    for page, ctx in ((64, 256), (64, 2048), (1, 256), (1, 2048)):
        cache = model.make_cache(-(-B * (ctx + 2 * page) // page), page, "fp8_e4m3")
        ids = [cache.add_sequence() for _ in range(B)]
        cache.reserve(ids, ctx - 1)
        r = DecodeRunner(model, cache, max_batch=B, max_context=ctx + page, use_cuda_graph=False)
        r.use_cuda_graph = True                      # graph-mode attention buffers, no capture
        monkeypatch.setattr(r, "_capture", lambda g: None)
        r._bucket(B)
        keep.append((cache, r))  # alive: no later host tensor reuses these addresses
        device_ptrs.clear()
        device_ptrs |= {r.table.untyped_storage().data_ptr()}
        device_ptrs |= {t.untyped_storage().data_ptr() for g in r._graphs.values() for t in (g.block_table, g.dev)}
        prefix = [ctx - 1] * B
        for _ in range(2):  # fills the rows, builds the buffers, then the steady state (the staged prefix's views)
            r.begin_step(ids, prefix).cancel()
        with _OpCount() as c:
            st = r.begin_step(ids, prefix)
        st.cancel()
        calls = _count_python_lines(lambda: r.begin_step(ids, prefix).cancel())
        launches = {k: v for k, v in c.ops.items() if k not in _NO_LAUNCH}
        seen[(page, ctx)] = (sum(c.ops.values()), launches, calls)
        assert r._graphs[B].attn.backend == "triton" and r._graphs[B].attn.layout.host is not None
        # ONE staged copy (positions, slots, rows, table entries, page ids and the plan's schedule arrays: the plan
        # stages into the runner's buffer, from a persistent host buffer: no pinning per step), one scatter (int64
        # index: no cast), one gather: 3 ops in all, each a launch on a GPU (17 with 4 launches before the plan
        # staged with the runner, 165 once)
        assert launches == {"copy_": 1, "scatter_": 1, "index_select": 1}, c.ops
        assert sum(c.ops.values()) == 3, c.ops
        assert not {"_local_scalar_dense", "item"} & set(c.ops), c.ops  # nothing read back from the device
    for page in (64, 1):  # nothing grows with the context (8x the pages): the same ops, the same lines but for a
        # few that follow the host schedules' memo of their last items, which earlier tests of the process leave
        # behind (a full CI run measured 2,055 against 2,064 at page 64; O(batch) would be >= 64, O(pages) more)
        assert seen[(page, 256)][:2] == seen[(page, 2048)][:2], seen
        assert abs(seen[(page, 256)][2] - seen[(page, 2048)][2]) <= 16, seen
    # page 1 against page 64: the same ops; a few more lines per sequence (each step takes a new page, and the
    # cancel gives it back): O(batch), never O(pages)
    assert seen[(1, 256)][:2] == seen[(64, 256)][:2], seen
    assert 0 <= seen[(1, 256)][2] - seen[(64, 256)][2] <= 8 * B, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runner_begin_step_never_syncs():
    """The CUDA-graph runner's begin_step (after its bucket was captured) under set_sync_debug_mode("error")."""
    from fp8mla.models import DeepseekMLAModel
    from fp8mla.models.runner import DecodeRunner
    model = DeepseekMLAModel.random("tiny", seed=1, dtype=torch.bfloat16, device="cuda")
    for page in (1, 16):
        cache = model.make_cache(-(-4 * 80 // page), page, "fp8_e4m3")
        ids = [cache.add_sequence() for _ in range(3)]
        cache.reserve(ids, [30, 7, 45])
        r = DecodeRunner(model, cache, max_batch=4)
        prefix = [cache.seq_len(s) for s in ids]
        r.begin_step(ids, prefix).cancel()  # captures the bucket's graph
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            st = r.begin_step(ids, prefix)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        st.cancel()
        r.close()


@pytest.mark.parametrize("backend", ["triton"] if "triton" in fp8mla.available_backends("cpu") else [])
def test_eager_begin_step_python_work_does_not_grow_with_pages(backend):
    """model.begin_step (no runner) at page 1: the same Python lines run for 256 and 4096 tokens per sequence (the
    cache's page tables are copied as int32 arrays, the page ids never walked in Python), and the layout it plans
    is the cache's (page ids, lengths, the largest page id)."""
    from fp8mla.models import DeepseekMLAModel
    model = DeepseekMLAModel("tiny", 1, dtype=torch.bfloat16, backend=backend, fused=False)
    counts = []
    for ctx in (256, 4096):
        cache = model.make_cache(8 * (ctx + 4) + 9, 1, "fp8_e4m3")
        cache.add_sequence()  # a first sequence, freed: the others' pages are not 0..n in order
        ids = [cache.add_sequence() for _ in range(8)]
        cache.reserve(ids, [ctx - 1 - 3 * i for i in range(8)])
        cache.free(0)
        model.begin_step(cache, ids, [1] * 8).cancel()
        counts.append(_count_python_lines(lambda: model.begin_step(cache, ids, [1] * 8).cancel()))
        st = model.begin_step(cache, ids, [1] * 8)
        lay = st.paged.layout
        want = [p for s in ids for p in cache.pages(s)]
        assert lay.kv_indices.tolist() == want and lay.kv_lens == [cache.seq_len(s) for s in ids]
        assert lay.max_page_id == max(want) and lay.host is not None
        st.cancel()
    assert counts[0] == counts[1], f"Python lines run by model.begin_step grew with the pages: {counts}"


def test_block_table_decode_path_matches_general_path(monkeypatch):
    """from_block_table over a device table with host lengths (the runner's path: O(batch) checks, one staged
    copy) gives the general path's layout, and refuses a length past the row's pages the same way."""
    g = torch.Generator().manual_seed(5)
    B, W, ps = 7, 5, 3
    bt = torch.randint(0, 50, (B, W), generator=g, dtype=torch.int32)
    kv_len = torch.randint(0, W * ps + 1, (B,), generator=g, dtype=torch.int32)
    kv_len[2] = 0
    want = PagedLayout.from_block_table(bt, kv_len, ps)
    real = fp8mla.layout._on_host
    monkeypatch.setattr(fp8mla.layout, "_on_host", lambda t: t.data_ptr() != bt.data_ptr() and real(t))
    got = PagedLayout.from_block_table(bt, kv_len, ps)
    for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    assert got.qo_lens == want.qo_lens and got.kv_lens == want.kv_lens and got.max_page_id is None
    assert all(torch.equal(got.host[k], want.host[k]) for k in ("qo_indptr", "kv_indptr", "kv_len"))
    bad = kv_len.clone()
    bad[4] = W * ps + 1
    with pytest.raises(ValueError, match=r"^kv_len: request 4 .*block_table has 5 pages per row"):
        PagedLayout.from_block_table(bt, bad, ps)


def test_decode_rows_host_lists_schedule_like_the_general_path(monkeypatch):
    """PagedLayout.decode_rows (the runner's device table + host lengths) hands the backends its arrays as checked
    lists (``host["lists"]``): the triton and gluon host schedules then skip their clamping pass, and give the
    same arrays as from the host tensors alone, and as the device schedules (empty rows, full rows, B = 1)."""
    from fp8mla.backends import gluon as gb
    from fp8mla.kernels import sm90 as k, split
    g = torch.Generator().manual_seed(17)
    for trial in range(40):
        B, W, ps = [1, 3, 64, 17][trial % 4], int(torch.randint(1, 9, (1,), generator=g)), [1, 16, 64, 5][trial % 4]
        bt = torch.randint(0, 1000, (B, W), generator=g, dtype=torch.int32)
        lens = torch.randint(0, W * ps + 1, (B,), generator=g).tolist()
        lens[0] = [0, W * ps][trial % 2]
        monkeypatch.setattr(fp8mla.layout, "_on_host", lambda t, bt=bt: t.data_ptr() != bt.data_ptr())
        lay = PagedLayout.decode_rows(bt, list(lens), ps)
        monkeypatch.undo()
        assert lay.host.get("lists") is not None
        plain = {key: lay.host[key] for key in ("qo_indptr", "kv_indptr", "kv_len")}
        n = bt.numel()
        kw = dict(num_indices=n, target=int(torch.randint(1, 300, (1,), generator=g)), block_n=64, min_chunk=256)
        fast = split.chunk_items_host(lay.host, ps, **kw)
        assert fast == split.chunk_items_host(plain, ps, **kw), trial
        dev = split.chunk_items(lay.qo_indptr, lay.kv_indptr, lay.kv_len, ps, max_items=kw["target"] + B, **kw)
        m = int(dev["num_items"])
        assert fast["item_end"] == dev["item_end"][:m].tolist() and fast["kv_len"] == dev["kv_len"].tolist()
        gk = dict(num_indices=n, num_ctas=[1, 5, 66][trial % 3], min_tiles=[1, 4][trial % 2])
        fast = split.tile_items_host(lay.host, ps, **gk)
        assert fast == split.tile_items_host(plain, ps, **gk), trial
        d = split.tile_items_device(gb._device_kv_len(lay), gk["num_ctas"], gk["min_tiles"])
        m = int(d["m_ptr"][-1])
        assert fast["cta_ptr"] == d["cta_ptr"].tolist() and fast["item_t1"] == d["item_t1"][:m].tolist(), trial


def test_runner_begin_step_gluon_plan_is_host_scheduled(monkeypatch):
    """The runner's begin_step when the gluon backend plans (as `auto` does on the H200 at 128 heads, FP8, page 64):
    its split schedule is made on the host and staged in the runner's one copy (the device schedule dispatched ~90
    small ops here), so the step dispatches the same 3 ops as the Triton plan (all launching), reads nothing
    back, and the buffers hold
    the device schedule's arrays. The kernel is never launched (it needs an sm_90 GPU): only the plan runs."""
    from fp8mla.backends import gluon as gb
    from fp8mla.kernels import sm90 as k, split
    from fp8mla.models import DeepseekMLAModel, load_config
    from fp8mla.models.runner import DecodeRunner
    monkeypatch.setattr(fp8mla.runtime, "gluon_usable", lambda device: True)
    monkeypatch.setattr(gb, "num_sms", lambda device: 132)
    B, page, ctx = 64, 64, 1000
    cfg = load_config("tiny").replace(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    model = DeepseekMLAModel(cfg, 1, dtype=torch.bfloat16, backend="gluon", fused=True)
    cache = model.make_cache(-(-B * (ctx + 2 * page) // page), page, "fp8_e4m3")
    ids = [cache.add_sequence() for _ in range(B)]
    cache.reserve(ids, [ctx - 1 - 7 * i for i in range(B)])
    r = DecodeRunner(model, cache, max_batch=B, max_context=ctx + page, use_cuda_graph=False)
    r.use_cuda_graph = True
    monkeypatch.setattr(r, "_capture", lambda g: None)
    r._bucket(B)
    dev = {r.table.untyped_storage().data_ptr(), r._graphs[B].dev.untyped_storage().data_ptr(),
           r._graphs[B].block_table.untyped_storage().data_ptr()}
    on_host = fp8mla.layout._on_host
    monkeypatch.setattr(fp8mla.layout, "_on_host", lambda t: t.untyped_storage().data_ptr() not in dev and on_host(t))
    prefix = [cache.seq_len(s) for s in ids]
    for _ in range(2):
        r.begin_step(ids, prefix).cancel()
    with _OpCount() as c:
        st = r.begin_step(ids, prefix)
    attn = r._graphs[B].attn
    assert attn.backend == "gluon" and attn.layout.host is not None
    launches = {key: v for key, v in c.ops.items() if key not in _NO_LAUNCH}
    assert launches == {"copy_": 1, "scatter_": 1, "index_select": 1} and sum(c.ops.values()) == 3, c.ops
    assert not {"_local_scalar_dense", "item"} & set(c.ops), c.ops
    st.cancel()
    # Decode steps (committed, the lengths grow): each step's buffers hold the device schedule of its lengths,
    # whether the plan was kept (every request within its 64-token tiles: gluon.replan_rows) or built again.
    kept = 0
    for step in range(24):
        prefix = [cache.seq_len(s) for s in ids]
        impl = attn._plan.impl
        st = r.begin_step(ids, prefix)
        kept += attn._plan.impl is impl
        t = attn._plan.impl.t
        L = gb._device_kv_len(attn.layout)
        assert L.tolist() == [p + 1 for p in prefix]
        want = split.tile_items_device(L, 132 // 2, 256 // k.TILE, slack=gb.aligned_slack(attn._plan.impl.build))
        n = int(want["m_ptr"][-1])
        for key in ("cta_ptr", "m_ptr"):
            assert torch.equal(t[key][: want[key].numel()], want[key]), (step, key)
        for key in ("item_req", "item_t0", "item_t1", "m_list"):
            assert torch.equal(t[key][:n], want[key][:n]), (step, key)
        assert int(t["batch_size"][0]) == B and torch.equal(t["kv_len"][:B], L)
        st.committed = True  # (no forward: the reserved token counts as written)
    assert 0 < kept < 24, kept  # both paths ran (lengths 1000 - 7i cross a tile boundary on some steps)
    # A captured bucket (a stand-in graph, never replayed here): its plan object stays through tile changes (the
    # graph holds its launch configuration), and the buffers still hold each step's device schedule.
    r._graphs[B].graph = object()
    impl = attn._plan.impl
    for step in range(8):
        prefix = [cache.seq_len(s) for s in ids]
        st = r.begin_step(ids, prefix)
        assert attn._plan.impl is impl
        t, L = impl.t, torch.tensor([p + 1 for p in prefix], dtype=torch.int32)  # the true lengths
        want = split.tile_items_device(L, 132 // 2, 256 // k.TILE, slack=gb.aligned_slack(attn._plan.impl.build))
        n = int(want["m_ptr"][-1])
        assert torch.equal(t["cta_ptr"][: want["cta_ptr"].numel()], want["cta_ptr"]), step
        for key in ("item_req", "item_t0", "item_t1"):
            assert torch.equal(t[key][:n], want[key][:n]), (step, key)
        assert torch.equal(t["kv_len"][:B], L)
        st.committed = True
    r._graphs[B].graph = None


def test_host_schedule_memos_match_fresh_schedules():
    """The host schedules keep their last result for the next decode step (gluon: the same tiles; triton: the same
    splits, each request's last end updated): over random sequences of steps (lengths + 0/1/2/50, rows joining
    and leaving, other CTA counts and targets) every memo answer equals a fresh schedule."""
    from fp8mla.kernels.split import chunks, tiles
    g = torch.Generator().manual_seed(23)
    hits = {"triton": 0, "gluon": 0}
    for trial in range(60):
        B = [1, 3, 64, 17][trial % 4]
        L = (torch.randint(0, 9000, (B,), generator=g) * (torch.rand(B, generator=g) > 0.1)).tolist()
        tk = dict(target=[7, 132, 264][trial % 3], block_n=[16, 64][trial % 2], min_chunk=[64, 256][trial % 2])
        gk = dict(num_ctas=[3, 66, 132][trial % 3], min_tiles=[1, 4][trial % 2])
        for step in range(12):
            W = max(L) // 16 + 2
            host = dict(lists=(list(range(B + 1)), list(range(0, (B + 1) * W, W)), list(L)))
            for name, mod, fn, kw, memo in (("triton", chunks, chunks.chunk_items_host, tk, "_LAST_SPLIT"),
                                            ("gluon", tiles, tiles.tile_items_host, gk, "_LAST_ITEMS")):
                before = getattr(mod, memo)
                got = fn(host, 16, num_indices=B * W, **kw)
                hits[name] += before is not None and getattr(mod, memo) is before
                setattr(mod, memo, None)  # a fresh schedule (which the next step's memo then holds)
                assert got == fn(host, 16, num_indices=B * W, **kw), (name, trial, step)
            L = [n + [0, 1, 1, 2, 50][int(torch.randint(0, 5, (1,), generator=g))] for n in L]
    assert hits["triton"] > 100 and hits["gluon"] > 50, hits  # the memo paths ran


@pytest.mark.skipif("triton" not in fp8mla.available_backends("cpu"), reason="needs the triton backend here")
def test_runner_fast_plan_still_refuses_bad_lengths(monkeypatch):
    """The runner's trusted re-plan (MLAPagedAttention.replan_rows) skips re-validating the spec and the table it
    made, not the lengths: a length past the block table's rows is refused naming the request, the reservation is
    given back, and an unknown sequence id is refused by the cache (its own error)."""
    from fp8mla.models import DeepseekMLAModel
    from fp8mla.models.runner import DecodeRunner
    model = DeepseekMLAModel("tiny", 1, dtype=torch.bfloat16, backend="triton", fused=True)
    cache = model.make_cache(64, 16, "fp8_e4m3")
    ids = [cache.add_sequence() for _ in range(3)]
    cache.reserve(ids, [40, 7, 20])
    r = DecodeRunner(model, cache, max_batch=4, max_context=64, use_cuda_graph=False)
    r.use_cuda_graph = True
    monkeypatch.setattr(r, "_capture", lambda g: None)
    prefix = [cache.seq_len(s) for s in ids]
    r.begin_step(ids, prefix).cancel()
    assert r._graphs[4].fast and r._graphs[4].attn._rows_fast is not None  # the trusted path is taken
    before = [(cache.seq_len(s), list(cache.pages(s))) for s in ids]
    with pytest.raises(ValueError, match=r"^kv_len: request 1 has kv_len 65, expected 0 <= kv_len <= .* = 64"):
        r.begin_step(ids, [40, 64, 20])
    assert [(cache.seq_len(s), list(cache.pages(s))) for s in ids] == before
    with pytest.raises(KeyError, match="seq_id"):
        r.begin_step(ids + [99], prefix + [5])
    assert [(cache.seq_len(s), list(cache.pages(s))) for s in ids] == before
    st = r.begin_step(ids, prefix)  # and the runner still plans
    assert r._graphs[4].attn.layout.kv_lens == [p + 1 for p in prefix] + [0]
    st.cancel()


def test_runner_staging_ring_reuses_only_copied_buffers(monkeypatch):
    """The runner's staging ring (a GPU's pinned host buffers, each reused only once the copy that read it has
    run), driven on the CPU with stand-in events: a busy buffer is never rewritten (the step stages through a fresh
    copy instead), each buffer's event is recorded after its copy, and a shorter format copies only the buffer's
    first entries (the rest stays as the last full copy left it)."""
    import ctypes
    from fp8mla.models.runner import _Staging

    class Event:  # done until recorded; then busy until the test says the copy ran
        def __init__(self):
            self.done, self.records = True, 0

        def query(self):
            return self.done

        def record(self, stream=None):
            self.records, self.done = self.records + 1, False

    dev = torch.full((8,), -1, dtype=torch.int32)
    st = _Staging(dev)
    st.host = [torch.zeros(8, dtype=torch.int32) for _ in range(3)]
    st.mem = [(ctypes.c_char * 32).from_address(t.data_ptr()) for t in st.host]
    st.events = [Event() for _ in range(3)]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone())  # (no pinned memory on the CPU)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    for step in range(5):   # steps 0..2 take buffers 0..2; 3 and 4 find buffer 0 busy: fresh copies
        vals = [10 * step + j for j in range(8)]
        st.copy("=8i", vals)
        assert dev.tolist() == vals, step
    assert [h[0].item() for h in st.host] == [0, 10, 20]       # no busy buffer rewritten
    assert [e.records for e in st.events] == [1, 1, 1] and st.i == 0
    st.events[0].done = True                                  # buffer 0's copy ran: reused
    st.copy("=4i", [7, 7, 7, 7])
    assert dev.tolist() == [7, 7, 7, 7, 44, 45, 46, 47] and st.host[0][:4].tolist() == [7] * 4
    assert st.events[0].records == 2 and st.i == 1
