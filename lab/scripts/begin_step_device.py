"""Issue 13 item 3 on one GPU: the decode runner's begin_step host time, in < 60 s and < 20 GB.

    python scripts/begin_step_device.py [OUTDIR]        (repo root; OUTDIR default out/begin_step, or $OUT)

DeepSeek-V3 shape (128 heads), 2 layers, FP8 e4m3 cache filled with random latents. Per point (B, context, page):
- begin (runner): DecodeRunner.begin_step host ms, median of REPS (default 30) after warm-up (the first call
  captures the bucket's graph); each step is cancelled right after, untimed (as `fp8mla bench step --model`).
  The same step repeated: the host schedules' memo of the last step hits (a decode step within the same tiles /
  splits, see backends._gluon_host_schedule / backends.triton schedule_host);
- cold: the same with those memos cleared before each call (a step where a request crosses a 64-token tile: ~2/3
  of B=64 steps with spread lengths on the gluon plan, ~1/4 on the triton plan; every 64th of a uniform batch);
- begin (eager): model.begin_step host ms (the non-runner path), median;
- ops: torch ops one runner begin_step dispatches / those that launch on the GPU (an op with a CUDA tensor
  argument: the staged copy, the scatter, the gather; the pinning of the staged host buffer is CPU work);
- sync-free: one runner begin_step under torch.cuda.set_sync_debug_mode("error");
- rel L2: the graph step's output against the eager step's (same cache, same token);
- attention: the backend that planned the runner's step (gluon / triton), "forced" when the point forces it.
Targets: begin (runner) <= 0.3 ms at B=64 page 64, <= 1 ms at B=64 ctx 8192 page 1.
Env: REPS (30), BACKEND (auto; "triton" forces the host-scheduled Triton plan), DRY=1 (CPU plumbing check).
Writes OUTDIR/begin_step.csv and OUTDIR/profile_*.txt (cProfile of 20 runner begin_steps, by cumulative time).
"""
from __future__ import annotations

import cProfile
import csv
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from fp8mla.models import DeepseekMLAModel, load_config  # noqa: E402
from fp8mla.models.runner import DecodeRunner  # noqa: E402

# (B, ctx, page, backend): None = the model's (BACKEND, default auto: gluon on the H200 at 128 heads FP8 page 64,
# triton at page 1); the forced-triton point beside the auto one compares the two plans' host work.
POINTS = [(64, 8192, 64, None), (64, 8192, 64, "triton"), (64, 8192, 1, None), (1, 4096, 64, None)]
NO_LAUNCH = {"slice", "select", "view", "lift_fresh", "alias", "as_strided", "detach", "unsqueeze", "expand"}
KEY_FUNCS = ("reserve_slots", "_plan", "_replan_rows", "replan_rows", "build", "schedule_host", "pack_ints",
             "packed")


def clear_schedule_memos() -> None:
    from fp8mla.backends import _gluon_host_schedule, triton
    triton._LAST_SPLIT = _gluon_host_schedule._LAST_ITEMS = None


def median_ms(fn, reps: int, cold: bool = False) -> float:
    times = []
    for i in range(reps + 1):
        if cold:
            clear_schedule_memos()
        t = time.perf_counter()
        st = fn()
        dt = (time.perf_counter() - t) * 1e3
        st.cancel()
        if i:
            times.append(dt)
    times.sort()
    return times[len(times) // 2]


def count_ops(fn) -> tuple[int, int, dict]:
    from torch.utils._python_dispatch import TorchDispatchMode
    ops: dict = {}

    launches: dict = {}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            k = func.overloadpacket.__name__
            ops[k] = ops.get(k, 0) + 1
            out = func(*args, **(kwargs or {}))
            ts = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
            # launching: an op on CUDA tensors (on the CPU, DRY: every op but views)
            if any(t.is_cuda for t in ts) or (not torch.cuda.is_available() and k not in NO_LAUNCH):
                launches[k] = launches.get(k, 0) + 1
            return out
    with Mode():
        st = fn()
    st.cancel()
    return sum(ops.values()), sum(launches.values()), launches


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "out/begin_step")
    os.makedirs(out, exist_ok=True)
    reps = int(os.environ.get("REPS", "30"))
    dry = os.environ.get("DRY") == "1"  # the plumbing on the CPU: tiny config, no graphs; not a benchmark
    if not dry and not torch.cuda.is_available():
        print("needs a CUDA device (DRY=1: a CPU plumbing check)", file=sys.stderr)
        return 2
    t0 = time.time()
    dev = torch.device("cpu" if dry else "cuda")
    cfg = load_config("tiny" if dry else "dsv3")
    points = [(4, 64, 4, None), (4, 64, 4, "triton"), (4, 64, 1, None), (1, 32, 4, None)] if dry else POINTS
    backend = os.environ.get("BACKEND", "auto")  # auto: what serving gets (triton at H=128 unless gluon takes it)
    model = DeepseekMLAModel.random(cfg, num_layers=2, dtype=torch.float32 if dry else torch.bfloat16, device=dev,
                                    backend=backend)
    name = "CPU DRY RUN" if dry else torch.cuda.get_device_name(dev)
    print(f"{'tiny' if dry else 'dsv3'} shape, 2 layers, {cfg.num_heads} heads, FP8 e4m3 cache, {name}, "
          f"torch {torch.__version__}; model built in {time.time() - t0:.1f} s; reps {reps}", flush=True)
    hdr = (f"{'B':>3} {'ctx':>5} {'page':>4} {'begin runner ms':>15} {'cold':>6} {'begin eager ms':>14} "
           f"{'ops/launch':>10} {'sync-free':>9} {'graph vs eager rel L2':>21}  attention")
    print(hdr, flush=True)
    rows, ok = [], True
    for B, ctx, page, force in points:
        model.backend = force or backend  # the runner's and the eager step's plans (a plain attribute)
        cache = model.make_cache(-(-B * (ctx + 2 * page) // page), page, "fp8_e4m3")
        ids = [cache.add_sequence() for _ in range(B)]
        slots = cache.reserve(ids, ctx - 1)
        g = torch.Generator(device=dev).manual_seed(B + ctx + page)
        for layer in range(len(model.layers)):
            for a in range(0, slots.numel(), 1 << 16):
                s = slots[a: a + (1 << 16)]
                cache.write(layer, s, torch.randn(s.numel(), cfg.kv_lora_rank, generator=g, device=dev),
                            torch.randn(s.numel(), cfg.qk_rope_head_dim, generator=g, device=dev))
        x = torch.randn(B, cfg.hidden_size, generator=g, device=dev).to(model.dtype)
        prefix = [ctx - 1] * B
        r = dict(B=B, ctx=ctx, page=page, requested=model.backend)
        r["begin_eager_ms"] = median_ms(lambda: model.begin_step(cache, ids, [1] * B),
                                        min(reps, 10) if page == 1 else reps)
        st = model.begin_step(cache, ids, [1] * B)
        y_eager = model(x, st)
        cache.unreserve(ids)
        runner = DecodeRunner(model, cache, max_batch=B, max_context=ctx + page)
        if dry:  # the CPU: the graph path's plan into CUDA-graph buffers, run without capture (as the CPU tests)
            runner.use_cuda_graph, runner._capture = True, lambda g: None
        try:
            r["begin_ms"] = median_ms(lambda: runner.begin_step(ids, prefix), reps)
            r["begin_cold_ms"] = median_ms(lambda: runner.begin_step(ids, prefix), reps, cold=True)
            r["ops"], r["launches"], launches = count_ops(lambda: runner.begin_step(ids, prefix))
            r["launch_ops"] = " ".join(f"{k}:{v}" for k, v in sorted(launches.items()))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                runner.begin_step(ids, prefix).cancel()
            pr.disable()
            sio = io.StringIO()
            stats = pstats.Stats(pr, stream=sio)
            stats.sort_stats("cumulative").print_stats(40)
            with open(os.path.join(out, f"profile_B{B}_ctx{ctx}_page{page}_{model.backend}.txt"), "w") as f:
                f.write(sio.getvalue())
            per = {fn[2]: v[3] / 20 * 1e3 for fn, v in stats.stats.items() if fn[2] in KEY_FUNCS}
            r["profile_ms"] = " ".join(f"{k}={per[k]:.3f}" for k in KEY_FUNCS if k in per)
            st = None
            if dry:
                r["sync_free"] = "yes"  # nothing to check on the CPU
            else:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    st = runner.begin_step(ids, prefix)
                    r["sync_free"] = "yes"
                except RuntimeError as e:  # begin_step gave its reservation back
                    r["sync_free"] = f"NO: {str(e).splitlines()[0][:80]}"
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if st is None:
                st = runner.begin_step(ids, prefix)
            y = runner.forward(x, st)
            r["rel_l2"] = float((y.float() - y_eager.float()).norm() / y_eager.float().norm().clamp_min(1e-30))
            r["graph"] = runner.stats["captures"] > 0
            r["backend"] = st.paged.backend
            cache.unreserve(ids)
        finally:
            runner.close()
        ok &= r["rel_l2"] < 1e-2 and r["sync_free"] == "yes"
        print(f"{B:>3} {ctx:>5} {page:>4} {r['begin_ms']:>15.3f} {r['begin_cold_ms']:>6.3f} {r['begin_eager_ms']:>14.3f} "
              f"{r['ops']:>4}/{r['launches']:<5} {r['sync_free'][:9]:>9} {r['rel_l2']:>21.1e}  "
              f"{r['backend']}{' (forced)' if force else ''}{'' if r['graph'] else ' (no graph!)'}", flush=True)
        print(f"      launches: {r['launch_ops']}; cProfile per call (ms, inflated): {r['profile_ms']}", flush=True)
        rows.append(r)
        for i in ids:
            cache.free(i)
        del cache
        if not dry:
            torch.cuda.empty_cache()
    with open(os.path.join(out, "begin_step.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    model.backend = backend
    print(f"targets: B=64 page 64 <= 0.3 ms: {rows[0]['begin_ms']:.3f} cold {rows[0]['begin_cold_ms']:.3f} "
          f"({rows[0]['backend']}; triton {rows[1]['begin_ms']:.3f} cold {rows[1]['begin_cold_ms']:.3f}); B=64 ctx "
          f"8192 page 1 <= 1 ms: {rows[2]['begin_ms']:.3f}; peak GPU memory "
          f"{0 if dry else torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; "
          f"{time.time() - t0:.0f} s; checks {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
