"""``fp8mla bench decode --v4 --compare flashmla``: FlashMLA's V4 row takes the ``fp8_v4`` pools as they are (the
584-byte record, pages at their padded stride, one KV head), the window as ``k_cache`` + ``indices`` and the
compressed rows as ``extra_k_cache`` + ``extra_indices``, heads and sinks zero-padded to 64 or 128; the formats its
Hopper build does not read and missing ops are skipped by name (CPU, with a stand-in for the ops)."""
from __future__ import annotations

import sys

import pytest
import torch

from fp8mla.bench import flashmla
from fp8mla.bench import v4 as bench_v4
from fp8mla.formats_v4 import get_v4_format


class _Ops:
    """Records sparse_decode_fwd's arguments and returns FlashMLA's tuple (out filled with a marker)."""

    def __init__(self):
        self.calls = []

    def sparse_decode_fwd(self, *a):
        self.calls.append(a)
        out = a[12]
        out.copy_(torch.arange(out.shape[2], dtype=out.dtype)[None, None, :, None].expand_as(out))
        return out, None, "meta", "splits"


def _inputs(H=16, B=3, page=16):
    fmt = get_v4_format("fp8_v4")
    window, comp = fmt.new_pool(4, page), fmt.new_pool(5, page)
    w_idx = torch.randint(-1, 4 * page, (B, 128), dtype=torch.int32)
    c_idx = torch.randint(-1, 5 * page, (B, 64), dtype=torch.int32)
    return window, comp, w_idx, c_idx, torch.randn(H), torch.randn(B, H, 512).bfloat16()


def test_v4_runner_passes_the_pools_as_they_are():
    window, comp, w_idx, c_idx, sinks, q = _inputs()
    ops = _Ops()
    out = torch.full((3, 16, 512), float("nan")).bfloat16()
    run = flashmla.v4_runner((ops, None), "fp8_v4", window, w_idx, comp, c_idx, sinks, 0.04, q, out)
    run()
    assert len(ops.calls) == 2 and ops.calls[1][5:7] == ("meta", "splits")   # the schedule of the first call
    qp, k, wi, topk_len, sink, _, _, ek, ci, etl, dv, scale, o, inv = ops.calls[0]
    assert qp.shape == (3, 1, 64, 512) and torch.equal(qp[:, 0, :16], q) and not qp[:, 0, 16:].any()
    for cache, pool in ((k, window), (ek, comp)):
        assert cache.shape == (pool.shape[0], 16, 1, 584) and cache.stride(1) == 584
        assert cache.stride(0) == get_v4_format("fp8_v4").page_bytes(16) and cache.data_ptr() == pool.data_ptr()
    assert torch.equal(wi[:, 0], w_idx) and torch.equal(ci[:, 0], c_idx) and wi.dtype == torch.int32
    assert sink.shape == (64,) and torch.equal(sink[:16], sinks) and not sink[16:].any()
    assert topk_len is None and etl is None and dv == 512 and scale == pytest.approx(0.04) and inv is False
    assert torch.equal(out[0, :, 0], torch.arange(16).bfloat16())   # the first H heads of FlashMLA's out


def test_v4_runner_pads_to_128_heads():
    window, comp, w_idx, c_idx, sinks, q = _inputs(H=72)
    ops = _Ops()
    flashmla.v4_runner((ops, None), "fp8_v4", window, w_idx, comp, c_idx, None, 0.04, q,
                       torch.empty(3, 72, 512).bfloat16())
    assert ops.calls[0][0].shape == (3, 1, 128, 512) and ops.calls[0][4] is None


@pytest.mark.parametrize("fmt", ["fp8_v41", "bf16"])
def test_other_formats_are_refused_by_name(fmt, capsys):
    with pytest.raises(ValueError, match="584-byte"):
        flashmla.v4_runner((_Ops(), None), fmt, None, None, None, None, None, 0.04, torch.zeros(1, 8, 512), None)
    assert bench_v4._flashmla_row(fmt, None, None, None, None, None, 0.04, None, None, 1, 1) is None
    assert f"flashmla v4 {fmt}: skipped" in capsys.readouterr().out


def test_missing_ops_are_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm._flashmla_C", None)
    assert bench_v4._flashmla_row("fp8_v4", None, None, None, None, None, 0.04, None, None, 1, 1) is None
    assert "flashmla-ops" in capsys.readouterr().out
