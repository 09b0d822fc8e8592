"""``fp8mla doctor TRACE`` (a file, a pipe, or ``-`` for standard input): GPU time by kernel and by CPU op, dtype
casts, and KV-pool casts that repeat once per layer, with the cost per step and the fix. Exit status: 0 nothing
flagged, 1 pool-sized casts flagged, 2 the trace could not be read."""
from __future__ import annotations

import json
import os
import sys

from ..tools.doctor import diagnose, format_report, parse_bytes, plot_report
from ..tools.trace import TraceError


def _pool_bytes(text):
    import argparse
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text):
    import argparse
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return n


def add_arguments(p):
    p.add_argument("trace", metavar="TRACE", help="Chrome trace from torch.profiler export_chrome_trace "
                   "(.json or .json.gz; SGLang /start_profile and vLLM profiler traces too); a pipe such as "
                   "<(zcat t.json.gz) or - for standard input")
    p.add_argument("--pool-bytes", type=_pool_bytes, default=None, metavar="N",
                   help="bytes of one layer's KV pool in its storage dtype (tokens x bytes/token; 285MB, "
                        "272MiB, 285000000); default: inferred from the largest tensor a repeated cast or a "
                        "gather reads")
    p.add_argument("--top", type=_positive, default=10, metavar="N", help="rows per table (default 10)")
    p.add_argument("--steps", type=_positive, default=None, metavar="N",
                   help="number of profiled steps, for traces without ProfilerStep#N annotations")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="bar chart of where a step's time goes "
                   "(needs matplotlib)")


def _plot_target_error(path: str) -> str | None:
    """Why ``--plot PATH`` cannot be written, checked before the trace is read (a long read must not end in a
    missing folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--plot: {path} is a folder; expected a file name such as {os.path.join(path, 'doctor.png')}"
    if not os.path.isdir(folder):
        return f"--plot: the folder {folder} does not exist; create it first or pick another path"
    if not os.access(folder, os.W_OK):
        return f"--plot: the folder {folder} is not writable"
    return None


def main(args) -> int:
    if args.plot and (why := _plot_target_error(args.plot)):
        print(f"fp8mla doctor: {why}", file=sys.stderr)
        return 2
    try:
        report = diagnose(args.trace, pool_bytes=args.pool_bytes, steps=args.steps)
    except TraceError as e:
        print(f"fp8mla doctor: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        print(format_report(report, top=args.top))
    if args.plot:
        try:
            plot_report(report, args.plot, top=args.top)
        except RuntimeError as e:
            print(f"fp8mla doctor: {e}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as e:  # a full disk, an extension matplotlib cannot write
            print(f"fp8mla doctor: --plot: cannot write {args.plot} ({e})", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 1 if report.findings else 0
