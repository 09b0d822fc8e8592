"""`fp8mla generate`: the attention-only continuous-batching decode loop, on the tiny config (CPU, seconds)."""
from __future__ import annotations

import json

import pytest
import torch

from fp8mla.cli import main
from fp8mla.models import DeepseekMLAModel, load_config


def run(capsys, *argv):
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "bf16"])
def test_generate_random_tiny(capsys, kv_format):
    rc, out, err = run(capsys, "--config", "tiny", "--prompts", "5", "--prompt-len", "12", "--max-new-tokens", "4",
                       "--max-batch", "2", "--page-size", "4", "--kv-format", kv_format, "--dtype", "fp32",
                       "--device", "cpu")
    assert rc == 0, err
    assert "generated tok/s" in out and f"cache: {kv_format}" in out
    # 5 requests with 2 at a time: later ones join as earlier ones leave, so every request completes
    assert "done: 5 requests" in out
    assert "done 5/5" in err  # the progress display


def test_generate_from_checkpoint(tmp_path, capsys):
    """A checkpoint directory in the Hugging Face layout (config.json + safetensors) drives the loop."""
    safetensors = pytest.importorskip("safetensors.torch")
    cfg = load_config("tiny")
    model = DeepseekMLAModel.random(cfg, dtype=torch.float32, seed=3)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}))
    safetensors.save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()},
                          str(tmp_path / "model.safetensors"))
    loaded = DeepseekMLAModel.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    rc, out, err = run(capsys, "--checkpoint", str(tmp_path), "--prompts", "3", "--prompt-len", "6",
                       "--max-new-tokens", "3", "--layers", "all", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "2 of 2 layers" in out and "done: 3 requests" in out


@pytest.mark.parametrize("argv, msg", [
    (["--tp", "2"], "torchrun"),
    (["--prompts", "0"], "--prompts"),
    (["--layers", "x"], "--layers"),
    (["--config", "no-such-model"], "config"),
])
def test_generate_errors_name_the_argument(capsys, argv, msg):
    rc, out, err = run(capsys, "--device", "cpu", "--no-progress", *argv)
    assert rc == 2 and msg in err, err


def test_block_scaled_fp8_checkpoint_is_dequantized(tmp_path):
    """Published DeepSeek-V3/Kimi-K2 weights are e4m3 with one fp32 `weight_scale_inv` per 128x128 block."""
    safetensors = pytest.importorskip("safetensors.torch")
    from fp8mla.models.checkpoint import CheckpointReader
    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5                       # ceil(200/128) x ceil(300/128) blocks
    full = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    stored = (w / full).to(torch.float8_e4m3fn)
    safetensors.save_file({"a.weight": stored, "a.weight_scale_inv": scale, "b.weight": w},
                          str(tmp_path / "model.safetensors"))
    r = CheckpointReader(tmp_path)
    assert torch.equal(r.get("a.weight"), stored.float() * full)
    assert torch.equal(r.get("b.weight")[:, 5:9], w[:, 5:9])  # plain tensors are read lazily, by slice
