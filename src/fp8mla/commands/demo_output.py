"""What ``fp8mla demo`` leaves to look at: one folder holding the summary (Markdown and CSV), a plot of the step
time by way, a plot of where a cast-pool step's time goes, and the profiler traces the doctor read.

Two different times are reported for each way, and they are named apart everywhere:

- the **timed step** (``ms/step``): the median wall time (CPU) or CUDA-event time (GPU) of ``--reps`` steps run
  without the profiler, with their spread (min / median / max);
- the **profiled step**: the one step run under ``torch.profiler`` (recording shapes, and memory on a CPU),
  whose trace the doctor read: the cast shares are shares of that step.
"""
from __future__ import annotations

import csv
import os
import statistics
import time

FILES = ("summary.md", "summary.csv", "formats.csv", "step_time.png", "cast_pool_step.png")
WAY_COLORS = {"cast_pool": "#d62728", "gather_cast": "#ff7f0e", "native": "#2ca02c"}


def default_out_dir(now: float | None = None) -> str:
    """``./fp8mla-demo-<UTC timestamp>`` (with ``-2``, ``-3``... when a run of the same second has it)."""
    base = os.path.join(os.getcwd(), time.strftime("fp8mla-demo-%Y%m%d-%H%M%S", time.gmtime(now)))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def folder_error(path: str):
    """Why ``path`` cannot hold the demo's files (it is made when missing), checked before anything runs."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file; expected a folder (made if missing)"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot make the folder {path} ({e.strerror or e})"
    if not os.access(path, os.W_OK):
        return f"the folder {path} is not writable"
    return None


def ms(v: float) -> str:
    """A time in ms with 3 significant digits, without an exponent."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def spread(times: list) -> tuple[float, float, float]:
    """(min, median, max) of the timed repeats, ms."""
    return min(times), statistics.median(times), max(times)


def _pct(d: dict, key: str):
    return 100 * d[key] if d.get("available", True) and key in d else None


def scenario_rows(res: dict) -> list[dict]:
    """One row per way: what the summary table, the CSV and the plots show."""
    sc, ways = res["sc"], res["ways"]
    B = len(sc.context_lens)
    base = ways["cast_pool"]["ms"]
    rows = []
    for way, r in ways.items():
        lo, med, hi = spread(r["times"])
        rep = r["doctor"].get("report")
        rows.append(dict(
            way=way, backend=r["backend"], cuda_graph=bool(r["graph"]), timed_reps=len(r["times"]),
            ms_median=med, ms_min=lo, ms_max=hi,
            profiled_step_ms=None if rep is None else rep.step_ms,
            tok_per_s=B / (med * 1e-3), speedup_vs_cast_pool=base / med,
            cast_share_pct=_pct(r["doctor"], "cast_share"), pool_cast_share_pct=_pct(r["doctor"], "pool_cast_share"),
            extra_mem_bytes=r["extra_mem"], rel_l2_vs_f64=r["err"], trace=r.get("trace")))
    return rows


def format_rows(fmt_rows: list) -> list[dict]:
    out = []
    for r in fmt_rows:
        row = dict(format=r["format"], bytes_per_token=r["bytes_per_token"], saved_vs_bf16_pct=100 * r["saved"],
                   cache_bytes=r["cache_bytes"])
        for step in ("decode", "multi"):
            d = r[step]
            row.update({f"{step}_backend": d.get("backend"), f"{step}_rel_l2": d.get("err"),
                        f"{step}_rel_l2_orig": d.get("err_orig"), f"{step}_ms": d.get("ms"),
                        f"{step}_error": d.get("error")})
        out.append(row)
    return out


def conclusion(res: dict, device) -> str:
    """One line: what the run says, and what it cannot (times on a CPU)."""
    rows = {r["way"]: r for r in scenario_rows(res)}
    cp, nat = rows["cast_pool"], rows["native"]
    pool = cp["pool_cast_share_pct"]
    doctor = ("" if pool is None else
              f"the doctor finds cast_pool spending {pool:.0f}% of its profiled step casting the whole pool, "
              f"native {nat['pool_cast_share_pct'] or 0:.0f}%")
    if device.type == "cuda":
        return (f"conclusion: native reads the FP8 pool in place, {cp['ms_median'] / nat['ms_median']:.1f}x faster "
                f"per step than casting it (cast_pool), {ms(nat['ms_median'])} vs {ms(cp['ms_median'])} ms "
                f"(medians of {nat['timed_reps']} timed steps)" + (f"; {doctor}" if doctor else ""))
    if nat["ms_max"] < cp["ms_min"]:
        times = (f"native beat cast_pool in every timed repeat here ({ms(nat['ms_min'])}-{ms(nat['ms_max'])} vs "
                 f"{ms(cp['ms_min'])}-{ms(cp['ms_max'])} ms), but CPU times do not carry over to a GPU")
    else:
        times = (f"the timed steps overlap here (native {ms(nat['ms_min'])}-{ms(nat['ms_max'])} ms, cast_pool "
                 f"{ms(cp['ms_min'])}-{ms(cp['ms_max'])} ms): on a CPU the times are noise")
    return (f"conclusion: {times}; what holds on any device is the trace: "
            + (doctor if doctor else "(no doctor here)") + "; for the times, run it on a GPU (--device cuda)")


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _md_table(header: list, rows: list[list]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _f(v, fmt: str, none: str = "n/a") -> str:
    """``v`` formatted (a trailing "%" in ``fmt`` is appended), or ``none``."""
    return none if v is None else format(v, fmt.rstrip("%")) + "%" * fmt.endswith("%")


def write_markdown(path: str, *, title: str, res, fmt_rows, device, files: list, concl) -> None:
    L = [f"# fp8mla demo: {title}", ""]
    if fmt_rows:
        L += ["## 1. KV formats", "",
              "rel L2 error of the output vs float64 attention on the dequantized KV (the kernel's own error) and on "
              "the values before quantization (kernel + storage error); ms per call is the median of the timed "
              "calls.", ""]
        L += _md_table(["format", "B/token", "vs bf16", "cache B", "decode err", "decode err orig", "decode ms",
                        "multi err", "multi err orig", "multi ms", "backend"],
                       [[r["format"], r["bytes_per_token"], f"{-r['saved_vs_bf16_pct'] + 0.0:+.0f}%", r["cache_bytes"],
                         _f(r["decode_rel_l2"], ".1e"), _f(r["decode_rel_l2_orig"], ".1e"), _f(r["decode_ms"], ".2f"),
                         _f(r["multi_rel_l2"], ".1e"), _f(r["multi_rel_l2_orig"], ".1e"), _f(r["multi_ms"], ".2f"),
                         r["decode_backend"] or r["decode_error"]] for r in format_rows(fmt_rows)])
        L.append("")
    if res:
        sc = res["sc"]
        L += [f"## 2. The {res['scale']} scenario", "",
              f"Attention of one decode step over {res['layers']} layers, {res['heads']} heads, "
              f"B={len(sc.context_lens)} (contexts {min(sc.context_lens)}-{max(sc.context_lens)}, "
              f"{sc.active_tokens:,} active tokens) on a {sc.pool_tokens:,}-token FP8 pool per layer, on {device}.", ""]
        L += _md_table(["way", "backend", "ms/step (median)", "min-max ms", "timed reps", "profiled step ms",
                        "speedup", "casts", "pool casts", "extra mem B", "rel L2 vs f64"],
                       [[r["way"], r["backend"] + (" +graph" if r["cuda_graph"] else ""), ms(r["ms_median"]),
                         f"{ms(r['ms_min'])}-{ms(r['ms_max'])}", r["timed_reps"],
                         "n/a" if r["profiled_step_ms"] is None else ms(r["profiled_step_ms"]),
                         f"{r['speedup_vs_cast_pool']:.2f}x", _f(r["cast_share_pct"], ".1f%"),
                         _f(r["pool_cast_share_pct"], ".1f%"), r["extra_mem_bytes"],
                         f"{r['rel_l2_vs_f64']:.1e}"] for r in scenario_rows(res)])
        L += ["", "- **ms/step**: the timed steps (no profiler), median of the timed repeats, with their min-max.",
              "- **profiled step ms**: the one step run under torch.profiler (recording shapes, and memory on a CPU); "
              "its trace is in `traces/`, and the casts / pool casts columns are shares of that step (the doctor's "
              "reading).", "", "Doctor, per way (its times are of the profiled step):", ""]
        L += [f"- `{way}` ({r['backend']}): {r['doctor']['verdict']}" for way, r in res["ways"].items()]
        L.append("")
    if concl:
        L += [f"**{concl}**", ""]
    L += ["Files: " + ", ".join(f"`{f}`" for f in files), ""]
    with open(path, "w") as f:
        f.write("\n".join(L))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_step_times(path: str, res: dict, device) -> None:
    """The timed steps by way: each repeat a dot, the median a bar, min-max a whisker."""
    plt = _pyplot()
    rows = scenario_rows(res)
    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.7 * len(rows)))
    labels = [f"{r['way']}\n({r['backend']})" for r in rows][::-1]
    for i, r in enumerate(rows[::-1]):
        c = WAY_COLORS.get(r["way"], "#7f7f7f")
        ax.barh(i, r["ms_median"], color=c, alpha=0.6)
        ax.errorbar(r["ms_median"], i, xerr=[[r["ms_median"] - r["ms_min"]], [r["ms_max"] - r["ms_median"]]],
                    fmt="none", ecolor="black", capsize=4)
        ax.plot(res["ways"][r["way"]]["times"], [i + 0.3] * r["timed_reps"], "o", ms=4, mfc="white", mec="black")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("ms per step (timed, no profiler): bar = median, whisker = min-max, dots = each repeat")
    sc = res["sc"]
    ax.set_title(f"{res['scale']}: one decode step's attention, {res['layers']} layers, B={len(sc.context_lens)}, "
                 f"{device}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(out_dir: str, *, title: str, res, fmt_rows, device, concl) -> tuple[list, list]:
    """Write the folder's files. Returns (the files written, notes on what could not be)."""
    files, notes = [], []
    if res:
        write_csv(os.path.join(out_dir, "summary.csv"), scenario_rows(res))
        files.append("summary.csv")
    if fmt_rows:
        write_csv(os.path.join(out_dir, "formats.csv"), format_rows(fmt_rows))
        files.append("formats.csv")
    if res:
        if _pyplot() is None:
            notes.append("no PNGs: matplotlib is not installed (pip install matplotlib)")
        else:
            plot_step_times(os.path.join(out_dir, "step_time.png"), res, device)
            files.append("step_time.png")
            rep = res["ways"]["cast_pool"]["doctor"].get("report")
            if rep is not None:
                from ..tools.doctor import plot_report
                plot_report(rep, os.path.join(out_dir, "cast_pool_step.png"),
                            step=f"cast_pool's profiled {rep.step_ms:.2f} ms step ({res['scale']}, {device})")
                files.append("cast_pool_step.png")
        for r in res["ways"].values():  # in the folder (default: traces/), or where --trace-dir put them
            rel = os.path.relpath(r["trace"], out_dir)
            files.append(r["trace"] if rel.startswith("..") else rel)
    write_markdown(os.path.join(out_dir, "summary.md"), title=title, res=res, fmt_rows=fmt_rows, device=device,
                   files=["summary.md"] + files, concl=concl)
    return ["summary.md"] + files, notes
