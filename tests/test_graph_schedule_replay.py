"""CUDA-graph wrappers planned with device-only lengths (an engine's decode step under CUDA graphs: vLLM passes its
lengths on the device) make their split schedule with tens of small torch ops, 1.2-2.6 ms of host launches per
plan on an H100 host. The graph buffers record those ops once per shape as a CUDA graph and replay them
(``GraphBuffers.replay``). GPU: the replayed schedule fills the buffers exactly as the eager ops do, over changing
lengths, rows of length 0, lengths past a row's pages and batch sizes that come back; the outputs are the same
bits; every shape was recorded. CPU: the ops run eagerly (no graph), the same buffers."""
from __future__ import annotations

import math

import pytest
import torch

import fp8mla
from fp8mla.layout import PagedLayout

H, PAGE, W = 128, 64, 24
FP8 = torch.float8_e4m3fn


def _wrapper(backend):
    return fp8mla.MLAPagedAttention(None, use_cuda_graph=True, backend=backend, max_batch_size=16, max_qo_len=1,
                                    max_kv_indices=16 * W)


def _plan(attn, table, lens, kv_dtype):
    B = table.shape[0]
    lay = PagedLayout.from_block_table(table, lens, PAGE, qo_indptr=torch.arange(B + 1, dtype=torch.int32))
    attn.plan_layout(lay, H, 512, 64, True, 1 / math.sqrt(192), torch.bfloat16, kv_dtype)


def _cases():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [("triton", torch.bfloat16), ("triton", FP8)]
    if dev == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        cases.append(("gluon", FP8))
    return dev, cases


DEV, CASES = _cases()


@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU (on a CPU the ops run eagerly: the test below)")
@pytest.mark.parametrize("backend,kv_dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_replayed_schedule_fills_the_buffers_as_the_eager_ops(backend, kv_dtype):
    g = torch.Generator(device="cpu").manual_seed(11)
    P = 16 * W + 3
    pool = torch.randn(P, PAGE, 576, generator=g).to(kv_dtype).to(DEV)
    table = torch.randperm(P, generator=g)[: 16 * W].view(16, W).to(torch.int32).to(DEV)
    q_nope = torch.randn(16, H, 512, generator=g).to(torch.bfloat16).to(DEV)
    q_pe = torch.randn(16, H, 64, generator=g).to(torch.bfloat16).to(DEV)
    replayed, eager = _wrapper(backend), _wrapper(backend)
    steps = [[1030, 700, 64], [1031, 701, 65], [5000, 0, 1], list(range(100, 1700, 100)), [1032, 702, 66],
             [40] * 16, [1033, 703, 67]]   # (5000: past the row's 24 pages of 64, clamped)
    keys = set()
    for i, lens in enumerate(steps):
        B = len(lens)
        lens_dev = torch.tensor(lens, dtype=torch.int32, device=DEV)
        for attn in (replayed, eager):
            _plan(attn, table[:B], lens_dev, kv_dtype)
            assert attn.backend == backend
        buf_r = replayed._state[backend].graph
        buf_e = eager._state[backend].graph
        buf_e.replay = lambda key, ops: ops()   # this wrapper's schedule: the eager ops, every plan
        keys.add(B)
        assert torch.equal(buf_r.flat, buf_e.flat), f"step {i}: the replayed schedule's buffers differ"
        outs = [attn.run(q_nope[:B], q_pe[:B], pool[..., :512], pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
                for attn in (replayed, eager)]
        assert torch.equal(outs[0], outs[1]), f"step {i}: outputs differ"
        assert not outs[0].isnan().any()
    rec = buf_r._replays
    assert len(rec) == len(keys) and all(v is not None for v in rec.values()), rec


def test_replay_runs_the_ops_eagerly_on_a_cpu_device():
    from fp8mla.backends._graph import GraphBuffers
    buf = GraphBuffers(dict(a=4), {}, "cpu")
    calls = []

    def ops():
        calls.append(1)
        buf.buf["a"].add_(1)

    for _ in range(3):
        buf.replay(("shape",), ops)
    assert len(calls) == 3 and buf.buf["a"].tolist() == [3] * 4 and not buf._replays
