"""The fp8_ds_mla record: its bytes (against a layout written out by hand here, not through formats.py), the
saturating write (torch and the Triton write kernel, same bytes), PagedMLACache over a record pool, and the
dense API refusing the format by name."""
from __future__ import annotations

import math
import struct

import pytest
import torch

import fp8mla
from fp8mla.formats import FP8_DS_MLA, get_format


def _hand_record(c_kv: torch.Tensor, k_pe: torch.Tensor) -> bytes:
    """One 656-byte record, written out field by field as FlashMLA / vLLM document it."""
    out = bytearray()
    scales = []
    for g in range(4):
        grp = c_kv[128 * g: 128 * g + 128].float()
        amax = float(grp.abs().max())
        scales.append(max(float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)),
                          float(torch.finfo(torch.float32).tiny)))
    for g in range(4):
        q = (c_kv[128 * g: 128 * g + 128].float() / torch.tensor(scales[g], dtype=torch.float32))
        out += q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    out += struct.pack("<4f", *scales)
    out += k_pe.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return bytes(out)


def test_record_bytes_match_the_documented_layout():
    g = torch.Generator().manual_seed(0)
    c_kv = torch.randn(3, 512, generator=g) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    k_pe = torch.randn(3, 64, generator=g)
    rec = FP8_DS_MLA.pack(c_kv, k_pe)
    assert rec.dtype == torch.uint8 and rec.shape == (3, 656) and FP8_DS_MLA.bytes_per_token() == 656
    for t in range(3):
        assert rec[t].numpy().tobytes() == _hand_record(c_kv[t], k_pe[t])
    c, k = FP8_DS_MLA.unpack(rec, dtype=torch.float64)
    assert torch.equal(k, k_pe.to(torch.bfloat16).double())
    rel = (c - c_kv.double()).norm() / c_kv.double().norm()
    assert rel < 0.04  # e4m3: 3 mantissa bits


def test_saturation_and_nonfinite():
    c_kv = torch.zeros(2, 512)
    c_kv[0, 0], c_kv[0, 1], c_kv[0, 2] = 1.0, float("inf"), float("nan")
    c_kv[0, 128:256] = 0.0  # an all-zero group: scale FLT_MIN, stored zeros
    c_kv[1, :] = 1e30
    k_pe = torch.full((2, 64), 1e39, dtype=torch.float64)  # beyond bf16's range: saturates, never inf
    rec = FP8_DS_MLA.pack(c_kv, k_pe)
    c, k = FP8_DS_MLA.unpack(rec)
    assert c[0, 0] == 1.0 and c[0, 1] == 448.0 * FP8_DS_MLA.scales_of(rec)[0, 0] and math.isnan(c[0, 2])
    assert FP8_DS_MLA.scales_of(rec)[0, 1] == torch.finfo(torch.float32).tiny and (c[0, 128:256] == 0).all()
    assert torch.isfinite(c[1]).all() and torch.isfinite(k).all()


def test_record_format_has_no_single_dtype_quantize():
    """The inherited per-dtype helpers would cast to uint8: the record format names pack / unpack instead."""
    x = torch.randn(2, 512)
    with pytest.raises(TypeError, match="use pack"):
        FP8_DS_MLA.quantize(x)
    with pytest.raises(TypeError, match="use unpack"):
        FP8_DS_MLA.dequantize(FP8_DS_MLA.pack(x, torch.randn(2, 64)))
    with pytest.raises(TypeError, match="use pack"):
        FP8_DS_MLA.quantize_groups(x, FP8_DS_MLA.group_scales(x))


def test_dense_api_refuses_the_record_format():
    with pytest.raises(ValueError, match="kv_data_type: 'fp8_ds_mla' is the sparse"):
        get_format("fp8_ds_mla")
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        fp8mla.MLAPagedAttention(backend="torch").plan(
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 8, 512, 64, 16, True,
            0.1, torch.bfloat16, "fp8_ds_mla")


def test_cache_over_records():
    cache = fp8mla.PagedMLACache(2, num_pages=5, page_size=4, kv_format="fp8_ds_mla")
    assert cache.pool.shape == (2, 5, 4, 656) and cache.pool.dtype == torch.uint8 and cache.scale_arr is None
    assert cache.bytes_per_token == 656
    s = cache.add_sequence(num_tokens=7)
    c_kv, k_pe = torch.randn(7, 512), torch.randn(7, 64)
    cache.append(1, [s], c_kv, k_pe)
    slots = torch.tensor([cache.pages(s)[t // 4] * 4 + t % 4 for t in range(7)])
    flat = cache.kv_cache(1).reshape(-1, 656)
    assert torch.equal(flat[slots], FP8_DS_MLA.pack(c_kv, k_pe))
    with pytest.raises(ValueError, match="ckv_cache: the fp8_ds_mla pool holds whole 656-byte records"):
        cache.ckv_cache(0)
    with pytest.raises(ValueError, match="run_inputs"):
        cache.run_inputs(0)
    with pytest.raises(ValueError, match="kpe_scale: the fp8_ds_mla format takes no per-tensor scale"):
        fp8mla.PagedMLACache(1, 2, 4, kv_format="fp8_ds_mla", kpe_scale=2.0)
    with pytest.raises(ValueError, match="ckv_scale: the fp8_ds_mla format"):
        fp8mla.PagedMLACache(1, 2, 4, kv_format="fp8_ds_mla", ckv_scale=2.0)
    assert set(cache.sparse_run_inputs(1)) == {"kv_cache"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_write_kernel_stores_the_torch_bytes(dtype):
    pytest.importorskip("triton")
    if "triton" not in fp8mla.available_backends("cpu") and not torch.cuda.is_available():
        pytest.skip("triton cannot run here")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    T = 11
    c_kv = (torch.randn(T, 512, generator=g) * torch.logspace(-3, 3, T)[:, None]).to(dtype)
    c_kv[0, 5], c_kv[1, 130], c_kv[2, 300] = math.nan, math.inf, -math.inf
    c_kv[3, 128:256] = 0
    k_pe = (torch.randn(T, 64, generator=g) * 100).to(dtype)
    cache = fp8mla.PagedMLACache(1, num_pages=6, page_size=4, kv_format="fp8_ds_mla", device=device)
    slots = torch.randperm(24, generator=g)[:T].to(device)
    cache.write(0, slots, c_kv.to(device), k_pe.to(device), use_triton=True)
    got = cache.kv_cache(0).reshape(-1, 656)[slots].cpu()
    want = FP8_DS_MLA.pack(c_kv, k_pe)
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (cache.kv_cache(0).reshape(-1, 656)[untouched.to(device)] == 0).all()
