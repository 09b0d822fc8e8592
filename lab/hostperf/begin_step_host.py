"""Host time of the decode step's planning: ``model.begin_step``, ``DecodeRunner.begin_step`` (each cancelled, as
``fp8mla bench step`` times them) and ``DecodeRunner.step`` with the lengths advancing (as ``fp8mla generate``
runs it), with a cProfile of each.

On the CPU (``--device cpu``, the default) the kernels never run: the Gluon backend is mocked in (sm_90 taken as
usable, 132 SMs, ``auto`` resolved as on a Hopper GPU), the runner's CUDA-graph bucket is made with its graph
buffers but no capture, and the graph replay is a no-op, so what is timed is the Python and host tensor work of
the GPU path. On a GPU (``--device cuda``) nothing is mocked; ``--sync-check`` runs each timed call once under
``torch.cuda.set_sync_debug_mode("warn")`` to show any device-to-host sync.

    cd <tree> && TRITON_INTERPRET=1 PYTHONPATH=$PWD/src python lab/hostperf/begin_step_host.py --config dsv3 \
        --layers 1 --batch 64 --ctx 8192
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def mock_gluon() -> None:
    """Plans as on an H200: the selector sees an sm_90 CUDA device with Triton (``auto`` then picks as there)."""
    import fp8mla.backends.gluon as gl
    import fp8mla.runtime as rt
    rt.gluon_usable = lambda d: True
    rt.device_tags = lambda d: frozenset({"cuda", "triton", "sm90"})
    rt.num_sms = gl.num_sms = lambda d: 132


def median_ms(fn, reps: int, sync) -> float:
    ts = []
    for i in range(reps + 1):
        sync()
        t = time.perf_counter()
        fn()
        dt = (time.perf_counter() - t) * 1e3
        if i:
            ts.append(dt)
    ts.sort()
    return ts[len(ts) // 2]


def profile(name: str, fn, n: int, top: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(f"--- {name}: cProfile of {n} calls\n{s.getvalue()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="dsv3")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--sync-check", action="store_true")
    a = p.parse_args()
    dev = torch.device(a.device)
    cpu = dev.type == "cpu"
    if cpu:
        torch.set_num_threads(1)
        mock_gluon()
    from fp8mla.models import DeepseekMLAModel, load_config
    from fp8mla.models.runner import DecodeRunner
    B, ctx, ps, steps = a.batch, a.ctx, a.page_size, 3 * a.reps + 20
    cfg = load_config(a.config)
    model = DeepseekMLAModel.random(cfg, num_layers=a.layers, dtype=torch.bfloat16, device=dev, backend=a.backend)
    cache = model.make_cache(-(-(B * (ctx + steps + 2 * ps)) // ps) + 1, ps, "fp8_e4m3")
    ids = [cache.add_sequence() for _ in range(B)]
    cache.reserve(ids, ctx - 1)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    runner = DecodeRunner(model, cache, max_batch=B, max_context=ctx + steps + ps, use_cuda_graph=not cpu)
    if cpu:  # the GPU path's bucket (graph buffers, staged re-plans) without a capture or a replay
        runner.use_cuda_graph = True
        runner._capture = lambda g: None
        runner._run_bucket = lambda g: runner.x
        runner.is_graph_step = lambda p, c: True
    eager = lambda: model.begin_step(cache, ids, [1] * B).cancel()  # noqa: E731
    begin = lambda: runner.begin_step(ids, [cache.seq_len(s) for s in ids]).cancel()  # noqa: E731
    x = torch.randn(B, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    step = lambda: runner.step(ids, [1] * B, x)  # noqa: E731
    print(f"{a.config} layers={a.layers} B={B} ctx={ctx} page={ps} backend={a.backend} device={dev}"
          f"{' (gluon mocked, no kernels)' if cpu else ''}")
    for name, fn in (("model.begin_step + cancel", eager), ("runner.begin_step + cancel", begin),
                     ("runner.step (advancing)", step)):
        fn()
        if a.sync_check and not cpu:
            torch.cuda.set_sync_debug_mode("warn")
            fn()
            torch.cuda.set_sync_debug_mode(0)
        print(f"{name}: median {median_ms(fn, a.reps, sync):.4f} ms (host)")
    g = runner._graphs.get(B) or next(iter(runner._graphs.values()))
    print(f"runner bucket: fast re-plan {g.fast}, backend {runner.last_step.paged.backend}")
    for name, fn in (("model.begin_step + cancel", eager), ("runner.begin_step + cancel", begin),
                     ("runner.step (advancing)", step)):
        profile(name, fn, 100, a.top)
    runner.close()


if __name__ == "__main__":
    main()
