"""KV storage formats: quantize/dequantize round trip, saturation, group scales, bytes per token, lookup."""
from __future__ import annotations

import math

import pytest
import torch

from fp8mla.formats import FORMATS, KVFormat, expand_group_scales, get_format

# Unit roundoff (half an ulp, relative) of normal numbers and the smallest subnormal of each storage dtype.
PRECISION = {
    torch.bfloat16: (2.0 ** -8, 2.0 ** -133),
    torch.float16: (2.0 ** -11, 2.0 ** -24),
    torch.float8_e4m3fn: (2.0 ** -4, 2.0 ** -9),
    torch.float8_e5m2: (2.0 ** -3, 2.0 ** -16),
}
FP8 = [n for n, f in FORMATS.items() if f.is_fp8]


def _bound(fmt: KVFormat, x: torch.Tensor, scale) -> torch.Tensor:
    """Largest round-trip error the format allows for each element of ``x`` stored under ``scale``."""
    u, tiny = PRECISION[fmt.storage_dtype]
    return u * x.abs() + tiny / 2 * scale + 1e-30


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_round_trip_per_tensor_scale(name, dtype):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 576, generator=g) * torch.logspace(-3, 1, 576)).to(dtype)  # magnitudes over 4 decades
    # fp8 formats store x / scale; pick the scale that maps the largest value to the format's max.
    scale = float(x.float().abs().max()) / fmt.max_value if fmt.is_fp8 else 1.0
    stored = fmt.quantize(x, scale)
    assert stored.dtype == fmt.storage_dtype and stored.shape == x.shape
    back = fmt.dequantize(stored, scale)
    assert back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    bound = _bound(fmt, x.double(), scale)
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3e} at {int((err - bound).argmax())}"
    # A quantize that returned its input would pass the bound: the values really go through the storage dtype.
    if dtype != torch.bfloat16:
        assert err.max() > 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_scale_convention(name):
    """real = stored x scale: quantize divides by the scale, dequantize multiplies."""
    fmt = FORMATS[name]
    x = torch.tensor([1.0, -3.0, 0.5, 0.0])
    for scale in (0.5, torch.tensor(0.5)):
        stored = fmt.quantize(x, scale)
        assert torch.equal(stored.float(), torch.tensor([2.0, -6.0, 1.0, 0.0]))
        assert torch.equal(fmt.dequantize(stored, scale), x)
    assert fmt.dequantize(fmt.quantize(x), dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_saturates(name, scale):
    fmt = FORMATS[name]
    m = fmt.max_value
    x = torch.tensor([m, m * 1.03, m * 1.1, m * 4, 1e30, math.inf, -m * 1.1, -1e30, -math.inf]) * scale
    stored = fmt.quantize(x, scale)
    got = stored.float()
    want = torch.tensor([m, m, m, m, m, m, -m, -m, -m])
    assert not torch.isnan(got).any(), f"overflow made NaN: {got}"
    assert torch.equal(got, want), got
    assert torch.equal(fmt.dequantize(stored, scale), want * scale)


@pytest.mark.parametrize("name", list(FORMATS))
def test_nan_stays_nan_and_no_overflow(name):
    fmt = FORMATS[name]
    m = fmt.max_value
    x = torch.tensor([math.nan, 1.0, math.inf, -math.inf, m * 1.5, -m * 1.5], dtype=torch.float64)
    got = fmt.dequantize(fmt.quantize(x))
    assert math.isnan(got[0]) and got[1] == 1.0
    assert torch.isfinite(got[2:]).all(), f"{name}: overflow gave {got[2:]}"  # saturating, also for fp16
    assert torch.equal(got[2:].sign(), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert (got[2:].abs() == float(fmt.quantize(torch.tensor([fmt.max_value])).float())).all()


def test_max_values():
    assert FORMATS["fp8_e4m3"].max_value == 448.0 == FORMATS["fp8_e4m3_group"].max_value
    assert FORMATS["fp8_e5m2"].max_value == 57344.0
    for f in FORMATS.values():  # max is representable and is the largest finite value of the dtype
        assert f.max_value == float(torch.finfo(f.storage_dtype).max)


# -- group scales ----------------------------------------------------------------------------------------------
GROUP = FORMATS["fp8_e4m3_group"]


def test_group_scales_one_per_128_channels():
    g = torch.Generator().manual_seed(2)
    c = torch.randn(5, 3, 512, generator=g)
    amax = [0.5, 3.0, 100.0, 1e-3]
    for i, a in enumerate(amax):
        grp = c[..., i * 128:(i + 1) * 128]
        grp.mul_(a / grp.abs().amax(dim=-1, keepdim=True))
    s = GROUP.group_scales(c)
    assert s.shape == (5, 3, 4) and s.dtype == torch.float32
    assert torch.allclose(s, torch.tensor(amax) / 448.0 * torch.ones(5, 3, 1), rtol=1e-6)
    # Changing one channel changes only its own group's scale.
    c2 = c.clone()
    c2[1, 2, 300] = 1e4  # channel 300 is in group 2
    s2 = GROUP.group_scales(c2)
    changed = (s2 != s).nonzero().tolist()
    assert changed == [[1, 2, 2]]
    assert GROUP.num_groups(512) == 4 and GROUP.num_groups(256) == 2 and FORMATS["fp8_e4m3"].num_groups() == 0


def test_group_round_trip():
    g = torch.Generator().manual_seed(3)
    c = torch.randn(16, 512, generator=g) * torch.logspace(-2, 2, 16)[:, None]
    s = GROUP.group_scales(c)
    stored = GROUP.quantize_groups(c, s)
    assert stored.dtype == torch.float8_e4m3fn
    full = expand_group_scales(s, 512)
    back = GROUP.dequantize(stored, full)
    err = (back - c).abs()
    assert (err <= _bound(GROUP, c, full)).all()
    # The group's largest value maps to 448 exactly (scale = amax / 448): the full range is used.
    assert float(stored.float().abs().reshape(16, 4, 128).amax(-1).min()) == 448.0


def test_group_scales_zero_nan_inf_tiny():
    c = torch.randn(4, 512, generator=torch.Generator().manual_seed(4)) * 10
    c[0] = 0.0                        # an all-zero token
    c[1, :128] = 0.0                  # one zero group
    c[2, 130] = math.nan              # a NaN must not spoil the rest of its group
    c[3, 260] = math.inf              # inf saturates; the group keeps the scale of its finite values
    c[3, 384:] = 1e-44                # subnormal fp32 values: the scale must not underflow to 0
    s = GROUP.group_scales(c)
    assert torch.isfinite(s).all() and (s > 0).all(), s
    assert (s[0] == 1.0).all() and s[1, 0] == 1.0
    back = GROUP.dequantize(GROUP.quantize_groups(c, s), expand_group_scales(s, 512))
    assert (back[0] == 0).all() and (back[1, :128] == 0).all()
    assert math.isnan(back[2, 130]) and int(torch.isnan(back).sum()) == 1
    ok = torch.isfinite(c) & ~torch.isnan(back)
    err = (back - c).abs()
    assert (err[ok] <= _bound(GROUP, c, expand_group_scales(s, 512))[ok]).all(), "finite values not preserved"
    finite_amax = c[3, 256:384].clone()
    finite_amax[4] = 0
    assert back[3, 260] == pytest.approx(float(finite_amax.abs().max()), rel=2 ** -4)


# -- sizes and lookup ------------------------------------------------------------------------------------------
def test_bytes_per_token():
    got = {n: f.bytes_per_token() for n, f in FORMATS.items()}
    assert got == {"bf16": 1152, "fp16": 1152, "fp8_e4m3": 576, "fp8_e4m3_group": 592, "fp8_e5m2": 576}
    assert GROUP.bytes_per_token(256, 32) == 288 + 4 * 2
    assert FORMATS["bf16"].bytes_per_token(256, 32) == 576
    with pytest.raises(ValueError, match="head_dim_ckv"):
        GROUP.bytes_per_token(500, 64)


def test_format_attributes():
    assert [f.scale_kind for f in FORMATS.values()] == ["none", "none", "tensor", "group", "tensor"]
    assert [f.is_fp8 for f in FORMATS.values()] == [False, False, True, True, True]
    assert [f.element_bytes for f in FORMATS.values()] == [2, 2, 1, 1, 1]


def test_get_format():
    for name, f in FORMATS.items():
        assert get_format(name) is f
        assert get_format(f) is f
    assert get_format(torch.bfloat16).name == "bf16"
    assert get_format(torch.float16).name == "fp16"
    assert get_format(torch.float8_e4m3fn).name == "fp8_e4m3"  # a dtype means per-tensor scales
    assert get_format(torch.float8_e5m2).name == "fp8_e5m2"


@pytest.mark.parametrize("spec, exc", [
    (torch.float32, TypeError), (torch.int8, TypeError), (torch.float8_e4m3fnuz, TypeError),
    ("fp8", ValueError), ("e4m3", ValueError), ("", ValueError), (None, ValueError), (8, ValueError),
])
def test_get_format_errors(spec, exc):
    with pytest.raises(exc, match="kv_data_type"):
        get_format(spec)
    with pytest.raises(exc, match="kv_format"):
        get_format(spec, arg="kv_format")


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("scale", [0.0, -0.0, -0.5, math.nan, math.inf, -math.inf,
                                   torch.tensor(0.0), torch.tensor(math.nan), torch.tensor([1.0, -1.0]),
                                   torch.tensor([[0.5, math.inf]])])
def test_bad_scales_are_refused(name, scale):
    """A zero scale used to store x / 0 = +-inf saturated to +-max (and 0 / 0 = NaN): plausible-looking garbage.
    Zero, negative, NaN and inf scales are refused, as floats and as tensors, by quantize and dequantize."""
    fmt = FORMATS[name]
    x = torch.randn(2, 2)
    with pytest.raises(ValueError, match=r"^scale: expected (a )?positive finite"):
        fmt.quantize(x, scale)
    with pytest.raises(ValueError, match=r"^scale: expected (a )?positive finite"):
        fmt.dequantize(fmt.quantize(x), scale)


@pytest.mark.parametrize("scale", ["0.5", None, True, [0.5]])
def test_scale_of_another_type_is_refused(scale):
    with pytest.raises(TypeError, match=r"^scale: expected a positive finite float"):
        FORMATS["fp8_e4m3"].quantize(torch.ones(2), scale)


def test_empty_tensor_scale_for_empty_values():
    """Group scales of zero tokens are an empty tensor: nothing to check, nothing to store."""
    fmt = FORMATS["fp8_e4m3_group"]
    out = fmt.quantize_groups(torch.empty(0, 512), torch.empty(0, 4))
    assert out.shape == (0, 512) and out.dtype == fmt.storage_dtype
