"""``fp8mla bench decode --sparse``: the arguments parse, the floor counts the gathered records and both products,
the CLI refuses to time without a GPU, and ``fp8mla info`` lists the sparse kernels (CPU)."""
from __future__ import annotations

import pytest
import torch

from fp8mla.bench.common import Ceilings
from fp8mla.bench.sparse import sparse_cost
from fp8mla.cli import build_parser, main


def test_arguments_parse():
    args = build_parser("bench").parse_args(["bench", "decode", "--sparse", "--topk", "2048", "--heads", "64",
                                             "--sparse-kv", "fp8_ds_mla", "fp8_e4m3"])
    assert args.sparse and args.topk == 2048 and args.heads == [64] and args.sparse_kv == ["fp8_ds_mla", "fp8_e4m3"]
    dense = build_parser("bench").parse_args(["bench", "decode"])
    assert not dense.sparse and dense.topk == 2048


def test_floor_arithmetic():
    # GLM-5 at 64 heads, 32 tokens, topk 2048: 32 x 2048 x 656 B and 2 x 32 x 64 x 2048 x 1088 FLOPs
    nbytes, flops = sparse_cost(32, 64, 2048, "fp8_ds_mla")
    assert nbytes == 32 * 2048 * 656 == 42_991_616
    assert flops == 2 * 32 * 64 * 2048 * (576 + 512) == 9_126_805_504
    assert sparse_cost(1, 16, 64, "bf16") == (64 * 1152, 2 * 16 * 64 * 1088)
    assert sparse_cost(1, 16, 64, "fp8_e4m3_group")[0] == 64 * 592
    c = Ceilings(read_gbps=4000.0, matmul_tflops=800.0)
    # 42.99 MB / 4 TB/s = 10.75 us against 9.13 GFLOP / 800 TFLOP/s = 11.41 us: at 64 heads the FLOPs bound it
    assert c.floor_ms(nbytes, flops) == pytest.approx(max(nbytes / 4e12, flops / 8e14) * 1e3)
    assert c.floor_ms(nbytes, flops) == pytest.approx(flops / 8e14 * 1e3)
    small = sparse_cost(32, 8, 2048, "fp8_ds_mla")  # 8 heads: the bytes dominate
    assert c.floor_ms(*small) == pytest.approx(small[0] / 4e12 * 1e3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_gpu(capsys):
    assert main(["bench", "decode", "--sparse", "--topk", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_info_lists_sparse_kernels(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "fp8_ds_mla" in text and "656 B/token" in text
    assert "kernels/sparse_decode.py" in text and "gluon" in text


@pytest.mark.parametrize("fmt_name", ["fp8_ds_mla", "fp8_e4m3_group", "bf16"])
def test_bench_pool_and_slots(fmt_name):
    """The bench's requests: each one's slots are distinct, inside its own (shuffled) pages, and the pool has the
    format's shape; the run kwargs are what MLASparseAttention.run takes for the format."""
    from fp8mla.bench.sparse import _pool
    from fp8mla.formats import get_format
    fmt = get_format(fmt_name, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    kv, slots, perm, extra = _pool(3, 100, 16, fmt, "cpu", g)
    assert kv.shape == (3 * 7 + 8, 16, 656 if fmt_name == "fp8_ds_mla" else 576)
    assert slots.shape == (3, 100) and len(set(slots.flatten().tolist())) == 300
    for b in range(3):
        assert set((slots[b] // 16).tolist()) == set(perm[b].tolist())
    assert set(extra) == {"fp8_ds_mla": set(), "fp8_e4m3_group": {"kpe_scale", "ckv_scale_arr"}, "bf16": set()}[fmt_name]
