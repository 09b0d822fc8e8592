"""MLAPagedAttention against the float64 reference over a grid of batches, page sizes, KV formats, heads,
query lengths and odd kv lengths (0, 1, page +- 1, several pages), causal and not, in both LSE bases.

Every case builds its batch with ``make_paged_batch`` (NaN in every unused page and slot, shuffled page ids,
fresh values from a per-case seed), runs into NaN-poisoned ``out``/``lse`` buffers and compares with the
reference on the dequantized KV: relative L2 of ``out`` <= 1e-2, ``lse`` finite exactly where the reference is,
``-inf`` (and ``out`` 0) where a query sees no token, and close in both bases.

Axes: batch {1, 3, 7}, kv_len {0, 1, 17, 33, 96, 97, 114, 514}, qo_len {1, 3, 17}, causal, page {1, 16, 64},
H {16, 128}, every format. Batch 1 runs every kv_len on its own; batches 3 and 7 cycle through the kv_len set
(so every length appears in each) with uniform or mixed query lengths, and each of their requests lists one
NaN page past the pages its kv_len needs. H=128 runs with pages 1 and 64, and batched with decode and mixed
query lengths only (H is only a broadcast dimension in the torch backend; the rest is covered at H=16).
Both lse bases run on the batch-1 cases and the backend slice (the base is a per-element factor, independent
of the batch). The Triton backend runs a small slice (``-m triton``).
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import BACKEND_PARAMS, DEVICE
from fp8mla import FORMATS, MLAPagedAttention
from fp8mla.testing import assert_close, compare, make_paged_batch

KV_LENS = [0, 1, 17, 33, 96, 97, 114, 514]
QO_LENS = [1, 3, 17]
PAGES = [1, 16, 64]
FORMAT_NAMES = list(FORMATS)
REL_L2 = 1e-2
# Absolute lse error (either base). The torch backend does fp32 math on the exact inputs (~1e-6 here; an
# off-by-one in causal masking moves lse by ~1/kv_len nats, 2.8e-3 at 514). The triton backend folds the
# per-tensor scales into Q before rounding it to fp16 for the MMAs: ~1.5e-3 measured.
LSE_ATOL = {"torch": 1e-4, "triton": 5e-3}
LN2 = math.log(2.0)
# Non-unit per-tensor scales (ignored by make_paged_batch for the 16-bit formats): a backend that drops or
# swaps a scale changes the scores and the output by a large factor.
SCALES = dict(ckv_scale=0.02, kpe_scale=0.03)


def _cycle(batch: int) -> list[list[int]]:
    """kv_len lists of ``batch`` requests that walk through KV_LENS until every length appeared."""
    n = -(-len(KV_LENS) // batch)
    return [[KV_LENS[i % len(KV_LENS)] for i in range(k * batch, (k + 1) * batch)] for k in range(n)]


BATCHED_KV_LENS = [pytest.param(lens, id=f"b{len(lens)}-" + "_".join(map(str, lens))) for b in (3, 7)
                   for lens in _cycle(b)]
# Query lengths of a batched case: the same for every request, or mixed decode / MTP / extend.
BATCHED_QO = ["1", "3", "17", "mixed"]


def _qo_lens(spec: str, batch: int) -> list[int]:
    return [QO_LENS[i % 3] for i in range(batch)] if spec == "mixed" else [int(spec)] * batch


def check_attention(backend, kv_lens, qo_lens, num_heads, page_size, kv_format, causal, seed, *,
                    q_dtype=torch.bfloat16, both_bases=False, **batch_kw):
    """Run one batch and check it against the float64 reference. Returns (out, lse base 2)."""
    pb = make_paged_batch(kv_lens, qo_lens, num_heads, page_size, kv_format, causal=causal, device=DEVICE,
                          seed=seed, q_dtype=q_dtype, **{**SCALES, **batch_kw})
    attn = MLAPagedAttention(backend=backend)
    attn.plan(**pb.plan_args)
    assert attn.backend == backend
    n, Dc = sum(qo_lens), pb.plan_args["head_dim_ckv"]
    ref_out, ref_lse = pb.reference()

    # Poisoned buffers: every element must be written (a skipped row stays NaN and fails the comparison).
    out = torch.full((n, num_heads, Dc), math.nan, dtype=q_dtype, device=DEVICE)
    lse = torch.full((n, num_heads), math.nan, dtype=torch.float32, device=DEVICE)
    got = attn.run(**pb.run_args, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse, "run() must write into the given out= / lse= buffers"
    _check(out, lse, ref_out, ref_lse, "base 2", LSE_ATOL[backend])

    if both_bases:  # the same plan again, buffers allocated by run(), natural-log lse
        out_e, lse_e = attn.run(**pb.run_args, return_lse=True, return_lse_base_on_e=True)
        _check(out_e, lse_e, ref_out, ref_lse * LN2, "base e", LSE_ATOL[backend])
        assert out_e.dtype == q_dtype and lse_e.dtype == torch.float32
    return out, lse


def _check(out, lse, ref_out, ref_lse, what, lse_atol):
    assert not torch.isnan(out).any(), f"{what}: out has NaN (unwritten rows or a read of a poisoned slot)"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN (unwritten rows or a read of a poisoned slot)"
    assert_close(out, ref_out, REL_L2, what=f"out ({what})")
    lse, ref_lse = lse.double().cpu(), ref_lse.double().cpu()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: lse finite at other places than the reference's"
    assert (lse[~seen] == -math.inf).all(), f"{what}: a query that sees no token needs lse -inf"
    assert (out.cpu()[~seen] == 0).all(), f"{what}: a query that sees no token needs out 0"
    if seen.any():
        err = (lse - ref_lse)[seen].abs()
        assert err.max() <= lse_atol, f"{what}: lse max abs error {err.max():.3e} (limit {lse_atol:.0e})"


# -- batch 1: every kv_len ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qo_len", QO_LENS)
@pytest.mark.parametrize("kv_len", KV_LENS)
def test_batch1_h16(kv_len, qo_len, causal, page_size, kv_format, case_seed):
    check_attention("torch", [kv_len], [qo_len], 16, page_size, kv_format, causal, case_seed, both_bases=True)


@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qo_len", QO_LENS)
@pytest.mark.parametrize("kv_len", KV_LENS)
def test_batch1_h128(kv_len, qo_len, causal, page_size, kv_format, case_seed):
    check_attention("torch", [kv_len], [qo_len], 128, page_size, kv_format, causal, case_seed, both_bases=True)


# -- batches 3 and 7: kv_len cycling through the set ----------------------------------------------------------
@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qo", BATCHED_QO)
@pytest.mark.parametrize("kv_lens", BATCHED_KV_LENS)
def test_batched_h16(kv_lens, qo, causal, page_size, kv_format, case_seed):
    check_attention("torch", kv_lens, _qo_lens(qo, len(kv_lens)), 16, page_size, kv_format, causal, case_seed,
                    extra_pages=1)


@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qo", ["1", "mixed"])
@pytest.mark.parametrize("kv_lens", BATCHED_KV_LENS)
def test_batched_h128(kv_lens, qo, causal, page_size, kv_format, case_seed):
    check_attention("torch", kv_lens, _qo_lens(qo, len(kv_lens)), 128, page_size, kv_format, causal, case_seed,
                    extra_pages=1)


# -- every backend: a representative slice -------------------------------------------------------------------
SLICE = {  # id: (kv_lens, qo_lens, page_size, causal, extra NaN pages per request)
    "decode-p16": ([17, 0, 33], [1, 1, 1], 16, True, 1),
    "mtp-p1": ([17, 1], [3, 3], 1, True, 0),
    "extend-p16-full": ([33, 1, 0], [17, 3, 1], 16, False, 1),
}


@pytest.mark.parametrize("kv_format", FORMAT_NAMES)
@pytest.mark.parametrize("case", list(SLICE))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_backend_slice(backend, case, kv_format, case_seed):
    kv_lens, qo_lens, page_size, causal, extra = SLICE[case]
    check_attention(backend, kv_lens, qo_lens, 16, page_size, kv_format, causal, case_seed, both_bases=True,
                    extra_pages=extra)


# -- edges the grid does not reach ---------------------------------------------------------------------------
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3", "fp8_e4m3_group"])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_query_dtypes(q_dtype, kv_format, case_seed):
    """fp16 queries over every storage (the query dtype and the KV dtype are planned independently)."""
    check_attention("torch", [97, 0, 17], [1, 3, 17], 16, 16, kv_format, True, case_seed, q_dtype=q_dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_requests_without_queries(causal, case_seed):
    """Requests with qo_len 0 (and an empty batch) produce no rows and must not disturb their neighbours."""
    check_attention("torch", [33, 17, 96, 0], [0, 3, 0, 1], 16, 16, "fp8_e4m3", causal, case_seed)
    pb = make_paged_batch([], [], 16, 16, "fp8_e4m3", device=DEVICE, seed=case_seed)
    attn = MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    out, lse = attn.run(**pb.run_args, return_lse=True)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


def test_causal_alignment_exact():
    """Causal queries align to the end: query i of q over L tokens sees tokens 0 .. L - q + i exactly.

    Each token's c_kv is a one-hot marker and every score is equal, so out is the mean of the visible markers:
    a mask that is one token off changes which markers appear.
    """
    L, q, page = 20, 4, 16
    pb = make_paged_batch([L], [q], 16, page, "bf16", device=DEVICE, seed=0, causal=True)
    ckv, kpe = pb.run_args["ckv_cache"], pb.run_args["kpe_cache"]
    pages = pb.plan_args["kv_indices"].tolist()
    for t in range(L):
        row = torch.zeros(512)
        row[t] = 1.0
        ckv[pages[t // page], t % page] = row.to(ckv.dtype)
        kpe[pages[t // page], t % page] = 0
    pb.run_args["q_nope"].zero_()
    pb.run_args["q_pe"].zero_()
    attn = MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    out, lse = attn.run(**pb.run_args, return_lse=True)
    for i in range(q):
        visible = L - q + i + 1
        want = torch.zeros(512)
        want[:visible] = 1.0 / visible
        torch.testing.assert_close(out[i, 0].float().cpu(), want, rtol=1e-2, atol=1e-3)
        assert lse[i, 0].item() == pytest.approx(math.log2(visible), abs=1e-4)


def test_scales_as_tensors_match_floats(case_seed):
    """0-d fp32 tensors as ckv_scale/kpe_scale give the same result as the floats."""
    pb = make_paged_batch([96, 17], [1, 3], 16, 16, "fp8_e4m3", device=DEVICE, seed=case_seed, **SCALES)
    attn = MLAPagedAttention(backend="torch")
    attn.plan(**pb.plan_args)
    a = attn.run(**pb.run_args)
    args = dict(pb.run_args, ckv_scale=torch.tensor(SCALES["ckv_scale"], device=DEVICE),
                kpe_scale=torch.tensor(SCALES["kpe_scale"], device=DEVICE))
    b = attn.run(**args)
    assert torch.equal(a, b)
    # The scales matter: dropping one is a large error, not within the tolerance.
    ref = pb.reference()[0]
    for wrong in (dict(kpe_scale=1.0), dict(ckv_scale=1.0)):
        c = compare(attn.run(**dict(pb.run_args, **wrong)), ref)
        assert not c.ok(REL_L2), f"a run with {wrong} still matched the reference: {c}"
