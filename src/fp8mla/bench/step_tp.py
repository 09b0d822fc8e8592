"""``fp8mla bench step --model`` / ``--tp N``: one decode step of the DeepSeek MLA layer stack, eager and replayed
from CUDA graphs (:class:`~fp8mla.models.runner.DecodeRunner`), heads optionally split over N ranks.

Launch: ``fp8mla bench step --model [--config dsv3] [--layers L]`` on one GPU, or
``torchrun --nproc-per-node N -m fp8mla bench step --tp N ...``: each rank holds ``num_heads / N`` heads and its own
paged FP8 cache with the same page tables (fp8mla.models.parallel); its graphs hold the NCCL all-reduce. With
``--tp N > 1`` rank 0 then times the same config and shape with all heads on its own GPU (``--tp 1``) while the
others wait, and prints the speed-up. NCCL on GPUs (keep NCCL_NVLS_ENABLE=0 where NVLink multicast must stay off),
gloo on CPUs (a dry run of the plumbing: eager, no graphs; its times are not a benchmark).

For every (B, context) the cache is filled with random latents (quantize-on-write, no prefill compute), then, per
step: ``begin_step`` (host ms: reserving one slot per sequence and planning; the runner's O(batch) planning and the
model's eager one), the eager step ``model(x, step)`` and the graph replay (ms by CUDA events), the sum of the
kernels' device time of one eager step (profiler), and the roofline floor (weight + KV bytes at the read bandwidth
measured now, attention + projection FLOPs at the measured bf16 matmul rate).
"""
from __future__ import annotations

import csv
import os
import sys
import time

import torch

from .common import kernel_table, kernel_time_ms, measure_ceilings, step_time_ms


def _begin_step_ms(begin, reps: int) -> float:
    """Median host ms of ``begin()`` (a reservation + plan), each step cancelled right after (untimed)."""
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        st = begin()
        dt = (time.perf_counter() - t) * 1e3
        st.cancel()
        if i:  # the first one compiles / captures
            times.append(dt)
    times.sort()
    return times[len(times) // 2]


def _layer_bytes_flops(model, B: int, ctx: int, cache) -> tuple[float, float]:
    """Bytes and FLOPs of one layer's decode step on this rank: weights read once, the batch's KV read once."""
    blk = model.layers[0]
    params = sum(p.numel() for p in blk.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in blk.parameters())
    H = model.num_local_heads
    kv = cache.bytes_per_token * B * ctx
    flops = 2 * B * params + 2 * B * H * ctx * (cache.head_dim_ckv + cache.head_dim_kpe + cache.head_dim_ckv)
    return wbytes + kv, flops


def _fill(cache, ids: list, ctx: int, layers: int, cfg, dev, seed: int) -> None:
    """``ctx - 1`` tokens of random latents per sequence (the same on every rank: one seeded generator)."""
    slots = cache.reserve(ids, ctx - 1)
    g = torch.Generator(device=dev).manual_seed(seed)
    chunk = 1 << 16
    for layer in range(layers):
        for a in range(0, slots.numel(), chunk):
            s = slots[a: a + chunk]
            cache.write(layer, s, torch.randn(s.numel(), cfg.kv_lora_rank, generator=g, device=dev),
                        torch.randn(s.numel(), cfg.qk_rope_head_dim, generator=g, device=dev))


def measure(model, cache, B: int, ctx: int, reps: int, dev, *, graphs: bool, seed: int = 0,
            profile: bool = False) -> dict:
    """One (B, context) point on ``model`` / ``cache``: begin_step host ms, eager and graph ms per step, kernels.
    ``profile``: also print the graph step's top kernels (``kernel_table``) to stderr."""
    from ..models.runner import DecodeRunner
    cfg, layers = model.cfg, len(model.layers)
    ids = [cache.add_sequence() for _ in range(B)]
    try:
        _fill(cache, ids, ctx, layers, cfg, dev, seed)
        prefix = [ctx - 1] * B
        x = torch.randn(B, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1)).to(dev, model.dtype)
        r = dict(B=B, ctx=ctx)
        r["begin_eager_ms"] = _begin_step_ms(lambda: model.begin_step(cache, ids, [1] * B), reps)
        st = model.begin_step(cache, ids, [1] * B)
        with torch.no_grad():
            y_eager = model(x, st)
            r["eager_ms"] = step_time_ms(lambda: model(x, st), reps, dev)
            if dev.type == "cuda":
                try:
                    r["kernels_ms"], r["kernels"] = kernel_time_ms(lambda: model(x, st))
                    if model.fused:  # before/after the fused kernels: the same step in torch ops
                        cache.unreserve(ids)
                        model.fused = False
                        try:
                            st2 = model.begin_step(cache, ids, [1] * B)
                            r["unfused_ms"] = step_time_ms(lambda: model(x, st2), reps, dev)
                            r["unfused_kernels_ms"], r["unfused_kernels"] = kernel_time_ms(lambda: model(x, st2))
                        finally:
                            model.fused = True
                        cache.unreserve(ids)
                        st = model.begin_step(cache, ids, [1] * B)
                except Exception as e:  # noqa: BLE001 - the profiler is a measurement aid; say why it is missing
                    print(f"kernel time not measured: {type(e).__name__}: {e}", file=sys.stderr)
        r["backend"] = st.paged.backend
        cache.unreserve(ids)
        runner = DecodeRunner(model, cache, max_batch=B, max_context=ctx + cache.page_size,
                              use_cuda_graph=graphs and dev.type == "cuda")
        try:
            r["begin_ms"] = _begin_step_ms(lambda: runner.begin_step(ids, prefix), reps)
            st = runner.begin_step(ids, prefix)
            out = runner.forward(x, st)
            r["graph_ms"] = step_time_ms(lambda: runner.forward(x, st), reps, dev)
            if dev.type == "cuda" and profile:
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                for name, ms, n in kernel_table(lambda: runner.forward(x, st)):
                    print(f"  [profile rank {rank} B={B} ctx={ctx} graph step] {ms:8.4f} ms  x{n:<4d} {name}",
                          file=sys.stderr)
            r["graph"] = runner.stats["captures"] > 0
            r["capture_error"] = runner.stats.get("capture_error", "")
            r["graph_backend"] = st.paged.backend
            r["rel_l2"] = float((out.float() - y_eager.float()).norm() / y_eager.float().norm().clamp_min(1e-30))
            cache.unreserve(ids)
        finally:
            runner.close()
        return r
    finally:
        for i in ids:
            cache.free(i)


def run_tp(args) -> int:
    """The ``--model`` / ``--tp`` path of ``fp8mla bench step`` (arguments of fp8mla.bench.step.add_arguments)."""
    import torch.distributed as dist

    from ..models import DeepseekMLAModel, load_config
    from ..models.parallel import init_tensor_parallel

    if args.device == "cuda" and not torch.cuda.is_available():
        print("fp8mla bench step --model/--tp: needs CUDA devices (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    group, dev = init_tensor_parallel(args.tp, args.device)
    rank = 0 if group is None else dist.get_rank(group)
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = load_config(args.config)
    layers = args.layers or cfg.num_layers
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    page = args.page_size
    points = args.points or [(b, c) for b in args.batches for c in args.contexts]
    pool_tokens = args.pool_tokens or max(b * (c + 2 * page) for b, c in points)
    ceil = measure_ceilings(dev) if dev.type == "cuda" and args.ceilings else None
    graphs = args.cuda_graph and dev.type == "cuda"

    def build(tp_group):
        m = DeepseekMLAModel.random(cfg, num_layers=layers, dtype=dtype, device=dev, tp_group=tp_group)
        return m, m.make_cache(-(-pool_tokens // page), page, "fp8_e4m3")

    model, cache = build(group)
    say(f"MLA decode step, {args.config}: {layers} layers, {cfg.num_heads} heads ({model.num_local_heads} per rank, "
        f"tp {args.tp}), FP8 e4m3 cache, page {page}, pool {cache.num_pages * page:,} tokens per rank, {dev}"
        + (" (DRY RUN: gloo/eager on the CPU, not a benchmark)" if dev.type == "cpu" else ""))
    if ceil:
        say(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    cols = ("B", "ctx", "begin_ms", "begin_eager_ms", "eager_ms", "graph_ms", "kernels_ms", "floor_ms")
    say("per step (all layers): begin_ms = runner.begin_step host ms, begin_eager_ms = model.begin_step; "
        "graph/kernels and graph/floor are per-layer ratios")
    say(" ".join(f"{c:>14}" for c in cols) + f" {'graph/kern':>10} {'graph/floor':>11} {'tok/s':>9}")
    rows = []
    for B, ctx in points:
        if B * (ctx + 2 * page) > cache.num_pages * page:
            say(f"{B:>14} {ctx:>14}  skipped: {B} x {ctx} tokens exceed the pool")
            continue
        r = measure(model, cache, B, ctx, args.reps, dev, graphs=graphs, profile=getattr(args, "profile", False))
        nbytes, flops = _layer_bytes_flops(model, B, ctx, cache)
        r["floor_ms"] = layers * ceil.floor_ms(nbytes, flops) if ceil else float("nan")
        r.setdefault("kernels_ms", float("nan"))
        r["tp"], r["layers"], r["page"] = args.tp, layers, page
        rows.append(r)
        say(" ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols)
            + f" {r['graph_ms'] / r['kernels_ms']:>10.2f} {r['graph_ms'] / r['floor_ms']:>11.2f}"
            + f" {B / r['graph_ms'] * 1e3:>9.0f}  graph vs eager rel_l2 {r['rel_l2']:.1e}  attention "
            f"{r['backend']}/{r['graph_backend']}"
            + ("" if r["graph"] or not graphs else f"  (no graph: {r.get('capture_error')})"), flush=True)
        if "kernels" in r:
            say(f"{'':>14} kernels per step: {r['kernels']} fused"
                + (f", {r['unfused_kernels']} in torch ops (eager {r['unfused_ms']:.3f} ms, kernels "
                   f"{r['unfused_kernels_ms']:.3f} ms)" if "unfused_kernels" in r else ""))
    if group is not None:
        # The same config and shape on one GPU (rank 0, all heads) while the other ranks wait: the speed-up.
        dist.barrier(group)
        if rank == 0:
            del model, cache
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            model1, cache1 = build(None)
            say(f"tp 1 on rank 0's device ({model1.num_local_heads} heads), same config and shapes:")
            for r in rows:
                r1 = measure(model1, cache1, r["B"], r["ctx"], args.reps, dev, graphs=graphs)
                for k in ("eager_ms", "graph_ms"):
                    r[f"tp1_{k}"] = r1[k]
                say(f"  B={r['B']} ctx={r['ctx']}: tp 1 graph {r1['graph_ms']:.3f} ms, eager {r1['eager_ms']:.3f} ms"
                    f" -> tp {args.tp} speed-up {r1['graph_ms'] / r['graph_ms']:.2f}x (graphs), "
                    f"{r1['eager_ms'] / r['eager_ms']:.2f}x (eager)")
        dist.barrier(group)
        dist.destroy_process_group()
    if rank == 0 and rows:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"step_model_tp{args.tp}_page{page}.csv")
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        say(f"wrote {path}")
    return 0 if rows else 1

