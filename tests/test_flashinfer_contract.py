"""The FlashInfer contract: ``fp8mla.MLAPagedAttention`` called exactly the way FlashInfer's own MLA tests and the
serving engines call ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (0.6.18; 0.7.x keeps the same positional
order). Our own code and data, nothing of FlashInfer's: each case builds a fresh NaN-poisoned paged batch
(shuffled page ids, NaN in every unused page and slot) and compares with the float64 reference of
``fp8mla.reference`` on the dequantized KV.

What is pinned here, and who relies on it (docs/flashinfer_compat.md has the full table):
- the positional order and defaults of the constructor, plan() and run(); ckv_scale / ckv_scale_arr / kpe_scale
  keyword-only (FlashInfer's own test inspects that);
- the constructor's CUDA-graph buffers (qo_indptr=, kv_indptr=, kv_indices=, kv_len_arr=), with multi-token
  plans in graph mode (FlashInfer's paged test plans up to 17 query tokens per request in a graph-mode wrapper);
- indptr arrays longer than B + 1 and slices of larger buffers (B comes from kv_len_arr, as in FlashInfer's
  C++ plan; SGLang passes slices, FlashInfer's varlen test a kv_indptr with extra entries);
- head_dim_kpe = 0 (MLA without a rope part) with per-token group scales given through ckv_scale_arr while
  kv_data_type is the plain torch.float8_e4m3fn (vLLM's SM90 NoPE backend, FlashInfer >= 0.6.18);
- an FP8 run without ckv_scale / ckv_scale_arr raises, naming them; dtype mismatches raise ValueError;
- fp16 queries over an FP8 pool are accepted (fp8mla's documented superset; FlashInfer refuses them).
"""
from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close, make_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# bf16 output vs float64: rounding of the output (2^-9) dominates. The interpreter truncates (2x).
TOL = 5e-3 if DEVICE == "cpu" else 3e-3
GROUP_TOL = 1e-2
LSE_TOL = 2e-4


def _triton_param():
    ok = "triton" in fp8mla.available_backends(DEVICE)
    return pytest.param("triton", id="triton", marks=[pytest.mark.triton] + (
        [] if ok else [pytest.mark.skip(reason="triton backend unavailable here")]))


TORCH = [pytest.param("torch", id="torch")]
TORCH_TRITON = TORCH + [_triton_param()]


# -- helpers ---------------------------------------------------------------------------------------------------
def fi_batch(kv_lens, qo_lens, *, heads=16, page=16, fmt="fp8_e4m3", dk=64, q_dtype=torch.bfloat16, causal=True,
             seed=0, ckv_scale=0.021, kpe_scale=0.013, value_scale=3.0):
    """A random batch and its FlashInfer-style plan arguments (kv_data_type as the torch dtype FlashInfer takes:
    the group format is planned as plain torch.float8_e4m3fn, its scales come with run())."""
    b = make_paged_batch(kv_lens, qo_lens, heads, page, fmt, head_dim_kpe=dk, q_dtype=q_dtype, causal=causal,
                         device=DEVICE, seed=seed, ckv_scale=ckv_scale if fmt == "fp8_e4m3" else 1.0,
                         kpe_scale=kpe_scale if fmt.startswith("fp8") else 1.0, value_scale=value_scale)
    fmt_obj = fp8mla.formats.get_format(fmt)
    b.plan_args["kv_data_type"] = fmt_obj.storage_dtype
    return b


def plan_positional(b):
    a = b.plan_args
    return (a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], a["num_heads"], a["head_dim_ckv"],
            a["head_dim_kpe"], a["page_size"], a["causal"], a["sm_scale"], a["q_data_type"], a["kv_data_type"])


def scale_kwargs(b):
    """The scales as FlashInfer takes them: exactly one of ckv_scale / ckv_scale_arr, and kpe_scale, for FP8."""
    r = b.run_args
    if b.plan_args["kv_data_type"] != FP8 and b.plan_args["kv_data_type"] != torch.float8_e5m2:
        return {}
    if r["ckv_scale_arr"] is not None:
        return dict(ckv_scale_arr=r["ckv_scale_arr"], kpe_scale=r["kpe_scale"])
    return dict(ckv_scale=r["ckv_scale"], kpe_scale=r["kpe_scale"])


def poisoned(b):
    n, H, Dc = b.run_args["q_nope"].shape
    out = torch.full((n, H, Dc), math.nan, dtype=b.plan_args["q_data_type"], device=DEVICE)
    lse = torch.full((n, H), math.nan, dtype=torch.float32, device=DEVICE)
    return out, lse


def check(b, out, lse, tol=TOL, base_e=False):
    ref_o, ref_lse = b.reference()
    assert_close(out, ref_o, tol, "out")
    if base_e:
        ref_lse = ref_lse * math.log(2.0)
    assert_close(lse, ref_lse, LSE_TOL, "lse")


def caches(b):
    r = b.run_args
    return r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"]


def workspace():
    return torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE)


# -- signatures ------------------------------------------------------------------------------------------------
# FlashInfer 0.6.18's BatchMLAPagedAttentionWrapper (read from the released wheel); 0.7.x keeps these positions.
CTOR = [("float_workspace_buffer", None), ("use_cuda_graph", False), ("qo_indptr", None), ("kv_indptr", None),
        ("kv_indices", None), ("kv_len_arr", None), ("backend", "auto")]
PLAN = ["qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
        "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type", ("use_profiler", False)]
RUN = ["q_nope", "q_pe", "ckv_cache", "kpe_cache", ("out", None), ("lse", None), ("return_lse", False),
       ("profiler_buffer", None), ("kv_len", None), ("page_table", None), ("return_lse_base_on_e", False),
       ("o_scale", None)]
RUN_KEYWORD_ONLY = ["ckv_scale", "ckv_scale_arr", "kpe_scale"]


def _positional(fn):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name != "self"]


@pytest.mark.parametrize("fn,expected", [(fp8mla.MLAPagedAttention.__init__, CTOR),
                                         (fp8mla.MLAPagedAttention.plan, PLAN),
                                         (fp8mla.MLAPagedAttention.run, RUN)], ids=["ctor", "plan", "run"])
def test_positional_order_and_defaults_are_flashinfers(fn, expected):
    params = _positional(fn)
    assert len(params) >= len(expected), [p.name for p in params]
    for p, want in zip(params, expected):
        name, default = want if isinstance(want, tuple) else (want, inspect.Parameter.empty)
        assert p.name == name, f"{fn.__qualname__}: position of {name!r} holds {p.name!r}"
        if default is not inspect.Parameter.empty:
            assert p.default == default, f"{fn.__qualname__}({name}=...) default {p.default!r}, want {default!r}"
    # Anything fp8mla adds comes after FlashInfer's positions, as keywords (a positional extra would shift
    # nothing today but would let a future FlashInfer argument land in it silently).
    assert len(params) == len(expected), f"extra positional parameters: {[p.name for p in params[len(expected):]]}"


def test_scales_are_keyword_only_with_default_none():
    params = inspect.signature(fp8mla.MLAPagedAttention.run).parameters
    for name in RUN_KEYWORD_ONLY:
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is None, name


# -- positional and keyword forms ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", TORCH)
def test_positional_and_keyword_forms_give_the_same_answer(backend):
    b = fi_batch([37, 0, 70], [1, 2, 3], page=16, seed=1)
    attn = fp8mla.MLAPagedAttention(workspace(), False, None, None, None, None, backend)   # all positional
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    # FlashInfer's run positions: out, lse, return_lse, profiler_buffer, kv_len, page_table, return_lse_base_on_e
    res = attn.run(*caches(b), out, lse, True, None, None, None, True, **scale_kwargs(b))
    assert res[0] is out and res[1] is lse
    check(b, out, lse, base_e=True)

    attn2 = fp8mla.MLAPagedAttention(float_workspace_buffer=workspace(), use_cuda_graph=False, backend=backend)
    a = b.plan_args
    attn2.plan(qo_indptr=a["qo_indptr"], kv_indptr=a["kv_indptr"], kv_indices=a["kv_indices"],
               kv_len_arr=a["kv_len_arr"], num_heads=a["num_heads"], head_dim_ckv=a["head_dim_ckv"],
               head_dim_kpe=a["head_dim_kpe"], page_size=a["page_size"], causal=a["causal"],
               sm_scale=a["sm_scale"], q_data_type=a["q_data_type"], kv_data_type=a["kv_data_type"],
               use_profiler=False)
    q_nope, q_pe, ckv, kpe = caches(b)
    out2, lse2 = attn2.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, return_lse=True,
                           return_lse_base_on_e=True, **scale_kwargs(b))
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)

    # Mixed, the way vLLM's SM90 backend plans: 10 positional, then q_data_type= / kv_data_type= keywords.
    attn3 = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn3.plan(*plan_positional(b)[:10], q_data_type=a["q_data_type"], kv_data_type=a["kv_data_type"])
    out3 = attn3.run(*caches(b), **scale_kwargs(b))            # return_lse False: only the output
    assert isinstance(out3, torch.Tensor)
    torch.testing.assert_close(out3, out, rtol=0, atol=0)


@pytest.mark.parametrize("backend", TORCH)
def test_lse_buffer_is_filled_without_return_lse(backend):
    """FlashInfer writes a given lse buffer even when return_lse is False (its paged test checks that)."""
    b = fi_batch([45, 9], [3, 1], seed=2)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    res = attn.run(*caches(b), out=out, lse=lse, **scale_kwargs(b))
    assert res is out
    check(b, out, lse)


# -- the constructor's CUDA-graph buffers ----------------------------------------------------------------------
def graph_buffers(B, max_pages=1 << 20, *, slack=0):
    """FlashInfer-style user buffers; ``slack`` > 0 gives slices of larger buffers (SGLang)."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    qo = torch.empty(B + 1 + slack, **i32)[: B + 1]
    kv = torch.empty(B + 1 + slack, **i32)[: B + 1]
    lens = torch.empty(B + slack, **i32)[:B]
    return dict(qo_indptr=qo, kv_indptr=kv, kv_indices=torch.empty(max_pages, **i32), kv_len_arr=lens)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_graph_buffers_with_multi_token_plans(backend, page):
    """FlashInfer's paged test: a graph-mode wrapper built with user buffers (kv_indices 2^20 entries), then
    plans of up to 17 query tokens per request; a re-plan with other lengths (same batch) must follow."""
    B = 3
    bufs = graph_buffers(B)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend, use_cuda_graph=True, **bufs)
    for seed, (kv_lens, qo_lens) in enumerate([([7, 23, 97], [7, 7, 7]), ([1, 40, 17], [1, 7, 3])]):
        b = fi_batch(kv_lens, qo_lens, page=page, seed=10 + seed + page)
        attn.plan(*plan_positional(b))
        out, lse = poisoned(b)
        attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
        check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH)
def test_graph_buffers_positional_and_sliced(backend):
    """The same buffers given positionally, as slices of larger buffers (SGLang's cuda_graph_*[: bs + 1])."""
    B = 2
    bufs = graph_buffers(B, 4096, slack=5)
    attn = fp8mla.MLAPagedAttention(workspace(), True, bufs["qo_indptr"], bufs["kv_indptr"], bufs["kv_indices"],
                                    bufs["kv_len_arr"], backend)
    b = fi_batch([33, 5], [7, 2], page=1, seed=4)
    attn.plan(*plan_positional(b))
    out, lse = attn.run(*caches(b), return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH)
def test_graph_mode_reads_the_kv_indices_buffer_at_run(backend):
    """FlashInfer's graph mode runs on the user's kv_indices buffer: vLLM's SM90 backend plans with that very
    buffer and writes the step's page ids into it after plan(), inside the captured forward, before run()."""
    B = 2
    bufs = graph_buffers(B, 64)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend, use_cuda_graph=True, **bufs)
    b = fi_batch([20, 31], [1, 1], page=16, seed=5)
    a = b.plan_args
    n = a["kv_indices"].numel()
    bufs["kv_indices"].zero_()                                  # stale ids at plan time
    attn.plan(a["qo_indptr"], a["kv_indptr"], bufs["kv_indices"][:n], *plan_positional(b)[3:])
    bufs["kv_indices"][:n].copy_(a["kv_indices"])               # the real ids arrive after plan()
    out, lse = attn.run(*caches(b), return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


# -- indptr longer than B + 1, padded rows ---------------------------------------------------------------------
@pytest.mark.parametrize("host", [True, False], ids=["host_indptr", "device_indptr"])
@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_indptr_longer_than_batch(backend, host):
    """B = kv_len_arr.numel(); qo_indptr / kv_indptr entries past B + 1 are not read (FlashInfer's varlen test
    passes a kv_indptr with extra trailing entries; engines pass slices of max-batch buffers)."""
    b = fi_batch([0, 11, 130, 1], [2, 7, 3, 1], page=16, seed=6)
    a = dict(b.plan_args)
    extra = torch.tensor([a["kv_indptr"][-1].item() + 3, 10**6], dtype=torch.int32)
    a["kv_indptr"] = torch.cat([a["kv_indptr"].cpu(), extra])
    a["qo_indptr"] = torch.cat([a["qo_indptr"].cpu(), torch.tensor([10**6], dtype=torch.int32)])
    if not host:
        a["kv_indptr"], a["qo_indptr"] = a["kv_indptr"].to(DEVICE), a["qo_indptr"].to(DEVICE)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(**a)
    out, lse = poisoned(b)
    attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH)
def test_padded_rows_without_queries_may_claim_tokens(backend):
    """vLLM's SM90 backend pads the batch to a fixed size: padded rows have no queries and no pages but keep a
    nonzero kv_len ("never dereferenced"). Rows without queries produce nothing, so that must plan and run."""
    b = fi_batch([19, 64], [1, 1], page=1, seed=7)
    a = dict(b.plan_args)
    pad = 3
    last_q, last_kv = int(a["qo_indptr"][-1]), int(a["kv_indptr"][-1])
    a["qo_indptr"] = torch.cat([a["qo_indptr"].cpu(), torch.full((pad,), last_q, dtype=torch.int32)])
    a["kv_indptr"] = torch.cat([a["kv_indptr"].cpu(), torch.full((pad,), last_kv, dtype=torch.int32)])
    a["kv_len_arr"] = torch.cat([a["kv_len_arr"].cpu(), torch.full((pad,), 2048, dtype=torch.int32)])
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(**a)
    out, lse = attn.run(*caches(b), return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


# -- rope-free MLA and group scales under the plain FP8 dtype --------------------------------------------------
@pytest.mark.parametrize("views", [False, True], ids=["separate", "pool_views"])
@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_rope_free_group_scales_under_plain_fp8_dtype(backend, views):
    """head_dim_kpe = 0, kv_data_type = torch.float8_e4m3fn, per-token group scales through ckv_scale_arr
    ([P, page, 4]) and kpe_scale 1.0, zero-width q_pe / kpe_cache: separate empty tensors (FlashInfer's test) or
    zero-width views of a [P, page, 512] pool (vLLM's flat[..., 512:])."""
    if backend == "triton":
        pytest.skip("the Triton kernels need head_dim_kpe >= 16 (auto falls back to torch for rope-free plans)")
    b = fi_batch([45, 29, 0, 3], [1, 1, 1, 2], page=16, fmt="fp8_e4m3_group", dk=0, seed=8)
    assert b.plan_args["kv_data_type"] == FP8 and b.plan_args["head_dim_kpe"] == 0
    q_nope, q_pe, ckv, kpe = caches(b)
    if not views:
        ckv = ckv.contiguous()
        kpe = torch.empty(ckv.shape[0], ckv.shape[1], 0, dtype=FP8, device=DEVICE)
        q_pe = torch.empty(q_nope.shape[0], q_nope.shape[1], 0, dtype=q_nope.dtype, device=DEVICE)
    assert kpe.shape[-1] == 0 and q_pe.shape[-1] == 0
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    attn.run(q_nope, q_pe, ckv, kpe, out, lse, True, ckv_scale_arr=b.run_args["ckv_scale_arr"], kpe_scale=1.0)
    check(b, out, lse, GROUP_TOL)


@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_group_scales_with_rope_under_plain_fp8_dtype(backend):
    b = fi_batch([64, 5, 200], [1, 3, 1], page=64, fmt="fp8_e4m3_group", seed=9)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
    check(b, out, lse, GROUP_TOL)


@pytest.mark.parametrize("backend", TORCH)
def test_rope_free_16bit(backend):
    """FlashInfer's rope-free test: fp16 queries and pool, head_dim_kpe = 0, kv_len 97, page 16."""
    b = fi_batch([97, 97], [3, 3], page=16, fmt="fp16", dk=0, q_dtype=torch.float16, causal=False, seed=10)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = attn.run(*caches(b), return_lse=True)
    check(b, out, lse)


# -- scales ----------------------------------------------------------------------------------------------------
def _fp8_plan(backend="torch", **kw):
    b = fi_batch([40, 3], [1, 2], seed=11, **kw)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    return b, attn


def test_fp8_run_without_a_ckv_scale_raises_naming_both():
    b, attn = _fp8_plan()
    with pytest.raises(ValueError) as e:
        attn.run(*caches(b), kpe_scale=b.run_args["kpe_scale"])
    assert "ckv_scale" in str(e.value) and "ckv_scale_arr" in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:  # no scale at all, FlashInfer's test_fp8_kv_requires_scales call
        attn.run(*caches(b))
    assert "ckv_scale" in str(e.value), str(e.value)


def test_fp8_run_without_kpe_scale_raises_naming_it():
    """FlashInfer 0.6.18 requires kpe_scale for an FP8 pool ("kpe_scale is required when kv_data_type is FP8."),
    rope-free plans included; a missing scale must not silently become 1.0."""
    b, attn = _fp8_plan()
    with pytest.raises(ValueError, match="kpe_scale"):
        attn.run(*caches(b), ckv_scale=b.run_args["ckv_scale"])


def test_fp8_run_with_both_ckv_scales_raises():
    b, attn = _fp8_plan()
    arr = torch.ones(*b.run_args["ckv_cache"].shape[:2], 4, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="ckv_scale"):
        attn.run(*caches(b), ckv_scale=0.5, ckv_scale_arr=arr, kpe_scale=1.0)


def test_fp8_per_tensor_scales_are_applied():
    """Scales far from 1 (0.021, 0.013): a kernel that drops one is far off the reference."""
    b, attn = _fp8_plan()
    out, lse = poisoned(b)
    attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


# -- dtype mismatches ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q_nope", "q_pe", "ckv_cache", "kpe_cache"])
def test_dtype_mismatch_raises_value_error_naming_the_tensor(name):
    """FlashInfer raises ValueError "<name>.dtype=... does not match the planned ..." and its test matches the
    regex ``<name>.dtype``; an error that is both ValueError and TypeError is fine."""
    b, attn = _fp8_plan()
    t = dict(zip(["q_nope", "q_pe", "ckv_cache", "kpe_cache"], caches(b)))
    wrong = torch.float16 if name.startswith("q") else torch.bfloat16
    t[name] = torch.zeros(t[name].shape, dtype=wrong, device=DEVICE)
    with pytest.raises(ValueError) as e:
        attn.run(t["q_nope"], t["q_pe"], t["ckv_cache"], t["kpe_cache"], ckv_scale=1.0, kpe_scale=1.0)
    assert re.search(f"{name}.dtype", str(e.value)), f"message does not match FlashInfer's {name}.dtype: {e.value}"


# -- the documented superset -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_fp16_queries_over_fp8_are_accepted(backend):
    """FlashInfer refuses fp16 queries over an FP8 pool ("only supports q_data_type=torch.bfloat16");
    fp8mla plans the query and KV dtypes separately and supports it."""
    b = fi_batch([33, 70], [1, 4], q_dtype=torch.float16, seed=12)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
    assert out.dtype == torch.float16
    check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH)
def test_empty_requests_give_zero_and_minus_inf(backend):
    b = fi_batch([0, 0, 5], [1, 2, 1], seed=13, causal=False)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = poisoned(b)
    attn.run(*caches(b), out=out, lse=lse, return_lse=True, **scale_kwargs(b))
    assert bool((out[:3] == 0).all()) and bool((lse[:3] == -math.inf).all())
    check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH)
def test_engine_views_of_one_pool_page_size_1(backend):
    """SGLang's call: page size 1, q and KV given as strided views of [n, H, 576] / [P, 1, 576] tensors."""
    b = fi_batch([12, 50, 1], [1, 1, 1], page=1, seed=14, fmt="bf16", causal=False)
    q = torch.cat([b.run_args["q_nope"], b.run_args["q_pe"]], dim=-1)
    pool = b.pool
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend)
    attn.plan(*plan_positional(b))
    out, lse = attn.run(q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:], return_lse=True)
    check(b, out, lse)


@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_flashinfer_backend_names_are_accepted(name):
    """FlashInfer's tests and engines construct with backend="fa2"/"fa3" (vLLM's SM90 backend: "fa3"); a drop-in
    takes them (as "auto") instead of failing at construction."""
    b = fi_batch([30, 2], [2, 1], seed=15)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=name)
    attn.plan(*plan_positional(b))
    out, lse = attn.run(*caches(b), return_lse=True, **scale_kwargs(b))
    check(b, out, lse)


@pytest.mark.parametrize("backend", TORCH_TRITON)
def test_graph_mode_all_empty_requests_over_an_empty_pool(backend):
    """FlashInfer's paged test with kv_len 0: a pool of 0 pages, an empty kv_indices, multi-token queries, in a
    graph-mode wrapper; out 0 and lse -inf, also into given buffers with return_lse False."""
    B, qo, H = 3, 7, 16
    bufs = graph_buffers(B)
    attn = fp8mla.MLAPagedAttention(workspace(), backend=backend, use_cuda_graph=True, **bufs)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    attn.plan(torch.arange(B + 1, **i32) * qo, torch.zeros(B + 1, **i32), torch.zeros(0, **i32),
              torch.zeros(B, **i32), H, 512, 64, 16, False, 0.07, torch.float16, torch.float16)
    q_nope = torch.randn(B * qo, H, 512, dtype=torch.float16, device=DEVICE)
    q_pe = torch.randn(B * qo, H, 64, dtype=torch.float16, device=DEVICE)
    ckv = torch.empty(0, 16, 512, dtype=torch.float16, device=DEVICE)
    kpe = torch.empty(0, 16, 64, dtype=torch.float16, device=DEVICE)
    out, lse = attn.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())
    out2 = torch.full_like(out, math.nan)
    lse2 = torch.full_like(lse, math.nan)
    attn.run(q_nope, q_pe, ckv, kpe, out=out2, lse=lse2)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
