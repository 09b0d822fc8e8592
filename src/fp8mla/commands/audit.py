"""``fp8mla audit PATH...``: static check of attention-backend sources (Python ``ast``; nothing imported, no torch)
for KV-pool reads converted to the compute dtype and FlashInfer plan() calls that plan the KV as the query dtype."""
from __future__ import annotations

import argparse
import json
import sys

from ..tools.audit import (DEFAULT_POOL_NAMES, MAX_FILE_BYTES, RULES, audit_run, exit_status, findings_json,
                           findings_sarif, format_findings)

EPILOG = """\
rules:
""" + "".join(f"  {r}  {d}\n" for r, d in RULES.items()) + """
A line opts out with a comment on any line of the flagged expression:
  # fp8mla: ignore[KV001]      (several: ignore[KV001,KV002]; every rule: # fp8mla: ignore)

A file named as PATH is always parsed. A file found in a directory that has no plan()/begin_forward()
call and no KV-pool name with a conversion (.to(, .float(, ...) cannot hold a finding: it is not parsed,
and the summary says how many were not (their syntax errors are not reported). Anything that is not a
regular file (a named pipe, a device) and any file over --max-bytes is skipped and reported, never read.

exit status:
  0  every path was read and nothing was flagged
  1  something was flagged (paths that could not be read are listed on stderr too)
  2  nothing was flagged and some path could not be read or parsed (missing, not a regular file,
     over --max-bytes, not text in its declared encoding, a syntax error or nesting too deep to
     parse in a file that is parsed, or Python 3.12 syntax on an older Python); a bad option
     value (an empty --select, an unknown rule code) is 2 as well
"""


def _names(text):
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _rules(text):
    got = {r.strip().upper() for r in text.split(",") if r.strip()}
    bad = sorted(got - set(RULES))
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rule code(s) {', '.join(bad)}; expected some of "
                                         f"{', '.join(RULES)}")
    return got


def _selected(text):
    got = _rules(text)
    if not got:  # `--select ""` (an unset variable in a CI script) would report nothing and exit 0
        raise argparse.ArgumentTypeError(f"expected one or more rule codes ({','.join(RULES)}), got {text!r}")
    return got


def _max_bytes(text):
    from ..tools.doctor import parse_bytes  # pure Python, no torch
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive size (8388608, 8MiB, 20MB), got {text!r}") \
            from None


def add_arguments(p):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories (*.py below them)")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text",
                   help="output: text (default), json, or sarif (SARIF 2.1.0 for CI code-scanning annotations)")
    p.add_argument("--json", action="store_const", const="json", dest="format", help="same as --format json")
    p.add_argument("--select", type=_selected, default=None, metavar="KV001,...",
                   help="report only these rules (an empty list is an error)")
    p.add_argument("--ignore", type=_rules, default=None, metavar="KV001,...",
                   help="do not report these rules (an empty list ignores none)")
    p.add_argument("--max-bytes", type=_max_bytes, default=MAX_FILE_BYTES, metavar="N",
                   help=f"skip (and report) files larger than this (default {MAX_FILE_BYTES // 2**20}MiB)")
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="worker processes for large trees (default: one per CPU; 1: none)")
    p.add_argument("--pool-names", type=_names, default=None, metavar="A,B",
                   help="names that read a KV pool (calls, attributes or variables), replacing the defaults: "
                        + ",".join(DEFAULT_POOL_NAMES))
    p.add_argument("--add-pool-names", type=_names, default=(), metavar="A,B",
                   help="names that read a KV pool, added to the defaults")


def main(args) -> int:
    names = tuple(args.pool_names if args.pool_names is not None else DEFAULT_POOL_NAMES) + args.add_pool_names
    if args.jobs is not None and args.jobs < 1:
        print(f"fp8mla audit: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    run = audit_run(args.paths, pool_names=names, select=args.select, ignore=args.ignore, jobs=args.jobs,
                    max_bytes=args.max_bytes)
    findings, errors, n = run.findings, run.errors, run.files_checked
    status = exit_status(findings, errors)
    if args.format == "json":
        print(json.dumps({"findings": findings_json(findings), "errors": errors, "files_checked": n,
                          "files_not_parsed": run.not_parsed, "exit_status": status}, indent=1))
    elif args.format == "sarif":
        print(json.dumps(findings_sarif(findings, errors), indent=1))
    elif n or not errors:  # nothing read at all: the errors alone say it
        print(format_findings(findings, n, run.not_parsed))
    for e in errors:
        print(f"fp8mla audit: {e}", file=sys.stderr)
    return status
