"""The deployments `fp8mla bench step --scale` and `fp8mla demo --scale` reproduce match the models' public configs:
heads per GPU = the model's attention heads / its tensor-parallel degree, layers and latent sizes as configured."""
from __future__ import annotations

import pytest

from fp8mla.bench.step import HEAD_DIM_CKV, HEAD_DIM_KPE, SCALES


def test_glm5_scale_is_glm5_at_tp8():
    cfg_mod = pytest.importorskip("transformers.models.glm_moe_dsa.configuration_glm_moe_dsa",
                                  reason="transformers without GLM-5's config (glm_moe_dsa)")
    cfg = cfg_mod.GlmMoeDsaConfig()   # the defaults are zai-org/GLM-5's
    s = SCALES["glm5"]
    assert cfg.num_attention_heads == 64 and s.heads * 8 == cfg.num_attention_heads, (s.heads, cfg.num_attention_heads)
    assert s.layers == cfg.num_hidden_layers == 78
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (HEAD_DIM_CKV, HEAD_DIM_KPE)
    assert "8 heads per GPU" in s.what


def test_dsv3_scale_is_deepseek_v3_at_tp8():
    from fp8mla.models.config import load_config
    cfg = load_config("dsv3")
    s = SCALES["dsv3"]
    assert s.heads * 8 == cfg.num_heads and s.layers == cfg.num_layers, (s, cfg)
