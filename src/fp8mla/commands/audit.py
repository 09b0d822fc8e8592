"""``fp8mla audit PATH...``: static check of attention-backend sources (Python ``ast``, nothing imported) for
KV-pool reads converted to the compute dtype and plan() calls that plan the KV as the query dtype.
Exit status: 0 clean, 1 findings, 2 a path could not be read or parsed."""
from __future__ import annotations

import json
import sys

from ..tools.audit import DEFAULT_POOL_NAMES, audit_paths, findings_json, format_findings


def _names(text):
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_arguments(p):
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories (*.py below them)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.add_argument("--pool-names", type=_names, default=None, metavar="A,B",
                   help="names that read a KV pool (calls, attributes or variables), replacing the defaults: "
                        + ",".join(DEFAULT_POOL_NAMES))
    p.add_argument("--add-pool-names", type=_names, default=(), metavar="A,B",
                   help="names that read a KV pool, added to the defaults")


def main(args) -> int:
    names = tuple(args.pool_names if args.pool_names is not None else DEFAULT_POOL_NAMES) + args.add_pool_names
    findings, errors, n = audit_paths(args.paths, pool_names=names)
    if args.json:
        print(json.dumps({"findings": findings_json(findings), "errors": errors, "files_checked": n}, indent=1))
    elif n or not errors:  # nothing read at all: the errors alone say it
        print(format_findings(findings, n))
    for e in errors:
        print(f"fp8mla audit: {e}", file=sys.stderr)
    if errors:
        return 2
    return 1 if findings else 0
