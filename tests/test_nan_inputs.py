"""NaN in must give NaN out: a NaN/inf query, or NaN in one channel of one token a query sees, never yields the
"no keys" answer (out 0, lse -inf) or a plausible number; other requests and heads stay finite. Same in the
float64 reference. (NaN in unused slots and pages never leaks: tests/test_attention_grid.py poisons them.)"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import BACKEND_PARAMS, DEVICE
from fp8mla import MLAPagedAttention
from fp8mla.reference import mla_reference
from fp8mla.testing import make_paged_batch


def _run(backend, pb):
    attn = MLAPagedAttention(backend=backend)
    attn.plan(**pb.plan_args)
    return attn.run(**pb.run_args, return_lse=True)


def _ref(pb):
    a, r = pb.plan_args, pb.run_args
    return mla_reference(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                         a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=a["causal"],
                         ckv_scale=r["ckv_scale"], kpe_scale=r["kpe_scale"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_bad_query_gives_nan(backend, bad, case_seed):
    pb = make_paged_batch([33, 17], [1, 1], 16, 16, "fp8_e4m3", device=DEVICE, seed=case_seed)
    pb.run_args["q_nope"][1, 3, 7] = bad                        # request 1, head 3
    out, lse = _run(backend, pb)
    ref_out, ref_lse = _ref(pb)
    for o, s, what in ((out, lse, backend), (ref_out, ref_lse, "reference")):
        assert torch.isnan(o[1, 3]).all() and torch.isnan(s[1, 3]), f"{what}: bad query did not give NaN"
        assert torch.isfinite(o[0]).all() and torch.isfinite(s[0]).all(), f"{what}: NaN leaked to request 0"
        assert torch.isfinite(o[1, 4]).all(), f"{what}: NaN leaked to another head"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_nan_in_a_seen_token_gives_nan(backend, case_seed):
    # bf16 pool: NaN is representable in storage (e4m3fn has NaN too, but bf16 keeps the test format-agnostic).
    pb = make_paged_batch([40], [3], 16, 16, "bf16", device=DEVICE, seed=case_seed, causal=True)
    a = pb.plan_args
    page = int(a["kv_indices"][2])         # token 32..39 live on the request's third page
    pb.run_args["ckv_cache"][page, 39 - 32, 100] = math.nan   # position 39: seen only by the last query
    out, lse = _run(backend, pb)
    ref_out, ref_lse = _ref(pb)
    for o, s, what in ((out, lse, backend), (ref_out, ref_lse, "reference")):
        assert torch.isnan(o[2]).all() and torch.isnan(s[2]).all(), f"{what}: NaN token did not give NaN"
    # (queries 0 and 1 do not see position 39, but its value row meets them as 0 x NaN in P.V: not asserted)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_nan_in_a_seen_token_gives_nan_on_decode_rows(backend, case_seed):
    """Decode rows of mixed lengths in one length bucket (the torch backend pads the shorter rows, whose padding
    points into request 0's first page and its NaN slots 9..15, and skips its scan for non-finite masked values
    on decode rows): NaN in a token request 0 sees gives NaN for request 0 only."""
    pb = make_paged_batch([9, 15, 12], [1, 1, 1], 16, 16, "bf16", device=DEVICE, seed=case_seed)
    page = int(pb.plan_args["kv_indices"][0])           # request 0's only page: tokens 0..8, NaN after
    pb.run_args["ckv_cache"][page, 5, 300] = math.nan
    out, lse = _run(backend, pb)
    ref_out, _ = _ref(pb)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all(), f"{backend}: the NaN token did not give NaN"
    assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all(), f"{backend}: NaN leaked"
    assert (out[1:].float() - ref_out[1:].float()).abs().max() < 0.02


def test_nan_in_a_token_an_earlier_query_does_not_see_stays_out_of_it(case_seed):
    """Causal rows see masked keys: the torch backend keeps its guard there, so a NaN in the last token reaches
    only the last query, not the earlier ones through 0 x NaN (as in the float64 reference)."""
    pb = make_paged_batch([40, 21], [3, 1], 16, 16, "bf16", device=DEVICE, seed=case_seed, causal=True)
    page = int(pb.plan_args["kv_indices"][2])           # tokens 32..39 of request 0
    pb.run_args["ckv_cache"][page, 39 - 32, 100] = math.nan
    out, lse = _run("torch", pb)
    ref_out, ref_lse = _ref(pb)
    for o, s, what in ((out, lse, "torch"), (ref_out, ref_lse, "reference")):
        assert torch.isnan(o[2]).all() and torch.isnan(s[2]).all(), f"{what}: the NaN token did not give NaN"
        assert torch.isfinite(o[[0, 1, 3]]).all() and torch.isfinite(s[[0, 1, 3]]).all(), f"{what}: NaN leaked"
    assert (out[[0, 1, 3]].float() - ref_out[[0, 1, 3]].float()).abs().max() < 0.02
