"""``fp8mla bench decode``: paged MLA decode against the ceilings measured in the same run.

Grid: H in {16, 128} x (B, L) in {(1, 32768), (8, 8192), (32, 4096), (128, 2048), (64, 8192)}, page 64 and 1,
FP8 (e4m3, per-tensor scale) and BF16 KV. Each point: median of CUDA-graph replays with the L2 flushed,
ms, GB/s (KV bytes / time), TFLOP/s, % of floor (floor = max(bytes / read BW, FLOPs / bf16 matmul peak)) and
relative L2 error against a float64 reference on the dequantized KV (first requests of the batch).
"""
from __future__ import annotations

import csv
import math
import os
import time

import torch

from ..attention import MLAPagedAttention
from ..formats import get_format
from ..reference import mla_reference
from ..runtime import available_backends as fp8mla_backends
from ..testing import compare
from .common import start_run, time_ms

SHAPES = [(1, 32768), (8, 8192), (32, 4096), (128, 2048), (64, 8192)]
DC, DK = 512, 64


def add_arguments(p):
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--shapes", nargs="+", default=[f"{b}x{L}" for b, L in SHAPES],
                   help="BxL pairs (default: the grid of docs/benchmarks.md)")
    p.add_argument("--pages", type=int, nargs="+", default=[64, 1])
    p.add_argument("--kv", nargs="+", default=["fp8_e4m3", "bf16"], help="KV formats")
    p.add_argument("--strategy", choices=["native", "gather_cast"], default="native")
    p.add_argument("--compare", nargs="*", default=[], metavar="NAME",
                   choices=["flashinfer", "flashmla", "gather_cast", "torch", "fp8_math", "wide_heads", "graph"],
                   help="also time: flashinfer (fa3, fa2 on the same pool), flashmla (FlashMLA's BF16 decode on a BF16 "
                        "copy of the pool and its FP8 path with Q quantized, vLLM's FLASHMLA; with --sparse its "
                        "sparse decode, with --v4 its V4 sparse decode on fp8_v4: fp8mla.bench.flashmla), "
                        "gather_cast, torch, fp8_math (the gluon "
                        "kernel's opt-in FP8 tensor-core math), wide_heads (both builds of the gluon kernel at 33-128 "
                        "heads, heads-on-M and wide, whichever the default picked), graph (the gluon kernel in a "
                        "CUDA-graph wrapper of 256 request slots, the engines' launch: each build that takes the "
                        "plan)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time the batch-invariant mode (MLAPagedAttention(batch_invariant=True): the Triton "
                        "kernel with each request cut in fixed chunks; plain and CUDA-graph plans) beside the "
                        "default; with --sparse: MLASparseAttention(batch_invariant=True); with --v4: "
                        "V4SparseAttention(batch_invariant=True)")
    p.add_argument("--sweep", action="store_true", help="time kernel variants (block sizes, stages, splits)")
    p.add_argument("--variants", nargs="+", default=None, help="with --sweep: only these variants")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--err-requests", type=int, default=2, help="requests checked against the float64 reference")
    p.add_argument("--out", default="bench_out", help="directory for decode.csv / decode.png")
    p.add_argument("--sparse", action="store_true",
                   help="sparse (DSA) decode: each token over --topk selected tokens (fp8mla.bench.sparse)")
    p.add_argument("--topk", type=int, default=2048, help="with --sparse: selected tokens per query token")
    p.add_argument("--sparse-kv", nargs="+", default=["fp8_ds_mla"], help="with --sparse: KV formats")
    p.add_argument("--v4", action="store_true",
                   help="DeepSeek V4 decode: window + compressed rows + sinks (fp8mla.bench.v4)")
    p.add_argument("--v4-kv", nargs="+", default=["fp8_v4", "fp8_v41"], help="with --v4: pool formats")
    p.add_argument("--window", type=int, default=128, help="with --v4: window slots per query token")
    p.add_argument("--compressed-topk", type=int, default=512, help="with --v4: compressed rows per query token")


def make_pool(B, L, page, fmt_name, device, seed=0):
    """Random pool with shuffled page ids; real values N(0, 1), FP8 stored with scale 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    fmt = get_format(fmt_name)
    pages_per = -(-L // page)
    P = B * pages_per + 8
    pool = torch.randn(P, page, DC + DK, device=device, generator=g).to(fmt.storage_dtype)
    perm = torch.randperm(P, device=device, generator=g)[: B * pages_per].to(torch.int32)
    i32 = dict(dtype=torch.int32, device=device)
    plan_args = dict(qo_indptr=torch.arange(B + 1, **i32), kv_indptr=torch.arange(B + 1, **i32) * pages_per,
                     kv_indices=perm, kv_len_arr=torch.full((B,), L, **i32), head_dim_ckv=DC, head_dim_kpe=DK,
                     page_size=page, causal=True, sm_scale=1.0 / math.sqrt(192), q_data_type=torch.bfloat16)
    return pool, plan_args


def reference_error(out, q_nope, q_pe, ckv, kpe, plan_args, nreq):
    """Relative L2 of ``out`` on the first ``nreq`` requests against float64 attention."""
    a = plan_args
    n = min(nreq, a["kv_len_arr"].numel())
    ref, _ = mla_reference(q_nope[:n], q_pe[:n], ckv, kpe, a["qo_indptr"][: n + 1], a["kv_indptr"][: n + 1],
                           a["kv_indices"], a["kv_len_arr"][:n], sm_scale=a["sm_scale"], causal=True)
    return compare(out[:n], ref).rel_l2


def _mh_takes(attn) -> bool:
    """Whether the gluon kernel's heads-on-M build takes this wrapper's plan (whatever the default picked)."""
    from ..backends.capabilities import GLUON_HEADS_ON_M
    from ..backends.select import dense_question, qo_range, refusal
    p = attn._plan
    return not refusal(GLUON_HEADS_ON_M, dense_question(p.spec, qo_range(p.layout), {}))


def _why(e: Exception, head: int = 200, tail: int = 400) -> str:
    """An exception for the log: its type and message, long ones cut in the middle (a FlashInfer JIT build error
    says what failed at its end, a plan refusal at its start: keep both)."""
    msg = " ".join(str(e).split())
    if len(msg) > head + tail + 5:
        msg = f"{msg[:head]} [...] {msg[-tail:]}"
    return f"{type(e).__name__}: {msg}"


def _flashinfer_runner(backend, plan_args, H, kv_dtype, q_nope, q_pe, ckv, kpe, out, lse):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    a = plan_args
    w = BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.int8, device=q_nope.device),
                                      backend=backend)
    w.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], H, DC, DK, a["page_size"], True,
           a["sm_scale"], torch.bfloat16, kv_dtype)
    kw = dict(ckv_scale=1.0, kpe_scale=1.0) if kv_dtype != torch.bfloat16 else {}
    return lambda: w.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True, **kw)


def _flashmla_runners(plan_args, H, pool, fmt, q_nope, q_pe, out, where: str) -> dict:
    """FlashMLA's rows (``fp8mla.bench.flashmla``), or none with the reason printed."""
    from . import flashmla
    ops = flashmla.load_ops()
    try:
        if isinstance(ops, str):
            raise RuntimeError(ops)
        return flashmla.dense_runners(ops, plan_args, H, pool, fmt, q_nope, q_pe, out)
    except Exception as e:  # noqa: BLE001 - record and go on
        print(f"  flashmla {where}: skipped: {_why(e)}", flush=True)
        return {}


VARIANTS = {
    "default": {},
    "n32": dict(block_n=32), "n32s3": dict(block_n=32, num_stages=3), "n32s4": dict(block_n=32, num_stages=4),
    "s1": dict(num_stages=1), "s3": dict(num_stages=3),
    "w8": dict(num_warps=8), "w4": dict(num_warps=4), "noevict": dict(evict_first=False), "idx64": dict(index64=True),
    "vasm": dict(v_convert="asm"), "vasmw8": dict(v_convert="asm", num_warps=8),
    "cta1": dict(ctas_per_sm=1), "cta4": dict(ctas_per_sm=4),
    "chunk512": dict(min_chunk=512), "chunk128": dict(min_chunk=128), "chunk1024": dict(min_chunk=1024),
    "m32": dict(block_m=32), "m16": dict(block_m=16), "m64": dict(block_m=64),
}


def build_label(build) -> str:
    """A gluon plan's build in a row name: mh (heads-on-M), wide (the wide-heads build), h16 (<= 16 heads)."""
    return "mh" if build.heads_on_m else ("wide" if build.wide else "h16")


def main(args) -> int:
    if getattr(args, "sparse", False):
        from .sparse import main as sparse_main
        return sparse_main(args)
    if getattr(args, "v4", False):
        from .v4 import main as v4_main
        return v4_main(args)
    ceil = start_run("decode", args.out)
    if ceil is None:
        return 2
    device = "cuda"
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    variants = VARIANTS if args.sweep else {"default": {}}
    if args.sweep and args.variants:
        variants = {k: VARIANTS[k] for k in ["default"] + [v for v in args.variants if v != "default"]}
    rows = []
    for H in args.heads:
        for page in args.pages:
            for fmt_name in args.kv:
                fmt = get_format(fmt_name)
                for B, L in shapes:
                    t0 = time.time()
                    pool, plan_args = make_pool(B, L, page, fmt_name, device)
                    ckv, kpe = pool[..., :DC], pool[..., DC:]
                    # The pool holds values stored with scale 1: say so (an FP8 run without its scales is refused).
                    sk = {} if not fmt.is_fp8 else dict(kpe_scale=1.0, **(
                        dict(ckv_scale_arr=torch.ones(*pool.shape[:2], DC // 128, device=device))
                        if fmt.scale_kind == "group" else dict(ckv_scale=1.0)))
                    q_nope = torch.randn(B, H, DC, device=device, dtype=torch.bfloat16)
                    q_pe = torch.randn(B, H, DK, device=device, dtype=torch.bfloat16)
                    out = torch.empty(B, H, DC, device=device, dtype=torch.bfloat16)
                    lse = torch.empty(B, H, device=device, dtype=torch.float32)
                    nbytes = B * L * fmt.bytes_per_token(DC, DK)
                    flops = 2 * B * H * L * (DC + DK + DC)
                    floor = ceil.floor_ms(nbytes, flops)
                    floor_fp8 = ceil.floor_ms(B * L * (DC + DK), flops)  # the target: FP8 bytes
                    runners = {}
                    for vname, opts in variants.items():
                        name = "fp8mla" if vname == "default" else f"fp8mla[{vname}]"
                        # the portable kernel
                        attn = MLAPagedAttention(backend="triton", strategy=args.strategy, **opts)
                        attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                        runners[name] = (lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **sk))
                    if "gluon" in fp8mla_backends(device):  # the Hopper kernel, where its supports() takes the plan
                        try:   # the row names the build the selector picked ([mh] heads-on-M, [wide], [h16])
                            attn = MLAPagedAttention(backend="gluon")
                            attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                            built = attn._plan.impl.build
                            runners[f"fp8mla gluon[{build_label(built)}]"] = (
                                lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **sk))
                            # the Hopper kernel's other build beside the default's pick (heads-on-M where it takes
                            # the plan, else nothing), and the heads-on-M build in a CUDA-graph wrapper
                            both = [] if "wide_heads" not in args.compare else (
                                [False] if built.heads_on_m else [True] if _mh_takes(attn) else [])
                            for want in both:
                                a2 = MLAPagedAttention(backend="gluon", heads_on_m=want)
                                a2.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                                runners[f"fp8mla gluon[{build_label(a2._plan.impl.build)}]"] = (
                                    lambda a=a2: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **sk))
                            if "graph" in args.compare:   # what the default picks there, and heads-on-M
                                takes = built.heads_on_m or _mh_takes(attn)
                                for want in (None, True) if takes else (None,):
                                    a2 = MLAPagedAttention(backend="gluon", use_cuda_graph=True, heads_on_m=want)
                                    a2.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                                    label = build_label(a2._plan.impl.build)
                                    if f"fp8mla gluon[{label},graph]" in runners:
                                        continue
                                    runners[f"fp8mla gluon[{label},graph]"] = (
                                        lambda a=a2: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **sk))
                        except ValueError as e:
                            print(f"  fp8mla gluon {fmt_name} H{H} B{B} L{L} page{page}: not taken ({e})")
                        if "fp8_math" in args.compare and fmt.is_fp8 and fmt.scale_kind == "tensor":
                            try:   # the opt-in FP8 tensor-core math (error budget 2e-2)
                                attn = MLAPagedAttention(backend="gluon", fp8_math=True)
                                attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                                runners["fp8mla gluon fp8_math"] = (
                                    lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **sk))
                            except ValueError as e:
                                print(f"  fp8mla gluon fp8_math H{H} B{B} L{L} page{page}: not taken ({e})")
                    if getattr(args, "batch_invariant", False):
                        # auto's pick in the mode (the Triton kernel), and the Gluon builds, which take it named
                        for be in ("auto", "gluon") if "gluon" in fp8mla_backends(device) else ("auto",):
                            try:
                                made = invariant_attentions(plan_args, H, fmt_name, args.strategy, backend=be)
                            except ValueError as e:
                                print(f"  fp8mla {be}[invariant] {fmt_name} H{H} B{B} L{L} page{page}: not taken "
                                      f"({e})")
                                continue
                            for name, attn in made.items():
                                runners[name] = (lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse,
                                                                      **sk))
                    if "gather_cast" in args.compare:
                        attn = MLAPagedAttention(backend="triton", strategy="gather_cast")
                        attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                        runners["fp8mla gather_cast"] = (lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out,
                                                                               lse=lse, **sk))
                    if "torch" in args.compare:
                        attn = MLAPagedAttention(backend="torch")
                        attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
                        runners["torch gather-cast"] = (lambda a=attn: a.run(q_nope, q_pe, ckv, kpe, out=out,
                                                                              lse=lse, **sk))
                    if "flashinfer" in args.compare:
                        for be in ("fa3", "fa2"):
                            try:
                                runners[f"flashinfer {be}"] = _flashinfer_runner(
                                    be, plan_args, H, fmt.storage_dtype, q_nope, q_pe, ckv, kpe, out, lse)
                            except Exception as e:  # noqa: BLE001 - record and go on
                                print(f"  flashinfer {be} {fmt_name} H{H} B{B} L{L} page{page}: not planned: "
                                      f"{_why(e)}", flush=True)
                    if "flashmla" in args.compare:
                        runners.update(_flashmla_runners(plan_args, H, pool, fmt, q_nope, q_pe, out,
                                                         f"{fmt_name} H{H} B{B} L{L} page{page}"))
                    for name, fn in runners.items():
                        try:
                            out.fill_(float("nan"))
                            fn()
                            torch.cuda.synchronize()
                            err = reference_error(out, q_nope, q_pe, ckv, kpe, plan_args, args.err_requests)
                            ms = time_ms(fn, reps=args.reps)
                        except Exception as e:  # noqa: BLE001
                            print(f"  {name} {fmt_name} H{H} B{B} L{L} page{page}: failed: {_why(e)}", flush=True)
                            continue
                        from ..kernels import decode as _dec
                        ck = _dec.LAST_COMPILED if name.startswith("fp8mla") and "gluon" not in name else None
                        res = (f"regs {ck.n_regs} spills {ck.n_spills} smem {ck.metadata.shared // 1024}KB"
                               if ck is not None and hasattr(ck, "n_regs") else "")
                        row = dict(kernel=name, kv=fmt_name, H=H, B=B, L=L, page=page, ms=ms,
                                   gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9, pct_floor=100 * floor / ms,
                                   floor_ms=floor, pct_fp8_floor=100 * floor_fp8 / ms, rel_l2=err)
                        rows.append(row)
                        print(f"{name:22s} {fmt_name:9s} H{H:<3d} B{B:<3d} L{L:<6d} page{page:<3d} "
                              f"{ms:8.4f} ms {row['gbps']:7.0f} GB/s {row['tflops']:6.1f} TFLOP/s "
                              f"{row['pct_floor']:5.1f}% floor  err {err:.2e} {res}", flush=True)
                    pool = ckv = kpe = None   # (frees the memory: closures above read these names, so no del)
                    torch.cuda.empty_cache()
                    _ = t0
    path = os.path.join(args.out, "decode.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kernel"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    _plot(rows, os.path.join(args.out, "decode.png"), ceil)
    return 0


def invariant_attentions(plan_args, H, fmt_name, strategy="native", backend="auto") -> dict:
    """The batch-invariant runs beside the default: ``{row name: planned MLAPagedAttention}``, a plain plan and
    (native strategy) a CUDA-graph one sized for this batch."""
    B = plan_args["kv_len_arr"].numel()
    made = {}
    for graph in (False, True) if strategy == "native" else (False,):
        opts = dict(max_batch_size=max(1, B), max_kv_indices=max(1, plan_args["kv_indices"].numel())) if graph \
            else {}
        attn = MLAPagedAttention(backend=backend, strategy=strategy, use_cuda_graph=graph, batch_invariant=True,
                                 **opts)
        attn.plan(**plan_args, num_heads=H, kv_data_type=fmt_name)
        made[f"fp8mla {attn.backend}[invariant{',graph' if graph else ''}]"] = attn
    return made


def _plot(rows, path, ceil):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the plot is optional
        print("matplotlib not available: no plot")
        return
    heads = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(7 * len(heads), 4.5), squeeze=False)
    for ax, H in zip(axes[0], heads):
        sub = [r for r in rows if r["H"] == H and r["page"] == max(r2["page"] for r2 in rows)]
        shapes = sorted({(r["B"], r["L"]) for r in sub}, key=lambda s: s[0] * s[1])
        series = sorted({(r["kernel"], r["kv"]) for r in sub})
        width = 0.8 / max(1, len(series))
        for i, (k, kv) in enumerate(series):
            ys = [next((r["pct_fp8_floor"] for r in sub if (r["B"], r["L"]) == s and r["kernel"] == k
                        and r["kv"] == kv), 0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=f"{k} / {kv}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"B{b} L{L}" for b, L in shapes])
        ax.set_ylabel("% of the FP8 floor (higher is better)")
        ax.set_title(f"MLA decode H={H} (read {ceil.read_gbps:.0f} GB/s, mm {ceil.matmul_tflops:.0f} TFLOP/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
