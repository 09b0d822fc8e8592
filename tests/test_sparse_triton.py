"""The Triton sparse kernel (kernels/sparse_decode.py) against the float64 reference: formats x heads x topk x
page sizes x several query tokens per request x -1 padding (scattered and trailing) over shuffled pages with NaN
in every unused slot, outputs poisoned before the call; rows with no token; NaN in; out-of-pool entries; splits
and their merge (deterministic). CPU: under TRITON_INTERPRET=1 (conftest.py) at small sizes; GPU: the same."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close, capture_then_replay, make_sparse_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif("triton" not in fp8mla.available_backends(DEVICE),
                                 reason="triton backend unavailable here")]
# The dense decode's budget (tests/test_decode_triton.py): interpreter 5e-3 (fp32 dots, output rounded to bf16 by
# truncation), GPU 3e-3.
TOL = 5e-3 if DEVICE == "cpu" else 3e-3
LSE_TOL = 1e-4


def run(batch, **plan_extra):
    attn = fp8mla.MLASparseAttention(backend="triton")
    attn.plan(**{**batch.plan_args, **plan_extra})
    assert attn.backend == "triton"
    r = batch.run_args
    n, H, _ = r["q_nope"].shape
    out = torch.full((n, H, 512), math.nan, dtype=r["q_nope"].dtype, device=DEVICE)
    lse = torch.full((n, H), math.nan, device=DEVICE)
    res = attn.run(**r, out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    return out, lse, attn


def check(batch, **plan_extra):
    out, lse, attn = run(batch, **plan_extra)
    ref_o, ref_l = batch.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l, LSE_TOL, "lse")
    return out, lse, attn


@pytest.mark.parametrize("fmt,pad", [("fp8_ds_mla", "scattered"), ("fp8_e4m3", "trailing"),
                                     ("fp8_e4m3_group", "scattered"), ("fp8_e5m2", "trailing"),
                                     ("bf16", "scattered"), ("fp16", "trailing")])
def test_formats(fmt, pad):
    scales = dict(ckv_scale=0.25, kpe_scale=2.0) if fmt in ("fp8_e4m3", "fp8_e5m2") else {}
    b = make_sparse_batch([23, 2, 40], [2, 1, 2], 16, 64, 16, fmt, pad=pad, seed=len(fmt), device=DEVICE,
                          **scales)
    check(b)


@pytest.mark.parametrize("heads", [8, 20, 64])
def test_heads_ds_mla(heads):
    b = make_sparse_batch([30, 50], [1, 2], heads, 64, 16, "fp8_ds_mla", seed=heads, device=DEVICE)
    check(b)


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_sizes(page_size):
    b = make_sparse_batch([70, 5], [2, 1], 16, 64, page_size, "fp8_ds_mla", seed=page_size, device=DEVICE)
    check(b)


def test_topk_128_fp16_queries_group():
    b = make_sparse_batch([150], [2], 8, 128, 16, "fp8_e4m3_group", q_dtype=torch.float16, seed=11,
                          device=DEVICE, selected=lambda b, i: (128, 77)[i])
    check(b)


def test_fp16_queries_over_records():
    """fp16 queries against the record's bf16 k_pe (on a GPU: hi + lo bf16 parts of the rope query)."""
    b = make_sparse_batch([60, 20], [2, 1], 16, 64, 16, "fp8_ds_mla", q_dtype=torch.float16, seed=13,
                          device=DEVICE)
    check(b)


def test_topk_2048_tiny_batch_splits_and_merge():
    """GLM-5's topk at one token: the row is split over programs and merged; splitting does not change the answer
    beyond rounding."""
    b = make_sparse_batch([2100], [1], 8, 2048, 64, "fp8_ds_mla", seed=5, device=DEVICE,
                          selected=lambda b, i: 1900)
    out, lse, attn = check(b)
    assert attn.splits_for(1) > 1
    one, one_l, attn1 = run(b, num_splits=1)
    assert attn1.splits_for(1) == 1
    assert_close(one, out.double(), TOL, "unsplit vs split")


def test_reads_records_with_flashmla_power_of_two_scales():
    """FlashMLA's test quantizer writes the same bytes with each scale rounded up to a power of two: such records
    read correctly (the kernel takes the stored fp32 scale as it is)."""
    b = make_sparse_batch([50], [2], 16, 64, 16, "fp8_ds_mla", seed=8, device=DEVICE)
    kv = b.run_args["kv_cache"].reshape(-1, 656)
    used = ~(kv == 0xFF).all(dim=1)
    from fp8mla.formats import FP8_DS_MLA
    c, k = FP8_DS_MLA.unpack(kv[used].cpu())
    amax = c.reshape(-1, 4, 128).abs().amax(dim=-1)
    scale = torch.pow(2, (amax / 448).clamp_min(1e-4).log2().ceil())
    q = (c.reshape(-1, 4, 128) / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(-1, 512)
    rec = torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(-1, 16),
                     k.to(torch.bfloat16).view(torch.uint8).reshape(-1, 128)], dim=1)
    kv[used] = rec.to(kv.device)
    assert set(FP8_DS_MLA.scales_of(rec).log2().flatten().tolist()) <= set(range(-30, 30))  # powers of two
    check(b)


def test_empty_rows_nan_base_e_and_determinism():
    b = make_sparse_batch([20, 9], [2, 2], 16, 128, 4, "fp8_ds_mla", seed=1, device=DEVICE,
                          selected=lambda b, i: 0 if i else 5)
    b.run_args["q_nope"][2, 3, 100] = math.nan  # token 2 (request 1, five tokens) head 3: NaN in, NaN out
    attn = fp8mla.MLASparseAttention(backend="triton")
    attn.plan(**b.plan_args, min_split=64)
    assert attn.splits_for(4) > 1  # the empty rows go through the merge too
    out, lse = attn.run(**b.run_args, return_lse=True, return_lse_base_on_e=True)
    again, again_l = attn.run(**b.run_args, return_lse=True, return_lse_base_on_e=True)
    assert torch.equal(out.nan_to_num(), again.nan_to_num()) and torch.equal(lse.nan_to_num(), again_l.nan_to_num())
    ref_o, ref_l = b.reference()
    empty = (b.run_args["indices"] < 0).all(dim=1)
    assert empty.tolist() == [False, True, False, True]
    assert (out[empty] == 0).all() and (lse[empty] == -math.inf).all()
    assert torch.isnan(out[2, 3]).all() and math.isnan(lse[2, 3])
    assert_close(out, ref_o, TOL, "out")  # NaN positions must match the reference's
    assert_close(lse, ref_l * math.log(2), LSE_TOL, "lse base e")


def test_nan_in_a_selected_token_only_reaches_its_rows():
    b = make_sparse_batch([30], [3], 8, 64, 16, "fp8_e4m3", seed=9, device=DEVICE, ckv_scale=1.0,
                          selected=lambda b, i: 12)
    idx = b.run_args["indices"]
    only_0 = (set(idx[0].tolist()) - set(idx[1].tolist()) - set(idx[2].tolist())) - {-1}
    if not only_0:
        pytest.skip("no slot selected by token 0 alone in this draw")
    s = min(only_0)
    b.run_args["kv_cache"].view(-1, 576)[s, 17] = math.nan
    out, lse, _ = run(b)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(out[1:]).any()


def test_out_of_pool_entries_are_never_read():
    b = make_sparse_batch([40], [2], 16, 64, 16, "fp8_ds_mla", seed=4, device=DEVICE, pad="trailing",
                          selected=lambda b, i: 30)
    P = b.run_args["kv_cache"].shape[0]
    want, want_l, _ = run(b)
    idx = b.run_args["indices"]
    idx[0, 40], idx[1, 50], idx[1, 63] = P * 16, 2**31 - 1, -5
    got, got_l, _ = run(b)
    assert torch.equal(got, want) and torch.equal(got_l, want_l)


@pytest.mark.skipif(DEVICE != "cuda", reason="GPU sizes and CUDA graphs")
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("heads", [8, 64, 128])
def test_gpu_glm5_sizes_and_cuda_graph(fmt, heads):
    """topk 2048 at decode and MTP batch sizes, then run() captured in a CUDA graph and replayed after new
    indices are written into the same buffer (what an engine's captured step does)."""
    b = make_sparse_batch([3000, 2500, 2200, 4000], [2, 1, 1, 2], heads, 2048, 64, fmt, seed=heads, device=DEVICE,
                          selected=lambda b, i: 2048 - 100 * i)
    check(b)
    attn = fp8mla.MLASparseAttention(backend="triton")
    attn.plan(**b.plan_args)
    r = b.run_args
    out = torch.empty(6, heads, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(6, heads, device=DEVICE)
    graph = capture_then_replay(lambda: attn.run(**r, out=out, lse=lse), out)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "replayed out")
    r["indices"][:, 1000:] = -1  # new selections in the captured buffer
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, b.reference()[0], TOL, "replayed after new indices")


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_e4m3_group", "fp8_e4m3", "fp8_e5m2"])
def test_sm80_uint8_path(fmt, monkeypatch):
    """Before sm_89 Triton has no FP8 type: the launcher passes the e4m3 bytes as uint8 and converts them to
    value / 256 by bit manipulation, the 256 folded back into the scores. The record's k_pe is bf16 (not
    divided by 256): its score term must not be multiplied by 256. Run here by making the launcher see sm_80."""
    from fp8mla.kernels import sparse_decode
    scales = dict(ckv_scale=0.5, kpe_scale=2.0) if fmt in ("fp8_e4m3", "fp8_e5m2") else {}
    b = make_sparse_batch([40, 9], [2, 1], 16, 64, 16, fmt, seed=3, device=DEVICE, **scales)
    attn = fp8mla.MLASparseAttention(backend="triton")
    attn.plan(**b.plan_args)
    seen = []
    real = sparse_decode._sparse_mla_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["RAW_FP8"], args[2].dtype))
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(sparse_decode, "device_arch", lambda t: 80)
    monkeypatch.setattr(sparse_decode, "_sparse_mla_kernel", Spy())
    out, lse = attn.run(**b.run_args, return_lse=True)
    assert seen == [(2 if fmt == "fp8_e5m2" else 1, torch.uint8)]
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l, LSE_TOL, "lse")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_group", "bf16"])
def test_separate_ckv_and_kpe_caches(backend, fmt):
    """``kv_cache`` = c_kv ``[P, page, 512]`` with ``kpe_cache [P, page, 64]`` (two tensors, as FlashInfer's
    dense API takes them) reads what the joined pool reads."""
    b = make_sparse_batch([33, 8], [2, 1], 16, 64, 16, fmt, seed=12, device=DEVICE)
    r = dict(b.run_args)
    pool = r.pop("kv_cache")
    ckv, kpe = pool[..., :512].contiguous(), pool[..., 512:].contiguous()
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(**b.plan_args)
    out, lse = attn.run(**r, kv_cache=ckv, kpe_cache=kpe, return_lse=True)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l, LSE_TOL, "lse")
    with pytest.raises(ValueError, match=r"kpe_cache: expected shape"):
        attn.run(**r, kv_cache=ckv, kpe_cache=kpe[:, :8].contiguous())


@pytest.mark.parametrize("num_splits", [1, 2])
def test_lse_base_e_split_and_unsplit(num_splits):
    """``return_lse_base_on_e`` on both store paths: the kernel's own (one split) and the merge's."""
    b = make_sparse_batch([50, 30], [1, 2], 16, 128, 16, "fp8_ds_mla", seed=14, device=DEVICE,
                          selected=lambda b, i: 20 + 10 * i)
    attn = fp8mla.MLASparseAttention(backend="triton")
    attn.plan(**b.plan_args, num_splits=num_splits, min_split=64)
    assert attn.splits_for(3) == num_splits
    out, lse = attn.run(**b.run_args, return_lse=True, return_lse_base_on_e=True)
    ref_o, ref_l = b.reference()
    assert_close(out, ref_o, TOL, "out")
    assert_close(lse, ref_l * math.log(2), LSE_TOL, "lse base e")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_flashmla_typed_padded_record_pool(backend):
    """A pool as FlashMLA's test quantizer lays it out: float8_e4m3fn-typed bytes, ``[P, page, 1, 656]``, each
    block padded by one record (block stride ``(page + 1) x 656``). Same answer as the plain uint8 pool."""
    b = make_sparse_batch([45, 12], [2, 1], 16, 64, 16, "fp8_ds_mla", seed=15, device=DEVICE)
    r = dict(b.run_args)
    kv = r.pop("kv_cache")
    P, page, _ = kv.shape
    buf = torch.full((P, page + 1, 656), 0xFF, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    flash = buf[:, :page]
    flash.view(torch.uint8).copy_(kv)
    flash = flash.view(P, page, 1, 656)
    assert flash.dtype == torch.float8_e4m3fn and flash.stride(0) == (page + 1) * 656
    attn = fp8mla.MLASparseAttention(backend=backend)
    attn.plan(**b.plan_args)
    want, want_l = attn.run(**r, kv_cache=kv, return_lse=True)
    out, lse = attn.run(**r, kv_cache=flash, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_l)
    ref_o, _ = fp8mla.reference.sparse_mla_reference(r["q_nope"], r["q_pe"], flash, r["indices"],
                                                     sm_scale=b.plan_args["sm_scale"], kv_format="fp8_ds_mla",
                                                     page_size=page)
    assert_close(out, ref_o, TOL, "out")
