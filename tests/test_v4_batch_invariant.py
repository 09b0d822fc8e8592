"""The V4 API's batch-invariant mode (``V4SparseAttention(batch_invariant=True)``): each query row's output and lse
are the same bits whatever else the call holds: calls of 1 to 8 rows, other orders, neighbours of other lengths,
the row twice in one call, MTP rows of one request side by side, the pools' pages moved elsewhere; with and
without sinks, both segments and window-only, with and without per-row lengths. Torch and the Triton kernel (the
interpreter on the CPU); the bits are the right attention (float64 reference). And the default mode is not
claimed invariant: its split count follows the call, and so do a row's bits. Bad options are named. The GPU cases
(skipped without CUDA) take V4's sizes and a CUDA graph replayed across re-plans."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.formats_v4 import get_v4_format
from fp8mla.reference import v4_attention_reference
from fp8mla.testing import assert_close
from fp8mla.v4 import write_v4_pool
from tests.conftest import BACKEND_PARAMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SM_SCALE = 512 ** -0.5
CHUNK = 64                      # a full row (48 + 112 entries) is cut in three pieces
W_TOPK, C_TOPK = 48, 112
# Small splits for the default mode: without the invariant mode the split count would follow the call's size
# (8 programs a row at 1 row on the interpreter's 4 "SMs", 1 at 8 rows): the mutation check (these tests fail
# with the mode ignored). The invariant mode does not read it.
MIN_SPLIT = 16
NAN_SLOT = -2                   # an entry past the row's length that names an unwritten (NaN) slot
TRITON = [p for p in BACKEND_PARAMS if p.id == "triton"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _entries(g, topk, length, num_tokens, with_lengths):
    """One index row over a request's tokens: ``length`` distinct token ids (every 7th one -1), then past the
    length NaN slots (with lengths) or -1."""
    row = torch.full((topk,), -1, dtype=torch.long)
    row[:length] = torch.randperm(num_tokens, generator=g)[:length]
    row[:length][torch.arange(length) % 7 == 3] = -1
    if with_lengths:
        row[length:] = NAN_SLOT
    return row


class V4Requests:
    """Fixed requests (their cached window tokens and compressed rows, query rows and index rows) that any call can
    be built from, each time written at fresh random slots of NaN-filled pools of a random size."""

    def __init__(self, fmt, rows, *, heads=16, w_topk=W_TOPK, c_topk=C_TOPK, sinks=True, lengths=True, seed=0,
                 w_page=8, c_page=4):
        g = torch.Generator().manual_seed(seed)
        self.fmt, self.heads, self.w_topk, self.c_topk = get_v4_format(fmt), heads, w_topk, c_topk
        self.pages, self.lengths = (w_page, c_page), lengths
        self.w_tokens, self.c_tokens = w_topk + 8, c_topk + 8
        self.kv, self.rows = [], []   # per request: (window rows, compressed rows); per row: (request, ...)
        for r, lens in enumerate(rows):
            self.kv.append(((torch.randn(self.w_tokens, 512, generator=g) * 2),
                            (torch.randn(self.c_tokens, 512, generator=g) * 2)))
            for w_len, c_len in lens:
                self.rows.append(dict(
                    request=r, w_len=w_len, c_len=c_len,
                    w=_entries(g, w_topk, w_len, self.w_tokens, lengths),
                    c=_entries(g, c_topk, c_len, self.c_tokens, lengths) if c_topk else None,
                    q=(torch.randn(heads, 512, generator=g) * 2).to(torch.bfloat16)))
        self.sinks = (torch.randn(heads, generator=g) * 2).to(DEVICE) if sinks else None
        self.plan_args = dict(num_heads=heads, sm_scale=SM_SCALE, q_data_type=torch.bfloat16,
                              kv_format=self.fmt.name, window_topk=w_topk, window_page_size=w_page, device=DEVICE)
        if c_topk:
            self.plan_args.update(compressed_topk=c_topk, compressed_page_size=c_page)

    def rows_of(self, order):
        """The row ids of a call of requests ``order`` (repeats allowed): each request's rows side by side."""
        return [i for r in order for i, row in enumerate(self.rows) if row["request"] == r]

    def _segment(self, g, seg, rows):
        """A NaN pool holding the requests' tokens of segment ``seg`` (0 window, 1 compressed) at random slots,
        and the rows' index rows mapped to them."""
        page = self.pages[seg]
        tokens = self.w_tokens if seg == 0 else self.c_tokens
        reqs = sorted({self.rows[i]["request"] for i in rows})
        num_pages = -(-len(reqs) * tokens // page) + 1 + int(torch.randint(0, 4, (1,), generator=g))
        pool = self.fmt.new_pool(num_pages, page, DEVICE)
        if self.fmt.is_fp8:
            pool.view(torch.uint8).fill_(0xFF)   # e4m3, bf16 and ue8m0 NaN in every byte not written
        else:
            pool.fill_(math.nan)
        slots = torch.randperm(num_pages * page, generator=g)
        where = {r: slots[k * tokens:(k + 1) * tokens] for k, r in enumerate(reqs)}
        nan_slots = slots[len(reqs) * tokens:]
        for r in reqs:
            write_v4_pool(self.fmt, pool, where[r].to(DEVICE), self.kv[r][seg].to(DEVICE), backend="torch")
        idx = []
        for i in rows:
            e = self.rows[i]["w" if seg == 0 else "c"]
            mapped = torch.where(e >= 0, where[self.rows[i]["request"]][e.clamp(min=0)], e)
            if len(nan_slots):
                mapped = torch.where(e == NAN_SLOT, nan_slots[torch.randint(len(nan_slots), e.shape, generator=g)],
                                     mapped)
            idx.append(torch.where(mapped == NAN_SLOT, -1, mapped))
        lens = None
        if self.lengths:
            key = "w_len" if seg == 0 else "c_len"
            lens = torch.tensor([self.rows[i][key] for i in rows], dtype=torch.int32, device=DEVICE)
        return pool, torch.stack(idx).to(torch.int32).to(DEVICE), lens

    def call(self, rows, seed):
        """``run()`` keyword arguments of a call of ``rows``, in fresh pools."""
        g = torch.Generator().manual_seed(seed)
        w_pool, w_idx, w_len = self._segment(g, 0, rows)
        args = dict(q=torch.stack([self.rows[i]["q"] for i in rows]).to(DEVICE), window_pool=w_pool,
                    window_indices=w_idx, window_lengths=w_len, sinks=self.sinks)
        if self.c_topk:
            c_pool, c_idx, c_len = self._segment(g, 1, rows)
            args.update(compressed_pool=c_pool, compressed_indices=c_idx, compressed_lengths=c_len)
        return args

    def reference(self, args):
        return v4_attention_reference(
            args["q"], args["window_pool"], args["window_indices"], sm_scale=SM_SCALE, kv_format=self.fmt.name,
            window_page_size=self.pages[0], window_lengths=args["window_lengths"],
            compressed_pool=args.get("compressed_pool"), compressed_indices=args.get("compressed_indices"),
            compressed_lengths=args.get("compressed_lengths"), compressed_page_size=self.pages[1] if self.c_topk
            else None, sinks=self.sinks)


def run_call(attn, args):
    n, H, _ = args["q"].shape
    out = torch.full((n, H, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((n, H), math.nan, device=DEVICE)
    attn.run(**args, out=out, lse=lse, return_lse=True)
    return out, lse


def assert_same_bits(seen: dict, rows, out, lse, where: str):
    for j, i in enumerate(rows):
        if i not in seen:
            seen[i] = (out[j].clone(), lse[j].clone())
            continue
        o0, l0 = seen[i]
        assert torch.equal(out[j].view(torch.int16), o0.view(torch.int16)), f"row {i}: out differs in {where}"
        assert torch.equal(lse[j].view(torch.int32), l0.view(torch.int32)), f"row {i}: lse differs in {where}"


# (window length, compressed length) of each request's rows: a full row (three pieces), short rows, an MTP pair of
# two rows one entry apart, a row with no key, rows cut in two.
REQUESTS = [[(48, 112)], [(3, 0)], [(48, 40), (47, 41)], [(0, 0)], [(20, 100)], [(48, 16), (48, 17)]]
# 1, 2, 3, 5, 8 and 5 rows: alone, with short neighbours, all requests reversed, twice in one call
ORDERS = [[0], [3, 0], [1, 0, 4], [5, 0, 2], [5, 4, 3, 2, 1, 0], [0, 2, 0]]
# (format, compressed rows, sinks, per-row lengths)
CASES = [pytest.param("fp8_v4", True, True, True, id="fp8_v4-both-sinks"),
         pytest.param("fp8_v41", False, False, True, id="fp8_v41-window-nosinks"),
         pytest.param("bf16", True, False, False, id="bf16-both-nolengths")]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("fmt, compressed, sinks, lengths", CASES)
def test_same_bits_in_any_call(backend, fmt, compressed, sinks, lengths):
    if compressed:
        reqs = V4Requests(fmt, REQUESTS, sinks=sinks, lengths=lengths, seed=len(fmt) + 10 * compressed)
    else:   # window-only: the window row takes both lengths (a full row: 160 entries, three pieces)
        reqs = V4Requests(fmt, [[(w + c, 0) for w, c in r] for r in REQUESTS], w_topk=W_TOPK + C_TOPK, c_topk=0,
                          sinks=sinks, lengths=lengths, seed=len(fmt))
    attn = fp8mla.V4SparseAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK)
    attn.plan(**reqs.plan_args, min_split=MIN_SPLIT)
    assert attn.batch_invariant and attn.backend == backend
    if backend == "triton":   # a full row still splits at one row (latency), the same count in every call
        assert attn.splits_for(1) == attn.splits_for(1000) == -(-(W_TOPK + C_TOPK) // CHUNK) == 3
    seen = {}
    for k, order in enumerate(ORDERS):
        rows = reqs.rows_of(order)
        args = reqs.call(rows, seed=10 + k)
        out, lse = run_call(attn, args)
        assert_same_bits(seen, rows, out, lse, f"call of requests {order}")
        if k == len(ORDERS) - 2:   # all requests: the bits are the right attention
            ref_o, ref_l = reqs.reference(args)
            assert_close(out, ref_o, 5e-3, "out")
            assert_close(lse, ref_l, 1e-4, "lse")


@pytest.mark.parametrize("backend", TRITON)
def test_default_mode_is_not_invariant(backend):
    """Not claimed invariant: without the mode a row's split count follows the call's size, and its bits do."""
    reqs = V4Requests("fp8_v4", REQUESTS, seed=5)
    attn = fp8mla.V4SparseAttention(backend=backend)
    attn.plan(**reqs.plan_args, min_split=MIN_SPLIT)
    assert not attn.batch_invariant
    rows = reqs.rows_of([0] * 40)   # 40 copies of a full row: fewer splits a row here and on a 132-SM GPU
    assert attn.splits_for(1) > attn.splits_for(len(rows))
    alone = run_call(attn, reqs.call(rows[:1], seed=1))
    among = run_call(attn, reqs.call(rows, seed=1))
    same = torch.equal(alone[0][0].view(torch.int16), among[0][0].view(torch.int16)) and \
        torch.equal(alone[1][0].view(torch.int32), among[1][0].view(torch.int32))
    assert not same, "the default mode gave a full row the same bits alone and among 40 rows"


@pytest.mark.parametrize("backend", TRITON)
def test_workspace_outlives_replans(backend):
    """The split workspace (what a captured graph writes) is taken over by a re-plan and, once outgrown, kept
    alive: a graph captured on it never replays on freed memory (the GPU test below replays one)."""
    reqs = V4Requests("bf16", [[(48, 112)], [(10, 5)]], seed=2)
    attn = fp8mla.V4SparseAttention(backend=backend, batch_invariant=True, invariant_chunk=CHUNK)
    attn.plan(**reqs.plan_args)
    run_call(attn, reqs.call([0], seed=0))
    first = attn._plan.part_o
    assert first.shape[0] == 4   # one row: three pieces and the sink
    attn.plan(**reqs.plan_args)
    assert attn._plan.part_o is first
    run_call(attn, reqs.call([0, 1], seed=1))
    assert attn._plan.part_o.shape[0] == 8 and any(o is first for o, _ in attn._retired)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="batch_invariant: expected True or False"):
        fp8mla.V4SparseAttention(batch_invariant=1)
    for bad in (0, -64, 100, 32, True, 64.0, "64"):
        with pytest.raises(ValueError, match="invariant_chunk: expected a positive multiple of 64"):
            fp8mla.V4SparseAttention(backend="torch", batch_invariant=True, invariant_chunk=bad)
    with pytest.raises(ValueError, match="invariant_chunk: an option of the batch-invariant mode"):
        fp8mla.V4SparseAttention(backend="torch", invariant_chunk=64)
    attn = fp8mla.V4SparseAttention(backend="torch", batch_invariant=True)
    with pytest.raises(ValueError, match="num_splits: the batch-invariant mode cuts each row by invariant_chunk"):
        attn.plan(16, SM_SCALE, torch.bfloat16, "fp8_v4", window_topk=128, window_page_size=64, num_splits=2,
                  device=DEVICE)


@pytest.mark.parametrize("backend", TRITON)
def test_chunk_must_hold_whole_key_blocks(backend):
    attn = fp8mla.V4SparseAttention(backend=backend, batch_invariant=True, invariant_chunk=64)
    with pytest.raises(ValueError, match=r"invariant_chunk: expected a multiple of the kernel's key block "
                                         r"\(block_n=128\), got 64"):
        attn.plan(16, SM_SCALE, torch.bfloat16, "bf16", window_topk=128, window_page_size=64, block_n=128,
                  device=DEVICE)
    attn.plan(16, SM_SCALE, torch.bfloat16, "bf16", window_topk=128, window_page_size=64, block_n=64, device=DEVICE)
    assert attn.splits_for(1) == 2


def test_backends_that_cannot_honour_it_are_refused(monkeypatch):
    """A backend outside INVARIANT_BACKENDS (a Hopper build) is refused by name; "auto" never picks one."""
    import fp8mla.v4 as v4
    monkeypatch.setattr(v4, "V4_BACKENDS", v4.V4_BACKENDS + ("gluon",))
    with pytest.raises(ValueError, match="batch_invariant: backend 'gluon' does not cut a row by the row alone"):
        fp8mla.V4SparseAttention(backend="gluon", batch_invariant=True)
    fp8mla.V4SparseAttention(backend="gluon")   # the default mode takes it (the plan then checks it)
    # "auto" on a Hopper GPU: the selector passes over the gluon V4 build in this mode (its record says it does not
    # honour it), and takes it otherwise
    from fp8mla import runtime
    from fp8mla.backends.select import select, v4_question
    from fp8mla.formats_v4 import get_v4_format
    monkeypatch.setattr(runtime, "gluon_usable", lambda device: True)
    monkeypatch.setattr(runtime, "triton_usable", lambda device: True)
    for invariant, want in ((True, "triton"), (False, "gluon")):
        q = v4_question(16, get_v4_format("fp8_v4"), torch.bfloat16, "cuda", 64, batch_invariant=invariant)
        assert select(q, "auto").backend == want


# -- GPU: V4's sizes, CUDA graphs --------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8_v4", "fp8_v41"])
@pytest.mark.parametrize("heads, c_topk", [(64, 512), (128, 1024), (64, 2048)], ids=["flash", "pro", "hca"])
def test_gpu_v4_sizes_in_calls_of_1_to_64_rows(fmt, heads, c_topk):
    """The default chunk (512) at V4's window (128) and compressed widths: a row's bits in calls of 1 to 64 rows of
    other lengths, the real kernel configuration and the GPU's SM count."""
    g = torch.Generator().manual_seed(heads + c_topk)
    lens = [[(int(torch.randint(1, 129, (1,), generator=g)), int(torch.randint(0, c_topk + 1, (1,), generator=g)))]
            for _ in range(63)]
    reqs = V4Requests(fmt, [[(128, c_topk)], [(128, c_topk // 3), (127, c_topk // 3 + 1)]] + lens, heads=heads,
                      w_topk=128, c_topk=c_topk, w_page=64, c_page=64, seed=heads)
    attn = fp8mla.V4SparseAttention(batch_invariant=True)
    attn.plan(**reqs.plan_args)
    assert attn.backend == "triton" and attn.splits_for(1) == -(-(128 + c_topk) // 512)
    seen = {}
    order = list(range(len(reqs.kv)))   # 65 requests, 66 rows
    for k, n in enumerate([1, 2, 3, 7, 16, 33, 65]):
        calls = [order[:n], order[:n][::-1]] if n > 1 else [order[:1]]
        for c, o in enumerate(calls):
            rows = reqs.rows_of(o)
            args = reqs.call(rows, seed=100 * k + c)
            out, lse = run_call(attn, args)
            assert_same_bits(seen, rows, out, lse, f"a call of {len(rows)} rows")
    ref_o, ref_l = reqs.reference(args)
    assert_close(out, ref_o, 3e-3, "out")
    assert_close(lse, ref_l, 1e-4, "lse")


@needs_cuda
def test_gpu_cuda_graph_replays_the_same_bits_across_replans():
    """A call captured in a CUDA graph gives each row the bits of its plain runs; after re-plans and a larger call
    (which grows the workspace) the old graph still replays on live memory and gives the same bits."""
    reqs = V4Requests("fp8_v4", [[(128, 512)], [(100, 300), (101, 301)], [(5, 0)], [(128, 200)]], heads=64,
                      w_topk=128, c_topk=512, w_page=64, c_page=64, seed=3)
    attn = fp8mla.V4SparseAttention(batch_invariant=True)
    attn.plan(**reqs.plan_args)
    alone = {i: run_call(attn, reqs.call([i], seed=i)) for i in range(len(reqs.rows))}
    rows = reqs.rows_of([3, 1, 0, 2])
    args = reqs.call(rows, seed=7)
    n = len(rows)
    out = torch.full((n, 64, 512), math.nan, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((n, 64), math.nan, device=DEVICE)
    run = lambda: attn.run(**args, out=out, lse=lse)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()

    def replay_and_check(where):
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        for j, i in enumerate(rows):
            assert torch.equal(out[j].view(torch.int16), alone[i][0][0].view(torch.int16)), f"row {i}: out {where}"
            assert torch.equal(lse[j].view(torch.int32), alone[i][1][0].view(torch.int32)), f"row {i}: lse {where}"

    replay_and_check("in the graph")
    attn.plan(**reqs.plan_args)
    big = reqs.rows_of([0, 1, 2, 3] * 40)
    run_call(attn, reqs.call(big, seed=9))   # grows the workspace: the graph's stays alive
    attn.plan(**{**reqs.plan_args, "num_heads": 128})
    torch.cuda.empty_cache()
    replay_and_check("after re-plans")
