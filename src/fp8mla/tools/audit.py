"""``fp8mla audit``: a static check of attention-backend sources for the KV-pool cast bug class.

It reads Python with :mod:`ast` (nothing is imported or run; torch is not loaded) and reports, with
file:line, the reason and the fix:

- ``KV001`` a KV-pool read (``get_key_buffer(...)``, ``kv_cache``, ``k_buffer``, ... — configurable), or a view of
  one, converted to another dtype (:mod:`~fp8mla.tools.audit_casts`);
- ``KV002`` a FlashInfer ``plan(...)``/``begin_forward(...)`` that plans the KV data type as a compute dtype
  (the model's or the query's) while an FP8-capable pool is visible in the module;
- ``KV003`` a paged ``plan`` call that passes no KV data type in a class that keeps the KV dtype in an
  attribute (the call site that was missed) (both in :mod:`~fp8mla.tools.audit_plan`).

Arguments are resolved against the wrapper signatures of FlashInfer 0.2.x-0.7.x
(:mod:`~fp8mla.tools.flashinfer_signatures`); dtypes are told apart by intra-module data flow
(:mod:`~fp8mla.tools.audit_flow`). A line can opt out with ``# fp8mla: ignore[KV001]`` (or ``ignore[KV001,KV002]``,
or a bare ``# fp8mla: ignore`` for every rule) on any line of the flagged expression.

Heuristic by nature: names are matched, not types. A finding is a line to read, not a proof.
"""
from __future__ import annotations

import ast
import functools
import io
import os
import re
import stat
import sys
import tokenize
from dataclasses import asdict, dataclass

from .audit_casts import DEFAULT_POOL_NAMES, check_casts
from .audit_flow import ModuleIndex
from .audit_plan import check_plans

__all__ = ["Finding", "AuditError", "AuditRun", "DEFAULT_POOL_NAMES", "RULES", "MAX_FILE_BYTES", "audit_source",
           "audit_file", "audit_paths", "audit_run", "format_findings", "findings_json", "findings_sarif",
           "exit_status"]

RULES = {
    "KV001": "a KV-pool read converted to another dtype (the whole pool copied every layer of every step)",
    "KV002": "a plan()/begin_forward() that plans the KV data type as a compute dtype",
    "KV003": "a paged plan() call site that passes no KV data type where the class keeps one",
}
_IGNORE = re.compile(r"#\s*fp8mla:\s*ignore(?:\[([A-Za-z0-9_,\s]*)\])?")
_PEP695 = re.compile(r"^[ \t]*(type[ \t]+[A-Za-z_]\w*[ \t]*(\[[^\]\n]*\])?[ \t]*=|(async[ \t]+)?def[ \t]+\w+[ \t]*\[|"
                     r"class[ \t]+\w+[ \t]*\[)", re.M)
# a file without these spellings cannot produce a finding: one found in a directory is not parsed (parsing every
# file of an installed engine tree costs ~8x the audit), and is counted as not parsed. Whitespace before the
# parenthesis is valid Python.
_PLAN_CALLS = (re.compile(r"plan[\s\\]+\("), re.compile(r"begin_forward[\s\\]+\("))  # literal prefixes: fast
_CAST_TOKENS = (".to(", ".float(", ".half(", ".bfloat16(", ".double(", ".type(", ".type_as(")
_CAST_CALL = re.compile(r"\.[\s\\]*(?:to|float|half|bfloat16|double|type|type_as)[\s\\]*\(")
_GETATTR_CAST = re.compile(r"""getattr[\s\\]*\([^()]*,[\s\\]*["'](?:to|float|half|bfloat16|double|type|type_as)["']""")
# the most a file may hold: ast needs ~75x a file's size in memory, and nothing hand-written comes close
MAX_FILE_BYTES = 8 * 2**20
_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class AuditError(Exception):
    """A path could not be audited (missing, unreadable, not Python)."""


@dataclass
class Finding:
    path: str
    line: int
    col: int
    rule: str      # KV001, KV002, KV003
    message: str
    fix: str
    code: str      # the source line

    def __str__(self):
        return f"{self.path}:{self.line}:{self.col + 1}: {self.rule} {self.message}"


def _check_rules(rules, what):
    if rules is None:
        return None
    rules = {r.strip().upper() for r in rules if r.strip()}
    if not rules and what == "select":  # selecting no rule would report nothing: never what was meant
        raise ValueError(f"select: expected one or more rule codes ({', '.join(RULES)}), got none")
    bad = sorted(rules - set(RULES))
    if bad:
        raise ValueError(f"{what}: unknown rule code(s) {', '.join(bad)}; expected some of {', '.join(RULES)}")
    return rules


def _suppressed(lines, node, rule) -> bool:
    """An ``# fp8mla: ignore[...]`` comment on a line of the flagged expression names ``rule`` (or all)."""
    end = getattr(node, "end_lineno", None) or node.lineno
    for i in range(node.lineno, min(end, len(lines)) + 1):
        line = lines[i - 1]
        if "fp8mla" not in line:
            continue
        m = _IGNORE.search(line)
        if m and (m.group(1) is None or rule in {c.strip().upper() for c in m.group(1).split(",")}):
            return True
    return False


def _parse(source, path):
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as e:
        if sys.version_info < (3, 12) and _PEP695.search(source):
            raise AuditError(f"{path}: needs Python >= 3.12 syntax (PEP 695) — run fp8mla audit on 3.12+ "
                             f"(line {e.lineno}: {e.msg})") from None
        raise AuditError(f"{path}: not valid Python (line {e.lineno}: {e.msg})") from None


def audit_source(source: str, path: str = "<string>", pool_names=DEFAULT_POOL_NAMES, select=None,
                 ignore=None) -> list:
    """Findings in one Python source text. The text is always parsed: a syntax error raises
    :class:`AuditError`."""
    return _audit_text(source, path, pool_names, select, ignore, prescan=False)[0]


def _could_find(source: str, pool_names) -> tuple:
    """(casts, plans): whether the text spells a pool conversion / a plan() call at all."""
    # plain substring tests first, cheapest first (they decide most files of a tree); the regexes only for the
    # rare spelling with whitespace or a line continuation before the parenthesis
    casts = any(a in source for a in _anchors(tuple(pool_names))) and any(n in source for n in pool_names) and (
        any(t in source for t in _CAST_TOKENS) or bool(_CAST_CALL.search(source)) or (
            "getattr" in source and bool(_GETATTR_CAST.search(source))))
    plans = ("plan" in source or "begin_forward" in source) and (
        "plan(" in source or "begin_forward(" in source or any(r.search(source) for r in _PLAN_CALLS))
    return casts, plans


@functools.lru_cache(maxsize=8)
def _anchors(pool_names: tuple) -> tuple:
    """Words one of which every pool name contains ("cache", "buffer", "pool", else the name itself): three
    substring tests reject a file that names no pool, instead of one per name."""
    words = ("cache", "buffer", "pool")
    return tuple(dict.fromkeys(next((w for w in words if w in n), n) for n in pool_names))


def _audit_text(source, path, pool_names, select, ignore, prescan: bool):
    """(findings, parsed). ``prescan``: a text that spells no plan() call and no pool conversion is not parsed
    (it cannot have a finding; ``parsed`` is then False)."""
    select, ignore = _check_rules(select, "select"), _check_rules(ignore, "ignore") or set()
    want_casts, want_plans = _could_find(source, pool_names)
    if prescan and not (want_casts or want_plans):
        return [], False
    tree = _parse(source, path)
    if not (want_casts or want_plans):
        return [], True
    lines = source.splitlines()
    found: dict = {}

    def emit(node, rule, message, fix):
        key = (node.lineno, node.col_offset, rule)
        if key in found or rule in ignore or (select is not None and rule not in select):
            return
        if _suppressed(lines, node, rule):
            return
        code = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
        found[key] = Finding(path, node.lineno, node.col_offset, rule, message, fix, code)

    built = []

    def get_index():
        if not built:
            built.append(ModuleIndex(tree))
        return built[0]

    if want_casts:
        check_casts(tree, get_index, pool_names, emit)
    if want_plans:
        check_plans(get_index(), source, emit)
    return sorted(found.values(), key=lambda f: (f.line, f.col, f.rule)), True


def _kind(st) -> str | None:
    """What a non-regular file is ("a named pipe"), None for a regular file."""
    if stat.S_ISREG(st.st_mode):
        return None
    return next((what for test, what in _NOT_REGULAR if test(st.st_mode)), "not a regular file")


def _read_bytes(path: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``. Anything else -- a named pipe (reading it waits for
    a writer forever), a device (``/dev/zero`` never ends) -- is refused before it is read."""
    def refuse(st):
        raise AuditError(f"{path}: not a regular file ({_kind(st)}); skipped")

    def too_big(size):
        got = f"{size:,} bytes" if size else f"more than {max_bytes:,} bytes"
        raise AuditError(f"{path}: larger than the audit reads ({got}; the cap is {max_bytes:,}, --max-bytes); "
                         "skipped")
    try:
        st = os.stat(path)
        if _kind(st):
            refuse(st)
        if st.st_size > max_bytes:
            too_big(st.st_size)
        # O_NONBLOCK: should the path have become a pipe since the stat, opening it still returns at once
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file or directory") from None
    except OSError as e:
        raise AuditError(f"{path}: cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if _kind(st):
            refuse(st)
        chunks, got = [], 0
        while got <= max_bytes:  # a size from stat is not trusted alone (procfs files say 0)
            b = os.read(fd, max_bytes + 1 - got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > max_bytes:
            too_big(st.st_size if st.st_size > max_bytes else 0)
        return b"".join(chunks)
    except OSError as e:
        raise AuditError(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)


def _decode(raw: bytes, path: str) -> str:
    """Source text in the encoding the file declares (PEP 263: a coding comment on line 1 or 2, or a UTF-8
    byte-order mark); UTF-8 without one."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as e:
        if "unknown encoding" in str(e):
            raise AuditError(f"{path}: declares an unknown source encoding ({e})") from None
        raise AuditError(f"{path}: not a UTF-8 text file") from None
    try:
        source = raw.decode(encoding)
    except (UnicodeDecodeError, LookupError):
        if encoding.replace("_", "-").lower() in ("utf-8", "utf-8-sig"):
            raise AuditError(f"{path}: not a UTF-8 text file") from None
        raise AuditError(f"{path}: not valid {encoding} text (the encoding its coding comment declares)") \
            from None
    if "\x00" in source:
        raise AuditError(f"{path}: a binary file, expected Python source")
    return source


def _read(path: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    return _decode(_read_bytes(path, max_bytes), path)


def audit_file(path, pool_names=DEFAULT_POOL_NAMES, select=None, ignore=None,
               max_bytes: int = MAX_FILE_BYTES) -> list:
    """Findings in one file, which is always parsed. Raises :class:`AuditError` when it is not a regular file,
    holds more than ``max_bytes``, is not text in its declared encoding, or does not parse."""
    return _audit_path(os.fspath(path), pool_names, select, ignore, max_bytes, prescan=False)[0]


def _audit_path(path, pool_names, select, ignore, max_bytes, prescan):
    source = _read(path, max_bytes)
    try:
        return _audit_text(source, path, pool_names, select, ignore, prescan)
    except (RecursionError, MemoryError) as e:  # machine-generated code nested beyond what ast can hold
        raise AuditError(f"{path}: nests too deeply to analyse ({type(e).__name__})") from None


def _python_files(path: str):
    """(file, named): ``path`` itself when it is not a directory (named: always parsed), else every ``*.py``
    below it, hidden folders skipped."""
    if not os.path.isdir(path):
        yield path, True
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(root, f), False


def _audit_one(job):
    """(findings, error or None, parsed)."""
    path, named, pool_names, select, ignore, max_bytes = job
    try:
        found, parsed = _audit_path(path, pool_names, select, ignore, max_bytes, prescan=not named)
        return found, None, parsed
    except AuditError as e:
        return [], str(e), True


@dataclass
class AuditRun:
    findings: list
    errors: list
    files_checked: int   # files read (parsed, or found unable to hold a finding)
    not_parsed: int = 0  # of those, found in a directory with no plan() call or pool conversion: not parsed


_CHUNK = 64          # files per task handed to a worker
_MIN_PARALLEL = 200  # below this many files, starting workers costs more than it saves


def audit_paths(paths, pool_names=DEFAULT_POOL_NAMES, select=None, ignore=None, jobs: int | None = 1,
                max_bytes: int = MAX_FILE_BYTES):
    """Audit files and directories (``*.py`` below them). Returns ``(findings, errors, files_checked)``; see
    :func:`audit_run` for the count of files not parsed."""
    r = audit_run(paths, pool_names, select, ignore, jobs, max_bytes)
    return r.findings, r.errors, r.files_checked


def audit_run(paths, pool_names=DEFAULT_POOL_NAMES, select=None, ignore=None, jobs: int | None = 1,
              max_bytes: int = MAX_FILE_BYTES) -> AuditRun:
    """Audit files and directories. A file named in ``paths`` is always parsed; one found in a directory that
    spells no ``plan(``/``begin_forward(`` call and no pool-name conversion cannot hold a finding and is not
    parsed (counted in ``not_parsed``). ``jobs`` > 1 (None: one per CPU) spreads the files over worker processes
    when there are many, never more workers than there are tasks of files. Anything that is not a regular
    file, or holds more than ``max_bytes``, is skipped and listed in ``errors``."""
    _check_rules(select, "select"), _check_rules(ignore, "ignore")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    errors, files = [], []
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            errors.append(f"{p}: no such file or directory")
            continue
        files += list(_python_files(p))
    jobs = (os.cpu_count() or 1) if jobs is None else max(1, int(jobs))
    work = [(f, named, tuple(pool_names), select, ignore, max_bytes) for f, named in files]
    jobs = min(jobs, -(-len(work) // _CHUNK))  # a worker without a task of files only costs its start-up
    if jobs > 1 and len(work) >= _MIN_PARALLEL:
        import concurrent.futures
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as ex:
            results = list(ex.map(_audit_one, work, chunksize=_CHUNK))
    else:
        results = [_audit_one(w) for w in work]
    findings, n, skipped = [], 0, 0
    for got, err, parsed in results:
        if err:
            errors.append(err)
        else:
            findings += got
            n += 1
            skipped += not parsed
    return AuditRun(findings, errors, n, skipped)


def exit_status(findings, errors) -> int:
    """1 when anything was flagged (even if some path could not be read), 2 when nothing was flagged and some
    path could not be read, 0 when every path was read and nothing was flagged."""
    return 1 if findings else 2 if errors else 0


def format_findings(findings, files_checked: int, not_parsed: int = 0) -> str:
    out = []
    for f in findings:
        out += [str(f), f"    {f.code}", f"    fix: {f.fix}"]
    if findings:
        out.append(f"{len(findings)} finding(s) in {len({f.path for f in findings})} of {files_checked} file(s)")
    else:
        out.append(f"no KV-pool casts or KV-dtype plan mistakes found in {files_checked} file(s)")
    if not_parsed:
        out.append(f"  {not_parsed} of them not parsed: no plan() call and no KV-pool conversion in them, so nothing "
                   "to flag (their syntax is not checked; name a file to have it parsed)")
    return "\n".join(out)


def findings_json(findings) -> list:
    return [asdict(f) for f in findings]


def findings_sarif(findings, errors) -> dict:
    """SARIF 2.1.0 (the format CI code-scanning annotations read); errors go in as tool notifications."""
    from .. import __version__
    rules = [{"id": r, "shortDescription": {"text": d}, "defaultConfiguration": {"level": "warning"}}
             for r, d in RULES.items()]
    results = [{"ruleId": f.rule, "level": "warning", "message": {"text": f"{f.message}. Fix: {f.fix}"},
                "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.path.replace(os.sep, "/")},
                                                    "region": {"startLine": f.line, "startColumn": f.col + 1}}}]}
               for f in findings]
    notes = [{"level": "error", "message": {"text": e}} for e in errors]
    return {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0",
            "runs": [{"tool": {"driver": {"name": "fp8mla audit", "version": __version__, "rules": rules}},
                      "results": results,
                      "invocations": [{"executionSuccessful": not errors,
                                       "toolExecutionNotifications": notes}]}]}
