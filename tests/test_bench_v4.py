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



def test_batch_invariant_runs_beside_the_default():
    """``--v4 --batch-invariant`` parses, and its run plans and runs in a tiny configuration on the CPU (the torch
    backend), giving the default's answer within the kernels' tolerance."""
    from fp8mla import V4SparseAttention
    from fp8mla.bench.v4 import invariant_attention
    from fp8mla.formats_v4 import get_v4_format
    from fp8mla.testing import assert_close
    args = build_parser("bench").parse_args(["bench", "decode", "--v4", "--batch-invariant"])
    assert args.v4 and args.batch_invariant
    fmt = get_v4_format("fp8_v4")
    pool = fmt.new_pool(2, 64)
    fmt.write(pool, torch.arange(100), torch.randn(100, 512))
    plan = dict(num_heads=16, sm_scale=512 ** -0.5, q_data_type=torch.bfloat16, kv_format="fp8_v4",
                window_topk=128, window_page_size=64, device="cpu")
    inv = invariant_attention(plan, backend="torch")
    base = V4SparseAttention(backend="torch")
    base.plan(**plan)
    assert inv.batch_invariant and inv.backend == "torch"
    idx = torch.full((3, 128), -1, dtype=torch.int32)
    idx[:, :100] = torch.arange(100)
    q = torch.randn(3, 16, 512).bfloat16()
    assert_close(inv.run(q, pool, idx, sinks=torch.zeros(16)), base.run(q, pool, idx, sinks=torch.zeros(16)), 1e-2,
                 "invariant")
