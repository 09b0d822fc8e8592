"""MLASparseAttention's contract on its torch backend (the Triton kernel has tests/test_sparse_triton.py): every
format against the float64 reference, -1 padding, rows with no token, NaN in unselected slots, lse bases, and
each bad input a named error."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.sparse import SparseKernelError
from fp8mla.testing import assert_close, make_sparse_batch

FORMATS = ["fp8_ds_mla", "fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]


def run(batch, backend="torch", **plan_extra):
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(**{**batch.plan_args, **plan_extra})
    r = batch.run_args
    n, H, _ = r["q_nope"].shape
    out = torch.full((n, H, 512), math.nan, dtype=r["q_nope"].dtype)
    lse = torch.full((n, H), math.nan)
    res = attn.run(**r, out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    return out, lse


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pad", ["scattered", "trailing"])
def test_torch_backend_matches_reference(fmt, pad):
    b = make_sparse_batch([40, 3, 70], [2, 1, 3], 16, 64, 16, fmt, pad=pad, seed=FORMATS.index(fmt),
                          ckv_scale=0.5 if fmt in ("fp8_e4m3", "fp8_e5m2") else 1.0)
    out, lse = run(b)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, 3e-3, "out")
    assert_close(lse, ref_l, 1e-5, "lse")


def test_empty_rows_and_base_e():
    b = make_sparse_batch([20, 9], [2, 2], 8, 128, 4, "fp8_ds_mla", seed=1, selected=lambda b, i: 0 if i else 5)
    attn = fp8mla.MLASparseAttention(backend="torch")
    attn.plan(**b.plan_args)
    out, lse = attn.run(**b.run_args, return_lse=True, return_lse_base_on_e=True)
    ref_o, ref_l = b.reference()
    empty = (b.run_args["indices"] < 0).all(dim=1)
    assert empty.tolist() == [False, True, False, True]
    assert (out[empty] == 0).all() and (lse[empty] == -math.inf).all()
    assert_close(lse, ref_l * math.log(2), 1e-5, "lse base e")


def test_nan_in_the_query_is_nan_out():
    b = make_sparse_batch([30], [2], 8, 64, 16, "fp8_ds_mla", seed=2, selected=lambda b, i: 10)
    b.run_args["q_nope"][0, 3, 7] = math.nan
    out, lse = run(b)
    assert torch.isnan(out[0, 3]).all() and math.isnan(lse[0, 3]) and not torch.isnan(out[1]).any()


def _planned(fmt="fp8_ds_mla", **kw):
    b = make_sparse_batch([30], [2], 8, 64, 16, fmt, seed=3)
    attn = fp8mla.MLASparseAttention(backend="torch")
    attn.plan(**{**b.plan_args, **kw})
    return attn, b.run_args


def test_bad_input_is_named():
    attn, r = _planned()
    with pytest.raises(ValueError, match="indices.dtype=torch.int64"):
        attn.run(**{**r, "indices": r["indices"].long()})
    with pytest.raises(ValueError, match=r"indices: expected shape \[2, 64\]"):
        attn.run(**{**r, "indices": r["indices"][:, :32].contiguous()})
    with pytest.raises(ValueError, match="kv_cache.dtype"):
        attn.run(**{**r, "kv_cache": r["kv_cache"].view(torch.int8)})
    with pytest.raises(ValueError, match=r"kv_cache: expected shape \[\d+, 16, 656\]"):
        attn.run(**{**r, "kv_cache": r["kv_cache"][..., :576]})
    with pytest.raises(ValueError, match="ckv_scale: fp8_ds_mla records carry their own"):
        attn.run(**r, ckv_scale=1.0)
    with pytest.raises(ValueError, match="q_nope.dtype"):
        attn.run(**{**r, "q_nope": r["q_nope"].half()})
    a2, r2 = _planned("fp8_e4m3")
    with pytest.raises(ValueError, match="kpe_scale: an FP8 pool"):
        a2.run(**{**r2, "kpe_scale": None})
    a3, r3 = _planned("fp8_e4m3_group")
    with pytest.raises(ValueError, match="ckv_scale_arr: kv_data_type 'fp8_e4m3_group' needs"):
        a3.run(**{**r3, "ckv_scale_arr": None})
    with pytest.raises(SparseKernelError, match="head_dim_ckv/head_dim_kpe"):
        _planned(head_dim_ckv=256)
    with pytest.raises(ValueError, match="q_data_type"):
        _planned(q_data_type=torch.float32)
    with pytest.raises(RuntimeError, match="backend: 'gluon' cannot run on cpu"):   # (the default device is CUDA
        fp8mla.MLASparseAttention(backend="gluon").plan(8, 64, 16, 0.1, torch.bfloat16, "fp8_ds_mla",  # on a GPU)
                                                        device="cpu")
    with pytest.raises(ValueError, match="backend: expected one of"):
        fp8mla.MLASparseAttention(backend="flash")
    with pytest.raises(RuntimeError, match="plan"):
        fp8mla.MLASparseAttention().run(**r)


def test_gluon_plan_refusals_and_splits(monkeypatch):
    """backend="gluon" (as if on an sm_90 GPU): a plan outside the Hopper sparse build raises naming the argument;
    one inside it (any topk) plans 64-head groups and one-wave splits."""
    import fp8mla.runtime as rt
    from fp8mla.backends import sparse_gluon
    monkeypatch.setattr(rt, "gluon_usable", lambda device: True)
    g = fp8mla.MLASparseAttention(backend="gluon")
    for kw, match in ((dict(kv_data_type="fp8_e4m3"), "kv_data_type: the gluon sparse build reads fp8_ds_mla"),
                      (dict(q_data_type=torch.float16), "q_data_type: the gluon sparse build takes bfloat16"),
                      (dict(num_heads=129), "num_heads: the gluon sparse build takes 1..128")):
        args = dict(num_heads=16, topk=2048, page_size=64, sm_scale=0.1, q_data_type=torch.bfloat16,
                    kv_data_type="fp8_ds_mla")
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            g.plan(**args)
    with pytest.raises(TypeError, match="for the triton backend, not 'gluon'"):
        g.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla", block_h=32)
    with pytest.raises(TypeError, match="unknown keyword"):   # the single-partition build's option is gone
        g.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla", gather="async")
    g.plan(16, 37, 64, 0.1, torch.bfloat16, "fp8_ds_mla")     # odd topk: the last tile is masked per entry
    assert g.backend == "gluon"
    # one wave of one CTA per SM: splits = SMs // (tokens x head groups), each split >= min_split (256) entries
    monkeypatch.setattr(sparse_gluon, "num_sms", lambda device: 132)   # (the plan asks the SM count once)
    g.plan(128, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla")
    assert g.backend == "gluon" and g._plan.impl.config == {"block_h": 64}
    assert g.splits_for(64) == 1 and g.splits_for(33) == 2 and g.splits_for(1) == 8 and g.splits_for(2) == 8
    g.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla")
    assert g.splits_for(64) == 2 and g.splits_for(132) == 1 and g.splits_for(1) == 8
    monkeypatch.setattr(sparse_gluon, "num_sms", lambda device: 4)
    g.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla")
    assert g.splits_for(1) == 4 and g.splits_for(3) == 1 and g.splits_for(64) == 1
    g.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla", num_splits=5)
    assert g.splits_for(64) == 5


def test_auto_picks_gluon_only_on_hopper(monkeypatch):
    """backend="auto": the Gluon sparse build on an sm_90 GPU for a plan it takes, the Triton kernel on another GPU
    or for a plan gluon refuses (the reason kept with the choice), torch on the CPU."""
    import fp8mla.runtime as rt
    from fp8mla.formats import get_format
    rec, e4m3 = get_format("fp8_ds_mla", sparse_ok=True), get_format("fp8_e4m3", sparse_ok=True)
    auto = fp8mla.MLASparseAttention()
    monkeypatch.setattr(rt, "triton_usable", lambda device: True)
    monkeypatch.setattr(rt, "gluon_usable", lambda device: True)     # an H200
    assert auto._select(16, 2048, rec, torch.bfloat16, "cuda").backend == "gluon"
    c = auto._select(16, 2048, e4m3, torch.bfloat16, "cuda")
    assert c.backend == "triton" and c.passed_over == (
        ("gluon-sparse", "kv_data_type: the gluon sparse build reads fp8_ds_mla, got 'fp8_e4m3'"),)
    assert auto._select(16, 2048, rec, torch.float16, "cuda").backend == "triton"
    assert auto._select(16, 2048, rec, torch.bfloat16, "cpu").backend == "torch"
    monkeypatch.setattr(rt, "gluon_usable", lambda device: False)    # another GPU (sm_80 / 89 / 100 / 120)
    assert auto._select(16, 2048, rec, torch.bfloat16, "cuda").backend == "triton"
    monkeypatch.undo()
    a = fp8mla.MLASparseAttention()   # the real selection on this machine's CPU plan
    a.plan(16, 2048, 64, 0.1, torch.bfloat16, "fp8_ds_mla", device="cpu")
    assert a.backend == "torch"


def test_gluon_launcher_argument_checks():
    """The Hopper launcher's host checks (before any launch, so they run on the CPU): a pool whose records are not
    contiguous over pages, too many heads; no tokens launches nothing."""
    from fp8mla.kernels.sm90 import sparse as sm90_sparse
    pool = torch.zeros(4, 32, 656, dtype=torch.uint8)

    def args(H):
        return (torch.zeros(0, H, 512, dtype=torch.bfloat16), torch.zeros(0, H, 64, dtype=torch.bfloat16))

    def views(p):
        return (p[..., :512].view(torch.float8_e4m3fn), p.view(torch.bfloat16)[..., 264:328],
                p.view(torch.float32)[..., 128:132])
    idx = torch.zeros(0, 64, dtype=torch.int32)
    out, lse = torch.zeros(0, 16, 512, dtype=torch.bfloat16), torch.zeros(0, 16)
    c, k, sa = views(pool)
    sm90_sparse.sparse_mla(*args(16), c, k, sa, idx, out, lse, None, None, sm_scale=0.1, num_splits=1, lse_scale=1.0)
    c, k, sa = views(pool[:, ::2])
    with pytest.raises(ValueError, match="kv_cache: the gluon sparse kernel reads a contiguous record pool"):
        sm90_sparse.sparse_mla(*args(16), c, k, sa, idx, out, lse, None, None, sm_scale=0.1, num_splits=1,
                               lse_scale=1.0)
    c, k, sa = views(pool)
    with pytest.raises(ValueError, match="num_heads: the gluon sparse kernel takes 1..128"):
        sm90_sparse.sparse_mla(*args(130), c, k, sa, idx, out, lse, None, None, sm_scale=0.1, num_splits=1,
                               lse_scale=1.0)
    # the split geometry: entries per split a multiple of the 64-entry tile, empty splits dropped
    from fp8mla.kernels.split import split_geometry
    assert split_geometry(2048, 1) == (2048, 1)
    assert split_geometry(2048, 3) == (704, 3)
    assert split_geometry(129, 3) == (64, 3)
    assert split_geometry(37, 7) == (64, 1)
    assert split_geometry(1000, 8) == (128, 8)


def test_out_of_pool_indices(monkeypatch):
    attn, r = _planned()
    idx = r["indices"].clone()
    P = r["kv_cache"].shape[0]
    idx[0, 5] = P * 16 + 3  # past the pool: skipped like -1 (FlashMLA's rule) ...
    idx[1, 9] = -7
    out, lse = attn.run(**{**r, "indices": idx}, return_lse=True)
    clean = idx.clone()
    clean[0, 5] = clean[1, 9] = -1
    want, want_l = attn.run(**{**r, "indices": clean}, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_l)
    monkeypatch.setenv("FP8MLA_CHECK", "1")  # ... and named on the host under FP8MLA_CHECK=1
    with pytest.raises(ValueError, match=rf"indices: expected slots in \[0, {P * 16}\) or -1, got indices\[0, 5\]"):
        attn.run(**{**r, "indices": idx})


def test_triton_needs_topk_multiple_of_64():
    if "triton" not in fp8mla.available_backends("cpu"):
        pytest.skip("triton unavailable")
    with pytest.raises(SparseKernelError, match="topk: the triton sparse kernel needs a multiple of 64"):
        fp8mla.MLASparseAttention(backend="triton").plan(8, 100, 16, 0.1, torch.bfloat16, "fp8_ds_mla")
    attn = fp8mla.MLASparseAttention(backend="auto")  # the CPU: auto is the torch code, which takes any topk
    attn.plan(8, 100, 16, 0.1, torch.bfloat16, "fp8_ds_mla", device="cpu")
    assert attn.backend == "torch"


def test_docstring_example_runs():
    import doctest

    import fp8mla.sparse
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(fp8mla.sparse) if t.examples]
    assert tests, "MLASparseAttention lost its example"
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_device_tensor_scales():
    """Per-tensor scales as 1-element fp32 tensors (read on the device, no sync) give what the floats give; an
    invalid one (<= 0, inf, NaN) makes the output NaN rather than a silent wrong answer."""
    b = make_sparse_batch([30, 7], [2, 1], 8, 64, 16, "fp8_e4m3", seed=5, ckv_scale=0.5, kpe_scale=2.0,
                          selected=lambda b, i: 6)
    want, want_l = run(b)
    r = {**b.run_args, "ckv_scale": torch.tensor([0.5]), "kpe_scale": torch.tensor(2.0)}
    attn = fp8mla.MLASparseAttention(backend="torch")
    attn.plan(**b.plan_args)
    out, lse = attn.run(**r, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_l)
    out = attn.run(**{**r, "kpe_scale": torch.tensor(-1.0)})
    assert torch.isnan(out).all()
    out = attn.run(**b.run_args)  # back to floats: the device copy of the scales is refreshed
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="kpe_scale: expected a float or a 1-element fp32 tensor"):
        attn.run(**{**r, "kpe_scale": torch.tensor([2.0, 2.0])})


def test_flashmla_4d_record_pool_and_misaligned_views():
    """FlashMLA's ``[P, page, 1, 656]`` record pool reads as the 3-d one; views whose rows are not 4-byte aligned
    (the fp32 scales could not be read in place) are refused by name."""
    attn, r = _planned()
    want = attn.run(**r)
    kv = r["kv_cache"]
    assert torch.equal(attn.run(**{**r, "kv_cache": kv.unsqueeze(2)}), want)
    with pytest.raises(ValueError, match=r"kv_cache: expected shape"):
        attn.run(**{**r, "kv_cache": torch.cat([kv.unsqueeze(2)] * 2, dim=2)})
    wide = torch.zeros(*kv.shape[:2], 658, dtype=torch.uint8)
    wide[..., 2:] = kv
    with pytest.raises(ValueError, match="kv_cache: expected 656-byte records with contiguous bytes and 4-byte"):
        attn.run(**{**r, "kv_cache": wide[..., 2:]})
