"""`fp8mla generate`: the attention-only continuous-batching decode loop, on the tiny config (CPU, seconds)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp8mla.models
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


@pytest.mark.parametrize("flag", ["--prompt-len", "--max-new-tokens", "--max-batch", "--page-size", "--prompts"])
def test_generate_sizes_past_memory_name_the_flag(capsys, flag):
    """10**12-token sizes: refused before anything is allocated, naming the flag (was: a raw allocator error)."""
    rc, out, err = run(capsys, "--device", "cpu", "--no-progress", flag, str(10**12))
    assert rc == 2 and f"{flag} {10**12}" in err.replace(": ", " ") and "memory" in err, err
    assert "alloc" not in err and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_generate_cuda_without_cuda_names_the_device(capsys):
    rc, out, err = run(capsys, "--device", "cuda", "--no-progress", "--prompts", "1")
    assert rc == 2 and "--device" in err and "no CUDA device" in err and "Traceback" not in err, err


@pytest.mark.parametrize("text, msg", [
    ("{not json", "is not a valid JSON file"),
    ("[1, 2]", "expected an object"),
])
def test_generate_corrupt_config_names_the_file(tmp_path, capsys, text, msg):
    path = tmp_path / "broken.json"
    path.write_text(text)
    rc, out, err = run(capsys, "--config", str(path), "--device", "cpu", "--no-progress")
    assert rc == 2 and str(path) in err and msg in err, err


@pytest.mark.parametrize("scaling, msg", [
    ({"type": "yarn", "original_max_position_embeddings": 128}, "'factor'"),
    ({"type": "yarn", "factor": "8", "original_max_position_embeddings": 128}, "'factor'"),
    ({"type": "yarn", "factor": 8, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
])
def test_generate_yarn_without_factor(tmp_path, capsys, scaling, msg):
    cfg = json.loads((Path(fp8mla.models.__file__).parent / "configs" / "tiny.json").read_text())
    cfg["rope_scaling"] = scaling
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = run(capsys, "--config", str(path), "--device", "cpu", "--no-progress")
    assert rc == 2 and "rope_scaling" in err and msg in err and "Traceback" not in err, err


def test_generate_eager_flag_on_cpu(capsys):
    rc, out, err = run(capsys, "--config", "tiny", "--prompts", "2", "--prompt-len", "4", "--max-new-tokens", "2",
                       "--device", "cpu", "--no-progress", "--eager")
    assert rc == 0, err
    assert "steps: eager (--eager)" in out and "generated tok/s" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_generate_graphs_on_gpu_and_eager(capsys):
    argv = ["--config", "tiny", "--prompts", "6", "--prompt-len", "8", "--max-new-tokens", "6", "--max-batch", "4",
            "--no-progress"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "CUDA graphs:" in out and "decode steps replayed" in out and "generated tok/s" in out
    rc, out, err = run(capsys, *argv, "--eager")
    assert rc == 0 and "steps: eager" in out, err


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
