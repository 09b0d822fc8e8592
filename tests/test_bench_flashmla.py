"""``fp8mla bench decode --compare flashmla`` (and with ``--sparse``): FlashMLA's rows are optional; where its ops
do not import the rows are skipped with the reason, never a crash (CPU). The runners themselves need the ops and a
Hopper GPU: they are checked against float64 by the bench's own error column there."""
from __future__ import annotations

import argparse
import sys

import pytest
import torch

from fp8mla.bench import decode, flashmla
from fp8mla.formats import get_format


def test_compare_flashmla_is_a_choice():
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    assert p.parse_args(["--compare", "flashmla", "graph"]).compare == ["flashmla", "graph"]
    with pytest.raises(SystemExit):
        p.parse_args(["--compare", "flashmla_typo"])


def test_missing_ops_are_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm._flashmla_C", None)   # an import of it raises ImportError
    why = flashmla.load_ops()
    assert isinstance(why, str) and "vllm._flashmla_C" in why and "flashmla-ops" in why
    args = dict(page_size=64, kv_len_arr=torch.tensor([5]), kv_indices=torch.tensor([0]), sm_scale=0.1)
    got = decode._flashmla_runners(args, 16, torch.zeros(1, 64, 576), get_format("bf16"), None, None, None, "here")
    assert got == {}
    assert "flashmla here: skipped" in capsys.readouterr().out


def test_dense_runners_refuse_other_pages():
    with pytest.raises(ValueError, match="page_size 16"):
        flashmla.dense_runners((None, None), dict(page_size=16), 16, None, get_format("bf16"), None, None, None)


def test_query_padding_to_the_ops_heads():
    qn, qp = torch.randn(3, 16, 512), torch.randn(3, 16, 64)
    q = flashmla._q576(qn, qp, 64)
    assert q.shape == (3, 1, 64, 576) and q.dtype == torch.bfloat16 and q.is_contiguous()
    assert torch.equal(q[:, 0, :16, :512], qn.bfloat16()) and torch.equal(q[:, 0, :16, 512:], qp.bfloat16())
    assert not q[:, 0, 16:].any()
