"""The DSA model layer on its own: configs (real sizes, against transformers' defaults), the sparse path against
the dense MLA layer when the selection covers every token, the key cache under fork, and bad input."""
from __future__ import annotations

import math

import pytest
import torch

from fp8mla.models import DeepseekMLAModel
from fp8mla.models.dsa import DSAModel
from fp8mla.models.dsa_config import DSAConfig, load_dsa_config
from fp8mla.testing import compare


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: far faster than two threads on a loaded 2-core machine
    yield
    torch.set_num_threads(n)


def test_real_configs_match_transformers_defaults():
    """glm5.json / deepseek_v32.json carry the published sizes: transformers' config defaults are those models."""
    transformers = pytest.importorskip("transformers")
    for name, hf in (("glm5", transformers.GlmMoeDsaConfig()), ("dsv32", transformers.DeepseekV32Config())):
        c = load_dsa_config(name)
        assert (c.hidden_size, c.num_heads, c.num_layers, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                c.qk_rope_head_dim, c.v_head_dim, c.index_topk, c.index_n_heads, c.index_head_dim) == (
            hf.hidden_size, hf.num_attention_heads, hf.num_hidden_layers, hf.q_lora_rank, hf.kv_lora_rank,
            hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim, hf.index_topk, hf.index_n_heads,
            hf.index_head_dim), name
        assert c.model_type == hf.model_type
    glm, v32 = load_dsa_config("glm5"), load_dsa_config("dsv32")
    assert (glm.num_heads, glm.kv_lora_rank, glm.qk_rope_head_dim, glm.index_topk, glm.num_layers) == \
        (64, 512, 64, 2048, 78)
    assert glm.indexer_rope_interleave and not v32.indexer_rope_interleave and glm.rope_interleave and \
        v32.rope_interleave
    assert glm.rope_scaling is None and glm.rope_theta == 1e6 and glm.sm_scale == 256 ** -0.5
    assert v32.rope_scaling["factor"] == 40 and set(glm.indexer_types) == set(v32.indexer_types) == {"full"}


@pytest.mark.parametrize("extra", [dict(index_topk_freq=4, index_skip_topk_offset=3), dict(index_topk_freq=2),
                                   dict(index_topk_pattern="FFSSFS")])
def test_indexer_types_derived_as_transformers(extra):
    transformers = pytest.importorskip("transformers")
    n = len(extra.get("index_topk_pattern", "x" * 12))
    d = dict(load_dsa_config("glm5").to_dict())
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=n, **extra)
    raw = {"model_type": "glm_moe_dsa", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": n,
           "q_lora_rank": 32, "index_topk": 64, "index_n_heads": 2, "index_head_dim": 64, **extra}
    assert DSAConfig.from_dict(raw).indexer_types == hf.indexer_types
    assert d["indexer_types"] == ["full"] * 78


def test_bad_configs_are_named():
    cfg = load_dsa_config("tiny-dsa")
    with pytest.raises(ValueError, match="indexer_types"):
        cfg.replace(indexer_types=["shared", "full", "full"])
    with pytest.raises(ValueError, match="indexer_types"):
        cfg.replace(indexer_types=["full", "dense", "full"])
    with pytest.raises(ValueError, match="q_lora_rank"):
        cfg.replace(q_lora_rank=None)
    with pytest.raises(ValueError, match="index_topk"):
        cfg.replace(index_topk=0)
    with pytest.raises(ValueError, match="model_type"):
        DSAConfig.from_dict({"model_type": "deepseek_v3", "hidden_size": 8, "num_attention_heads": 1,
                             "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="index_topk"):
        DSAConfig.from_dict({"model_type": "deepseek_v32", "hidden_size": 8, "num_attention_heads": 1,
                             "num_hidden_layers": 1, "q_lora_rank": 4})


def test_unreadable_config_files_are_named(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid JSON file"):
        load_dsa_config(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list"):
        load_dsa_config(str(bad))
    with pytest.raises(ValueError, match="neither a known name"):
        load_dsa_config(tmp_path / "missing.json")


def _dense_twin(ours: DSAModel) -> DeepseekMLAModel:
    dense = DeepseekMLAModel(ours.cfg, len(ours.layers), dtype=ours.dtype, backend="torch")
    for d, s in zip(dense.layers, ours.layers):
        sd = {k: v for k, v in s.state_dict().items() if ".indexer." not in k}
        d.load_state_dict(sd)
    return dense


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_full_selection_is_dense_mla(kv_format):
    """With index_topk above every sequence's length the DSA layer attends to all tokens: it is the dense MLA
    layer (ragged prefill, cached-prefix merge, absorbed paged decode) with the same weights, step by step."""
    cfg = load_dsa_config("tiny-dsa").replace(index_topk=64)
    ours = DSAModel.random(cfg, dtype=torch.float32, backend="torch", seed=3)
    dense = _dense_twin(ours)
    a = ours.make_cache(32, 4, kv_format)
    b = dense.make_cache(32, 4, "bf16" if kv_format == "bf16" else "fp8_e4m3_group")
    for c in (a, b):
        c.add_sequence(0)
        c.add_sequence(1)
    g = torch.Generator().manual_seed(0)
    for counts in ([9, 1], [1, 6], [1, 1], [1, 1], [5, 1]):
        x = torch.randn(sum(counts), cfg.hidden_size, generator=g)
        got = ours(x, ours.begin_step(a, [0, 1], counts))
        want = dense(x, dense.begin_step(b, [0, 1], counts))
        c = compare(got - x, want - x)
        # the same bf16 attention on both sides; FP8 runs differ only in their rounding of the stored values
        assert c.nan_mismatch == 0 and c.rel_l2 < (1e-2 if kv_format == "bf16" else 6e-2), (counts, str(c))


def test_shared_layers_reuse_and_fork_copies_keys():
    cfg = load_dsa_config("tiny-dsa")
    m = DSAModel.random(cfg, dtype=torch.float32, backend="torch")
    assert [blk.self_attn.indexer is None for blk in m.layers] == [False, True, False]
    cache = m.make_cache(16, 4, "bf16")
    assert cache.index_layers == [0, 2] and cache.index_pool.shape == (2, 16, 4, cfg.index_head_dim)
    s = cache.add_sequence()
    m(torch.randn(6, cfg.hidden_size), m.begin_step(cache, [s], [6]))
    f = cache.fork(s)
    st = m.begin_step(cache, [s, f], [1, 1])  # both append to the shared, partly filled page 2: f gets a copy
    m(torch.randn(2, cfg.hidden_size), st)
    assert torch.equal(st.selections[1], st.selections[0])
    p_s, p_f = cache.pages(s)[1], cache.pages(f)[1]
    assert p_s != p_f
    for layer in (0, 2):
        keys = cache.index_keys(layer).view(16, 4, -1)
        assert torch.equal(keys[p_s, :2], keys[p_f, :2])  # the 2 shared tokens' keys were copied
    # each sequence's decode token selects only its own tokens: the forked prefix and its new one
    own = [set(cache.token_slots(q, 7).tolist()) for q in (s, f)]
    for row, slots in zip(st.selections[0], own):
        sel = {int(v) for v in row if v >= 0}
        assert sel <= slots and len(sel) == min(cfg.index_topk, 7)


def test_a_step_that_must_not_run_is_refused():
    """A cancelled step (its slots went back to the pool), or one whose page a later fork shares, would write its
    tokens where another sequence's are: refused by name, the pool unchanged."""
    cfg = load_dsa_config("tiny-dsa")
    m = DSAModel.random(cfg, dtype=torch.float32, backend="torch")
    cache = m.make_cache(16, 4, "bf16")
    a = cache.add_sequence()
    m(torch.randn(3, cfg.hidden_size), m.begin_step(cache, [a], [3]))
    st = m.begin_step(cache, [a], [1])
    st.cancel()
    b = cache.add_sequence()
    m(torch.randn(2, cfg.hidden_size), m.begin_step(cache, [b], [2]))
    pools = cache.pool.clone(), cache.index_pool.clone()
    with pytest.raises(ValueError, match="step: .*cancelled"):
        m(torch.randn(1, cfg.hidden_size), st)
    with pytest.raises(ValueError, match="step: .*cancelled"):
        m.layers[0].self_attn(torch.randn(1, cfg.hidden_size), st)
    st = m.begin_step(cache, [a], [1])
    f = cache.fork(a)
    with pytest.raises(ValueError, match=rf"step: sequence {a} shares page"):
        m(torch.randn(1, cfg.hidden_size), st)
    st = m.begin_step(cache, [b], [1])
    cache.free(b)
    with pytest.raises(ValueError, match=rf"step: sequence {b} is no longer in the cache"):
        m(torch.randn(1, cfg.hidden_size), st)
    assert torch.equal(cache.pool, pools[0]) and torch.equal(cache.index_pool, pools[1])
    m(torch.randn(2, cfg.hidden_size), m.begin_step(cache, [a, f], [1, 1]))  # new steps: their own pages


def test_bad_input_is_named():
    cfg = load_dsa_config("tiny-dsa")
    m = DSAModel.random(cfg, dtype=torch.float32, backend="torch")
    from fp8mla import PagedMLACache
    plain = PagedMLACache(3, 8, 4, "bf16", head_dim_ckv=512, head_dim_kpe=64)
    plain.add_sequence(0)
    with pytest.raises(TypeError, match="DSACache"):
        m.begin_step(plain, [0], [2])
    cache = m.make_cache(8, 4, "bf16")
    cache.add_sequence(0)
    st = m.begin_step(cache, [0], [3])
    x = torch.randn(3, cfg.hidden_size)
    with pytest.raises(ValueError, match="indices"):
        m.layers[0].self_attn(x, st, indices=torch.zeros(3, 8, dtype=torch.int32))
    other = m.make_cache(8, 4, "bf16")
    other.add_sequence(0)
    with pytest.raises(ValueError, match="shares the selection"):  # layer 1 without layer 0 before it
        m.layers[1].self_attn(x, m.begin_step(other, [0], [3]))
    with pytest.raises(ValueError, match="x: expected"):
        m.layers[0].self_attn(torch.randn(2, cfg.hidden_size), st)
    with pytest.raises(ValueError, match="keeps no indexer keys"):
        cache.index_keys(1)
    with pytest.raises(ValueError, match="num_layers"):
        DSAModel(cfg, num_layers=4)


def test_unselected_nan_never_reaches_the_output():
    """Poisoned pool and key cache: only the step's own writes become finite, and every row stays finite."""
    cfg = load_dsa_config("tiny-dsa")
    m = DSAModel.random(cfg, dtype=torch.float32, backend="torch")
    cache = m.make_cache(16, 4, "fp8_ds_mla")
    cache.pool.view(torch.uint8).fill_(0xFF)
    cache.index_pool.fill_(math.nan)
    for s in range(3):
        cache.add_sequence(s)
    out = m(torch.randn(14, cfg.hidden_size), m.begin_step(cache, [0, 1, 2], [1, 5, 8]))
    assert torch.isfinite(out).all()
    out = m(torch.randn(3, cfg.hidden_size), m.begin_step(cache, [0, 1, 2], [1, 1, 1]))
    assert torch.isfinite(out).all()
