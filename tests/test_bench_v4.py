"""``fp8mla bench decode --v4``: the arguments parse, the floor counts the gathered rows and both products, and
the CLI refuses to time without a GPU (CPU)."""
from __future__ import annotations

import pytest
import torch

from fp8mla.bench.v4 import v4_cost
from fp8mla.cli import build_parser, main


def test_arguments_parse():
    args = build_parser("bench").parse_args(["bench", "decode", "--v4", "--window", "128", "--compressed-topk",
                                             "1152", "--heads", "64", "--v4-kv", "fp8_v41"])
    assert args.v4 and args.window == 128 and args.compressed_topk == 1152 and args.v4_kv == ["fp8_v41"]
    assert not build_parser("bench").parse_args(["bench", "decode"]).v4


def test_cost_counts_rows_and_both_products():
    nbytes, flops = v4_cost(8, 64, 128 + 512, "fp8_v4")
    assert nbytes == 8 * 640 * 584 and flops == 2 * 8 * 64 * 640 * 1024
    assert v4_cost(1, 16, 10, "fp8_v41")[0] == 10 * 528 and v4_cost(1, 16, 10, "bf16")[0] == 10 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_gpu(tmp_path, capsys):
    assert main(["bench", "decode", "--v4", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
