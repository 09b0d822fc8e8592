"""The ``fp8mla`` command. Each subcommand lives in ``fp8mla.commands.<name>`` and provides
``add_arguments(parser)`` and ``main(args) -> int``; a module that is not there is simply not offered.

No Python traceback reaches a user: an exception a subcommand did not turn into a message itself becomes one
line on stderr (``fp8mla <command>: <what went wrong>``) and exit status 2 (Ctrl-C: 130). Set ``FP8MLA_DEBUG=1``
to get the traceback instead."""
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
    parser = argparse.ArgumentParser(prog="fp8mla", description="fp8mla: MLA attention over FP8 paged KV caches "
                                     "with BF16 queries, and tools that find KV-pool casts.")
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
    """Run ``fp8mla`` with ``argv`` (default: the command line); returns the exit status."""
    import os
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    names = [c[0] for c in COMMANDS]
    where = "fp8mla " + argv[0] if argv and argv[0] in names else "fp8mla"
    state: dict = {}
    try:
        return _run(argv, state)
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fp8mla doctor t.json | head`: the reader left; say nothing more
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - the one place that turns any failure into a message
        if os.environ.get("FP8MLA_DEBUG", "") not in ("", "0"):
            raise
        print(f"{where}: {error_line(e)}{_input_of(state.get('args'))} (FP8MLA_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 2


def _input_of(args) -> str:
    """`` while reading X`` for a command whose input is a file (the doctor's trace, the audit's paths)."""
    inputs = getattr(args, "trace", None) or getattr(args, "paths", None)
    if not inputs:
        return ""
    text = inputs if isinstance(inputs, str) else ", ".join(map(str, inputs))
    return f" while reading {text if len(text) <= 200 else text[:197] + '...'}"


def error_line(e: BaseException) -> str:
    """One line that says what went wrong, for an exception no command caught."""
    if isinstance(e, RecursionError):
        return ("the input nests too deeply for Python's recursion limit (RecursionError); it is not something "
                "this tool can read")
    if isinstance(e, MemoryError):
        return "ran out of memory (MemoryError) on this input"
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or type(e).__name__}"
    msg = " ".join(str(e).split())  # one line, whatever the message held
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _run(argv: list, state: dict) -> int:
    names = [c[0] for c in COMMANDS]
    parser = build_parser(argv[0] if argv and argv[0] in names else None)
    args = state["args"] = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    return int(args._main(args) or 0)
