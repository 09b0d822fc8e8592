"""numpy and torch integer scalars are taken wherever the public API takes an int (``np.int64(3)`` is what numpy
arithmetic and ``array[i]`` give, a 0-d tensor what ``t.sum()`` and ``t[0]`` give); each used to be refused with
"expected ... ints". Bools, floats, 1-element non-scalar tensors and strings are still refused by name, and every
accepted value reaches the code as a plain int (a numpy int in a kernel constexpr or a tensor as a dict key would
be a new bug)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8mla
from fp8mla._checks import as_int, as_real, check_positive_int
from fp8mla.testing import assert_close, make_paged_batch

KINDS = {"np.int64": np.int64, "np.int32": np.int32, "np.uint16": np.uint16,
         "tensor": lambda v: torch.tensor(v), "tensor_i32": lambda v: torch.tensor(v, dtype=torch.int32)}


@pytest.fixture(params=list(KINDS))
def num(request):
    return KINDS[request.param]


@pytest.fixture(params=["np.int64", "tensor"])
def num2(request):
    """Two kinds, for the tests that run a model or a kernel."""
    return KINDS[request.param]


def test_helpers_take_integer_scalars_and_refuse_the_rest(num):
    v = as_int(num(7))
    assert v == 7 and type(v) is int
    assert check_positive_int("x", num(3)) == 3
    for bad in (True, np.bool_(True), 3.0, np.float64(3.0), "3", torch.tensor([3]), torch.tensor(3.0),
                torch.tensor(True), None, [3]):
        assert as_int(bad) is None, bad
    with pytest.raises(ValueError, match=r"x: expected a positive int, got np.int64\(0\)|x: expected a positive"):
        check_positive_int("x", np.int64(0))
    r = as_real(np.float32(0.5))
    assert r == 0.5 and type(r) is float
    assert as_real(True) is None and as_real("1") is None


def test_cache_takes_integer_scalars(num):
    cache = fp8mla.PagedMLACache(num(2), num(16), num(4), "fp8_e4m3", head_dim_ckv=num(128),
                                 head_dim_kpe=num(64), ckv_scale=np.float32(0.5))
    assert type(cache.page_size) is int and cache.ckv_scale == 0.5
    s = cache.add_sequence(num_tokens=num(3))  # "num_tokens: expected non-negative ints, got 3"
    t = cache.add_sequence(seq_id=num(41), num_tokens=num(5))
    assert type(t) is int and t == 41 and sorted(cache.sequences) == sorted([s, 41])
    assert cache.seq_len(s) == 3 and cache.seq_len(num(41)) == 5
    cache.reserve([s, t], [num(1), 2])
    cache.reserve(s, num(2))
    assert cache.seq_len(s) == 6 and cache.seq_len(t) == 7
    a = cache.plan_inputs([s, t], qo_lens=num(1))
    assert a["qo_indptr"].tolist() == [0, 1, 2]
    assert cache.kv_cache(num(1)).shape == cache.kv_cache(1).shape
    cache.free(num(41))
    assert cache.sequences == [s]
    with pytest.raises(ValueError, match="num_tokens: expected non-negative ints"):
        cache.reserve(s, np.float64(1.0))
    with pytest.raises(ValueError, match="num_tokens: expected non-negative ints"):
        cache.reserve(s, True)
    with pytest.raises(TypeError, match="seq_id: expected an int or a str, got a tensor"):
        cache.add_sequence(seq_id=torch.tensor([7]))


def test_memory_budget_takes_integer_scalars(num):
    cache = fp8mla.PagedMLACache.from_memory_budget(np.int64(1 << 20), num(2), num(16), "bf16",
                                                    head_dim_ckv=num(128))
    assert cache.num_pages == (1 << 20) // (2 * 16 * 2 * (128 + 64))


def test_attention_plan_and_run_take_integer_scalars(num2):
    num = num2
    pb = make_paged_batch([21, 5], [1, 2], 4, 16, "fp8_e4m3", seed=1, ckv_scale=0.5, kpe_scale=0.25)
    a = dict(pb.plan_args, num_heads=num(4), head_dim_ckv=num(512), head_dim_kpe=num(64), page_size=num(16),
             sm_scale=np.float32(pb.plan_args["sm_scale"]))
    attn = fp8mla.MLAPagedAttention(backend="torch", block_n=num(32), num_warps=num(4))
    attn.plan(**a)
    spec = attn._plan.spec
    assert all(type(x) is int for x in (spec.num_heads, spec.head_dim_ckv, spec.head_dim_kpe, spec.page_size))
    assert type(attn._kernel_options["block_n"]) is int and type(attn._kernel_options["num_warps"]) is int
    r = dict(pb.run_args, ckv_scale=np.float32(0.5), kpe_scale=np.float64(0.25))
    out = attn.run(**r, o_scale=np.int64(2))
    assert_close(out, 2 * pb.reference()[0].float(), 2e-2)
    with pytest.raises(ValueError, match="num_heads: expected a positive int"):
        attn.plan(**dict(a, num_heads=np.float64(4.0)))


def test_sparse_and_ragged_plan_take_integer_scalars(num):
    sp = fp8mla.MLASparseAttention(backend="torch")
    sp.plan(num(16), num(64), num(64), np.float64(0.1), torch.bfloat16, "fp8_ds_mla", num_pages=num(4),
            min_split=num(256), device="cpu")
    if "triton" in fp8mla.available_backends("cpu"):
        st = fp8mla.MLASparseAttention(backend="triton")
        st.plan(num(16), num(64), num(64), 0.1, torch.bfloat16, "fp8_e4m3", device="cpu", block_n=num(32),
                num_warps=num(4))
        assert type(st._plan.impl.config["block_n"]) is int and type(st._plan.impl.config["num_warps"]) is int
    from fp8mla.ragged import MLARaggedPrefill
    rp = MLARaggedPrefill(backend="torch")
    ind = torch.tensor([0, 3], dtype=torch.int32)
    rp.plan(ind, ind, num(4), num(4), num(192), head_dim_vo=num(128), causal=True)


def test_model_begin_step_takes_integer_scalars(num2):
    num = num2
    from fp8mla.models import DeepseekMLAModel
    m = DeepseekMLAModel.random("tiny", seed=3, dtype=torch.float32, num_layers=num(1))
    assert len(m.layers) == 1
    cache = m.make_cache(32, 4, "bf16")
    a, b = cache.add_sequence(), cache.add_sequence()
    st = m.begin_step(cache, [a, b], [num(3), num(1)])  # "num_tokens: expected positive ints"
    assert st.prefix_lens == [0, 0] and [cache.seq_len(s) for s in (a, b)] == [3, 1]
    x = m(torch.randn(4, m.cfg.hidden_size), st)
    assert x.shape == (4, m.cfg.hidden_size) and not torch.isnan(x).any()


def test_doctor_steps_and_sentinel_fraction_take_numpy_scalars(tmp_path):
    from fp8mla.tools.doctor import diagnose
    from fp8mla.tools.sentinel import forbid_pool_casts
    pool = torch.zeros(4, 8, 16, dtype=torch.float8_e4m3fn)
    assert forbid_pool_casts(pool, max_fraction=np.float32(0.5)).max_fraction == 0.5  # (entering it is slow)
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10, '
                     '"pid": 0, "tid": 0}]}')
    assert diagnose(str(trace), steps=np.int64(2)) is not None
