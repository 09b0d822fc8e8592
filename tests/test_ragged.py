"""MLARaggedPrefill (torch and Triton backends) and merge_state against float64 references: varlen batches with
empty and length-1 requests, causal with more queries than keys, GQA, odd head dims, poisoned outputs; merging
against attention over the concatenation. Triton runs under TRITON_INTERPRET=1 on the CPU (small sizes)."""
from __future__ import annotations

import math

import pytest
import torch

from fp8mla.ragged import MLARaggedPrefill, merge_state, merge_state_in_place
from fp8mla.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or __import__("os").environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="triton cannot run"))]
LOG2E = 1.0 / math.log(2.0)


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def ragged_reference(q, k, v, qo_lens, kv_lens, causal, sm_scale):
    """float64 ``(out [n, Hq, Dv], lse [n, Hq] base 2)``; a query that sees no key gets 0 and -inf."""
    n, Hq, _ = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(n, Hq, v.shape[2], dtype=torch.float64)
    lse = torch.full((n, Hq), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for nq, nk in zip(qo_lens, kv_lens):
        if nq and nk:
            qq = q[q0:q0 + nq].cpu().double()
            kk = k[k0:k0 + nk].cpu().double().repeat_interleave(G, dim=1)
            vv = v[k0:k0 + nk].cpu().double().repeat_interleave(G, dim=1)
            s = torch.einsum("qhd,khd->qhk", qq, kk) * sm_scale
            if causal:
                hidden = torch.arange(nk)[None, :] > (nk - nq + torch.arange(nq))[:, None]
                s = s.masked_fill(hidden[:, None, :], -math.inf)
            seen = torch.isfinite(s.amax(-1))
            p = torch.softmax(torch.where(seen[..., None], s, 0.0), -1) * seen[..., None]
            out[q0:q0 + nq] = torch.einsum("qhk,khd->qhd", torch.where(torch.isnan(p), 0.0, p), vv)
            lse[q0:q0 + nq] = torch.where(seen, torch.logsumexp(s, -1) * LOG2E, -math.inf)
        q0, k0 = q0 + nq, k0 + nk
    return out, lse


def run(backend, qo_lens, kv_lens, Hq, Hk, Dqk, Dv, causal, q_dtype=torch.bfloat16, seed=0, base_e=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qo_lens), Hq, Dqk, generator=g).to(DEVICE, q_dtype)
    k = torch.randn(sum(kv_lens), Hk, Dqk, generator=g).to(DEVICE, q_dtype)
    v = torch.randn(sum(kv_lens), Hk, Dv, generator=g).to(DEVICE, q_dtype)
    sm = Dqk ** -0.5
    w = MLARaggedPrefill(backend=backend)
    w.plan(indptr(qo_lens), indptr(kv_lens), Hq, Hk, Dqk, Dv, causal=causal, sm_scale=sm, q_data_type=q_dtype)
    assert w.backend == backend
    out = torch.full((q.shape[0], Hq, Dv), float("nan"), dtype=q_dtype, device=DEVICE)
    lse = torch.full((q.shape[0], Hq), float("nan"), device=DEVICE)
    res = w.run(q, k, v, out=out, lse=lse, return_lse=True, return_lse_base_on_e=base_e)
    assert res[0] is out and res[1] is lse
    ref_o, ref_l = ragged_reference(q, k, v, qo_lens, kv_lens, causal, sm)
    if base_e:
        ref_l = ref_l / LOG2E
    return out, lse, ref_o, ref_l


# (qo_lens, kv_lens): empty requests, length 1, more queries than keys, block-boundary sizes
CASES = [([3, 0, 40, 1, 5], [5, 7, 40, 1, 0]),
         ([1, 33, 2], [1, 97, 17])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", [(192, 128), (40, 24)], ids=["192-128", "40-24"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_ragged_matches_reference(backend, causal, dims, case):
    qo_lens, kv_lens = CASES[case]
    out, lse, ref_o, ref_l = run(backend, qo_lens, kv_lens, 4, 2, *dims, causal, seed=case)
    assert_close(out, ref_o, 8e-3, "out")
    assert_close(lse, ref_l, 1e-5, "lse")
    # a request with kv_len 0 (or a causal query before every key) gives 0 and -inf, never NaN
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_mha_and_lse_base_e(backend):
    out, lse, ref_o, ref_l = run(backend, [7, 20], [30, 20], 3, 3, 64, 64, True, q_dtype=torch.float16,
                                 seed=5, base_e=True)
    assert out.dtype == torch.float16
    assert_close(out, ref_o, 5e-3, "out")
    assert_close(lse, ref_l, 1e-5, "lse")


@pytest.mark.skipif(DEVICE != "cuda", reason="large case on the GPU only")
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_triton_large_gpu(causal):
    out, lse, ref_o, ref_l = run("triton", [1000, 1, 513], [1500, 1, 513], 16, 16, 192, 128, causal, seed=9)
    assert_close(out, ref_o, 5e-3, "out")
    assert_close(lse, ref_l, 1e-5, "lse")


def test_validation_names_the_argument():
    w = MLARaggedPrefill(backend="torch")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16))
    ip = indptr([2, 3])
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(ip, ip, 3, 2, 16, 16)
    with pytest.raises(ValueError, match="kv_indptr"):
        w.plan(ip, indptr([1]), 2, 2, 16, 16)
    with pytest.raises(TypeError, match="kv_data_type"):
        w.plan(ip, ip, 2, 2, 16, 16, kv_data_type=torch.float8_e4m3fn)
    w.plan(ip, ip, 4, 2, 16, 8, causal=True, q_data_type=torch.bfloat16)
    q = torch.zeros(5, 4, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(5, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    v = torch.zeros(5, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="q: expected dtype torch.bfloat16"):
        w.run(q.half(), k, v)
    with pytest.raises(ValueError, match=r"v: expected shape \[5, 2, 8\]"):
        w.run(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="lse"):
        w.run(q, k, v, lse=torch.zeros(5, 3, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        MLARaggedPrefill(backend="cuda")


# -- merge_state ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_matches_attention_over_concatenation(backend):
    """Attention over [prefix | new] == merge(attention over prefix, causal attention over new)."""
    g = torch.Generator().manual_seed(11)
    new, prefix, H, D = [4, 0, 9, 1], [6, 3, 0, 17], 4, 64
    q = torch.randn(sum(new), H, D, generator=g).to(DEVICE, torch.bfloat16)
    kn = torch.randn(sum(new), H, D, generator=g).to(DEVICE, torch.bfloat16)
    vn = torch.randn(sum(new), H, D, generator=g).to(DEVICE, torch.bfloat16)
    kp = torch.randn(sum(prefix), H, D, generator=g).to(DEVICE, torch.bfloat16)
    vp = torch.randn(sum(prefix), H, D, generator=g).to(DEVICE, torch.bfloat16)
    w = MLARaggedPrefill(backend="torch")
    w.plan(indptr(new), indptr(new), H, H, D, causal=True, q_data_type=torch.bfloat16)
    o_new, s_new = w.run(q, kn, vn, return_lse=True)
    w.plan(indptr(new), indptr(prefix), H, H, D, causal=False, q_data_type=torch.bfloat16)
    o_pre, s_pre = w.run(q, kp, vp, return_lse=True)
    o, s = merge_state(o_pre.float(), s_pre, o_new.float(), s_new, backend=backend)
    # reference: one causal attention per request over the concatenated keys [prefix | new]
    cat_k, cat_v, lens, p0, n0 = [], [], [], 0, 0
    for a, b in zip(prefix, new):
        cat_k += [kp[p0:p0 + a], kn[n0:n0 + b]]
        cat_v += [vp[p0:p0 + a], vn[n0:n0 + b]]
        lens.append(a + b)
        p0, n0 = p0 + a, n0 + b
    ref_o, ref_l = ragged_reference(q, torch.cat(cat_k), torch.cat(cat_v), new, lens, True, D ** -0.5)
    assert_close(o, ref_o, 5e-3, "v")
    assert_close(s, ref_l, 1e-5, "s")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_empty_states(backend, dtype):
    n, H, D = 5, 3, 40
    g = torch.Generator().manual_seed(3)
    v_a = torch.randn(n, H, D, generator=g).to(DEVICE, dtype)
    v_b = torch.randn(n, H, D, generator=g).to(DEVICE, dtype)
    s_a = torch.randn(n, H, generator=g).to(DEVICE)
    s_b = torch.randn(n, H, generator=g).to(DEVICE)
    s_b[0] = -math.inf                     # b empty: identity
    v_b[0] = float("nan")                  # an empty state's v is ignored, even NaN
    s_a[1] = -math.inf                     # a empty
    s_a[2] = s_b[2] = -math.inf            # both empty: 0 / -inf
    v, s = merge_state(v_a, s_a, v_b, s_b, backend=backend)
    assert v.dtype == dtype and s.dtype == torch.float32
    assert torch.equal(v[0], v_a[0]) and torch.equal(s[0], s_a[0])
    assert torch.equal(v[1], v_b[1]) and torch.equal(s[1], s_b[1])
    assert (v[2] == 0).all() and (s[2] == -math.inf).all()
    m = torch.maximum(s_a[3:], s_b[3:]).double()
    wa, wb = torch.exp2(s_a[3:].double() - m), torch.exp2(s_b[3:].double() - m)
    ref = (v_a[3:].double() * wa[..., None] + v_b[3:].double() * wb[..., None]) / (wa + wb)[..., None]
    assert_close(v[3:], ref, 5e-3 if dtype == torch.bfloat16 else 1e-6, "v")
    assert_close(s[3:], m + torch.log2(wa + wb), 1e-6, "s")
    # in place gives the same
    merge_state_in_place(v_a, s_a, v_b, s_b, backend=backend)
    assert torch.equal(v_a, v) and torch.equal(s_a, s)


def test_merge_validation():
    v, s = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="s_b: expected shape"):
        merge_state(v, s, v, s[:1])
    with pytest.raises(TypeError, match="v_b: expected dtype"):
        merge_state(v, s, v.half(), s)


# -- bad input: NaN in gives NaN out, strides, named errors ------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_gives_nan_out(backend):
    """NaN in a query row, or in one channel of one used key / value, gives NaN rows (out and lse), never out 0
    with lse -inf; other requests are untouched; a request without keys still answers 0 / -inf."""
    qo_lens, kv_lens = [5, 4, 2], [9, 6, 0]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(11, 2, 24, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(15, 2, 24, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(15, 2, 16, generator=g).to(DEVICE, torch.bfloat16)
    w = MLARaggedPrefill(backend=backend)
    w.plan(indptr(qo_lens), indptr(kv_lens), 2, 2, 24, 16, causal=True, sm_scale=0.2)

    def run_(q, k, v):
        out, lse = w.run(q, k, v, return_lse=True)
        return out.float().cpu(), lse.cpu()

    clean_o, clean_l = run_(q, k, v)
    q2 = q.clone()
    q2[1, 0, 3] = math.nan
    out, lse = run_(q2, k, v)
    assert torch.isnan(lse[1, 0]) and torch.isnan(out[1, 0]).all()
    assert torch.equal(out[5:], clean_o[5:]) and torch.equal(lse[1, 1], clean_l[1, 1])
    for which in ("k", "v"):
        kk, vv = k.clone(), v.clone()
        (kk if which == "k" else vv)[9, 1, 2] = math.nan   # request 1's first key: all its queries see it
        out, lse = run_(q, kk, vv)
        assert torch.isnan(out[5:9, 1]).any(dim=-1).all(), which
        if which == "k":
            assert torch.isnan(lse[5:9, 1]).all()
        assert torch.equal(out[:5], clean_o[:5]) and torch.equal(out[9:], clean_o[9:])
        assert (out[9:] == 0).all() and (lse[9:] == -math.inf).all()


@pytest.mark.skipif(not TRITON_OK, reason="triton cannot run")
def test_triton_launcher_strides_and_named_errors():
    """lse may have any strides (a transposed lse used to be silently wrong); a strided out, a non-power-of-two
    block_n or a small block_m are ValueErrors naming the argument."""
    from fp8mla.kernels.ragged import ragged_prefill
    qo, kv = indptr([7, 3]), indptr([9, 3])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(10, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(12, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(12, 2, 32, generator=g).to(DEVICE, torch.bfloat16)
    fp32 = DEVICE == "cpu"
    kw = dict(sm_scale=0.2, causal=True, max_qo_len=7, fp32_dot=fp32)
    out = torch.empty(10, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(10, 2, device=DEVICE)
    ragged_prefill(q, k, v, qo, kv, out, lse, **kw)
    lse_t = torch.full((2, 10), math.nan, device=DEVICE).t()
    out2 = torch.empty_like(out)
    ragged_prefill(q, k, v, qo, kv, out2, lse_t, **kw)
    assert torch.equal(lse_t, lse) and torch.equal(out2, out)
    bad_out = torch.empty(32, 2, 10, dtype=torch.bfloat16, device=DEVICE).permute(2, 1, 0)
    with pytest.raises(ValueError, match="out"):
        ragged_prefill(q, k, v, qo, kv, bad_out, lse, **kw)
    for bad, name in ((dict(block_n=48), "block_n"), (dict(block_m=8), "block_m")):
        with pytest.raises(ValueError, match=name):
            ragged_prefill(q, k, v, qo, kv, out, lse, **kw, **bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_propagates_nan(backend):
    """merge_state(v_a, s_a=NaN, v_b, s_b=2) is NaN (it used to return state b alone); a NaN in an empty state's
    v (s = -inf) is still ignored."""
    v_a = torch.randn(3, 2, 8, device=DEVICE)
    v_b = torch.randn(3, 2, 8, device=DEVICE)
    s_a = torch.tensor([[math.nan, 1.0], [0.5, -math.inf], [1.0, 1.0]], device=DEVICE)
    s_b = torch.tensor([[2.0, math.nan], [-math.inf, -math.inf], [2.0, 3.0]], device=DEVICE)
    v_a[1, 1] = math.nan   # empty state: ignored
    v_b[1, 0] = math.nan   # empty state: ignored
    v_a[2, 0, 3] = math.nan  # a NaN value in a non-empty state: its row is NaN there
    v, s = merge_state(v_a, s_a, v_b, s_b, backend=backend)
    v, s = v.cpu(), s.cpu()
    assert torch.isnan(s[0]).all() and torch.isnan(v[0]).all()
    assert s[1, 0] == 0.5 and torch.equal(v[1, 0], v_a[1, 0].cpu())
    assert s[1, 1] == -math.inf and (v[1, 1] == 0).all()
    assert torch.isnan(v[2, 0, 3]) and torch.isfinite(v[2, 1]).all()
    assert s[2, 1].item() == pytest.approx(math.log2(2.0 + 8.0), abs=1e-5)
