"""Every bad input to plan(), run() and the cache raises a clear error that names the argument.

A wrong call must fail loudly, never return a silent wrong answer: each case checks the exception type and that
the message names the argument (and, where it helps, what was expected). run() also must not write anything
before it refuses.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import BACKEND_PARAMS, DEVICE
from fp8mla import MLAPagedAttention, OutOfPagesError, PagedMLACache
from fp8mla.testing import make_paged_batch


def _t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _batch(kv_format="fp8_e4m3", **kw):
    # Two requests: 33 tokens over 3 pages of 16, 17 tokens over 2 pages; 1 and 3 queries.
    return make_paged_batch([33, 17], [1, 3], 16, 16, kv_format, device=DEVICE, seed=0, **kw)


def _plan_args(**changes):
    args = dict(_batch().plan_args)
    args.update(changes)
    return args


def _plan(**changes):
    MLAPagedAttention(backend="torch").plan(**_plan_args(**changes))


# -- plan() ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value, exc, words", [
    # index pointers
    ("qo_indptr", _t([1, 2, 4]), ValueError, "start at 0"),
    ("qo_indptr", _t([0, 3, 1]), ValueError, "non-decreasing"),
    ("qo_indptr", _t([]), ValueError, "at least 3"),
    ("qo_indptr", _t([[0, 1, 4]]), ValueError, "1 dimensions"),
    ("qo_indptr", _t([0.0, 1.0, 4.0], torch.float32), TypeError, "int32"),
    ("qo_indptr", [0, 1, 4], TypeError, "torch.Tensor"),
    ("kv_indptr", _t([1, 3, 5]), ValueError, "start at 0"),
    ("kv_indptr", _t([0, 3, 2]), ValueError, "non-decreasing"),
    ("kv_indptr", _t([0, 3]), ValueError, "3 entries"),
    ("kv_indptr", _t([0, 3, 5], torch.int16), TypeError, "int32"),
    ("kv_indptr", _t([0, 3, 9]), ValueError, "kv_indices has 5 entries"),
    # lengths
    ("kv_len_arr", _t([33, 17, 4]), ValueError, "at least 4 entries"),
    ("kv_len_arr", _t([49, 17]), ValueError, "3 pages x page_size 16 = 48"),
    ("kv_len_arr", _t([33, 33]), ValueError, "2 pages x page_size 16 = 32"),
    ("kv_len_arr", _t([-1, 17]), ValueError, "0 <= kv_len"),
    ("kv_len_arr", _t([33.0, 17.0], torch.float64), TypeError, "int32"),
    # page ids
    ("kv_indices", _t([0, -1, 2, 3, 4]), ValueError, ">= 0"),
    ("kv_indices", _t([0.0, 1, 2, 3, 4], torch.float32), TypeError, "int32"),
    ("kv_indices", _t([0, 1, 2]), ValueError, "kv_indptr[-1]=5"),
    # scalars
    ("num_heads", 0, ValueError, "positive int"),
    ("num_heads", 16.0, ValueError, "positive int"),
    ("num_heads", True, ValueError, "positive int"),
    ("head_dim_ckv", -512, ValueError, "positive int"),
    ("head_dim_kpe", -1, ValueError, "non-negative int"),
    ("page_size", 0, ValueError, "positive int"),
    ("sm_scale", 0.0, ValueError, "positive finite"),
    ("sm_scale", -0.1, ValueError, "positive finite"),
    ("sm_scale", math.nan, ValueError, "positive finite"),
    ("sm_scale", math.inf, ValueError, "positive finite"),
    ("sm_scale", "0.07", ValueError, "positive finite"),
    ("q_data_type", torch.float32, TypeError, "bfloat16"),
    ("q_data_type", torch.float8_e4m3fn, TypeError, "bfloat16"),
    ("q_data_type", "bf16", TypeError, "bfloat16"),
    ("kv_data_type", torch.float32, TypeError, "float8_e4m3fn"),
    ("kv_data_type", "fp4", ValueError, "fp8_e4m3_group"),
    ("kv_data_type", None, ValueError, "format name"),
])
def test_plan_rejects(name, value, exc, words):
    with pytest.raises(exc) as e:
        _plan(**{name: value})
    msg = str(e.value)
    assert name in msg and words in msg, msg


def test_plan_negative_page_id_outside_kv_len_is_ignored():
    """Page slots past ceil(kv_len / page) are never read, so padding ids there (like -1) are allowed."""
    _plan(kv_indices=_t([0, 1, 2, 3, 4, -1]), kv_indptr=_t([0, 3, 6]), kv_len_arr=_t([33, 17]))
    with pytest.raises(ValueError, match="kv_indices"):  # but not inside the used range
        _plan(kv_indices=_t([0, 1, 2, 3, -1, 4]), kv_indptr=_t([0, 3, 6]), kv_len_arr=_t([33, 17]))


def test_plan_group_format_needs_multiple_of_128():
    with pytest.raises(ValueError, match="head_dim_ckv"):
        _plan(kv_data_type="fp8_e4m3_group", head_dim_ckv=192)


def test_constructor_rejects_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        MLAPagedAttention(backend="cuda")
    with pytest.raises(TypeError, match="float_workspace_buffer"):
        MLAPagedAttention(float_workspace_buffer=123)


# -- run() -------------------------------------------------------------------------------------------------
def _planned(kv_format="fp8_e4m3", **kw):
    pb = _batch(kv_format, **kw)
    attn = MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    return attn, pb


def _poisoned(n=4, H=16):
    return (torch.full((n, H, 512), math.nan, dtype=torch.bfloat16, device=DEVICE),
            torch.full((n, H), math.nan, device=DEVICE))


def _run_rejects(attn, run_args, exc, name, *words, **changes):
    """run() with ``changes`` raises ``exc`` naming ``name`` and writes nothing into out/lse."""
    out, lse = _poisoned()
    args = dict(run_args, out=out, lse=lse)
    args.update(changes)
    with pytest.raises(exc) as e:
        attn.run(**args)
    msg = str(e.value)
    assert name in msg, msg
    for w in words:
        assert w in msg, msg
    if "out" not in changes and "lse" not in changes:
        assert torch.isnan(out).all() and torch.isnan(lse).all(), "run() wrote before refusing"
    return msg


def test_run_before_plan():
    pb = _batch()
    with pytest.raises(RuntimeError, match="plan"):
        MLAPagedAttention(backend="torch").run(**pb.run_args)


def test_run_q_mismatch():
    attn, pb = _planned()
    r = pb.run_args
    q, qp = r["q_nope"], r["q_pe"]
    _run_rejects(attn, r, TypeError, "q_nope", "bfloat16", "float16", q_nope=q.half())
    _run_rejects(attn, r, TypeError, "q_pe", "bfloat16", "float32", q_pe=qp.float())
    _run_rejects(attn, r, ValueError, "q_nope", "[4, 16, 512]", q_nope=q[:3])           # tokens
    _run_rejects(attn, r, ValueError, "q_nope", "[4, 16, 512]", q_nope=q[:, :8])        # heads
    _run_rejects(attn, r, ValueError, "q_nope", "[4, 16, 512]", q_nope=q[..., :256])    # head_dim_ckv
    _run_rejects(attn, r, ValueError, "q_pe", "[4, 16, 64]", q_pe=qp[..., :32])
    _run_rejects(attn, r, ValueError, "q_pe", "[4, 16, 64]", q_pe=qp[None])
    _run_rejects(attn, r, ValueError, "q_nope", "on meta", q_nope=torch.empty_like(q, device="meta"))
    _run_rejects(attn, r, ValueError, "q_pe", "on meta", q_pe=torch.empty_like(qp, device="meta"))
    strided = torch.empty(4, 16, 1024, dtype=q.dtype, device=DEVICE)[..., ::2]
    _run_rejects(attn, r, ValueError, "q_nope", "contiguous", q_nope=strided)
    _run_rejects(attn, r, TypeError, "q_nope", "Tensor", q_nope=q.tolist())


def test_run_cache_mismatch():
    attn, pb = _planned("fp8_e4m3")
    r = pb.run_args
    ckv, kpe = r["ckv_cache"], r["kpe_cache"]
    # The pool's dtype must be the planned kv_data_type: reading e5m2 bits as e4m3 is a silent wrong answer.
    _run_rejects(attn, r, TypeError, "ckv_cache", "float8_e4m3fn", "float8_e5m2",
                 ckv_cache=ckv.float().to(torch.float8_e5m2))
    _run_rejects(attn, r, TypeError, "ckv_cache", "float8_e4m3fn", "bfloat16", ckv_cache=ckv.to(torch.bfloat16))
    _run_rejects(attn, r, TypeError, "kpe_cache", "float8_e4m3fn", kpe_cache=kpe.to(torch.bfloat16))
    # page_size: the same tokens viewed as pages of 8 (or 32) are other slots
    P = ckv.shape[0]
    _run_rejects(attn, r, ValueError, "ckv_cache", "[*, 16, 512]", ckv_cache=ckv.reshape(P * 2, 8, 512))
    _run_rejects(attn, r, ValueError, "kpe_cache", "16", kpe_cache=kpe.contiguous().reshape(P * 2, 8, 64))
    _run_rejects(attn, r, ValueError, "kpe_cache", f"[{P}, 16, 64]", kpe_cache=kpe[:-1])
    _run_rejects(attn, r, ValueError, "ckv_cache", "[*, 16, 512]", ckv_cache=ckv[..., :256])
    _run_rejects(attn, r, ValueError, "ckv_cache", "on meta", ckv_cache=torch.empty_like(ckv, device="meta"))
    # Fewer pages than the plan references: the largest referenced page id must be < num_pages.
    max_page = max(pb.plan_args["kv_indices"].tolist())
    _run_rejects(attn, r, ValueError, "kv_indices", f"page {max_page}", f"{max_page} pages",
                 ckv_cache=ckv[:max_page], kpe_cache=kpe[:max_page])


def test_run_scales():
    attn, pb = _planned("fp8_e4m3")
    r = pb.run_args
    # FlashInfer passes group scales under the plain e4m3 dtype: exactly one of ckv_scale / ckv_scale_arr.
    _run_rejects(attn, r, ValueError, "ckv_scale", "exactly one", ckv_scale=0.5,
                 ckv_scale_arr=torch.ones(r["ckv_cache"].shape[0], 16, 4, device=DEVICE))
    _run_rejects(attn, r, ValueError, "ckv_scale", "got neither", ckv_scale=None)  # never a silent 1.0
    # FlashInfer's own test (test_fp8_kv_requires_scales) matches this phrase: both scales missing, or either
    fi_words = "ckv_scale and kpe_scale are required"
    _run_rejects(attn, r, ValueError, "ckv_scale", fi_words, ckv_scale=None, kpe_scale=None)
    _run_rejects(attn, r, ValueError, "kpe_scale", fi_words, "got kpe_scale=None", kpe_scale=None)
    _run_rejects(attn, r, ValueError, "ckv_scale", "positive", ckv_scale=0.0)
    _run_rejects(attn, r, ValueError, "kpe_scale", "positive", kpe_scale=-1.0)
    _run_rejects(attn, r, ValueError, "kpe_scale", "positive", kpe_scale=math.nan)
    _run_rejects(attn, r, ValueError, "ckv_scale", "fp32", ckv_scale=torch.tensor(1.0, dtype=torch.float64))
    _run_rejects(attn, r, ValueError, "ckv_scale", "1-element", ckv_scale=torch.ones(2, device=DEVICE))
    _run_rejects(attn, r, ValueError, "ckv_scale", "on", ckv_scale=torch.ones((), device="meta"))

    attn, pb = _planned("fp8_e4m3_group")
    r = pb.run_args
    P = r["ckv_cache"].shape[0]
    _run_rejects(attn, r, ValueError, "ckv_scale_arr", "None", ckv_scale_arr=None)
    _run_rejects(attn, r, TypeError, "ckv_scale_arr", "float32", ckv_scale_arr=r["ckv_scale_arr"].double())
    _run_rejects(attn, r, ValueError, "ckv_scale_arr", f"[{P}, 16, 4]", ckv_scale_arr=r["ckv_scale_arr"][..., :2])
    _run_rejects(attn, r, ValueError, "ckv_scale_arr", f"[{P}, 16, 4]", ckv_scale_arr=r["ckv_scale_arr"][:-1])
    _run_rejects(attn, r, ValueError, "ckv_scale", "exactly one", ckv_scale=0.5)  # c_kv has group scales

    attn, pb = _planned("bf16")
    r = pb.run_args
    _run_rejects(attn, r, ValueError, "ckv_scale", "bf16", ckv_scale=2.0)
    _run_rejects(attn, r, ValueError, "kpe_scale", "bf16", kpe_scale=torch.tensor(1.0, device=DEVICE))
    attn.run(**dict(r, ckv_scale=1.0, kpe_scale=None))  # 1.0 and None mean "no scale": accepted


def test_run_out_lse_buffers():
    attn, pb = _planned()
    r = pb.run_args
    out, lse = _poisoned()
    _run_rejects(attn, r, TypeError, "out", "bfloat16", out=out.half())
    _run_rejects(attn, r, TypeError, "out", "bfloat16", out=out.float())
    _run_rejects(attn, r, ValueError, "out", "[4, 16, 512]", out=out[:3])
    _run_rejects(attn, r, ValueError, "out", "[4, 16, 512]", out=out.reshape(4, 32, 256))
    _run_rejects(attn, r, ValueError, "out", "on meta", out=torch.empty_like(out, device="meta"))
    _run_rejects(attn, r, TypeError, "lse", "float32", lse=lse.double())
    _run_rejects(attn, r, TypeError, "lse", "float32", lse=lse.bfloat16())
    _run_rejects(attn, r, ValueError, "lse", "[4, 16]", lse=lse[:, :8])
    _run_rejects(attn, r, ValueError, "lse", "[4, 16]", lse=lse[..., None])
    # After refusals the plan still works.
    got = attn.run(**r, out=out, lse=lse, return_lse=True)
    assert got[0] is out and not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_replan_replaces_the_plan():
    """run() checks against the latest plan: tensors of an older plan are refused."""
    attn, pb = _planned()
    pb2 = make_paged_batch([5], [2], 8, 16, "fp8_e4m3", device=DEVICE, seed=1)
    attn.plan(**pb2.plan_args)
    with pytest.raises(ValueError, match="q_nope"):
        attn.run(**pb.run_args)
    attn.run(**pb2.run_args)


# -- the cache -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("num_layers", 0), ("num_pages", -1), ("page_size", 0), ("page_size", 1.5), ("head_dim_ckv", 0),
    ("head_dim_kpe", -64), ("ckv_scale", 0.0), ("ckv_scale", -1.0), ("kpe_scale", math.inf),
    ("kpe_scale", math.nan), ("kpe_scale", "1"),
])
def test_cache_constructor_rejects(name, value):
    args = dict(num_layers=2, num_pages=4, page_size=16)
    with pytest.raises(ValueError, match=name):
        PagedMLACache(**{**args, name: value})


def test_cache_constructor_format():
    with pytest.raises(ValueError, match="kv_format"):
        PagedMLACache(1, 4, 16, "int8")
    with pytest.raises(TypeError, match="kv_format"):
        PagedMLACache(1, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim_ckv"):
        PagedMLACache(1, 4, 16, "fp8_e4m3_group", head_dim_ckv=100)


def test_from_memory_budget_rejects():
    with pytest.raises(ValueError, match="budget_bytes"):
        PagedMLACache.from_memory_budget(1000, num_layers=2, page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        PagedMLACache.from_memory_budget(10**9, num_layers=2, page_size=0)
    with pytest.raises(ValueError, match="num_layers"):
        PagedMLACache.from_memory_budget(10**9, num_layers=0, page_size=16)


def test_cache_sequence_errors():
    cache = PagedMLACache(2, 4, 16, device=DEVICE)
    s = cache.add_sequence(num_tokens=3)
    with pytest.raises(ValueError, match="seq_id"):
        cache.add_sequence(s)
    for call in (lambda: cache.reserve(99, 1), lambda: cache.free(99), lambda: cache.fork(99),
                 lambda: cache.seq_len(99), lambda: cache.plan_inputs([s, 99]), lambda: cache.pending_slots([99])):
        with pytest.raises(KeyError, match="seq_id"):
            call()
    with pytest.raises(ValueError, match="num_tokens"):
        cache.reserve(s, -1)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.reserve(s, 1.0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.reserve([s], [1, 2])
    with pytest.raises(ValueError, match="seq_ids"):
        cache.reserve([s, s], 1)
    with pytest.raises(ValueError, match="qo_lens"):
        cache.plan_inputs([s], qo_lens=[1, 1])
    # a full pool: a clear error, nothing reserved
    with pytest.raises(OutOfPagesError, match="full"):
        cache.reserve(s, 4 * 16)
    assert cache.seq_len(s) == 3 and cache.num_free_pages == 3
    with pytest.raises(OutOfPagesError):
        cache.add_sequence("big", num_tokens=4 * 16)
    assert "big" not in cache.sequences


def test_cache_write_errors():
    cache = PagedMLACache(2, 4, 16, device=DEVICE)
    s = cache.add_sequence(num_tokens=3)
    c, k = torch.randn(3, 512, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="layer"):
        cache.append(2, [s], c, k)
    with pytest.raises(ValueError, match="layer"):
        cache.ckv_cache(-1)
    with pytest.raises(ValueError, match="c_kv"):
        cache.append(0, [s], c[:2], k[:2])  # 3 tokens reserved
    with pytest.raises(ValueError, match="k_pe"):
        cache.append(0, [s], c, k[:, :32])
    with pytest.raises(TypeError, match="c_kv"):
        cache.append(0, [s], c.long(), k)
    with pytest.raises(ValueError, match="c_kv"):
        cache.append(0, [s], c.to("meta"), k)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.write(0, torch.tensor([0, 64], device=DEVICE), c[:2], k[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.write(0, torch.tensor([-1], device=DEVICE), c[:1], k[:1])
    with pytest.raises(TypeError, match="slot_mapping"):
        cache.write(0, torch.tensor([0.0], device=DEVICE), c[:1], k[:1])
    assert (cache.pool.float() == 0).all(), "a refused write changed the pool"


# -- misuse that used to give a silent wrong answer (each test failed before its fix) -----------------------------
def test_int64_block_table_past_int32_is_refused_not_wrapped():
    """An int64 table holding page p + 2**32 was cast to int32 before it was checked, and read as page p."""
    from fp8mla.layout import PagedLayout
    pb = _batch()
    pages = pb.plan_args["kv_indices"][:3].long()
    bt = torch.stack([pages, pages]).cpu()
    lens = torch.tensor([33, 20])
    PagedLayout.from_block_table(bt, lens, 16)  # fine as it is
    for bad in (2**32, -2**32):
        wrapped = bt.clone()
        wrapped[1, 1] += bad
        with pytest.raises(ValueError, match=r"block_table: request 1 references page -?42949672\d\d"):
            PagedLayout.from_block_table(wrapped, lens, 16)
    # FlashInfer's arrays: the same check, naming kv_indices. A host check, so host arrays (on a GPU DEVICE is
    # CUDA, and a device table is not read on the host: test_int64_device_table_is_clamped_not_wrapped)
    host = make_paged_batch([33, 17], [1, 3], 16, 16, "fp8_e4m3", device="cpu", seed=0)
    idx = host.plan_args["kv_indices"].long().clone()
    idx[1] += 2**32
    with pytest.raises(ValueError, match=r"kv_indices: request 0 references page 42949672\d\d"):
        MLAPagedAttention(backend="torch").plan(**{**host.plan_args, "kv_indices": idx})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device table needs CUDA")
def test_int64_device_table_is_clamped_not_wrapped(monkeypatch):
    """The device case of the test above: an int64 CUDA kv_indices is not read on the host (no sync, no refusal
    without FP8MLA_CHECK=1); its page p + 2**32 becomes int32's largest id (outside every pool, never read), not
    page p."""
    from fp8mla.layout import INT32_MAX, PagedLayout
    monkeypatch.delenv("FP8MLA_CHECK", raising=False)
    a = make_paged_batch([33, 17], [1, 3], 16, 16, "fp8_e4m3", device="cuda", seed=0).plan_args
    idx = a["kv_indices"].long().clone()
    idx[1] += 2**32
    idx[2] -= 2**32
    lay = PagedLayout.from_csr(a["qo_indptr"], a["kv_indptr"], idx, a["kv_len_arr"], 16)
    want = a["kv_indices"].to(torch.int32).clone()
    want[1], want[2] = INT32_MAX, -INT32_MAX - 1
    assert lay.kv_indices.dtype == torch.int32 and lay.kv_indices.is_cuda
    assert torch.equal(lay.kv_indices, want)
    # the torch backend reads its tables on the host (by design): it refuses the clamped id by name, never page p
    with pytest.raises(ValueError, match=r"kv_indices: request 0 references page -2147483648"):
        MLAPagedAttention(backend="torch").plan(**{**a, "kv_indices": idx})


def test_int64_ids_saturate_on_the_way_to_int32():
    """Device tables are not read on the host: their int64 ids become int32 clamped, never wrapped, so page
    p + 2**32 stays outside the pool (a kernel never reads it) instead of becoming page p."""
    from fp8mla.layout import int32_saturated
    t = torch.tensor([5, 2**32 + 5, -2**32 + 5, -1, 2**31 - 1])
    assert int32_saturated(t).tolist() == [5, 2**31 - 1, -2**31, -1, 2**31 - 1]
    assert int32_saturated(t).dtype == torch.int32
    i32 = torch.tensor([1, 2], dtype=torch.int32)
    assert int32_saturated(i32) is i32


def test_understated_page_id_hint_is_refused(backend):
    """``max_page_id`` (the largest page id, when the caller knows it) below the table's: a named error, not NaN
    (triton) or an IndexError (torch)."""
    from fp8mla.layout import PagedLayout
    pb = _batch()
    a = pb.plan_args
    hi = int(a["kv_indices"].max())
    host = [a[k].cpu() for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")]
    PagedLayout.from_csr(*host, 16, max_page_id=hi)  # an exact hint is taken as given
    with pytest.raises(ValueError, match=rf"max_page_id: .*{hi - 1}.*page {hi}"):
        PagedLayout.from_csr(*host, 16, max_page_id=hi - 1)
    # a hint that misses a page past the pool: refused at plan time, before any kernel reads the page
    idx = host[2].clone()
    idx[0] = pb.pool.shape[0] + 5
    with pytest.raises(ValueError, match="max_page_id"):
        lay = PagedLayout.from_csr(host[0], host[1], idx, host[3], 16, max_page_id=hi, device=DEVICE)
        attn = MLAPagedAttention(backend=backend)
        attn.plan_layout(lay, 16, 512, 64, True, pb.plan_args["sm_scale"], torch.bfloat16, "fp8_e4m3")
        out = attn.run(**pb.run_args)
        assert not torch.isnan(out).any()
    # ids outside the used range (padding, unused slots) do not count against the hint
    idx = torch.cat([host[2][:3], torch.tensor([10**6], dtype=host[2].dtype), host[2][3:]])
    kvp = torch.tensor([0, 4, 6], dtype=host[1].dtype)
    PagedLayout.from_csr(host[0], kvp, idx, host[3], 16, max_page_id=hi)


@pytest.mark.parametrize("merge_backend", BACKEND_PARAMS)
def test_merge_state_with_value_dim_0_merges_the_lse(merge_backend):
    """A value dimension of 0 still has log-sum-exps to merge (they were left uninitialized)."""
    from fp8mla.ragged import merge_state
    g = torch.Generator().manual_seed(3)
    s_a, s_b = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    s_b[0, 0] = -math.inf
    v = torch.zeros(5, 3, 0, device=DEVICE)
    out, s = merge_state(v, s_a.to(DEVICE), v.clone(), s_b.to(DEVICE), backend=merge_backend)
    want = torch.logaddexp2(s_a.double(), s_b.double())
    assert out.shape == (5, 3, 0)
    torch.testing.assert_close(s.cpu().double(), want, rtol=1e-6, atol=1e-6)
    from fp8mla.ragged import merge_state_in_place
    s_in = s_a.to(DEVICE).clone()
    merge_state_in_place(v, s_in, v.clone(), s_b.to(DEVICE), backend=merge_backend)
    torch.testing.assert_close(s_in.cpu().double(), want, rtol=1e-6, atol=1e-6)


# -- unclear errors made clear ----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_layout_on_cuda_without_cuda_names_the_device():
    """Was a bare AssertionError ("Torch not compiled with CUDA enabled")."""
    from fp8mla.layout import PagedLayout
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for make in (lambda d: PagedLayout.from_csr(t([0, 1]), t([0, 1]), t([0]), t([5]), 16, device=d),
                 lambda d: PagedLayout.from_block_table(t([[0]]), t([5]), 16, device=d),
                 lambda d: PagedLayout.decode_rows(t([[0]]), [5], 16, device=d)):
        for d in ("cuda", "cuda:1", torch.device("cuda", 0)):
            with pytest.raises(ValueError, match=r"device: .*no CUDA device.*expected 'cpu'"):
                make(d)
        with pytest.raises(ValueError, match="device: expected a torch device"):
            make("gpu0")
        assert make("cpu").device == torch.device("cpu")


def test_tuple_seq_id_is_refused_by_name():
    """A tuple id used to be accepted, then read as the list of ids it holds (a misleading KeyError)."""
    cache = PagedMLACache(1, 4, 4, "bf16", head_dim_ckv=128, head_dim_kpe=16)
    for call in (lambda: cache.add_sequence((1, 2)), lambda: cache.seq_len((1, 2)), lambda: cache.free((1,)),
                 lambda: cache.fork(cache.add_sequence(), (3, 4))):
        with pytest.raises(TypeError, match=r"seq_id: expected an int or a str, got a tuple"):
            call()
    assert cache.add_sequence("a") == "a" and cache.add_sequence(7) == 7
    assert cache.reserve(("a", 7), 1).numel() == 2  # a tuple of ids is still a list of ids
