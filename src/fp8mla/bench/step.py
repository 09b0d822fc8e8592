"""``fp8mla bench step``: the attention part of one MLA decode step over N layers, run three ways.

- ``cast_pool``: the legacy path (:mod:`fp8mla.bench.cast_pool`): every layer converts its whole FP8 pool to
  BF16, then attends over the copy. This is the seed deployment's bug (69% of the GLM-5 step in casts).
- ``gather_cast``: ``MLAPagedAttention(backend="torch")``: gathers only the batch's tokens, converts them.
- ``native``: ``MLAPagedAttention(backend="auto")``: the Triton kernel reading FP8 in registers on a GPU. On a
  machine without CUDA, "auto" is the torch backend too, and the native numbers equal gather_cast's.

:class:`StepScenario` builds the scenario (also used by ``fp8mla demo``); :func:`main` is the GPU benchmark:
B in {1, 8, 32, 64} x context 4K-32K at ``--scale glm5|dsv3``, CUDA-graph replays where the way can be
captured, ceilings measured in the same run, results as CSV, Markdown and a PNG plot in ``--out``.

The step times only attention: the new token's latent is appended once per layer before timing (the same
work in every way), and ``plan()`` runs once per batch layout, as an engine plans once per step.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass

import torch

from ..attention import MLAPagedAttention
from ..cache import PagedMLACache
from ..reference import mla_reference
from ..testing import Comparison, compare
from .cast_pool import CastPoolAttention

HEAD_DIM_CKV, HEAD_DIM_KPE = 512, 64
SM_SCALE = 192 ** -0.5  # DeepSeek-V3 family: 1 / sqrt(qk_nope 128 + qk_rope 64); YaRN's factor left out
WAYS = ("cast_pool", "gather_cast", "native")


@dataclass(frozen=True)
class Scale:
    layers: int
    heads: int          # attention heads per GPU
    pool_tokens: int    # tokens of one layer's pool (the whole pool, not the batch)
    batch: int          # demo default
    context: int        # demo default: longest context of the batch
    what: str


SCALES = {
    "small": Scale(4, 16, 32_768, 4, 1024, "CPU-sized: 4 layers, 16 heads, a 32,768-token pool"),
    # GLM-5 (zai-org/GLM-5, transformers' glm_moe_dsa config): 78 layers, 64 attention heads, kv_lora_rank 512 +
    # rope 64; at tensor parallel 8 each GPU attends with 64 / 8 = 8 heads
    "glm5": Scale(78, 8, 495_552, 8, 16_384,
                  "GLM-5 on 8 GPUs: 78 layers, 8 heads per GPU (64 / TP 8), a 495,552-token pool"),
    "dsv3": Scale(61, 16, 131_072, 8, 8_192,
                  "DeepSeek-V3 on 8xH200: 61 layers, 16 heads per GPU, a 131,072-token pool"),
}


def spread_context_lens(batch: int, longest: int) -> list[int]:
    """``batch`` different lengths from about ``longest / 4`` to ``longest``, not page aligned (-7 per step)."""
    if batch == 1:
        return [longest]
    return [max(1, int(longest * (0.25 + 0.75 * i / (batch - 1))) - 7 * (batch - 1 - i)) for i in range(batch)]


class StepScenario:
    """A paged FP8 (e4m3, scale 1) pool of ``layers`` layers, a batch of decode requests, and the three ways.

    Args:
        shared_pool: allocate one layer's pool and let every layer read and write it (``None``: only when all
            layers would take more than half of the free GPU memory). Each layer still does its own append,
            cast and attention, so the work per layer is real; only the data is shared.
        cast_pool_backend: attention backend on cast_pool's BF16 copy (``"auto"``: the kernel native gets).
    """

    def __init__(self, *, layers: int, heads: int, pool_tokens: int, page_size: int = 64, device="cpu",
                 shared_pool: bool | None = None, cast_pool_backend: str = "auto", use_cuda_graph: bool = False,
                 seed: int = 0):
        self.device = torch.device(device)
        self.layers, self.heads, self.page_size = layers, heads, page_size
        num_pages = -(-pool_tokens // page_size)
        self.pool_tokens = num_pages * page_size
        width = HEAD_DIM_CKV + HEAD_DIM_KPE
        self.layer_bytes = self.pool_tokens * width  # fp8: one byte per value
        if shared_pool is None:
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else float("inf")
            shared_pool = layers * self.layer_bytes > 0.5 * free
        self.shared_pool = bool(shared_pool)
        self.cache = PagedMLACache(1 if self.shared_pool else layers, num_pages, page_size, "fp8_e4m3",
                                   device=self.device)
        self.device = self.cache.device  # "cuda" resolved to "cuda:0"
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        # Every slot holds data, as in a busy server: the legacy cast converts all of it, used or not.
        chunk = max(1, (1 << 26) // (page_size * width))  # pages per fill chunk (~256 MB of fp32 randn)
        for layer in range(self.cache.num_layers):
            for p0 in range(0, num_pages, chunk):
                view = self.cache.pool[layer, p0:p0 + chunk]
                view.copy_(torch.randn(view.shape, generator=self.gen, device=self.device))
        self.ways = {"cast_pool": CastPoolAttention(cast_pool_backend, use_cuda_graph),
                     "gather_cast": MLAPagedAttention(backend="torch", use_cuda_graph=use_cuda_graph),
                     "native": MLAPagedAttention(backend="auto", use_cuda_graph=use_cuda_graph)}
        self.ids: list = []
        self._ref = None

    # -- batch ----------------------------------------------------------------------------------------------
    def cache_layer(self, layer: int) -> int:
        return 0 if self.shared_pool else layer

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the pool a deployment holds for all layers (allocated here: one layer if shared)."""
        return self.layers * self.layer_bytes

    def set_batch(self, context_lens: list[int]) -> None:
        """Replace the batch: one decode query per request; ``context_lens`` count the step's new token."""
        for i in self.ids:
            self.cache.free(i)
        self.ids = []
        B, H, dev = len(context_lens), self.heads, self.device
        ids: list = []
        try:  # all or nothing: a batch the pool cannot hold leaves no sequence (and no page) behind
            for L in context_lens:
                ids.append(self.cache.add_sequence(num_tokens=L - 1))
            self.cache.reserve(ids, 1)  # the decode step's token; each layer appends its own latent
        except Exception:
            for i in ids:
                self.cache.free(i)
            raise
        self.ids = ids
        self.context_lens = list(context_lens)
        for layer in range(self.layers):
            self.cache.append(self.cache_layer(layer), self.ids,
                              torch.randn(B, HEAD_DIM_CKV, generator=self.gen, device=dev),
                              torch.randn(B, HEAD_DIM_KPE, generator=self.gen, device=dev))
        bf16 = torch.bfloat16
        self.q_nope = torch.randn(self.layers, B, H, HEAD_DIM_CKV, generator=self.gen, device=dev).to(bf16)
        self.q_pe = torch.randn(self.layers, B, H, HEAD_DIM_KPE, generator=self.gen, device=dev).to(bf16)
        self.plan_args = self.cache.plan_inputs(self.ids)
        for impl in self.ways.values():
            impl.plan(**self.plan_args, num_heads=H, causal=True, sm_scale=SM_SCALE, q_data_type=bf16)
        self.out = {w: torch.empty(B, H, HEAD_DIM_CKV, dtype=bf16, device=dev) for w in WAYS}
        self._ref = None

    def backend(self, way: str) -> str:
        return self.ways[way].backend

    @property
    def active_tokens(self) -> int:
        return sum(self.context_lens)

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, way: str) -> torch.Tensor:
        """Attention of every layer for the batch; returns the last layer's output (the buffer is reused)."""
        impl, out = self.ways[way], self.out[way]
        for layer in range(self.layers):
            cl = self.cache_layer(layer)
            if way == "cast_pool":
                impl.run(self.q_nope[layer], self.q_pe[layer], self.cache.pool[cl], out=out)
            else:
                impl.run(self.q_nope[layer], self.q_pe[layer], **self.cache.run_inputs(cl), out=out)
        return out

    def reference(self) -> torch.Tensor:
        """float64 output of the last layer on the dequantized pool (cast_pool's BF16 copy is exact: scale 1)."""
        if self._ref is None:
            a, last = self.plan_args, self.layers - 1
            cl = self.cache_layer(last)
            self._ref, _ = mla_reference(self.q_nope[last], self.q_pe[last], self.cache.ckv_cache(cl),
                                         self.cache.kpe_cache(cl), a["qo_indptr"], a["kv_indptr"],
                                         a["kv_indices"], a["kv_len_arr"], sm_scale=SM_SCALE, causal=True)
        return self._ref

    def check(self, way: str) -> Comparison:
        return compare(self.step(way), self.reference())

    def extra_memory_bytes(self, way: str) -> int:
        """Peak memory one step allocates above what was held before it (the cast copies, gathers, scores)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.step(way)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(way)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mem.json")
            prof.export_chrome_trace(path)
            return peak_from_trace(path)


def peak_from_trace(path: str) -> int:
    """Peak CPU bytes allocated above the start, from a trace profiled with ``profile_memory=True`` (its
    ``[memory]`` records carry the running total of allocated bytes)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    if not mem:
        return 0
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(m["Total Allocated"] for m in mem) - base


# -- the GPU benchmark --------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; a ``k`` suffix means x 1024 (``"4k"`` -> 4096)."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in s.split(",") if x]


def _points(s: str) -> list[tuple[int, int]]:
    """``"1x4096,64x8k"`` -> [(1, 4096), (64, 8192)]."""
    out = []
    for item in s.split(","):
        if not item:
            continue
        b, sep, c = item.lower().partition("x")
        try:
            out.append((_ints(b)[0], _ints(c)[0]))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"expected BxCONTEXT pairs such as 1x4096,64x8k, got {item!r}") from None
    return out


def add_arguments(p):
    p.add_argument("--scale", choices=["glm5", "dsv3"], default="glm5", help="deployment to reproduce")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64], help="batch sizes, comma separated")
    p.add_argument("--contexts", type=_ints, default=[4096, 8192, 16384, 32768],
                   help="context lengths, comma separated (4k = 4096); combinations the pool cannot hold are "
                        "skipped")
    p.add_argument("--layers", type=int, help="override the scale's layer count")
    p.add_argument("--pool-tokens", type=int, help="override the scale's pool size")
    p.add_argument("--reps", type=int, default=20, help="timed replays per measurement (median)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", help="plain launches only")
    p.add_argument("--shared-pool", action=argparse.BooleanOptionalAction, default=None,
                   help="one layer's pool reused by every layer (default: only if all layers do not fit)")
    p.add_argument("--cast-pool-backend", choices=["auto", "torch"], default="auto",
                   help="attention on cast_pool's BF16 copy (auto: the same kernel native gets)")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false", help="skip the ceiling probes")
    p.add_argument("--profile", action="store_true", help="with --model/--tp: print each graph step's top kernels")
    p.add_argument("--out", default="out/bench_step", help="folder for step.csv, step.md, step.png")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: time the DeepSeek MLA layer stack with heads split over N ranks "
                        "(launch with torchrun --nproc-per-node N; see fp8mla.bench.step_tp)")
    p.add_argument("--model", action="store_true",
                   help="time the DeepSeek MLA layer stack's decode step (eager and CUDA-graph runner, begin_step, "
                        "kernels' device time, roofline floor) instead of the attention-only scenario; implied by "
                        "--tp N > 1 (see fp8mla.bench.step_tp)")
    p.add_argument("--points", type=_points, default=None,
                   help="with --model/--tp: (batch, context) pairs instead of --batches x --contexts, e.g. "
                        "1x4096,64x8k")
    p.add_argument("--page-size", type=int, default=64, help="with --model/--tp: cache page size (default 64)")
    p.add_argument("--config", default="dsv3", help="with --model/--tp: model config (dsv3, dsv2-lite, kimi-k2, "
                   "tiny)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default). 'cpu' is a dry run of the benchmark's plumbing at whatever size you give "
                        "it: wall-clock times, no CUDA graphs, no ceilings; its numbers are not a benchmark")


def capturable(fn) -> bool:
    """Whether ``fn`` can be captured in a CUDA graph (the torch backend cannot: boolean indexing syncs)."""
    from .common import capture
    return capture(fn) is not None


def main(args) -> int:
    for name in ("layers", "pool_tokens", "reps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"fp8mla bench step: --{name.replace('_', '-')}: expected a positive int, got {v}", file=sys.stderr)
            return 2
    if args.points is not None and any(b < 1 or c < 1 for b, c in args.points):
        print(f"fp8mla bench step: --points: expected positive sizes, got {args.points}", file=sys.stderr)
        return 2
    for name in ("batches", "contexts"):
        if any(v < 1 for v in getattr(args, name)):
            print(f"fp8mla bench step: --{name}: expected positive ints, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.tp < 1:
        print(f"fp8mla bench step: --tp: expected a positive int, got {args.tp}", file=sys.stderr)
        return 2
    if args.page_size < 1:
        print(f"fp8mla bench step: --page-size: expected a positive int, got {args.page_size}", file=sys.stderr)
        return 2
    if args.tp > 1 or args.model:
        from .step_tp import run_tp
        return run_tp(args)
    dry = torch.device(args.device).type == "cpu"
    if not dry and not torch.cuda.is_available():
        print("fp8mla bench step: needs a CUDA device (torch.cuda.is_available() is False). "
              "On a CPU, `fp8mla demo` runs the same scenario at a small size.", file=sys.stderr)
        return 2
    from .common import cpu_time_ms, environment, measure_ceilings, time_ms as gpu_time_ms
    time_ms = gpu_time_ms
    if dry:
        print("DRY RUN on the CPU: checks the benchmark's plumbing; the times are not a benchmark")
        time_ms, args.cuda_graph, args.ceilings = cpu_time_ms, False, False
    scale = SCALES[args.scale]
    layers = args.layers or scale.layers
    env = environment()
    if dry:
        env["gpu"] = "CPU (dry run)"
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    ceil = measure_ceilings() if args.ceilings else None
    if ceil:
        print(f"ceilings: read {ceil.read_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    sc = StepScenario(layers=layers, heads=scale.heads, pool_tokens=args.pool_tokens or scale.pool_tokens,
                      device=args.device, shared_pool=args.shared_pool, cast_pool_backend=args.cast_pool_backend,
                      use_cuda_graph=args.cuda_graph)
    print(f"scale {args.scale}: {layers} layers, {scale.heads} heads, pool {sc.pool_tokens:,} tokens "
          f"({sc.layer_bytes / 1e6:.0f} MB FP8 per layer{', one layer shared by all' if sc.shared_pool else ''})")
    rows = []
    for B in args.batches:
        for ctx in args.contexts:
            if B * -(-ctx // sc.page_size) > sc.cache.num_pages:
                print(f"B={B} ctx={ctx}: skipped, {B} x {ctx} tokens exceed the {sc.pool_tokens:,}-token pool")
                continue
            sc.set_batch([ctx] * B)
            res = {}
            for way in WAYS:
                fn = lambda w=way: sc.step(w)  # noqa: E731
                graph = args.cuda_graph and sc.backend(way) == "triton" and capturable(fn)
                ms = time_ms(fn, reps=args.reps, cuda_graph=graph)
                err = sc.check(way)
                mem = sc.extra_memory_bytes(way)
                floor = (layers * ceil.floor_ms(B * ctx * 576, 2 * B * scale.heads * ctx * (576 + 512))
                         if ceil else float("nan"))
                res[way] = ms
                rows.append(dict(scale=args.scale, layers=layers, heads=scale.heads, pool_tokens=sc.pool_tokens,
                                 B=B, ctx=ctx, way=way, backend=sc.backend(way), cuda_graph=graph,
                                 ms_step=round(ms, 4), tok_s=round(B / (ms * 1e-3), 1),
                                 floor_ms=round(floor, 4), pct_floor=round(100 * floor / ms, 1),
                                 extra_mem_mb=round(mem / 1e6, 1), rel_l2=f"{err.rel_l2:.2e}"))
                print(f"  B={B:3d} ctx={ctx:6d} {way:12s} {sc.backend(way):6s} graph={'y' if graph else 'n'} "
                      f"{ms:9.3f} ms/step {B / (ms * 1e-3):10.1f} tok/s  rel_l2 {err.rel_l2:.1e}", flush=True)
            for r in rows[-3:]:
                r["speedup_vs_cast_pool"] = round(res["cast_pool"] / res["native"], 2)
                r["speedup_vs_gather_cast"] = round(res["gather_cast"] / res["native"], 2)
            print(f"  -> native is {res['cast_pool'] / res['native']:.1f}x cast_pool, "
                  f"{res['gather_cast'] / res['native']:.1f}x gather_cast")
    if not rows:
        print("no batch fits the pool: lower --batches/--contexts or raise --pool-tokens", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = _markdown(rows, env, ceil)
    with open(os.path.join(args.out, "step.md"), "w") as f:
        f.write(md)
    print("\n" + md)
    _plot(rows, os.path.join(args.out, "step.png"), f"{args.scale}: {layers} layers, {scale.heads} heads, "
          f"pool {sc.pool_tokens:,} tokens, {env.get('gpu', 'CPU dry run')}")
    png = os.path.exists(os.path.join(args.out, "step.png"))
    print(f"wrote {args.out}/step.csv, step.md" + (", step.png" if png else ""))
    return 0


def _markdown(rows, env, ceil) -> str:
    r0 = rows[0]
    head = (f"MLA decode step (attention only), {r0['scale']}: {r0['layers']} layers, {r0['heads']} heads, pool "
            f"{r0['pool_tokens']:,} tokens, FP8 e4m3 KV, BF16 Q. {env.get('date')}, "
            f"{env.get('gpu', 'CPU (dry run)')}, driver {env.get('driver', 'n/a')}, torch {env.get('torch')}, "
            f"triton {env.get('triton')}"
            + (f"; read {ceil.read_gbps:.0f} GB/s, matmul {ceil.matmul_tflops:.0f} TFLOP/s" if ceil else "") + "\n\n"
            "ms per step (backend; g = CUDA-graph replay). % floor: the native step vs layers x max(bytes / read "
            "bandwidth, FLOPs / matmul peak).\n\n")

    def cell(r) -> str:
        return f"{r['ms_step']:.3f} ({r['backend']}{', g' if r['cuda_graph'] else ''})"

    lines = ["| B | ctx | cast_pool | gather_cast | native | native tok/s | native % floor | native vs cast_pool "
             "| native vs gather_cast |", "|---|---|---|---|---|---|---|---|---|"]
    by: dict = {}
    for r in rows:
        by.setdefault((r["B"], r["ctx"]), {})[r["way"]] = r
    for (B, ctx), w in by.items():
        n = w["native"]
        floor = "-" if math.isnan(n["pct_floor"]) else f"{n['pct_floor']:.0f}%"
        lines.append(f"| {B} | {ctx} | {cell(w['cast_pool'])} | {cell(w['gather_cast'])} | {cell(n)} | "
                     f"{n['tok_s']:.0f} | {floor} | {n['speedup_vs_cast_pool']:.1f}x | "
                     f"{n['speedup_vs_gather_cast']:.2f}x |")
    return head + "\n".join(lines) + "\n"


def _plot(rows, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fp8mla[bench]')")
        return
    configs = list(dict.fromkeys((r["B"], r["ctx"]) for r in rows))
    ms = {(r["B"], r["ctx"], r["way"]): r["ms_step"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(configs) + 2), 4.5))
    width = 0.27
    for i, way in enumerate(WAYS):
        xs = [j + (i - 1) * width for j in range(len(configs))]
        ax.bar(xs, [ms[(B, c, way)] for B, c in configs], width, label=way)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"B{B}\n{c // 1024}K" if c % 1024 == 0 else f"B{B}\n{c}" for B, c in configs])
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (attention, all layers)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
