"""``fp8mla demo``: the main job, in two parts.

1. Formats: a PagedMLACache of several sequences of different lengths in each KV format; tokens appended with
   quantize-on-write; a decode step and a multi-token step through ``MLAPagedAttention``; bytes per token,
   memory saved vs BF16, error vs the float64 reference and time per call.
2. The 69%-cast scenario in small: the attention of one decode step over N layers on a paged FP8 pool, run as
   ``cast_pool`` (the legacy whole-pool ``.to(bfloat16)``, a baseline kept only to be measured),
   ``gather_cast`` (the gather-then-cast strategy: the batch's tokens gathered and cast to BF16, then the
   16-bit kernel: Triton on a GPU, torch on the CPU) and ``native``; each profiled with torch.profiler and its
   trace read by the doctor. Every row says which backend it ran.

CPU by default at a small size (well under a minute on two cores); on a GPU, ``--scale glm5|dsv3`` runs the
deployments' sizes. The results stay in a folder named at the end (``--out``, default
``./fp8mla-demo-<UTC time>/``): the summary as Markdown and CSV, a PNG of the step time by way, a PNG of where a
cast-pool step's time goes, and the profiler traces (``traces/``, for ``fp8mla doctor``); see
:mod:`fp8mla.commands.demo_output` for what each time means (timed steps vs the profiled one).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

from .. import __version__
from ..attention import MLAPagedAttention
from ..bench.step import (HEAD_DIM_CKV as DC, HEAD_DIM_KPE as DK, SCALES, SM_SCALE, WAYS, StepScenario,
                          peak_from_trace, spread_context_lens)
from ..cache import PagedMLACache
from ..formats import FORMATS
from ..reference import mla_reference
from ..testing import compare
from . import demo_output

FORMAT_SEQ_LENS = (1, 17, 97, 300, 514)  # crosses page boundaries: 1 token, page +- 1, several pages
MTP = 3          # query tokens per sequence in the multi-token step (speculative / MTP decode)
PAGE = 64
BF16_BYTES = FORMATS["bf16"].bytes_per_token()


def add_arguments(p):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=dev, help=f"cpu or cuda (default here: {dev})")
    p.add_argument("--scale", choices=list(SCALES), default=None,
                   help="scenario size: " + "; ".join(f"{k}: {s.what}" for k, s in SCALES.items())
                   + " (default: small on the CPU, glm5 on a GPU)")
    p.add_argument("--layers", type=int, help="override the scale's layer count")
    p.add_argument("--heads", type=int, help="override the scale's heads")
    p.add_argument("--pool-tokens", type=int, help="override the scale's pool size (tokens per layer)")
    p.add_argument("--batch", type=int, help="decode requests in the scenario")
    p.add_argument("--context", type=int, help="longest context of the scenario's batch (others down to 1/4)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per measurement (median)")
    p.add_argument("--part", choices=["all", "formats", "scenario"], default="all",
                   help="formats: part 1 only; scenario: part 2 only")
    p.add_argument("--shared-pool", action=argparse.BooleanOptionalAction, default=None,
                   help="one layer's pool reused by every layer (default: only when all layers do not fit)")
    p.add_argument("--cast-pool-backend", choices=["auto", "torch"], default="auto",
                   help="attention on cast_pool's BF16 copy (auto: the kernel native gets)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: torch's choice). On a busy machine 1 is often faster: "
                        "OpenMP threads spin waiting for each other when other processes hold the cores")
    p.add_argument("--out", help="folder for the results: summary.md/.csv, PNGs, traces (default "
                   "./fp8mla-demo-<UTC time>, made if missing)")
    p.add_argument("--trace-dir", help="write the profiler traces here instead of OUT/traces")


class Progress:
    """One status line on stderr, rewritten in place on a terminal; plain lines when stderr is not one."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.width = 0

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:6.1f}s] {msg}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = max(self.width, len(line))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, reps: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls (the caller warmed it up), synchronized on a GPU."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# -- part 1: formats ----------------------------------------------------------------------------------------
def run_formats(device: torch.device, heads: int, reps: int, progress) -> list[dict]:
    rows = []
    B, P = len(FORMAT_SEQ_LENS), sum(-(-(L + 1 + MTP) // PAGE) for L in FORMAT_SEQ_LENS) + 2
    for fmt in FORMATS.values():
        g = torch.Generator().manual_seed(0)  # the same values and queries for every format
        cache = PagedMLACache(1, P, PAGE, fmt.name, device=device)
        # The values before quantization, in the pool's layout: the reference on them adds the quantization
        # error to the kernel's, the reference on the dequantized pool shows the kernel's alone.
        orig = torch.full((P * PAGE, DC + DK), math.nan, dtype=torch.float32, device=cache.device)
        ids = [cache.add_sequence() for _ in FORMAT_SEQ_LENS]

        def append(counts):
            slots = cache.reserve(ids, counts)
            x = torch.randn(len(slots), DC + DK, generator=g).to(cache.device)
            cache.append(0, ids, x[:, :DC], x[:, DC:])
            orig[slots] = x

        append(list(FORMAT_SEQ_LENS))
        row = dict(format=fmt.name, bytes_per_token=fmt.bytes_per_token(),
                   saved=1 - fmt.bytes_per_token() / BF16_BYTES, cache_bytes=cache.memory_bytes())
        for step, qo in (("decode", 1), ("multi", MTP)):
            progress(f"formats: {fmt.name} {step}")
            append(qo)
            plan = cache.plan_inputs(ids, [qo] * B)
            attn = MLAPagedAttention(backend="auto")
            q_nope = torch.randn(B * qo, heads, DC, generator=g).to(cache.device, torch.bfloat16)
            q_pe = torch.randn(B * qo, heads, DK, generator=g).to(cache.device, torch.bfloat16)
            try:
                attn.plan(**plan, num_heads=heads, causal=True, sm_scale=SM_SCALE, q_data_type=torch.bfloat16)
                run = lambda: attn.run(q_nope, q_pe, **cache.run_inputs(0))  # noqa: E731
                out = run()  # the warm-up call is the one checked
            except Exception as e:  # noqa: BLE001 - a backend without this format: say so, show the others
                row[step] = dict(error=f"{type(e).__name__}: {e}")
                continue
            ms = _median_ms(run, reps, cache.device)
            idx = [plan[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")]
            ri = cache.run_inputs(0)
            ref, _ = mla_reference(q_nope, q_pe, ri["ckv_cache"], ri["kpe_cache"], *idx, sm_scale=SM_SCALE,
                                   causal=True, ckv_scale=ri["ckv_scale"], kpe_scale=ri["kpe_scale"],
                                   ckv_scale_arr=ri["ckv_scale_arr"])
            view = orig.view(P, PAGE, DC + DK)
            ref_orig, _ = mla_reference(q_nope, q_pe, view[..., :DC], view[..., DC:], *idx, sm_scale=SM_SCALE,
                                        causal=True)
            row[step] = dict(ms=ms, err=compare(out, ref).rel_l2, err_orig=compare(out, ref_orig).rel_l2,
                             backend=attn.backend)
        rows.append(row)
    return rows


def print_formats(rows, device, heads) -> None:
    backends = sorted({r[s]["backend"] for r in rows for s in ("decode", "multi") if "backend" in r[s]})
    print(f"\n== 1. KV formats: {len(FORMAT_SEQ_LENS)} sequences (kv_len {', '.join(map(str, FORMAT_SEQ_LENS))} "
          f"+ new tokens), {heads} heads, page {PAGE}, BF16 queries, backend {'/'.join(backends)} on {device} ==")
    print("rel L2 error of the output vs float64 attention on the dequantized KV (the kernel's own error) and on "
          "the values before quantization (kernel + storage error)")
    print(f"{'format':15s} {'B/token':>7s} {'vs bf16':>8s} {'cache':>9s} | {'decode: err':>11s} {'err orig':>9s} "
          f"{'ms/call':>8s} | {f'{MTP}-token: err':>13s} {'err orig':>9s} {'ms/call':>8s}")
    for r in rows:
        cells = []
        for s in ("decode", "multi"):
            d = r[s]
            cells.append(f"{d['err']:11.1e} {d['err_orig']:9.1e} {d['ms']:8.2f}" if "ms" in d
                         else f"{'n/a: ' + d['error'][:28]:>30s}")
        less = -100 * r["saved"] + 0.0  # (+ 0.0: bf16's -0.0 prints as +0)
        print(f"{r['format']:15s} {r['bytes_per_token']:7d} {less:+7.0f}% {_mb(r['cache_bytes']):>9s} | "
              f"{cells[0]} | {cells[1]:>32s}")


# -- part 2: the scenario -----------------------------------------------------------------------------------
def _profile_step(sc: StepScenario, way: str, path: str, device: torch.device, memory: bool) -> None:
    """One step under torch.profiler (shapes recorded, as the doctor needs them), exported as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True, profile_memory=memory) as prof:
        with record_function("ProfilerStep#1"):  # the step marker torch.profiler's schedule would emit
            sc.step(way)
            _sync(device)
    prof.export_chrome_trace(path)


def diagnose(path: str, pool_bytes: int) -> dict:
    """The doctor's reading of one trace: the step's share in dtype casts, in pool-sized casts, its words."""
    try:
        from ..tools.doctor import diagnose as doctor_diagnose
    except ImportError:  # the tools layer is optional for the demo: the timings stand on their own
        return dict(available=False, verdict="doctor not available (fp8mla.tools.doctor missing)")
    r = doctor_diagnose(path, pool_bytes=pool_bytes)
    # First line of each paragraph: the finding and its cost; the fix follows on later lines.
    verdict = " | ".join(p.split("\n")[0] for p in r.diagnosis)
    return dict(available=True, cast_share=sum(g.share for g in r.casts),
                pool_cast_share=sum(g.share for g in r.findings), pool_casts_per_step=sum(
                    g.per_step for g in r.findings), verdict=verdict, report=r)


def gather_cast_attention() -> MLAPagedAttention:
    """The ``gather_cast`` way: the gather-then-cast strategy on the backend ``native`` gets (Triton on a GPU,
    torch on the CPU). StepScenario's own ``gather_cast`` is the torch backend everywhere, which on a GPU
    measured 0.4x of the legacy cast: the opposite of what gathering first does in the deployments (13.5 vs
    10.5 tok/s). No CUDA graph: its workspace follows each plan's token count."""
    return MLAPagedAttention(backend="auto", strategy="gather_cast")


def _gpu_times(fn, reps: int, graph: bool) -> list:
    """CUDA-event ms of each of ``reps`` timed steps (``bench.common.time_ms``'s method, every time kept: a CUDA
    graph replay when ``graph``, L2 flushed before each)."""
    from ..bench.common import L2Flush, capture, events_ms
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = capture(fn) if graph else None
    run = g.replay if g is not None else fn
    run()
    torch.cuda.synchronize()
    return events_ms(run, reps, L2Flush())


def run_scenario(args, device: torch.device, progress, trace_dir: str) -> dict:
    scale = SCALES[args.scale]
    layers, heads = args.layers or scale.layers, args.heads or scale.heads
    B, ctx = args.batch or scale.batch, args.context or scale.context
    progress(f"scenario: filling a {layers}-layer pool of {args.pool_tokens or scale.pool_tokens:,} tokens")
    sc = StepScenario(layers=layers, heads=heads, pool_tokens=args.pool_tokens or scale.pool_tokens,
                      device=device, shared_pool=args.shared_pool, cast_pool_backend=args.cast_pool_backend,
                      use_cuda_graph=device.type == "cuda")
    sc.ways["gather_cast"] = gather_cast_attention()  # before set_batch, which plans every way
    sc.set_batch(spread_context_lens(B, ctx))
    os.makedirs(trace_dir, exist_ok=True)
    res = dict(scale=args.scale, layers=layers, heads=heads, sc=sc, trace_dir=trace_dir, ways={})
    for way in WAYS:
        r = res["ways"][way] = dict(backend=sc.backend(way), graph=False, times=[])
        progress(f"{way}: first step (warm-up), checked against float64")
        r["err"] = sc.check(way).rel_l2
    if device.type == "cuda":  # CUDA-graph replays where the way can be captured, as an engine runs
        from ..bench.step import capturable
        for way, r in res["ways"].items():
            progress(f"{way}: timing")
            fn = lambda w=way: sc.step(w)  # noqa: E731
            r["graph"] = sc.backend(way) == "triton" and capturable(fn)
            r["times"] = _gpu_times(fn, max(args.reps, 5), r["graph"])
            r["ms"] = statistics.median(r["times"])
    else:
        # Round-robin over the ways: a busy CPU then slows each of them alike.
        for i in range(args.reps):
            for way, r in res["ways"].items():
                progress(f"timing step {i + 1}/{args.reps}: {way}")
                t = time.perf_counter()
                sc.step(way)
                r["times"].append((time.perf_counter() - t) * 1e3)
        for r in res["ways"].values():
            r["ms"] = statistics.median(r["times"])
    for way, r in res["ways"].items():
        progress(f"{way}: profiling one step")
        r["trace"] = os.path.join(trace_dir, f"{way}.json")
        # On the CPU the same profiled step gives the memory peak; on a GPU the allocator's counters do.
        _profile_step(sc, way, r["trace"], device, memory=device.type == "cpu")
        progress(f"{way}: doctor")
        r["doctor"] = diagnose(r["trace"], sc.layer_bytes)
        r["extra_mem"] = peak_from_trace(r["trace"]) if device.type == "cpu" else sc.extra_memory_bytes(way)
    return res


def _share(d: dict, key: str) -> str:
    return f"{100 * d[key]:.1f}%" if d.get("available", True) and key in d else "n/a"


def print_scenario(res: dict, device: torch.device) -> None:
    sc, ways = res["sc"], res["ways"]
    print(f"\n== 2. The {res['scale']} scenario: attention of one decode step over {res['layers']} layers, "
          f"{res['heads']} heads, B={len(sc.context_lens)} (contexts {min(sc.context_lens)}-{max(sc.context_lens)}, "
          f"{sc.active_tokens:,} active tokens) on a {sc.pool_tokens:,}-token FP8 pool per layer ==")
    for way, r in ways.items():
        d = r["doctor"]
        print(f"{way:12s} ({r['backend']}) doctor: {d['verdict']}")
    print("(the doctor's times are of the one step run under torch.profiler, not the timed steps of the summary)")


def print_summary(res: dict, fmt_rows, device: torch.device) -> None:
    sc = res["sc"]
    pool_note = " (one layer allocated, shared by all)" if sc.shared_pool else ""
    print(f"\n== Summary: {res['scale']}, {res['layers']} layers x {res['heads']} heads, B={len(sc.context_lens)}, "
          f"FP8 e4m3 pool {_mb(sc.kv_pool_bytes)}{pool_note} (BF16: {_mb(2 * sc.kv_pool_bytes)}), {device} ==")
    hdr = (f"{'way':12s} {'backend':20s} {'ms/step':>9s} {'min-max':>15s} {'profiled':>9s} {'tok/s':>8s} "
           f"{'speedup':>8s} {'casts':>7s} {'pool casts':>10s} {'extra mem/step':>14s} {'rel L2 vs f64':>13s}")
    print(hdr)
    print("-" * len(hdr))
    rows = demo_output.scenario_rows(res)
    for r in rows:
        be = r["backend"] + ("*" if device.type != "cuda" and r["way"] == "native" else "") + \
            ("+g" if r["cuda_graph"] else "")
        prof = "n/a" if r["profiled_step_ms"] is None else f"{r['profiled_step_ms']:.2f}"
        share = {k: "n/a" if r[k] is None else f"{r[k]:.1f}%" for k in ("cast_share_pct", "pool_cast_share_pct")}
        mm = f"{r['ms_min']:.2f}-{r['ms_max']:.2f}"
        print(f"{r['way']:12s} {be:20s} {r['ms_median']:9.2f} {mm:>15s} "
              f"{prof:>9s} {r['tok_per_s']:8.1f} {r['speedup_vs_cast_pool']:7.1f}x {share['cast_share_pct']:>7s} "
              f"{share['pool_cast_share_pct']:>10s} {_mb(r['extra_mem_bytes']):>14s} {r['rel_l2_vs_f64']:13.1e}")
    n = rows[0]["timed_reps"]
    print(f"ms/step: the timed steps, without the profiler: median of {n}, min-max their spread; profiled: the one "
          f"step run under torch.profiler (recording shapes{' and memory' if device.type == 'cpu' else ''}), whose "
          f"trace the doctor read and whose time its shares are of")
    print("backend: what each way ran: triton = the fp8mla kernel reading FP8 in registers; gather_cast+X = the "
          "batch's tokens gathered and cast to BF16, then backend X on that copy; torch = torch ops")
    print("speedup: vs cast_pool (medians); casts / pool casts: share of the profiled step in dtype casts / in casts "
          "the size of the pool (doctor); +g: CUDA-graph replay")
    if device.type != "cuda":
        print("* no CUDA device: 'native' (backend auto) is the torch backend on the CPU (its casts are the "
              "gathered tokens' fp8 -> fp32, never the pool); the Triton kernel, which casts nothing, and "
              "gather_cast+triton run on a GPU (fp8mla demo --device cuda).")
    if fmt_rows:
        f = {r["format"]: r for r in fmt_rows}["fp8_e4m3"]
        print(f"KV storage: fp8_e4m3 {f['bytes_per_token']} B/token vs bf16 {BF16_BYTES}: {100 * f['saved']:.0f}% "
              f"less; decode error vs float64 {f['decode'].get('err', math.nan):.1e} on the dequantized KV, "
              f"{f['decode'].get('err_orig', math.nan):.1e} on the original values.")
    print(demo_output.conclusion(res, device))


def _device(text: str):
    """(torch.device, None) or (None, why it cannot run here)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return None, f"expected cpu, cuda or cuda:N, got {text!r}"
    if device.type not in ("cpu", "cuda"):
        return None, f"expected cpu, cuda or cuda:N, got {text!r} (the demo runs on CPUs and CUDA GPUs)"
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            return None, f"{text!r} asked for, but torch sees no CUDA device; run without --device for the CPU"
        if device.index is not None and device.index >= n:
            return None, f"expected cuda:0 .. cuda:{n - 1} ({n} CUDA device(s)), got {text!r}"
    return device, None


def main(args) -> int:
    for name in ("layers", "heads", "pool_tokens", "batch", "context", "reps", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:  # 0 would silently fall back to the scale's default (`args.x or scale.x`)
            print(f"fp8mla demo: --{name.replace('_', '-')}: expected a positive int, got {v}", file=sys.stderr)
            return 2
    device, why = _device(args.device)
    if why:
        print(f"fp8mla demo: --device: {why}", file=sys.stderr)
        return 2
    # (--trace-dir first: a refused run leaves no empty default folder behind)
    for flag, path in (("--trace-dir", args.trace_dir), ("--out", args.out or demo_output.default_out_dir())):
        if path is not None and (why := demo_output.folder_error(path)):
            print(f"fp8mla demo: {flag}: {why}", file=sys.stderr)
            return 2
    out_dir = os.path.abspath(path)
    trace_dir = os.path.abspath(args.trace_dir or os.path.join(out_dir, "traces"))
    if args.scale is None:
        args.scale = "glm5" if device.type == "cuda" else "small"
    note = ""
    if device.type == "cpu" and not args.threads and hasattr(os, "getloadavg"):
        # Other processes holding the cores make OpenMP threads spin-wait on each other (3-10x slower steps,
        # and erratic ones): one thread gives steadier numbers on a busy machine.
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if cores > 1 and load > cores:
            args.threads, note = 1, f" (busy machine: load {load:.1f} on {cores} cores; --threads N to override)"
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    threads = f", {torch.get_num_threads()} thread(s){note}" if device.type == "cpu" else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"fp8mla {__version__} demo on {name}{threads}; torch {torch.__version__}")
    progress = Progress()
    scale = SCALES[args.scale]
    fmt_rows, res = [], None
    try:
        if args.part in ("all", "formats"):
            fmt_rows = run_formats(device, args.heads or scale.heads, args.reps, progress)
            progress.clear()
            print_formats(fmt_rows, device, args.heads or scale.heads)
        if args.part in ("all", "scenario"):
            res = run_scenario(args, device, progress, trace_dir)
            progress.clear()
            print_scenario(res, device)
    finally:
        progress.clear()
    if res:
        print_summary(res, fmt_rows, device)
    title = f"{args.scale}, {name}{threads}, fp8mla {__version__}, torch {torch.__version__}"
    files, notes = demo_output.write_all(out_dir, title=title, res=res, fmt_rows=fmt_rows, device=device,
                                         concl=demo_output.conclusion(res, device) if res else None)
    for n in notes:
        print(f"note: {n}")
    shown = out_dir if not out_dir.startswith(os.getcwd() + os.sep) else "./" + os.path.relpath(out_dir)
    print(f"demo done in {time.perf_counter() - t0:.1f} s; results in {shown}/: {', '.join(files)}")
    return 0
