"""Hostile inputs to PagedLayout, the backends and the FlashInfer-exact MLAPagedAttention.

Each test is one hostile input: it states the input, what should happen and (in the docstring) what the code did
before the fix. Small sizes (H=2, c_kv 64, k_pe 16) so the Triton cases stay
cheap under TRITON_INTERPRET=1. Ground truth: fp8mla.reference.mla_reference (float64) on the dequantized KV.

"Device-only" tables cannot be made on a CPU-only machine, so some tests simulate them by making
``fp8mla.layout._on_host`` answer False for the tensors that would live on the GPU: PagedLayout.from_csr then
takes exactly the path it takes for CUDA tensors (no host reads of those values).
"""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
import fp8mla.layout as layout_mod
from fp8mla.layout import PagedLayout
from fp8mla.testing import compare, make_paged_batch

from conftest import BACKEND_PARAMS, DEVICE

H, DC, DK, PAGE = 2, 64, 16, 4
I32 = torch.int32


def _batch(kv_lens, qo_lens, kv_format="bf16", seed=0, **kw):
    return make_paged_batch(kv_lens, qo_lens, H, PAGE, kv_format, head_dim_ckv=DC, head_dim_kpe=DK, seed=seed,
                            **kw)


def _planned(backend, plan_args, **ctor):
    attn = fp8mla.MLAPagedAttention(backend=backend, **ctor)
    attn.plan(**plan_args)
    return attn


def _assert_matches(out, lse, ref_out, ref_lse, what=""):
    co, cl = compare(out, ref_out), compare(lse, ref_lse)
    assert co.ok(2e-2) and cl.ok(1e-4), f"{what}: out {co} | lse {cl}"


def _with_padded_rows(plan_args, where: str, claim: int = 64):
    """vLLM's sparse SM90 padding: rows with no queries and no pages that still claim `claim` tokens."""
    a = dict(plan_args)
    qo, kvp, kvl = a["qo_indptr"].tolist(), a["kv_indptr"].tolist(), a["kv_len_arr"].tolist()
    if where == "end":
        qo, kvp, kvl = qo + [qo[-1]] * 2, kvp + [kvp[-1]] * 2, kvl + [claim] * 2
    else:  # a padded row between request 0 and request 1
        qo, kvp, kvl = qo[:2] + [qo[1]] + qo[2:], kvp[:2] + [kvp[1]] + kvp[2:], kvl[:1] + [claim] + kvl[1:]
    dev = a["qo_indptr"].device
    a["qo_indptr"], a["kv_indptr"] = torch.tensor(qo, dtype=I32, device=dev), torch.tensor(kvp, dtype=I32, device=dev)
    a["kv_len_arr"] = torch.tensor(kvl, dtype=I32, device=dev)
    return a


# -- 1. gather_cast over vLLM-padded rows ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["end", "middle"])
def test_token_slots_skip_rows_without_queries(where):
    """PagedLayout.token_slots() is "the slot ids of every used token". Rows without queries (vLLM's padding:
    no pages, kv_len = top-k width) are accepted by from_csr, but token_slots() walks their claimed kv_len over
    pages they do not own: at the end of the batch it indexes past kv_indices (IndexError here; an out-of-bounds
    device index on a GPU); in the middle it runs over the next request's pages and then past kv_indices too
    (a small claim there silently lists the next request's slots). Expected: only the 5 + 9 tokens of the two
    real requests."""
    b = _batch([5, 9], [1, 1])
    a = _with_padded_rows(b.plan_args, where)
    lay = PagedLayout.from_csr(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], PAGE)
    assert lay.token_slots().numel() == 5 + 9


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_gather_cast_with_padded_rows_without_queries(backend):
    """strategy="gather_cast" + vLLM-padded rows at the end of the batch: plan() dies with
    `IndexError: index 5 is out of bounds for dimension 0 with size 5` (layout.token_slots), where the native
    strategy (and FlashInfer) run the batch. Expected: the same answer as without the padded rows."""
    b = _batch([5, 9], [1, 1], "fp8_e4m3", ckv_scale=0.5, device=DEVICE)  # the GPU's too: triton needs it there
    attn = _planned(backend, _with_padded_rows(b.plan_args, "end"), strategy="gather_cast")
    out, lse = attn.run(**b.run_args, return_lse=True)
    _assert_matches(out, lse, *b.reference(), "gather_cast with padded rows")


# -- 2./3. device-only tables whose kv_len passes its pages ---------------------------------------------------------
def _device_only(monkeypatch, *device_tensors):
    """Make from_csr treat these tensors (by storage) as CUDA tensors: never read on the host. No argument: all."""
    ptrs = {t.data_ptr() for t in device_tensors}
    monkeypatch.setattr(layout_mod, "_on_host", (lambda t: t.data_ptr() not in ptrs) if ptrs else (lambda t: False))


@pytest.mark.parametrize("claim", [12, 40])
@pytest.mark.parametrize("qo0", [1, 10], ids=["decode", "extend"])
def test_triton_device_only_kv_len_past_pages_is_clamped(monkeypatch, qo0, claim):
    """docs/architecture.md: a device-only table is not read on the host; "the split schedule is computed on the
    device from it, clamping each kv_len to its pages, and the kernels never read a page id outside the pool".
    Request 0 owns 2 pages (8 tokens) but kv_len_arr claims `claim` tokens. The decode path (qo 1) clamps: the
    answer is attention over the 8 tokens. The extend path (qo >= 9, backends/triton.py passes layout.kv_len
    unclamped to mla_extend) does not: with claim 12 it silently reads request 1's page (rel_l2 0.6 vs the
    clamped answer), with claim 40 it reads kv_indices past its 5 entries (NaN rows here; an out-of-bounds read
    on a GPU). Expected: the clamped answer (or a named error), on both paths."""
    if "triton" not in fp8mla.available_backends("cpu"):
        pytest.skip("triton cannot run here")
    b = _batch([8, 9], [qo0, 1], causal=False)
    a = dict(b.plan_args, kv_len_arr=torch.tensor([claim, 9], dtype=I32))
    _device_only(monkeypatch)
    attn = _planned("triton", a)
    monkeypatch.undo()
    out, lse = attn.run(**b.run_args, return_lse=True)
    ref_out, ref_lse = b.reference()  # request 0 over the 8 tokens it owns
    _assert_matches(out[:qo0], lse[:qo0], ref_out[:qo0], ref_lse[:qo0], f"request 0 (qo {qo0}, claims {claim})")


@pytest.mark.parametrize("claim", [12, 40])
def test_torch_backend_device_only_kv_len_past_pages(monkeypatch, claim):
    """The torch backend reads the lengths on the host anyway (it syncs), but uses them unclamped and unchecked:
    request 0 (8 tokens owned, 12 claimed) silently attends over request 1's first page (rel_l2 0.49); with 40
    claimed it raises a bare IndexError from backends/torch.py (a device-side assert on a GPU). This is the path
    "auto" takes on a GPU for rope-free MLA (head_dim_kpe=0, vLLM's sparse SM90 backend). Expected: clamp to
    the pages (the triton decode answer) or a ValueError naming kv_len_arr."""
    b = _batch([8, 9], [1, 1], causal=False)
    a = dict(b.plan_args, kv_len_arr=torch.tensor([claim, 9], dtype=I32))
    _device_only(monkeypatch)
    try:
        attn = _planned("torch", a)
        monkeypatch.undo()
        out, lse = attn.run(**b.run_args, return_lse=True)
    except ValueError as e:
        assert "kv_len" in str(e)
        return
    ref_out, ref_lse = b.reference()
    _assert_matches(out[:1], lse[:1], ref_out[:1], ref_lse[:1], f"request 0 (claims {claim} of 8 tokens)")


def test_from_csr_checks_kv_len_on_host_when_only_kv_indices_is_on_the_device(monkeypatch):
    """vLLM's sparse SM90 call: qo_indptr, kv_indptr and kv_len_arr on the CPU, kv_indices on the GPU. Checking
    "kv_len <= pages x page_size" needs only kv_indptr and kv_len (host: no sync), but from_csr skips the whole
    table check unless kv_indices is on the host too, so a request claiming more tokens than its pages passes.
    Expected: the ValueError that the all-CPU table gets."""
    b = _batch([8, 9], [1, 1])
    a = b.plan_args
    bad = torch.tensor([12, 9], dtype=I32)
    with pytest.raises(ValueError, match="kv_len_arr"):  # all on the host: refused today
        PagedLayout.from_csr(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], bad, PAGE)
    _device_only(monkeypatch, a["kv_indices"])
    with pytest.raises(ValueError, match="kv_len_arr"):
        PagedLayout.from_csr(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], bad, PAGE)


# -- 4. host scales that do not fit fp32 ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ckv_scale", "kpe_scale"])
@pytest.mark.parametrize("value", [1e300, 1e39, 1e-46])
def test_host_scale_outside_fp32_is_refused(name, value):
    """_check_scale accepts any finite positive Python float, then the scale is stored in an fp32 tensor:
    1e39 and 1e300 become inf (out and lse all NaN), 1e-46 becomes 0.0 (ckv_scale: out exactly 0 with a finite,
    plausible lse -- a silent wrong answer). Expected: ValueError naming the scale (finite and > 0 in fp32)."""
    b = _batch([5, 9], [1, 1], "fp8_e4m3", ckv_scale=0.5)
    attn = _planned("torch", b.plan_args)
    with pytest.raises(ValueError, match=name):
        attn.run(**{**b.run_args, name: value})


# -- 5. causal: NaN in a token a query cannot see -------------------------------------------------------------------
@pytest.mark.parametrize("qo", [3, 10], ids=["decode-kernel", "extend-kernel"])
@pytest.mark.parametrize("backend", ["torch"])
def test_causal_nan_in_a_token_the_query_cannot_see(backend, qo):
    """run()'s docstring: "NaN in a query or in a token it sees gives NaN". Causal, kv_len 12, NaN in one channel
    of token 11 (the last): only the last query sees it, yet every query row comes out NaN on torch, triton
    (decode and extend kernels) and in mla_reference itself (softmax_rows does p @ v with p = 0 on the NaN row:
    0 x NaN = NaN). Expected: rows 0..qo-2 finite and equal to the reference computed without the NaN.
    (Fixed in the torch paths and the reference; the Triton kernels keep the 0 x NaN of P.V for now --
    documented in run(): such a NaN never leaves its request -- so they are not parametrized here.)"""
    b = _batch([12], [qo], causal=True)
    clean_out, clean_lse = b.reference()
    b.pool[int(b.plan_args["kv_indices"][2]), 3, 5] = float("nan")   # token 11, c_kv channel 5
    attn = _planned(backend, b.plan_args)
    out, lse = attn.run(**b.run_args, return_lse=True)
    assert torch.isnan(out[-1]).any(), "the last query sees the NaN token: NaN must propagate there"
    _assert_matches(out[:-1], lse[:-1], clean_out[:-1], clean_lse[:-1], "queries that cannot see token 11")


def test_reference_causal_nan_in_a_token_the_query_cannot_see():
    """The float64 reference has the same leak (it is the ground truth the kernels are held to)."""
    b = _batch([12], [3], causal=True)
    clean_out, _ = b.reference()
    b.pool[int(b.plan_args["kv_indices"][2]), 3, 5] = float("nan")
    out, _ = b.reference()
    assert torch.isnan(out[-1]).any()
    assert not torch.isnan(out[:-1]).any(), "queries 0 and 1 cannot see token 11"
    assert torch.equal(out[:-1], clean_out[:-1])


# -- 6. CUDA-graph mode: a later plan with more query tokens --------------------------------------------------------
@pytest.mark.triton
def test_graph_mode_replan_with_more_query_tokens():
    """FlashInfer's graph-mode wrapper (constructor buffers) takes any qo_len in later plans (its own tests plan
    up to 17 tokens per request in one). fp8mla sizes the row buffers from the FIRST plan: a decode plan (qo 1)
    followed by a verify/MTP plan (qo 3) on the same wrapper raises "qo_indptr: a request has 3 query tokens,
    above the 1 the CUDA-graph buffers were sized for". Expected: the re-plan works (or the default capacity
    covers the multi-token case engines use); the answer matches the reference."""
    if "triton" not in fp8mla.available_backends("cpu"):
        pytest.skip("triton cannot run here")
    bufs = dict(qo_indptr=torch.zeros(5, dtype=I32), kv_indptr=torch.zeros(5, dtype=I32),
                kv_indices=torch.zeros(256, dtype=I32), kv_len_arr=torch.zeros(4, dtype=I32))
    # Growing the row buffers would leave an already captured graph replaying stale buffers,
    # so a longer plan is a clear error naming max_qo_len, and max_qo_len sizes them for MTP up front.
    attn = fp8mla.MLAPagedAttention(None, True, **bufs, backend="triton")
    first = _batch([5, 9], [1, 1], "fp8_e4m3", ckv_scale=0.5)
    attn.plan(**first.plan_args)
    attn.run(**first.run_args)
    b = _batch([7, 9], [3, 2], "fp8_e4m3", seed=1, ckv_scale=0.5)
    with pytest.raises(ValueError, match="max_qo_len=3"):
        attn.plan(**b.plan_args)
    attn = fp8mla.MLAPagedAttention(None, True, **bufs, backend="triton", max_qo_len=4)
    attn.plan(**first.plan_args)
    attn.run(**first.run_args)
    attn.plan(**b.plan_args)
    out, lse = attn.run(**b.run_args, return_lse=True)
    _assert_matches(out, lse, *b.reference(), "graph re-plan with qo 3")


# -- 7./8. unclear errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [None, [0, 1, 2]], ids=["None", "list"])
def test_plan_kv_indices_not_a_tensor_names_it(bad):
    """plan(kv_indices=None or a list) raises `AttributeError: 'NoneType' object has no attribute 'device'`
    (attention.py reads kv_indices.device before any check). Expected: the named TypeError/ValueError every
    other plan argument gets ("kv_indices: expected a torch.Tensor, got ...")."""
    b = _batch([5, 9], [1, 1])
    with pytest.raises((TypeError, ValueError), match="kv_indices"):
        fp8mla.MLAPagedAttention(backend="torch").plan(**dict(b.plan_args, kv_indices=bad))


@pytest.mark.parametrize("o_scale", [float("nan"), float("inf"), "2"], ids=["nan", "inf", "str"])
def test_o_scale_is_validated(o_scale):
    """run(o_scale=nan/inf) silently returns an all-NaN/inf output; o_scale="2" raises torch's
    `mul_(): argument 'other' (position 1) must be Tensor, not str`. Every other scale is checked by name.
    Expected: ValueError/TypeError naming o_scale."""
    b = _batch([5, 9], [1, 1])
    attn = _planned("torch", b.plan_args)
    with pytest.raises((TypeError, ValueError), match="o_scale"):
        attn.run(**b.run_args, o_scale=o_scale)


def test_from_block_table_error_names_its_own_argument():
    """from_block_table(block_table, kv_len, ...) with a kv_len past its row's pages raises
    "kv_len_arr: request 0 has kv_len 100 ... its 2 pages" -- the name of from_csr's argument, which this caller
    never passed (and the from_block_table message below it is dead code). Expected: the error names `kv_len`
    and block_table."""
    bt = torch.tensor([[0, 1]], dtype=I32)
    with pytest.raises(ValueError, match=r"^kv_len:.*block_table"):
        PagedLayout.from_block_table(bt, torch.tensor([100], dtype=I32), PAGE)


@pytest.mark.triton
def test_triton_device_only_kv_indptr_past_kv_indices(monkeypatch):
    """The device-side clamp uses kv_indptr differences only, not kv_indices.numel() (known on the host from the
    shape, no sync): a device-only kv_indptr = [0, 5] over a 2-entry kv_indices (a slice of a larger buffer, as
    engines pass) makes the decode kernel read kv_indices[2:5] -- past the tensor -- and attend over whatever
    pages sit there: here request B's real tokens, so a finite, plausible, wrong answer. Expected: tokens past
    the listed pages are never read (the 8 tokens of the 2 listed pages), or a named error."""
    if "triton" not in fp8mla.available_backends("cpu"):
        pytest.skip("triton cannot run here")
    b = _batch([8, 9], [1, 1], causal=False)      # request A: 2 pages, request B: 3 pages
    full = b.plan_args["kv_indices"]               # [A's 2 pages, B's 3 pages]
    a = dict(b.plan_args, qo_indptr=torch.tensor([0, 1], dtype=I32), kv_indptr=torch.tensor([0, 5], dtype=I32),
             kv_indices=full[:2], kv_len_arr=torch.tensor([17], dtype=I32))
    _device_only(monkeypatch)
    attn = _planned("triton", a)
    monkeypatch.undo()
    run = dict(b.run_args, q_nope=b.run_args["q_nope"][:1], q_pe=b.run_args["q_pe"][:1])
    out, lse = attn.run(**run, return_lse=True)
    ref_out, ref_lse = b.reference()               # request A over its own 8 tokens
    _assert_matches(out, lse, ref_out[:1], ref_lse[:1], "request A clamped to the pages kv_indices lists")


# -- 10. memory: split partials sized by the batch, not by the splits ---------------------------------------------
@pytest.mark.triton
def test_triton_partials_do_not_grow_with_the_batch():
    """backends/triton.py allocates part_o [target + B, H * max_qo, Dc] fp32 on every plan (the old host
    schedule: [number of partials]). Only requests split in >= 2 items write partials, and there are at most
    2 * target of those (a split request has more than `chunk` tokens, so at most target of them, each with
    <= L/chunk + 1 items). At B = 1024, H = 128 (TP1 DeepSeek) that is ~300 MB per plan for decode batches
    whose requests are mostly unsplit. Expected: the partial buffers are bounded by the splits (2 * target + 1
    here), not by B. 200 one-token requests, nothing is split."""
    if "triton" not in fp8mla.available_backends("cpu"):
        pytest.skip("triton cannot run here")
    b = _batch([1] * 200, [1] * 200)
    attn = _planned("triton", b.plan_args)
    impl = attn._plan.impl
    from fp8mla.kernels.split import items_target
    from fp8mla.runtime import num_sms
    target = items_target(-(-impl.max_rows // impl.cfg["block_m"]), num_sms("cpu"), 2)
    assert impl.t["part_o"].shape[0] <= 2 * target + 1, (
        f"part_o holds {impl.t['part_o'].shape[0]} partials for a batch with no split request "
        f"(target {target})")


# -- 11. kernel options that are never validated ---------------------------------------------------------------
@pytest.mark.parametrize("opt", [dict(num_stages=0), dict(num_stages="x"), dict(num_warps=3),
                                 dict(evict_first="x"), dict(index64="x")], ids=lambda d: f"{d}")
def test_kernel_options_are_validated(opt):
    """The constructor checks block_m/block_n/num_warps/ctas_per_sm/min_chunk/max_* for positive ints, but not
    their meaning: num_stages 0 or "x", num_warps 3 (Triton needs a power of two), evict_first/index64 "x" are
    accepted and reach the kernel launch (ignored by the interpreter; a Triton compile error deep in the stack
    on a GPU, or a silently truthy flag). Expected: a ValueError/TypeError naming the option, at construction."""
    with pytest.raises((TypeError, ValueError), match=next(iter(opt))):
        fp8mla.MLAPagedAttention(backend="torch", **opt)


def test_fp8_math_is_refused_not_ignored():
    """``fp8_math`` was an accepted option name that no backend read: True ran the default numerics silently.
    FP8 tensor-core math exists on the gluon kernel only: a backend or strategy that cannot run it raises at
    construction, and an ``auto`` plan that would land elsewhere (here: no sm_90 GPU) raises at plan(), naming
    the option; False / None stay accepted everywhere."""
    for kw in (dict(backend="torch"), dict(backend="triton"), dict(strategy="gather_cast")):
        with pytest.raises(ValueError, match="fp8_math"):
            fp8mla.MLAPagedAttention(fp8_math=True, **kw)
    fp8mla.MLAPagedAttention(backend="torch", fp8_math=False)
    fp8mla.MLAPagedAttention(backend="torch", fp8_math=None)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return   # auto runs it there (tests/test_decode_sm90_fp8math.py)
    cache = fp8mla.PagedMLACache(num_layers=1, num_pages=4, page_size=16, kv_format="fp8_e4m3")
    s = cache.add_sequence(num_tokens=20)
    attn = fp8mla.MLAPagedAttention(fp8_math=True)
    with pytest.raises(ValueError, match="fp8_math: .*gluon kernel only"):
        attn.plan(**cache.plan_inputs([s]), num_heads=16, causal=True, sm_scale=0.1, q_data_type=torch.bfloat16)


def test_fp8_math_refusal_is_not_kept_by_a_graph_wrapper(monkeypatch):
    """A CUDA-graph wrapper keeps its backend choice per (spec, one query per request); the key does not hold the
    query lengths gluon's support depends on (qo 0 or > 8), so a refused fp8_math plan must not be kept: a later plan
    of the same key that gluon takes runs instead of raising (a refusal was once kept so)."""
    import fp8mla.attention as att
    cache = fp8mla.PagedMLACache(num_layers=1, num_pages=4, page_size=16, kv_format="fp8_e4m3")
    s = cache.add_sequence(num_tokens=20)
    kw = dict(num_heads=16, causal=True, sm_scale=0.1, q_data_type=torch.bfloat16)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, fp8_math=True)
    with pytest.raises(ValueError, match="fp8_math"):
        attn.plan(**cache.plan_inputs([s]), **kw)
    assert not attn._selected
    built = []
    from fp8mla.backends.capabilities import GLUON_WIDE
    from fp8mla.backends.select import Choice
    monkeypatch.setattr(att, "select", lambda *a, **k: Choice(GLUON_WIDE))
    monkeypatch.setattr(att.backends, "build", lambda name, *a: built.append(name) or object())
    attn.plan(**cache.plan_inputs([s]), **kw)
    assert built == ["gluon"] and [c.backend for c in attn._selected.values()] == ["gluon"]
