"""DeepSeek-V4 model layer pieces without transformers: config reading, the attention over gathered rows against
a float64 loop, the FP8 row codec, the window's page release, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from fp8mla.models.deepseek_v4 import V4Model
from fp8mla.models.v4_attend import attend_rows
from fp8mla.models.v4_config import CSA, HCA, SLIDING, V4Config, load_v4_config


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is much faster than two on a loaded 2-core machine (CI)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_config_legacy_names():
    d = {"model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
         "compress_ratios": [0, 4, 128], "compress_rate_hca": 64, "qk_rope_head_dim": 64,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}}
    c = V4Config.from_dict(d)
    assert c.layer_types == [SLIDING, CSA, HCA] and c.compress_rates == {CSA: 4, HCA: 64}
    assert (c.head_dim, c.qk_rope_head_dim, c.sliding_window, c.index_topk, c.o_groups) == (512, 64, 128, 512, 8)
    assert c.compress_rope_scaling["factor"] == 16 and c.compress_rope_theta == 160000.0
    assert c.rope_spec(SLIDING).rope_scaling is None and c.rope_spec(CSA).rope_scaling["attention_factor"] == 1.0
    assert V4Config.from_dict({**d, "compress_ratios": None, "num_hidden_layers": 5}).layer_types == \
        [HCA, HCA, HCA, CSA, HCA]  # transformers' default schedule
    assert V4Config.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("bad, match", [({"model_type": "deepseek_v3"}, "model_type"),
                                        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
                                        ({"compress_ratios": [0, 8, 128]}, "compress_ratios"),
                                        ({"o_groups": 3}, "o_groups")])
def test_config_errors(bad, match):
    d = {"model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, **bad}
    with pytest.raises(ValueError, match=match):
        V4Config.from_dict(d)


def loop_reference(q, pools, idxs, sinks, scale):
    """float64, one query and head at a time."""
    T, H, D = q.shape
    out, lse = torch.zeros(T, H, D, dtype=torch.float64), torch.empty(T, H, dtype=torch.float64)
    for t in range(T):
        rows = [pool[int(j)].double() for pool, idx in zip(pools, idxs) for j in idx[t] if j >= 0]
        for h in range(H):
            s = [float(q[t, h].double() @ r) * scale for r in rows]
            z = sum(math.exp(v) for v in s) + (math.exp(float(sinks[h])) if sinks is not None else 0.0)
            lse[t, h] = math.log(z) if z > 0 else -math.inf
            for v, r in zip(s, rows):
                out[t, h] += math.exp(v) / z * r
    return out, lse


@pytest.mark.parametrize("with_sinks", [True, False])
def test_attend_rows_against_float64_loop(with_sinks):
    g = torch.Generator().manual_seed(3)
    T, H, D = 5, 3, 512
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64) * 0.05
    pools = [torch.randn(40, D, generator=g, dtype=torch.float64), torch.randn(9, D, generator=g, dtype=torch.float64)]
    pools[0][30:] = math.nan  # never listed
    idxs = [torch.randint(0, 30, (T, 7), generator=g, dtype=torch.int32),
            torch.randint(0, 9, (T, 3), generator=g, dtype=torch.int32)]
    idxs[0][1, 3:] = -1
    idxs[1][2:] = -1
    idxs[0][4], idxs[1][4] = -1, -1  # row 4 sees nothing
    sinks = torch.randn(H, generator=g) if with_sinks else None
    segs = [(lambda s, p=p: p[s], i) for p, i in zip(pools, idxs)]
    out, lse = attend_rows(q, segs, sinks, 0.3, compute_dtype=torch.float64)
    ref_out, ref_lse = loop_reference(q, pools, idxs, sinks, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert torch.equal(lse[4], sinks.float() if with_sinks else torch.full((H,), -math.inf))


def tiny_model():
    return V4Model.random(load_v4_config("tiny-v4"), dtype=torch.float32, backend="torch")


def test_window_pages_are_given_back_and_a_failed_step_rolls_back():
    torch.manual_seed(0)
    m = tiny_model()
    cache = m.make_cache(num_pages=32, page_size=4, kv_format="bf16")
    empty = {k: len(v.free) for k, v in cache.streams.items()}
    s = cache.add_sequence()
    m(torch.randn(21, 64), m.begin_step(cache, [s], [21]))
    win = cache.streams["window"]
    for _ in range(30):
        m(torch.randn(1, 64), m.begin_step(cache, [s], [1]))
        held = sum(p >= 0 for p in win.pages[s])
        assert held <= -(-(16 - 1) // 4) + 1, held
    free = {k: len(v.free) for k, v in cache.streams.items()}
    step = m.begin_step(cache, [s], [9])
    with pytest.raises(ValueError, match="x: expected shape"):
        m(torch.randn(8, 64), step)
    assert {k: len(v.free) for k, v in cache.streams.items()} == free and cache.seq_len(s) == 51
    m(torch.randn(2, 64), m.begin_step(cache, [s], [2]))  # the sequence goes on where it was
    assert cache.seq_len(s) == 53
    cache.free(s)
    assert {k: len(v.free) for k, v in cache.streams.items()} == empty and not cache.states


def test_bad_input():
    m = tiny_model()
    with pytest.raises(ValueError, match="kv_format"):
        m.make_cache(num_pages=4, page_size=4, kv_format="fp8_e4m3")
    cache = m.make_cache(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="not in the cache"):
        m.begin_step(cache, [7], [1])
    s = cache.add_sequence()
    with pytest.raises(ValueError, match="num_tokens"):
        m.begin_step(cache, [s], [0])
    step = m.begin_step(cache, [s], [2])
    with pytest.raises(ValueError, match="csa_rows"):
        m.layers[1].self_attn(torch.randn(2, 64), step, csa_rows=torch.zeros(2, 9, dtype=torch.int64))
    step.cancel()
    step = m.begin_step(cache, [s], [2])
    m(torch.randn(2, 64), step)
    with pytest.raises(ValueError, match="step"):
        m.layers[0].self_attn(torch.randn(2, 64), step)
    from fp8mla.cache import OutOfPagesError
    with pytest.raises(OutOfPagesError, match="window"):
        m.begin_step(cache, [s], [40])
    assert cache.seq_len(s) == 2


def test_docs_example_runs():
    """The example at the top of docs/v4_model.md, as written."""
    import re
    from pathlib import Path
    text = (Path(__file__).parent.parent / "docs" / "v4_model.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/v4_model.md", "exec"), scope)
    out = scope["out"]
    assert out.shape == (31, scope["model"].cfg.hidden_size) and torch.isfinite(out).all()
