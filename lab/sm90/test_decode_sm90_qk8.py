"""FP8 scores in the Gluon decode kernel (``decode_sm90`` QK8 / QKC, behind ``GLUON_QK8`` / FP8MLA_GLUON_QK8; OFF:
kernel log 18 of docs/benchmarks.md measured it no faster and less exact than the default).

CPU: the e4m3 split of Q that the kernel does (2 terms hold any bf16 query exactly once scaled by a power of two,
fp16 needs 3; 2 terms are not enough for fp16), the compile for sm_90a (e4m3 x e4m3 QGMMA for the scores, the fp16
HGMMA for P.V only, no byte-wise shared loads in the loops, no wgmma serialization, shared memory), the shared-memory
rule that keeps fp16 queries at HPW 32 on the default kernel, the switch (off by default, env on/off) and the launch
arguments it routes, the refusal of a bad term count.
GPU (sm_90 with Gluon; skipped here, and not run on a GPU in this form: scripts/qk8_device.py ran the same checks
through ``launch``): float64 reference over NaN-poisoned shuffled pools through MLAPagedAttention with the switch on.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fp8mla
from fp8mla.backends import gluon as gb
from fp8mla.kernels import decode_sm90 as k
from conftest import compile_report_in_child
from fp8mla.testing import compare, make_paged_batch

ON_SM90 = torch.cuda.is_available() and "gluon" in fp8mla.available_backends("cuda")
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU with triton.experimental.gluon")


def _split(x: torch.Tensor, terms: int, amax=None) -> torch.Tensor:
    """The kernel's split of a head's query row(s) (fp32 math, e4m3 round-to-nearest per term): the sum of the terms.
    The power of two comes from ``amax``, the head's largest |q| (default: of ``x``'s last dim; the kernel takes it
    over q_nope and q_pe together)."""
    if amax is None:
        amax = x.float().abs().amax(-1, keepdim=True)
    amax = amax.clamp_min(1e-30)
    f = torch.exp2(torch.floor(torch.log2(256.0 / amax)))
    r = x.float() * f
    total = torch.zeros_like(r, dtype=torch.float64)
    for _ in range(terms):
        t = r.to(torch.float8_e4m3fn).float()
        total += t.double()
        r = r - t
    return total / f.double()


@pytest.mark.parametrize("dtype,terms,exact", [(torch.bfloat16, 2, True), (torch.float16, 3, True),
                                               (torch.float16, 2, False)])
def test_q_terms_hold_the_query(dtype, terms, exact):
    """2 e4m3 terms hold a bf16 query exactly (8 significant bits = 4 + 4), 3 an fp16 one (11); 2 do not hold fp16
    (the check can fail). Entries far below the row's largest underflow in the second term: compared on the rows'
    large entries, and the small ones within 2^-10 of the largest."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 576, generator=g) * torch.logspace(-2, 2, 64)[:, None]).to(dtype)
    assert k.qk8_terms(dtype) == (2 if dtype == torch.bfloat16 else 3)
    for row in x:
        got = _split(row, terms)
        big = row.float().abs() >= row.float().abs().max() * 2.0 ** -5
        err = (got - row.double()).abs()
        if exact:
            assert bool((err[big] == 0).all()), float(err[big].max())
            assert float(err.max()) <= float(row.float().abs().max()) * 2.0 ** -10
    if not exact:
        assert any(bool(((_split(r, terms) - r.double()).abs() > 0).any()) for r in x)


def test_smem_rule_keeps_fp16_wide_on_the_default(monkeypatch):
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "1")
    assert gb.plan_qk8(torch.bfloat16, 3, 16, False) == 2
    assert gb.plan_qk8(torch.float16, 3, 16, False) == 3
    assert gb.plan_qk8(torch.bfloat16, 3, 32, True) == 2
    assert gb.plan_qk8(torch.float16, 3, 32, True) == 0     # 3 terms x 2 consumers at HPW 32: over 227 KB
    assert k.smem_bytes(3, 32, True, 3) > k.SMEM_LIMIT >= k.smem_bytes(3, 32, True, 2)
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "0")
    assert gb.plan_qk8(torch.bfloat16, 3, 16, False) == 0


def test_ring_leaves_room_for_the_terms(monkeypatch):
    """At H <= 16 the default 3 stages become 4 where that fits (kernel log 25); with the switch on the depth must
    leave room for Q's terms (3, not 4), else the plan silently falls back to the default kernel (H200 2026-12-01:
    this test's GPU case saw qk8 0 at H16 after the even-depth change)."""
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "1")
    for dtype in (torch.bfloat16, torch.float16):
        ns = gb.plan_ring(3, 16, False, dtype)
        assert gb.plan_qk8(dtype, ns, 16, False) == k.qk8_terms(dtype), (dtype, ns)
    assert gb.plan_ring(3, 32, True, torch.bfloat16) == 3   # the wide variant keeps any depth
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "0")
    assert gb.plan_ring(3, 16, False, torch.bfloat16) == 4   # the default kernel: the deeper even ring
    assert gb.plan_ring(3, 16, False, torch.bfloat16, group=True) == 3   # 4 do not fit with the group tiles


def test_switch_is_off_by_default(monkeypatch):
    monkeypatch.delenv("FP8MLA_GLUON_QK8", raising=False)
    assert gb.GLUON_QK8 is False and not gb.qk8_enabled()
    monkeypatch.setattr(gb, "GLUON_QK8", True)
    assert gb.qk8_enabled()
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "0")
    assert not gb.qk8_enabled()


@pytest.mark.parametrize("H,qk8,max_qo,want", [(16, 0, 1, None), (16, 2, 1, (2, True)), (128, 2, 1, (2, False)),
                                                (8, 3, 1, (3, True)), (16, 2, 2, (2, False))])
def test_plan_routes_the_terms(monkeypatch, H, qk8, max_qo, want):
    """GluonPlan.run passes qk8 (and one accumulator per chunk on the H <= 16 one-query kernel only: the wide
    builds, MTP included, spill with five accumulators) only when the plan chose terms; the default launch gets no
    new keyword."""
    calls = []
    monkeypatch.setattr(k, "kv_descriptors", lambda a, b: ("kv", "kpe"))
    monkeypatch.setattr(k, "launch", lambda *a, **kw: calls.append(kw))
    spec = SimpleNamespace(num_heads=H, sm_scale=0.1, page_size=64, causal=True)
    plan = gb.GluonPlan(spec, 132, 8, 2, 256, 3, {}, max_qo, 0, qk8)
    pool = torch.zeros(4, 64, 576, dtype=torch.uint8)
    plan.run(None, None, pool[..., :512], pool[..., 512:], None, None, None, None, base_e=False)
    got = (calls[0]["qk8"], calls[0]["qk8_chunks"]) if "qk8" in calls[0] else None
    assert got == want


def test_launch_refuses_a_bad_term_count():
    q = torch.zeros(1, 16, 512)
    t = dict(part_o=torch.empty(1, 16, 512), part_lse=torch.empty(1, 16))
    with pytest.raises(ValueError, match="qk8"):
        k.launch(None, None, q, q, None, t, q, None, grid=132, grid_batch=1, max_rows=16, num_heads=16,
                 sm_scale=0.1, page_size=64, qk8=1)


@pytest.mark.usefixtures("sm90_compile_tools")
@pytest.mark.parametrize("heads,terms,chunks", [(16, 2, True), (16, 3, False), (128, 2, False)])
def test_compiles_for_sm90a(heads, terms, chunks):
    r, _ = compile_report_in_child(page=64, ns=3, heads=heads, qk8=terms, qk8_chunks=chunks, aligned_ints=True)
    qg = sum(n for op, n in r["ops"].items() if op.startswith("QGMMA"))
    hg = sum(n for op, n in r["ops"].items() if op.startswith("HGMMA"))
    # per consumer: scores (4 chunks x 4 k32 steps + 2 for k_pe) x terms in e4m3, P.V 8 chunks x 4 k16 steps in fp16
    assert qg == 2 * 18 * terms and hg == 2 * 32, r["ops"]
    assert not r["serialized_wgmma"], r["ptxas"]
    assert all(x["LDS.U8"] == 0 for x in r["loops"]), r["loops"]
    assert r["smem"] <= k.SMEM_LIMIT


# -- GPU --------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("H,page", [(16, 64), (16, 1), (128, 64)])
def test_matches_float64_over_nan_pools(monkeypatch, H, page):
    monkeypatch.setenv("FP8MLA_GLUON_QK8", "1")
    seen = []
    real = k.launch
    monkeypatch.setattr(k, "launch", lambda *a, **kw: (seen.append(kw.get("qk8", 0)), real(*a, **kw))[1])
    b = make_paged_batch([1, 63, 65, 97, 514, 0, 300], [1] * 7, H, page, "fp8_e4m3", causal=True, device="cuda",
                         seed=3, q_dtype=torch.bfloat16, ckv_scale=0.5, kpe_scale=0.25)
    attn = fp8mla.MLAPagedAttention(backend="gluon")
    attn.plan(**b.plan_args)
    out, lse = attn.run(**b.run_args, return_lse=True)
    ref_out, ref_lse = b.reference()
    assert seen == [2], seen   # the FP8-scores kernel ran (bf16 queries: 2 terms)
    c = compare(out, ref_out)
    assert c.ok(3e-3), c
    fin = torch.isfinite(ref_lse)
    assert bool((torch.isfinite(lse) == fin).all())
