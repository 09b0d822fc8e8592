"""Quantize-on-write: the Triton kernel stores the same bytes and group scales as PagedMLACache.write's torch
code (every format, input dtype, odd slot orders, NaN/inf/huge/tiny inputs); append + read-back round trips
with values beyond the FP8 range saturate and stay within the format's rounding error."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fp8mla import PagedMLACache
from fp8mla.formats import get_format
from fp8mla.gather import gather_dequant
from fp8mla.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="triton cannot run")
FORMATS = ["fp8_e4m3", "fp8_e4m3_group", "fp8_e5m2", "bf16", "fp16"]


def wild_values(T, D, dtype, g):
    """Magnitudes from 2^-20 (fp8 subnormals and underflow) to 2^20 (far past fp8 and fp16 max), NaN, +-inf."""
    mag = torch.exp2(torch.empty(T, D, dtype=torch.float64).uniform_(-20, 20, generator=g))
    x = torch.randn(T, D, generator=g, dtype=torch.float64).sign() * mag
    x[0, 5] = float("nan")
    x[min(1, T - 1), :] = 0                     # an all-zero token: group scale 1
    x[min(2, T - 1), 3] = float("inf")
    x[min(3, T - 1), D - 1] = -float("inf")
    return x.to(dtype).to(DEVICE)


def pair(fmt, **kw):
    # Scales only where the format takes them (the cache refuses a scale its format would ignore).
    f = get_format(fmt)
    kw = dict(head_dim_ckv=256, head_dim_kpe=32, ckv_scale=0.37 if f.scale_kind == "tensor" else 1.0,
              kpe_scale=3.1 if f.is_fp8 else 1.0, device=DEVICE) | kw
    return [PagedMLACache(2, 7, 4, fmt, **kw) for _ in range(2)]


def assert_same_bytes(a: PagedMLACache, b: PagedMLACache):
    xa, xb = a.pool.view(torch.uint8), b.pool.view(torch.uint8)
    both_nan = torch.isnan(a.pool.float()) & torch.isnan(b.pool.float())  # NaN payloads may differ
    diff = (xa.view(*a.pool.shape, -1) != xb.view(*b.pool.shape, -1)).any(-1) & ~both_nan
    assert not diff.any(), f"{int(diff.sum())} stored values differ, first at {diff.nonzero()[0].tolist()}"
    assert torch.equal(torch.isnan(a.pool.float()), torch.isnan(b.pool.float()))
    if a.scale_arr is not None:
        assert torch.equal(a.scale_arr, b.scale_arr)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_triton_stores_what_torch_stores(fmt, dtype, case_seed):
    g = torch.Generator().manual_seed(case_seed)
    torch_cache, triton_cache = pair(fmt)
    T = 17
    slots = torch.randperm(28, generator=g)[:T].to(DEVICE)   # shuffled, not page-aligned
    c_kv, k_pe = wild_values(T, 256, dtype, g), wild_values(T, 32, dtype, g)
    torch_cache.write(1, slots, c_kv, k_pe, use_triton=False)
    triton_cache.write(1, slots, c_kv, k_pe, use_triton=True)
    assert_same_bytes(torch_cache, triton_cache)


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_group"])
def test_triton_unit_scales_and_int32_slots(fmt, case_seed):
    g = torch.Generator().manual_seed(case_seed)
    torch_cache, triton_cache = pair(fmt, ckv_scale=1.0, kpe_scale=1.0)
    slots = torch.tensor([27, 0, 13], dtype=torch.int32, device=DEVICE)
    c_kv, k_pe = wild_values(3, 256, torch.bfloat16, g), wild_values(3, 32, torch.bfloat16, g)
    torch_cache.write(0, slots, c_kv, k_pe, use_triton=False)
    triton_cache.write(0, slots, c_kv, k_pe, use_triton=True)
    assert_same_bytes(torch_cache, triton_cache)


def _near_midpoint_values(dtype, scale, n):
    """``n`` positive values of ``dtype`` whose e4m3 quotient by ``scale`` comes out differently when dividing
    (IEEE fp32) and when multiplying by the fp32 reciprocal rounded either from fp32 or from fp64."""
    bits = torch.arange(0, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    x = bits[(bits > 0) & (bits < 1e4)].numpy()
    q = lambda v: torch.from_numpy(v).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    s32 = np.float32(scale)
    d = q(x / s32)
    hit = (d != q(x * (np.float32(1) / s32))) | (d != q(x * np.float32(1 / scale)))
    assert int(hit.sum()) >= n
    return torch.from_numpy(x[hit.numpy()][:n]).to(dtype)


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_scaling_is_an_ieee_division(use_triton):
    """``x / scale`` and ``amax / max`` are fp32 divisions rounded to nearest on every device (torch's own
    tensor / float rule multiplies by a reciprocal on CUDA): values whose quotient lies near an e4m3 midpoint,
    where a reciprocal lands on the other neighbour, store the correctly rounded quotient."""
    kpe = torch.cat([_near_midpoint_values(torch.float16, 3.1, 8), -_near_midpoint_values(torch.bfloat16, 0.9, 8)])
    ckv = _near_midpoint_values(torch.bfloat16, 0.9, 15).repeat(18)[:256]
    for fmt in ("fp8_e4m3", "fp8_e4m3_group"):
        cache = PagedMLACache(1, 2, 4, fmt, head_dim_ckv=256, head_dim_kpe=16,
                              ckv_scale=0.9 if fmt == "fp8_e4m3" else 1.0, kpe_scale=3.1, device=DEVICE)
        c_kv = torch.stack([ckv, -ckv.flip(0)]).to(DEVICE)
        k_pe = torch.stack([kpe, kpe.flip(0)]).to(torch.float16).to(DEVICE)
        cache.write(0, torch.tensor([5, 2], device=DEVICE), c_kv, k_pe, use_triton=use_triton)
        rows = cache.pool[0].view(8, -1)[[5, 2]].cpu()
        div = lambda a, b: torch.from_numpy(a.float().numpy() / np.float32(b))  # noqa: E731
        want_k = div(k_pe.cpu(), 3.1).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(rows[:, 256:].view(torch.uint8), want_k.view(torch.uint8)), fmt
        if fmt == "fp8_e4m3":
            want_c = div(c_kv.cpu(), 0.9).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            amax = c_kv.cpu().float().abs().view(2, 2, 128).amax(-1)
            gs = div(amax, 448.0)
            assert torch.equal(cache.scale_arr[0].view(8, -1)[[5, 2]].cpu(), gs)
            want_c = torch.from_numpy(c_kv.cpu().float().view(2, 2, 128).numpy() / gs[..., None].numpy())
            want_c = want_c.view(2, 256).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(rows[:, :256].view(torch.uint8), want_c.view(torch.uint8)), fmt


@pytest.mark.skipif(DEVICE != "cuda", reason="the default dispatch to Triton happens on CUDA")
def test_cuda_write_dispatches_to_triton(monkeypatch):
    import fp8mla.kernels.quant_append as qa
    calls = []
    real = qa.quant_append
    monkeypatch.setattr(qa, "quant_append", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = PagedMLACache(1, 4, 16, "fp8_e4m3", device="cuda")
    s = cache.add_sequence(num_tokens=5)
    cache.append(0, [s], torch.randn(5, 512, device="cuda"), torch.randn(5, 64, device="cuda"))
    assert calls == [1]


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_read_back_round_trip(fmt, use_triton, case_seed):
    """Values up to 4x past the FP8 range: stored saturated at +-max * scale, the rest within rounding error."""
    f = get_format(fmt)
    g = torch.Generator().manual_seed(case_seed)
    ckv_scale, kpe_scale = (0.5 if f.scale_kind == "tensor" else 1.0, 0.25) if f.is_fp8 else (1.0, 1.0)
    cache = PagedMLACache(1, 9, 8, fmt, head_dim_ckv=256, head_dim_kpe=64, ckv_scale=ckv_scale,
                          kpe_scale=kpe_scale, device=DEVICE)
    lens = [13, 1, 8]
    ids = [cache.add_sequence() for _ in lens]
    cache.reserve(ids[:1], 3)                              # interleave allocations: pages are not in order
    cache.reserve(ids[1:], [lens[1], lens[2]])
    cache.reserve(ids[0], lens[0] - 3)
    limit = 4 * f.max_value * ckv_scale if f.is_fp8 else 1e4
    # every token of every sequence was reserved; write them all through slot ids in sequence order
    T = sum(lens)
    c_kv = (torch.rand(T, 256, generator=g, dtype=torch.float64) * 2 - 1) * limit
    k_pe = (torch.rand(T, 64, generator=g, dtype=torch.float64) * 2 - 1) * limit
    c_kv[0, :128] = 1e-3 * torch.randn(128, generator=g, dtype=torch.float64)  # a small-valued group
    slots = torch.cat([torch.tensor([cache.pages(i)[t // 8] * 8 + t % 8 for t in range(L)])
                       for i, L in zip(ids, lens)]).to(DEVICE)
    cache.write(0, slots, c_kv.float().to(DEVICE), k_pe.float().to(DEVICE), use_triton=use_triton)
    plan = cache.plan_inputs(ids)
    ckv, kpe, _ = gather_dequant(cache.ckv_cache(0), cache.kpe_cache(0), plan["kv_indptr"], plan["kv_indices"],
                                 plan["kv_len_arr"], ckv_scale=cache.ckv_scale, kpe_scale=cache.kpe_scale,
                                 ckv_scale_arr=cache.ckv_scale_arr(0), dtype=torch.float32, backend="torch")
    if f.scale_kind == "group":
        want_c = c_kv                                     # per-token scales: nothing saturates
    else:
        want_c = c_kv.clamp(-f.max_value * ckv_scale, f.max_value * ckv_scale)
    want_k = k_pe.clamp(-f.max_value * kpe_scale, f.max_value * kpe_scale)
    rel = {"fp8_e4m3": 0.07, "fp8_e4m3_group": 0.07, "fp8_e5m2": 0.13, "bf16": 5e-3, "fp16": 7e-4}[fmt]
    assert_close(ckv, want_c.to(DEVICE), rel, "c_kv read back")
    assert_close(kpe, want_k.to(DEVICE), rel, "k_pe read back")
    if f.is_fp8 and f.scale_kind != "group":
        big = c_kv.abs() > f.max_value * ckv_scale
        assert big.any()
        assert torch.equal(ckv.cpu()[big].abs().double(), torch.full_like(c_kv[big], f.max_value * ckv_scale))
    if f.scale_kind == "group":  # the small group keeps its precision thanks to its own scale
        assert_close(ckv[0, :128], c_kv[0, :128].to(DEVICE), 0.07, "small group")
    assert torch.isfinite(ckv).all() and torch.isfinite(kpe).all()
