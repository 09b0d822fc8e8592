"""``fp8mla bench WHAT``: each benchmark lives in ``fp8mla.bench.<what>`` with ``add_arguments``/``main``."""
from __future__ import annotations

import importlib

BENCHES = [
    ("decode", "paged MLA decode: FP8/BF16 KV, page 64 and 1, H 16 and 128, vs ceilings (and FlashInfer)"),
    ("prefill", "paged extend and ragged prefill vs the bf16 matmul ceiling"),
    ("write", "quantize-on-write and gather-then-cast vs the bandwidth ceiling"),
    ("step", "one MLA decode step over N layers: cast_pool vs gather_cast vs native"),
    ("plan", "host time of MLAPagedAttention.plan() on host page tables (CPU or GPU)"),
]


def add_arguments(p):
    sub = p.add_subparsers(dest="bench", metavar="WHAT")
    for name, help_ in BENCHES:
        try:
            mod = importlib.import_module(f"fp8mla.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"fp8mla.bench.{name}":
                continue
            raise
        q = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(q)
        q.set_defaults(_bench_main=mod.main)


def main(args) -> int:
    if not getattr(args, "_bench_main", None):
        import sys
        print("usage: fp8mla bench {" + ",".join(n for n, _ in BENCHES) + "} ...  (fp8mla bench WHAT --help)",
              file=sys.stderr)  # an error: on stderr, like argparse's own usage errors
        return 2
    return int(args._bench_main(args) or 0)
