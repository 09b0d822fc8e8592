"""Tensor-parallel MLA on CPU: 2 processes over gloo give the single-process outputs (same weights and inputs).

The NCCL/GPU variant of the same check needs 2 GPUs and is not run here.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8mla.models import DeepseekMLAModel, load_config
from fp8mla.testing import compare

WORLD = 2
FORMATS = ("bf16", "fp8_e4m3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(model, kv_format: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill 3 sequences, then decode steps where one leaves, one joins and one prefills in two chunks.
    Returns the outputs of every step and the final page table."""
    g = torch.Generator().manual_seed(11)
    D = model.cfg.hidden_size
    cache = model.make_cache(num_pages=48, page_size=4, kv_format=kv_format)
    ids = [cache.add_sequence() for _ in range(3)]
    outs = [model(torch.randn(17, D, generator=g), model.begin_step(cache, ids, [9, 1, 7]))]
    for t in range(6):
        counts = [1] * len(ids)
        if t == 2:
            cache.free(ids.pop(0))
            counts.pop()
        if t in (3, 4):  # a newcomer's prompt in two chunks: the second attends its cached prefix
            if t == 3:
                ids.append(cache.add_sequence())
                counts.append(6)
            else:
                counts[-1] = 5
        x = torch.randn(sum(counts), D, generator=g)
        outs.append(model(x, model.begin_step(cache, ids, counts)))
    return outs, [cache.pages(i) for i in ids]


def _worker(rank: int, port: int, ckpt: str, result: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small CPU: oversubscribed threads would only slow down
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD
        loaded = DeepseekMLAModel.from_pretrained(ckpt, dtype=torch.float32, tp_group=group, backend="torch")
        outs = {f: schedule(loaded, f) for f in FORMATS}
        rnd = DeepseekMLAModel.random("tiny", 1, seed=4, dtype=torch.float32, tp_group=group)
        shards = {k: v for k, v in rnd.state_dict().items()}
        torch.save(dict(outs=outs, shards=shards, heads=loaded.num_local_heads), f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


def _save_checkpoint(model: DeepseekMLAModel, path) -> None:
    import json
    from safetensors.torch import save_file
    c = model.cfg
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads, "num_hidden_layers": c.num_layers,
        "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings}))
    save_file({"model." + k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def test_tp2_gloo_matches_single_process(tmp_path):
    pytest.importorskip("safetensors")
    full = DeepseekMLAModel.random("tiny", seed=2, dtype=torch.float32, backend="torch")
    _save_checkpoint(full, tmp_path / "ckpt")
    result = str(tmp_path / "out")
    mp.start_processes(_worker, args=(free_port(), str(tmp_path / "ckpt"), result), nprocs=WORLD, join=True,
                       start_method="spawn")
    ranks = [torch.load(f"{result}.{r}") for r in range(WORLD)]
    H = full.cfg.num_heads
    assert [r["heads"] for r in ranks] == [H // WORLD] * WORLD
    for f in FORMATS:
        want, pages = schedule(full, f)
        for r in ranks:
            assert r["outs"][f][1] == pages  # every rank's cache has the single-process page tables
            for step, (got, ref) in enumerate(zip(r["outs"][f][0], want)):
                # fp32 weights; the all-reduce sums the heads' partial o_proj outputs in another order, and a
                # bf16 rounding of an attention input may flip (measured <= 4e-4).
                c = compare(got, ref)
                assert c.nan_mismatch == 0 and c.rel_l2 < 2e-3, f"{f} step {step}: {c}"
    # random weights drawn per head: each rank's split equals the single-process tensors, split
    single = DeepseekMLAModel.random("tiny", 1, seed=4, dtype=torch.float32).state_dict()
    c = load_config("tiny")
    widths = {"q_b_proj.weight": (0, c.qk_head_dim), "kv_b_proj.weight": (0, c.qk_nope_head_dim + c.v_head_dim),
              "o_proj.weight": (1, c.v_head_dim)}
    for name, w in single.items():
        parts = [r["shards"][name] for r in ranks]
        key = name.split("self_attn.")[-1]
        if key in widths:
            assert torch.equal(torch.cat(parts, dim=widths[key][0]), w), name
        else:
            assert all(torch.equal(p, w) for p in parts), name


def test_torchrun_generate_tp2():
    """`torchrun --nproc-per-node 2 -m fp8mla generate --tp 2` runs over gloo on CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           f"--master-port={free_port()}", "-m", "fp8mla", "generate", "--tp", str(WORLD), "--config", "tiny",
           "--prompts", "3", "--prompt-len", "8", "--max-new-tokens", "3", "--device", "cpu", "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 per rank, tp 2" in p.stdout and "done: 3 requests" in p.stdout
    assert p.stdout.count("done: 3 requests") == 1  # only rank 0 prints


def test_torchrun_bench_step_tp2(tmp_path):
    """`torchrun --nproc-per-node 2 -m fp8mla bench step --tp 2` (gloo dry run on the CPU): heads split, one table,
    the runner's padded step equal to the eager one, then the tp 1 reference on rank 0 and the speed-up, a CSV."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           f"--master-port={free_port()}", "-m", "fp8mla", "bench", "step", "--tp", str(WORLD), "--config", "tiny",
           "--layers", "1", "--batches", "1,3", "--contexts", "40", "--reps", "2", "--device", "cpu",
           "--page-size", "4", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 per rank, tp 2" in p.stdout and "DRY RUN" in p.stdout
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.strip().startswith(("1 ", "3 "))]
    assert [ln[:2] for ln in lines] == [["1", "40"], ["3", "40"]]  # one row per point, printed by rank 0 only
    assert all(float(ln[2]) > 0 for ln in lines)
    assert all(float(ln[ln.index("rel_l2") + 1]) < 1e-5 for ln in lines)  # graph-runner path vs eager
    assert p.stdout.count("tp 2 speed-up") == 2 and "tp 1 on rank 0" in p.stdout
    assert (tmp_path / "step_model_tp2_page4.csv").exists()
