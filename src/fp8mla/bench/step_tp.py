"""``fp8mla bench step --tp N``: one decode step of the DeepSeek MLA layer stack, heads split over N ranks.

Launch: ``torchrun --nproc-per-node N -m fp8mla bench step --tp N [--config dsv3] [--layers L]``. Each rank holds
``num_heads / N`` heads (q_b_proj / kv_b_proj column-split, o_proj row-split + all-reduce) and its own paged FP8
cache with the same page tables (fp8mla.models.parallel). For every (B, context) the cache is filled with random
latents (quantize-on-write, no prefill compute), then one decode step (every layer: absorbed queries, paged FP8
attention, o_proj, all-reduce) is timed; rank 0 prints ms per step and tokens/s. NCCL on GPUs (keep
NCCL_NVLS_ENABLE=0 where NVLink multicast must stay off), gloo on CPUs (a dry run of the plumbing: its times are
not a benchmark).
"""
from __future__ import annotations

import statistics
import sys

import torch

from .common import _events_ms


def _time_ms(fn, reps: int, device: torch.device) -> float:
    """Median ms of ``fn()``: CUDA events on a GPU (no graph: the step plans on the host), wall clock on a CPU."""
    if device.type != "cuda":
        from .step import _cpu_time_ms
        return _cpu_time_ms(fn, reps)
    fn()
    return statistics.median(_events_ms(fn, reps))


def run_tp(args) -> int:
    """The ``--tp`` path of ``fp8mla bench step`` (arguments of fp8mla.bench.step.add_arguments)."""
    import torch.distributed as dist

    from ..models import DeepseekMLAModel, load_config
    from ..models.parallel import init_tensor_parallel

    device = None if args.device == "cuda" and not torch.cuda.is_available() else args.device
    if device is None:
        print("fp8mla bench step --tp: needs CUDA devices (or --device cpu for a gloo dry run)", file=sys.stderr)
        return 2
    group, dev = init_tensor_parallel(args.tp, device)
    rank = 0 if group is None else dist.get_rank(group)
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = load_config(args.config)
    layers = args.layers or cfg.num_layers
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = DeepseekMLAModel.random(cfg, num_layers=layers, dtype=dtype, device=dev, tp_group=group)
    page = 64
    pool_tokens = args.pool_tokens or max(b * c for b in args.batches for c in args.contexts) + page * max(
        args.batches)
    cache = model.make_cache(-(-pool_tokens // page), page, "fp8_e4m3")
    say(f"MLA decode step, {args.config}: {layers} layers, {cfg.num_heads} heads ({model.num_local_heads} per "
        f"rank, tp {args.tp}), FP8 e4m3 cache of {cache.num_pages * page:,} tokens per rank, {dev.type}"
        + (" (DRY RUN: gloo on the CPU, not a benchmark)" if dev.type == "cpu" else ""))
    say(f"{'B':>4} {'ctx':>7} {'ms/step':>10} {'tok/s':>10}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in args.batches:
        for ctx in args.contexts:
            if B * ctx + B * page > cache.num_pages * page:
                say(f"{B:>4} {ctx:>7}  skipped: {B} x {ctx} tokens exceed the pool")
                continue
            ids = [cache.add_sequence() for _ in range(B)]
            slots = cache.extend(ids, ctx)
            for layer in range(layers):  # the same random latents on every rank (same generator seed)
                c_kv = torch.randn(B * ctx, cfg.kv_lora_rank, generator=g).to(dev)
                k_pe = torch.randn(B * ctx, cfg.qk_rope_head_dim, generator=g).to(dev)
                cache.write(layer, slots, c_kv, k_pe)
            step = model.begin_step(cache, ids, [1] * B)
            x = torch.randn(B, cfg.hidden_size, generator=g).to(device=dev, dtype=dtype)
            with torch.no_grad():
                ms = _time_ms(lambda: model(x, step), args.reps, dev)
            rows.append((B, ctx, ms))
            say(f"{B:>4} {ctx:>7} {ms:>10.3f} {B / ms * 1e3:>10.1f}")
            for i in ids:
                cache.free(i)
    if group is not None:
        dist.barrier(group)
        dist.destroy_process_group()
    return 0 if rows else 1
