"""The DeepSeek V4 pool formats: their bytes (against layouts written out by hand here, not through
formats_v4.py), the ue8m0 scale choice, the saturating write (torch and the Triton write kernel, same bytes) and
named errors for pools of the wrong shape; `fp8mla info` lists them."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.formats_v4 import V4_FORMATS, get_v4_format, pool_geometry
from fp8mla.v4 import write_v4_pool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ue8m0_of(amax: float) -> int:
    """The scale byte FlashMLA's quantizer writes: 2^ceil(log2(max(amax / 448, 1e-4))), as its exponent + 127."""
    r = max(float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)), float(torch.tensor(1e-4)))
    return int(math.ceil(math.log2(r))) + 127


def _hand_codes(x: torch.Tensor, group: int) -> tuple[bytes, list[int]]:
    codes, scales = bytearray(), []
    for g in range(x.numel() // group):
        grp = x[g * group:(g + 1) * group].float()
        e = _ue8m0_of(float(grp.abs().max()))
        scales.append(e)
        codes += (grp / 2.0 ** (e - 127)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    return bytes(codes), scales


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 512, generator=g) * torch.logspace(-5, 4, n)[:, None]


def test_fp8_v4_page_layout_by_hand():
    fmt = get_v4_format("fp8_v4")
    page_size = 16
    assert fmt.token_bytes == 584 and fmt.page_bytes(16) == 17 * 576 and fmt.page_bytes(64) == 65 * 576
    pool = fmt.new_pool(3, page_size)
    assert pool.shape == (3, 16, 584) and pool.stride(0) == 17 * 576
    x = _rows(5, 0)
    slots = torch.tensor([17, 0, 47, 31, 5])
    fmt.write(pool, slots, x)
    flat = torch.as_strided(pool, (3, 17 * 576), (17 * 576, 1))
    for t, s in enumerate(slots.tolist()):
        page, off = divmod(s, page_size)
        codes, scales = _hand_codes(x[t, :448], 64)
        data = flat[page, 576 * off: 576 * off + 576].numpy().tobytes()
        assert data[:448] == codes
        assert data[448:] == x[t, 448:].to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        srow = flat[page, 576 * page_size + 8 * off: 576 * page_size + 8 * off + 8].tolist()
        assert srow == scales + [0]
    # the torch float8_e8m0fnu reading of the scale bytes agrees with 2^(e - 127)
    back = fmt.read(pool, slots, torch.float64)
    sc = flat[2, 576 * 16 + 8 * 15: 576 * 16 + 8 * 15 + 7].view(torch.float8_e8m0fnu).double()
    ref = flat[2, 576 * 15: 576 * 15 + 448].view(torch.float8_e4m3fn).double() * sc.repeat_interleave(64)
    assert torch.equal(back[2, :448], ref)


def test_fp8_v41_record_by_hand():
    fmt = get_v4_format("fp8_v41")
    pool = fmt.new_pool(2, 4)
    assert pool.shape == (2, 4, 528)
    x = _rows(3, 1)
    slots = torch.tensor([6, 1, 3])
    fmt.write(pool, slots, x)
    for t, s in enumerate(slots.tolist()):
        rec = pool[s // 4, s % 4].numpy().tobytes()
        codes, scales = _hand_codes(x[t], 32)
        assert rec[:512] == codes and list(rec[512:]) == scales


def test_scale_choice_is_the_power_of_two_ceiling():
    fmt = get_v4_format("fp8_v41")
    x = torch.zeros(4, 512)
    x[0, :32] = 448.0          # amax / 448 = 1: scale 2^0, byte 127
    x[1, :32] = 449.0          # just over: 2^1, byte 128
    x[2, :32] = 1e-9           # floor 1e-4: 2^-13, byte 114
    x[3, :32] = 448.0 * 0.75   # 0.75: 2^0
    _, sb, _ = fmt.encode(x)
    assert sb[:, 0].tolist() == [127, 128, 114, 127]
    assert (sb[:, 1:] == 114).all()  # all-zero groups take the floor


def test_saturation_and_nonfinite():
    fmt = get_v4_format("fp8_v4")
    pool = fmt.new_pool(1, 4)
    x = torch.zeros(3, 512, dtype=torch.float64)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, math.inf, math.nan
    x[1, :] = 1e30
    x[2, 448:] = 1e39  # beyond bf16's range: saturates, never inf
    fmt.write(pool, torch.arange(3), x)
    r = fmt.read(pool, torch.arange(3))
    assert r[0, 0] == 1.0 and r[0, 1] == 448.0 * 2.0 ** -8 and math.isnan(r[0, 2])  # inf: +448 x scale
    assert torch.isfinite(r[1]).all() and torch.isfinite(r[2]).all()
    assert r[2, 448] == torch.finfo(torch.bfloat16).max


@pytest.mark.parametrize("name", list(V4_FORMATS))
def test_round_trip_error(name):
    """Every value within half an e4m3 step of its group's scale (relative 2^-4, or 2^-10 x scale below the
    normal range), bf16 values within 2^-8 relative."""
    fmt = get_v4_format(name)
    pool = fmt.new_pool(2, 8)
    x = _rows(16, 2)
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    fmt.write(pool, slots, x)
    back = fmt.read(pool, slots, torch.float64)
    xd = x.double()
    bound = xd.abs() * 2.0 ** -8
    if fmt.is_fp8:
        _, sb, _ = fmt.encode(x)
        scale = (2.0 ** (sb.double() - 127)).repeat_interleave(fmt.group, dim=-1)
        n = fmt.fp8_dims
        bound[:, :n] = xd[:, :n].abs() * 2.0 ** -4 + scale * 2.0 ** -10
    assert ((back - xd).abs() <= bound).all()


@pytest.mark.triton
@pytest.mark.parametrize("name", list(V4_FORMATS))
def test_triton_writer_stores_the_torch_bytes(name):
    if "triton" not in fp8mla.available_backends(DEVICE):
        pytest.skip("triton cannot run here")
    fmt = get_v4_format(name)
    a, b = fmt.new_pool(3, 16, DEVICE), fmt.new_pool(3, 16, DEVICE)
    x = _rows(20, 3).to(DEVICE)
    x[0, 3], x[1, 5], x[2, 500], x[3] = math.nan, math.inf, -math.inf, 0.0
    x[4, :40] = 1e-30
    slots = torch.randperm(48)[:20].to(DEVICE)
    write_v4_pool(name, a, slots, x, backend="torch")
    write_v4_pool(name, b, slots, x, backend="triton")
    if name == "bf16":  # NaN payloads may differ (torch keeps the sign bit): compare values, NaN for NaN
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
    else:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(fmt.read(a, slots).nan_to_num(7.0), fmt.read(b, slots).nan_to_num(7.0))


def test_wrong_record_width_and_shapes_are_named():
    v4 = get_v4_format("fp8_v4")
    with pytest.raises(ValueError, match="584-byte records, got a record width of 656"):
        pool_geometry(v4, torch.zeros(2, 16, 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="528-byte records"):
        pool_geometry(get_v4_format("fp8_v41"), torch.zeros(2, 16, 584, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16"):
        pool_geometry(get_v4_format("bf16"), torch.zeros(2, 16, 512, dtype=torch.float16))
    with pytest.raises(ValueError, match="slots: expected values in"):
        v4.write(v4.new_pool(1, 4), torch.tensor([4]), torch.zeros(1, 512))
    with pytest.raises(ValueError, match="kv_format"):
        get_v4_format("fp8_ds_mla")


def test_info_lists_v4_formats_and_kernels(capsys):
    from fp8mla.cli import main
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "fp8mla.V4SparseAttention" in text and "584 B/token" in text and "528 B/token" in text
    assert "kernels/v4_attention.py" in text
