"""``fp8mla bench decode --batch-invariant``: the flag parses (dense and --sparse), and the runs it adds plan and
run in a tiny configuration on the CPU (the torch backend), plain and CUDA-graph plans, giving the default's
answer within the kernels' tolerance."""
from __future__ import annotations

import torch

from fp8mla.bench.decode import invariant_attentions, make_pool
from fp8mla.cli import build_parser
from fp8mla.testing import assert_close


def test_flag_parses():
    args = build_parser("bench").parse_args(["bench", "decode", "--batch-invariant", "--heads", "16"])
    assert args.batch_invariant and args.heads == [16]
    assert not build_parser("bench").parse_args(["bench", "decode"]).batch_invariant
    sparse = build_parser("bench").parse_args(["bench", "decode", "--sparse", "--batch-invariant"])
    assert sparse.sparse and sparse.batch_invariant


def test_invariant_runs_in_a_tiny_config():
    pool, plan_args = make_pool(2, 40, 16, "fp8_e4m3", "cpu")
    made = invariant_attentions(plan_args, 16, "fp8_e4m3", backend="torch")
    assert sorted(made) == ["fp8mla torch[invariant,graph]", "fp8mla torch[invariant]"]
    q_nope = torch.randn(2, 16, 512).bfloat16()
    q_pe = torch.randn(2, 16, 64).bfloat16()
    from fp8mla import MLAPagedAttention
    base = MLAPagedAttention(backend="torch")
    base.plan(**plan_args, num_heads=16, kv_data_type="fp8_e4m3")
    ref = base.run(q_nope, q_pe, pool[..., :512], pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
    for name, attn in made.items():
        assert attn.batch_invariant, name
        out = attn.run(q_nope, q_pe, pool[..., :512], pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
        assert_close(out, ref, 1e-2, name)
    assert list(invariant_attentions(plan_args, 16, "fp8_e4m3", "gather_cast", backend="torch")) == [
        "fp8mla gather_cast+torch[invariant]"]
