"""The ``fp8mla`` command. Each subcommand lives in ``fp8mla.commands.<name>`` and provides
``add_arguments(parser)`` and ``main(args) -> int``; a module that is not there is simply not offered."""
from __future__ import annotations

import argparse
import importlib

# (command, module, one-line help)
COMMANDS = [
    ("info", "fp8mla.commands.info", "versions, device, formats and backends available"),
    ("demo", "fp8mla.commands.demo", "the main job: the KV-cast scenario, run three ways and diagnosed"),
    ("bench", "fp8mla.commands.bench", "benchmarks with ceilings measured in the same run (GPU)"),
    ("doctor", "fp8mla.commands.doctor", "diagnose dtype casts of a KV pool in a torch profiler trace"),
    ("audit", "fp8mla.commands.audit", "static check of attention-backend sources for KV-pool casts"),
    ("generate", "fp8mla.commands.generate", "attention-only decode loop over the paged FP8 cache"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (a broken optional module then
    cannot take the other commands down)."""
    parser = argparse.ArgumentParser(prog="fp8mla", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_ in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                continue
            raise
        p = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv=None) -> int:
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [c[0] for c in COMMANDS]
    parser = build_parser(argv[0] if argv and argv[0] in names else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    return int(args._main(args) or 0)
