"""CUDA-graph wrappers keep one backend: a captured ``run()`` replays only the launches of the backend it ran, so
a later plan that another backend would take must not silently take it (its buffers would be the ones updated,
the replay would read stale ones: measured on an H100 as 3-4e-2 error or NaN output when a padded batch switched
between the Gluon and Triton backends). Trailing requests without queries (an engine's padding rows) are planned
without them, so a padded batch stays on the wrapper's backend. CPU: the plans and the refusal; the kernels run
in the interpreter or on torch."""
from __future__ import annotations

import torch
import pytest

import fp8mla
from fp8mla import attention as attention_mod
from fp8mla.reference import mla_reference
from fp8mla.testing import assert_close, make_paged_batch

from conftest import BACKENDS, DEVICE


def _graph_attn(backend):
    return fp8mla.MLAPagedAttention(use_cuda_graph=True, backend=backend, max_batch_size=8)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"] or ["triton"])
def test_trailing_rows_without_queries_are_planned_without_them(backend):
    if backend not in BACKENDS:
        pytest.skip("triton cannot run here")
    b = make_paged_batch([70, 33, 5, 0], [1, 1, 0, 0], 16, 16, "fp8_e4m3", device=DEVICE, seed=5)
    attn = _graph_attn(backend)
    attn.plan(**b.plan_args)
    p = attn._plan
    assert p.layout.batch_size == 2 and p.given_rows == 4
    out, lse = attn.run(**b.run_args, return_lse=True,
                        kv_len=b.plan_args["kv_len_arr"])   # FlashInfer's run() arguments: the given batch's size
    ref, ref_lse = b.reference()
    assert_close(out, ref, 5e-3)   # (a few tokens: the bf16 output's rounding dominates)
    assert_close(lse, ref_lse, 1e-4, "lse")
    with pytest.raises(ValueError, match="kv_len: expected 4 entries"):
        attn.run(**b.run_args, kv_len=b.plan_args["kv_len_arr"][:2])
    # a row without queries in the middle stays (only trailing ones are left out)
    b2 = make_paged_batch([70, 0, 5], [1, 0, 1], 16, 16, "fp8_e4m3", device=DEVICE, seed=6)
    attn.plan(**b2.plan_args)
    assert attn._plan.layout.batch_size == 3


def test_plain_wrappers_keep_every_row():
    b = make_paged_batch([70, 33, 5], [1, 1, 0], 16, 16, "fp8_e4m3", device=DEVICE, seed=7)
    attn = fp8mla.MLAPagedAttention(backend="torch")
    attn.plan(**b.plan_args)
    assert attn._plan.layout.batch_size == 3


def test_a_graph_wrapper_that_ran_never_switches_backend(monkeypatch):
    """A later plan that the selector would send to another backend is refused by name once the wrapper has run
    (before any run it may still move: nothing was captured)."""
    b = make_paged_batch([70, 33], [1, 1], 16, 16, "fp8_e4m3", device=DEVICE, seed=8)
    from fp8mla.backends.capabilities import TORCH, TRITON
    from fp8mla.backends.select import Choice
    picks = iter([TORCH, TRITON, TORCH, TRITON])
    real = attention_mod.select

    def pick(question, requested="auto"):
        real(question, requested)
        return Choice(next(picks))
    monkeypatch.setattr(attention_mod, "select", pick)
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="auto", max_batch_size=8)
    attn.plan(**b.plan_args)                  # torch
    attn._selected.clear()                     # (the wrapper keeps its choice per spec: forget it, ask again)
    attn.plan(**b.plan_args)                  # triton: nothing ran yet, taken
    assert attn._plan.backend == "triton"
    attn._selected.clear()
    attn.plan(**b.plan_args)                  # torch again, then it runs
    attn.run(**b.run_args)
    attn._selected.clear()
    with pytest.raises(ValueError, match="CUDA-graph wrapper has run the 'torch' backend"):
        attn.plan(**b.plan_args)              # triton after a run: refused
    assert attn._plan.backend == "torch"      # the plan that ran stays
    out = attn.run(**b.run_args)
    ref, _ = b.reference()
    assert_close(out, ref, 5e-3)
