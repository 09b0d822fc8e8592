"""``fp8mla doctor``: find where a decode step's time goes in a torch profiler trace, and whether a KV pool is
being cast to the compute dtype on every layer.

The bug this looks for: ``get_key_buffer(layer).to(q.dtype)`` converts the whole FP8 pool (hundreds of MB) on
each layer of each step, because the attention kernel was planned with the query dtype for the KV too. In a
trace it shows as one large ``aten::copy_`` / ``unrolled_elementwise_kernel<direct_copy_kernel_cuda>`` per
layer, as big as the pool, taking most of the step. A correct decode reads the pool in place, or gathers the
active tokens first and casts only those (a cast as big as the active tokens, not the pool).

>>> from fp8mla.tools.doctor import diagnose, format_report
>>> report = diagnose("trace.json.gz", pool_bytes=285_000_000)     # doctest: +SKIP
>>> print(format_report(report))                                    # doctest: +SKIP
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from .._checks import as_int, check_positive_int
from .casts import find_casts, gather_inputs, is_float
from .trace import Trace, kernel_label, load_trace

__all__ = ["CastGroup", "Report", "diagnose", "format_report", "plot_report", "parse_bytes", "fmt_bytes",
           "POOL_FRACTION", "TIME_SHARE"]

POOL_FRACTION = 0.5    # a cast reading at least this fraction of the pool is "pool-sized"
TIME_SHARE = 0.10      # a repeated cast kernel of unknown size is suspect above this share of the step
MIN_POOL_BYTES = 1 << 20  # an inferred pool smaller than this is not a KV pool worth a warning


@dataclass
class CastGroup:
    """Casts with the same op chain, dtypes, source shape and call site."""

    op: str
    side: str
    src: str | None
    dst: str | None
    shape: tuple | None
    bytes_read: int | None
    bytes_written: int | None
    site: str | None
    calls: int = 0
    time_us: float = 0.0
    per_step: float = 0.0       # calls per profiled step
    ms_per_step: float = 0.0
    share: float = 0.0          # of the profiled time
    pool_fraction: float | None = None
    flagged: bool = False
    why: str = ""

    @property
    def bytes_moved(self):
        return None if self.bytes_read is None or self.bytes_written is None else \
            self.bytes_read + self.bytes_written


@dataclass
class Report:
    path: str
    num_steps: int
    steps_source: str           # "ProfilerStep#N annotations", "--steps", or "whole trace"
    profiled_us: float
    has_gpu: bool
    shapes_recorded: bool
    graph_kernels: int          # kernels with no CPU op (CUDA-graph replays)
    gpu_busy_us: float
    kernels: list = field(default_factory=list)   # dicts: name, calls, total_ms, ms_per_step, share
    cpu_ops: list = field(default_factory=list)   # dicts: name, calls, self_ms, total_ms, gpu_ms, share
    casts: list = field(default_factory=list)     # CastGroup, most expensive first
    pool_bytes: int | None = None
    pool_source: str | None = None
    findings: list = field(default_factory=list)  # flagged CastGroups
    diagnosis: list = field(default_factory=list)  # paragraphs
    rest: list = field(default_factory=list)       # (name, ms per step) of kernels (or CPU ops, self time)
                                                   # with the casts taken out: the other bars of the plot

    @property
    def step_ms(self) -> float:
        return self.profiled_us / self.num_steps / 1e3

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step_ms"] = self.step_ms
        return d


# -- sizes ----------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text) -> int:
    """``"285MB"``, ``"272MiB"``, ``"1.5G"`` or ``"285000000"`` -> bytes (k/M/G are powers of 10)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"pool bytes: expected a size like 285000000, 285MB, 272MiB or 1.5GB, got {text!r}")
    x = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if x != x or x == float("inf"):  # "1e999": int() of it would raise OverflowError
        raise ValueError(f"pool bytes: expected a finite size, got {text!r}")
    n = int(x)
    if n <= 0:
        raise ValueError(f"pool bytes: expected a positive size, got {text!r}")
    return n


def fmt_bytes(n) -> str:
    if n is None:
        return "?"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


# -- analysis -------------------------------------------------------------------------------------------------
def _steps(trace: Trace, steps):
    if steps is not None:
        steps = check_positive_int("steps", steps)
        span = sum(s.dur for s in trace.steps) if trace.steps else trace.span_us
        return steps, span, "--steps"
    if trace.steps:
        return len(trace.steps), sum(s.dur for s in trace.steps), "ProfilerStep#N annotations"
    return 1, trace.span_us, "whole trace (no ProfilerStep#N annotations)"


def _tables(trace: Trace, profiled: float, n_steps: int):
    kern: dict = {}
    for k in trace.gpu:
        name = kernel_label(k.name) if k.cat.lower() == "kernel" else k.name
        c = kern.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += k.dur
    kernels = [dict(name=n, calls=c, total_ms=t / 1e3, ms_per_step=t / 1e3 / n_steps, share=t / profiled)
               for n, (c, t) in sorted(kern.items(), key=lambda kv: -kv[1][1])]
    gpu_by_op: dict = {}
    for k in trace.gpu:
        op = trace.ops_by_ext_id.get(k.ext_id)
        name = op.name if op is not None else "(no CPU op: CUDA-graph replay)"
        gpu_by_op[name] = gpu_by_op.get(name, 0.0) + k.dur
    ops: dict = {}
    for op in trace.cpu_ops:
        c = ops.setdefault(op.name, [0, 0.0, 0.0])
        c[0] += 1
        c[1] += op.dur
        c[2] += op.dur - sum(ch.dur for ch in op.children if ch.cat == op.cat)
    names = set(ops) | set(gpu_by_op)
    has_gpu = bool(trace.gpu)
    rows = []
    for n in names:
        calls, total, self_ = ops.get(n, [0, 0.0, 0.0])
        g = gpu_by_op.get(n, 0.0)
        rows.append(dict(name=n, calls=calls, self_ms=self_ / 1e3, total_ms=total / 1e3, gpu_ms=g / 1e3,
                         share=(g if has_gpu else self_) / profiled))
    rows.sort(key=lambda r: -(r["gpu_ms"] if has_gpu else r["self_ms"]))
    return kernels, rows


def _group(casts: list, n_steps: int, profiled: float) -> list:
    groups: dict = {}
    sites: dict = {}
    for c in casts:
        # not keyed by site: the same cast in each layer's scope (layer0, layer1, ...) is one repeated cast
        key = (c.op, c.side, c.src, c.dst, c.shape)
        g = groups.get(key)
        if g is None:
            g = groups[key] = CastGroup(c.op, c.side, c.src, c.dst, c.shape, c.bytes_read, c.bytes_written, None)
        g.calls += 1
        g.time_us += c.time_us
        if c.site:
            sites.setdefault(key, {})[c.site] = None
    for key, g in groups.items():
        names = list(sites.get(key, ()))
        g.site = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "") if names else None
        g.per_step = g.calls / n_steps
        g.ms_per_step = g.time_us / 1e3 / n_steps
        g.share = g.time_us / profiled
    return sorted(groups.values(), key=lambda g: -g.time_us)


def _flag(groups: list, pool_bytes, refs: dict):
    """Mark pool-sized casts that repeat within a step. Returns (pool_bytes, source) used for the report."""
    source = "given" if pool_bytes else None
    pool_dtype = None
    if not pool_bytes:
        # The pool's dtype is that of a repeated float cast's source, FP8 first (the pools this is about).
        srcs = {g.src for g in groups if g.bytes_read and is_float(g.src) and g.per_step >= 2}
        fp8 = sorted(s for s in srcs if s.startswith("float8"))
        cands = fp8 or sorted(srcs, key=lambda s: -refs.get(s, 0))
        if cands and refs.get(cands[0], 0) >= MIN_POOL_BYTES:
            pool_dtype = cands[0]
            pool_bytes = refs[pool_dtype]
            source = f"inferred: the largest {pool_dtype} tensor a repeated cast or a gather reads"
    for g in groups:
        repeated = g.per_step >= 2
        if g.bytes_read is not None:
            ref = pool_bytes if source == "given" or g.src == pool_dtype else None
            if ref:
                g.pool_fraction = g.bytes_read / ref
            if (repeated and g.pool_fraction is not None and g.pool_fraction >= POOL_FRACTION
                    and (source == "given" or (g.bytes_read >= MIN_POOL_BYTES and is_float(g.src)))):
                g.flagged = True
                g.why = (f"reads {g.pool_fraction:.0%} of the KV pool ({fmt_bytes(ref)}) {g.per_step:g} times "
                         "per step")
        elif repeated and g.share >= TIME_SHARE:
            g.flagged = True
            g.why = (f"a cast {g.per_step:g} times per step taking {g.share:.0%} of the step; sizes not "
                     "recorded (CUDA graph or record_shapes=False), judged by time")
    return pool_bytes, source


def _fix(src, dst) -> str:
    kv = src or "the pool's dtype"
    q = dst or "the query dtype"
    return (f"Fix: do not convert the pool. Plan attention with q_data_type={q} and kv_data_type={kv} so the "
            "kernel reads the pool in place (fp8mla.MLAPagedAttention does, on any GPU Triton supports), or "
            "gather the active tokens first and cast only those (pool[kv_indices].to(q.dtype)). Find the call "
            "site with `fp8mla audit <attention backend source>`; guard it in tests with "
            "fp8mla.tools.sentinel.forbid_pool_casts.")


def _diagnose_words(r: Report) -> list:
    out = []
    step = r.step_ms
    for g in r.findings:
        what = f"{g.src or '?'} -> {g.dst or '?'}"
        where = f" (from {g.site})" if g.site else ""
        saved = step - g.ms_per_step
        gain = f", {step / saved:.2f}x faster" if saved > 0 else ""
        if g.bytes_read is not None:
            pool = r.pool_bytes if r.pool_source == "given" else g.bytes_read / g.pool_fraction
            moved = fmt_bytes(g.per_step * g.bytes_moved if g.bytes_moved else None)
            shape = list(g.shape) if g.shape is not None else "?"
            out.append(
                f"KV-pool cast: {g.op} {what} of {shape}{where} runs {g.per_step:g} times per step (once per "
                f"layer), each reading {fmt_bytes(g.bytes_read)} and writing {fmt_bytes(g.bytes_written)}: "
                f"{g.pool_fraction:.0%} of the KV pool ({fmt_bytes(pool)}). Cost: {g.ms_per_step:.2f} ms per step, "
                f"{g.share:.0%} of the {step:.2f} ms step ({moved} moved per step), while attention needs only "
                f"the active tokens.\n  {_fix(g.src, g.dst)}\n  Removing it saves up to {g.ms_per_step:.2f} ms "
                f"per step ({step:.2f} -> {saved:.2f} ms{gain}).")
        else:
            out.append(
                f"Suspected KV-pool cast: {g.op} ({what}){where} runs {g.per_step:g} times per step and takes "
                f"{g.ms_per_step:.2f} ms per step, {g.share:.0%} of the {step:.2f} ms step. Its sizes were not "
                "recorded (CUDA-graph replay or record_shapes=False); a cast kernel repeated once per layer at this "
                "cost is the signature of a pool-wide cast. Confirm with a few eager steps profiled with "
                f"record_shapes=True (and --pool-bytes).\n  {_fix(g.src, g.dst)}\n  Removing it saves up to "
                f"{g.ms_per_step:.2f} ms per step ({step:.2f} -> {saved:.2f} ms{gain}).")
    total = sum(g.ms_per_step for g in r.casts)
    if not r.casts:
        out.append("No dtype casts in the trace.")
    elif not r.findings:
        sized = [g for g in r.casts if g.bytes_read is not None]
        big = max(sized, key=lambda g: g.bytes_read, default=None)
        line = (f"No pool-sized cast repeats within a step. Casts take {total:.3f} ms per step "
                f"({total / step:.0%} of the step).")
        if big is not None:
            frac = f", {big.pool_fraction:.1%} of the KV pool" if big.pool_fraction is not None else ""
            line += f" The largest reads {fmt_bytes(big.bytes_read)} ({big.src} -> {big.dst}{frac})."
        out.append(line)
    if r.pool_source and r.pool_source != "given" and r.findings:
        out.append(f"The KV pool size was {r.pool_source}; pass --pool-bytes (one layer's pool) to be sure.")
    if any(g.bytes_read is None and g.side != "kernel" for g in r.casts):
        out.append("Shapes were not recorded: profile with torch.profiler.profile(record_shapes=True) to size "
                   "each cast in bytes.")
    if r.steps_source.startswith("whole"):
        out.append("No ProfilerStep#N annotations: the whole trace counts as one step (call prof.step() each "
                   "step, or pass --steps N).")
    return out


def diagnose(trace, pool_bytes=None, steps: int | None = None) -> Report:
    """Analyse a trace (a path or a loaded :class:`~fp8mla.tools.trace.Trace`).

    Args:
        pool_bytes: bytes of one layer's KV pool in its storage dtype (tokens x bytes per token; an int or a
            string such as ``"285MB"``). Without it the pool size is inferred from the largest tensor that a
            repeated cast or a gather reads.
        steps: number of profiled steps, when the trace has no ``ProfilerStep#N`` annotations.
    Raises:
        TraceError: the file is missing or not a Chrome trace.
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = load_trace(trace)
    if pool_bytes is not None:
        pool_bytes = parse_bytes(pool_bytes) if as_int(pool_bytes) is None else as_int(pool_bytes)
    if pool_bytes is not None and (isinstance(pool_bytes, bool) or pool_bytes <= 0):
        raise ValueError(f"pool_bytes: expected a positive size, got {pool_bytes!r}")
    n_steps, profiled, source = _steps(trace, steps)
    profiled = max(profiled, 1e-3)
    kernels, ops = _tables(trace, profiled, n_steps)
    casts = find_casts(trace)
    groups = _group(casts, n_steps, profiled)
    pool, pool_source = _flag(groups, pool_bytes, gather_inputs(trace))
    r = Report(path=trace.path, num_steps=n_steps, steps_source=source, profiled_us=profiled,
               has_gpu=bool(trace.gpu), shapes_recorded=trace.shapes_recorded,
               graph_kernels=sum(1 for k in trace.gpu if k.cat.lower() == "kernel"
                                 and k.ext_id not in trace.ops_by_ext_id),
               gpu_busy_us=sum(k.dur for k in trace.gpu), kernels=kernels, cpu_ops=ops, casts=groups,
               pool_bytes=pool, pool_source=pool_source, findings=[g for g in groups if g.flagged])
    r.diagnosis = _diagnose_words(r)
    r.rest = _rest(trace, casts, n_steps)
    return r


def _rest(trace: Trace, casts: list, n_steps: int) -> list:
    """Time per name with every event that belongs to a cast removed, so no time is drawn twice."""
    cast_events = {id(e) for c in casts for e in c.events}
    acc: dict = {}
    if trace.gpu:
        for k in trace.gpu:
            if id(k) not in cast_events:
                name = kernel_label(k.name) if k.cat.lower() == "kernel" else k.name
                acc[name] = acc.get(name, 0.0) + k.dur
    else:
        for op in trace.cpu_ops:
            if id(op) not in cast_events:
                self_ = op.dur - sum(ch.dur for ch in op.children if ch.cat == op.cat)
                acc[op.name] = acc.get(op.name, 0.0) + self_
    return sorted(((n, t / 1e3 / n_steps) for n, t in acc.items()), key=lambda x: -x[1])


# -- text -----------------------------------------------------------------------------------------------------
def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def format_report(r: Report, top: int = 10) -> str:
    step = r.step_ms
    L = [f"fp8mla doctor: {r.path}",
         f"  {r.num_steps} step(s) ({r.steps_source}), {step:.3f} ms per step; "
         f"shapes recorded: {'yes' if r.shapes_recorded else 'no'}"]
    if r.has_gpu:
        L.append(f"  GPU busy {r.gpu_busy_us / r.profiled_us:.0%} of the profiled time; "
                 f"{r.graph_kernels} kernel(s) with no CPU op (CUDA-graph replays)")
    L.append("")
    if r.has_gpu:
        L.append(f"{f'GPU time by kernel (top {top})':80s} {'calls':>6s} {'ms/step':>8s} {'share':>6s}")
        for k in r.kernels[:top]:
            L.append(f"  {_cut(k['name'], 78):78s} {k['calls']:6d} {k['ms_per_step']:8.3f} {k['share']:6.1%}")
    else:
        L.append("GPU time by kernel: none (a CPU-only trace)")
    L.append("")
    col = "gpu ms" if r.has_gpu else "self ms"
    L.append(f"{f'Time by CPU op (top {top}, by {col})':58s} {'calls':>6s} {'self ms':>8s} {'total ms':>9s} "
             f"{'gpu ms':>8s} {'share':>6s}")
    for o in r.cpu_ops[:top]:
        L.append(f"  {_cut(o['name'], 56):56s} {o['calls']:6d} {o['self_ms']:8.3f} {o['total_ms']:9.3f} "
                 f"{o['gpu_ms']:8.3f} {o['share']:6.1%}")
    L.append("")
    L.append(f"Dtype casts: {sum(g.calls for g in r.casts)} in {len(r.casts)} kind(s)" +
             (f"; KV pool {fmt_bytes(r.pool_bytes)} ({r.pool_source})" if r.pool_bytes else ""))
    if r.casts:
        L.append("  " + f"{'op':44s} {'src -> dst':28s} {'shape':18s} {'read':>9s} {'written':>9s} "
                 f"{'/step':>6s} {'ms/step':>8s} {'share':>6s}  pool")
    for g in r.casts[:top]:
        pool = f"{g.pool_fraction:.0%}" if g.pool_fraction is not None else "-"
        mark = "  <-- " + g.why if g.flagged else ""
        dtypes = f"{g.src or '?'} -> {g.dst or '?'}"
        shape = str(list(g.shape)) if g.shape is not None else "?"
        L.append(f"  {_cut(g.op, 44):44s} {_cut(dtypes, 28):28s} {_cut(shape, 18):18s} {fmt_bytes(g.bytes_read):>9s} "
                 f"{fmt_bytes(g.bytes_written):>9s} {g.per_step:6g} {g.ms_per_step:8.3f} {g.share:6.1%}  "
                 f"{pool}{mark}")
        if g.site:
            L.append(f"      at {g.site}")
    L.append("")
    L.append("Diagnosis")
    for p in r.diagnosis:
        L.append("  " + p)
    return "\n".join(L)


def plot_report(r: Report, path, top: int = 10, step: str | None = None) -> None:
    """Where a step's time goes: flagged casts, other casts, the biggest kernels (CPU ops on a CPU-only trace)
    without their casts, and the rest. Written as a PNG; ``step`` names the step in the title (default: "a
    <ms> ms step")."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    rows = [(f"POOL CAST {g.src}->{g.dst} x{g.per_step:g}", g.ms_per_step, "#d62728") for g in r.findings]
    other = sum(g.ms_per_step for g in r.casts if not g.flagged)
    if other:
        rows.append(("other casts", other, "#ff7f0e"))
    shown = r.rest[:top]
    rows += [(_cut(name, 60), ms, "#7f7f7f") for name, ms in shown]
    left = sum(ms for _, ms in r.rest[top:])
    if left > 0:
        rows.append(("everything else", left, "#c7c7c7"))
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.5))
    ax.barh([x[0] for x in rows][::-1], [x[1] for x in rows][::-1], color=[x[2] for x in rows][::-1])
    ax.set_xlabel("ms per step")
    what = "GPU kernels" if r.has_gpu else "CPU ops, self time"
    ax.set_title(f"Where {step or f'a {r.step_ms:.2f} ms step'} goes\n({what}; casts taken out of their ops)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
