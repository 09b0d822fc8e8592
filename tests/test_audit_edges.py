"""fp8mla audit at its edges: an empty rule selection, files with no finding to look for that do not
parse, things in a tree that are not regular files, files too large to read, the worker count, PEP 263 source
encodings, and a conversion whose target dtype is the pool's own."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp8mla.tools.audit as audit_mod
from fp8mla.cli import main as cli
from fp8mla.tools.audit import AuditError, audit_file, audit_paths, audit_source

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
BUGGY = "def f(q, kv_cache):\n    return kv_cache.to(q.dtype)\n"
SRC = str(Path(__file__).parents[1] / "src")


def _run(*args, timeout=60):
    """``python -m fp8mla audit ...`` in a child process, so that a hang fails the test instead of the suite."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "fp8mla", "audit", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


# -- an empty selection --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", " , "])
def test_empty_select_is_an_error(tmp_path, capsys, text):
    bad = str(FIXTURES / "bad_decode_updater.py")
    with pytest.raises(SystemExit) as e:
        cli(["audit", "--select", text, bad])
    assert e.value.code == 2
    assert "--select: expected one or more rule codes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="select: expected one or more rule codes"):
        audit_source(BUGGY, select=[t for t in text.split(",")])
    with pytest.raises(ValueError, match="select: expected one or more rule codes"):
        audit_paths([bad], select=[])


def test_empty_ignore_ignores_nothing(capsys):
    assert cli(["audit", "--ignore", "", str(FIXTURES / "bad_decode_updater.py")]) == 1
    assert "KV001" in capsys.readouterr().out


def test_help_says_what_an_empty_select_is_and_what_is_parsed(capsys):
    with pytest.raises(SystemExit):
        cli(["audit", "--help"])
    out = " ".join(capsys.readouterr().out.split()).lower()
    assert "an empty list is an error" in out and "a file named as path is always parsed" in out
    assert "not parsed, and the summary says how many" in out and "--max-bytes" in out


# -- what is parsed: a named file always; a file in a directory when it could hold a finding ----------------
@pytest.mark.parametrize("src, msg", [
    ("def broken(:\n    return 1\n", "not valid Python (line 1"),                 # no plan(, no pool name
    ("x = " + "(" * 300 + ")" * 300 + "\n", "not valid Python (line 1: too many nested parentheses"),
    ("x = 1" + " + 1" * 20000 + "\n", "nests too deeply to analyse (RecursionError)"),
])
def test_a_named_file_is_always_parsed(tmp_path, capsys, src, msg):
    """A named file with nothing to find used to be skipped unparsed and exit 0 as if it had been checked."""
    p = tmp_path / "other.py"
    p.write_text(src)
    with pytest.raises(AuditError, match=re.escape(msg)):
        audit_file(p)
    assert cli(["audit", str(p)]) == 2
    assert f"{p}: {msg}" in capsys.readouterr().err


def test_a_file_in_a_directory_that_cannot_hold_a_finding_is_counted_as_not_parsed(tmp_path, capsys):
    (tmp_path / "other.py").write_text("def broken(:\n")
    (tmp_path / "fine.py").write_text("y = 1\n")
    (tmp_path / "backend.py").write_text("def f(q, kv_cache):\n    return kv_cache.to(q.device)\n")
    assert cli(["audit", "-j", "1", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "found in 3 file(s)" in out and "2 of them not parsed: no plan() call and no KV-pool conversion" in out
    assert cli(["audit", "--json", str(tmp_path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["files_checked"], d["files_not_parsed"], d["errors"]) == (3, 2, [])
    (tmp_path / "broken_backend.py").write_text("def f(q, kv_cache):\n    return kv_cache.to(q.dtype\n")
    assert cli(["audit", str(tmp_path)]) == 2  # one that could hold a finding is parsed: its error counts
    assert "broken_backend.py: not valid Python" in capsys.readouterr().err


def test_plan_spelled_with_a_space_is_found():
    """The pre-scan looked for the exact text ``plan(``: ``wrapper.plan (`` was never analysed."""
    src = ("from flashinfer import BatchMLAPagedAttentionWrapper\nkv_cache_dtype = None\n"
           "def f(w: BatchMLAPagedAttentionWrapper, a, b, c, d, model_runner):\n"
           "    w.plan (a, b, c, d, 16, 512, 64, 1, False, 0.1, q_data_type=model_runner.dtype,\n"
           "            kv_data_type=model_runner.dtype)\n")
    assert [(f.line, f.rule) for f in audit_source(src)] == [(4, "KV002")]
    assert [(f.line, f.rule) for f in audit_source("def f(q, kv_cache):\n    return kv_cache.to (q.dtype)\n")] \
        == [(2, "KV001")]


# -- things that are not regular files, and big files --------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_a_named_pipe_in_a_tree_is_skipped_and_reported(tmp_path):
    (tmp_path / "a.py").write_text(BUGGY)
    os.mkfifo(tmp_path / "pipe.py")
    r = _run(tmp_path)
    assert r.returncode == 1, r.stderr  # the real file was still audited and flagged
    assert "KV001" in r.stdout and f"{tmp_path / 'pipe.py'}: not a regular file (a named pipe); skipped" in r.stderr
    (tmp_path / "a.py").write_text("y = 1\n")
    r = _run(tmp_path)
    assert r.returncode == 2 and "not a regular file (a named pipe)" in r.stderr
    findings, errors, n = audit_paths([tmp_path])
    assert (findings, n) == ([], 1) and errors == [f"{tmp_path / 'pipe.py'}: not a regular file (a named pipe); "
                                                   "skipped"]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_not_read():
    r = _run("/dev/zero", timeout=30)
    assert r.returncode == 2 and "/dev/zero: not a regular file (a character device); skipped" in r.stderr


def test_a_symlink_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "real.py").write_text(BUGGY)
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    findings, errors, n = audit_paths([tmp_path / "link.py"])
    assert len(findings) == 1 and errors == [] and n == 1


def test_a_file_over_the_byte_cap_is_skipped_and_reported(tmp_path, capsys, monkeypatch):
    assert audit_mod.MAX_FILE_BYTES == 8 * 2**20  # the cap docs/tools.md states
    big = tmp_path / "big.py"
    with open(big, "wb") as f:  # sparse: nothing is written, and nothing must be read
        f.truncate(audit_mod.MAX_FILE_BYTES + 1)
    with pytest.raises(AuditError, match=r"big\.py: larger than the audit reads \(8,388,609 bytes; the cap is "
                                         r"8,388,608, --max-bytes\); skipped"):
        audit_file(big)
    assert cli(["audit", str(big)]) == 2
    assert "larger than the audit reads" in capsys.readouterr().err
    small = tmp_path / "small.py"
    small.write_text(BUGGY)
    assert cli(["audit", "--max-bytes", "10", str(small)]) == 2
    assert "the cap is 10" in capsys.readouterr().err
    assert cli(["audit", "--max-bytes", "1KiB", str(small)]) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli(["audit", "--max-bytes", "0", str(small)])
    assert "--max-bytes" in capsys.readouterr().err


def test_a_file_that_grows_past_its_stat_size_is_still_capped(tmp_path, monkeypatch):
    """A size from fstat is not trusted alone (procfs files say 0): at most cap + 1 bytes are read."""
    p = tmp_path / "grow.py"
    p.write_text("x = 1\n" * 100)
    reads = []
    real_read = os.read

    def counting_read(fd, n):
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(audit_mod.os, "fstat", lambda fd: os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0)))
    monkeypatch.setattr(audit_mod.os, "read", counting_read)
    with pytest.raises(AuditError, match="larger than the audit reads"):
        audit_file(p, max_bytes=64)
    assert sum(reads) <= 65


# -- workers -------------------------------------------------------------------------------------------------
class _FakePool:
    started: list = []

    def __init__(self, max_workers):
        _FakePool.started.append(max_workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, work, chunksize=1):
        return map(fn, work)


@pytest.mark.parametrize("files, jobs, most", [(240, 64, 4), (240, 2, 2), (5000, 8, 8)])
def test_jobs_are_bounded_by_the_work(tmp_path, monkeypatch, files, jobs, most):
    import concurrent.futures
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _FakePool)
    _FakePool.started = []
    for i in range(files):
        (tmp_path / f"m{i}.py").write_text("y = 1\n")
    findings, errors, n = audit_paths([tmp_path], jobs=jobs)
    assert n == files and errors == []
    assert _FakePool.started and max(_FakePool.started) <= most


def test_a_few_files_start_no_workers(tmp_path, monkeypatch):
    import concurrent.futures
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _FakePool)
    _FakePool.started = []
    for i in range(5):
        (tmp_path / f"m{i}.py").write_text(BUGGY)
    assert len(audit_paths([tmp_path], jobs=32)[0]) == 5 and _FakePool.started == []


# -- source encodings (PEP 263) ------------------------------------------------------------------------------
def test_a_latin1_file_is_read_in_its_declared_encoding(tmp_path):
    p = tmp_path / "latin.py"
    p.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + BUGGY.encode())
    (f,) = audit_file(p)
    assert (f.line, f.rule) == (4, "KV001")
    q = tmp_path / "latin_clean.py"
    q.write_bytes(b"# vim: set fileencoding=iso-8859-15 :\nname = 'caf\xe9'\n")
    assert audit_paths([q]) == ([], [], 1)


@pytest.mark.parametrize("raw, msg", [
    (b"# coding: no-such-codec\nx = 1\n", "declares an unknown source encoding"),
    (b"# coding: ascii\nx = '\xe9'\n", "not valid ascii text"),
    (b"x = '\xe9'\n", "not a UTF-8 text file"),
])
def test_a_wrong_encoding_is_a_clear_error(tmp_path, raw, msg):
    p = tmp_path / "enc.py"
    p.write_bytes(raw)
    with pytest.raises(AuditError, match=msg):
        audit_file(p)


# -- a conversion to the pool's own dtype --------------------------------------------------------------------
@pytest.mark.parametrize("src, n", [
    ("def f(fb, layer):\n    k = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)\n    return k.to(k.dtype)\n", 0),
    ("def f(layer):\n    x = kv_cache\n    return x.to(kv_cache.dtype)\n", 0),
    ("def f(layer):\n    x = kv_cache[layer.layer_id]\n    return x.to(dtype=kv_cache.dtype)\n", 0),
    ("def f(fb, layer):\n    k = fb.pool.get_key_buffer(0)\n    return k.view(-1, 576).type(k.dtype)\n", 0),
    ("def f(fb, layer):\n    k = fb.pool.get_key_buffer(0)\n    return k.type_as(k)\n", 0),
    # the twins: another tensor's dtype is a conversion
    ("def f(fb, layer, q):\n    k = fb.token_to_kv_pool.get_key_buffer(layer.layer_id)\n    return k.to(q.dtype)\n", 1),
    ("def f(fb, layer, q):\n    k = fb.pool.get_key_buffer(0)\n    return k.type_as(q)\n", 1),
    ("def f(fb, w):\n    k = fb.pool.get_key_buffer(0)\n    return k.to(w.dtype)\n", 1),
])
def test_a_cast_to_the_pools_own_dtype_is_not_reported(src, n):
    got = audit_source(src)
    assert len(got) == n, [str(f) for f in got]


# -- only the assignments that reach a use ------------------------------------------------------------------
@pytest.mark.parametrize("body, kind", [
    ("    if fast:\n        USE\n    else:\n        kv = model_runner.dtype\n", None),     # after, other branch
    ("    if fast:\n        kv = model_runner.dtype\n        USE\n", "compute"),             # before, same branch
    ("    if fast:\n        kv = model_runner.dtype\n        return\n    USE\n", None),       # that branch returned
    ("    if fast:\n        kv = model_runner.dtype\n    USE\n", "compute"),                 # may fall through
    ("    for i in range(2):\n        USE\n        kv = model_runner.dtype\n", "compute"),   # the next pass
    ("    while fast:\n        kv = model_runner.kv_cache_dtype\n        break\n    USE\n", "kv"),
    ("    try:\n        kv = model_runner.dtype\n    except OSError:\n        pass\n    USE\n", "compute"),
    ("    kv = model_runner.dtype\n    kv = model_runner.kv_cache_dtype\n    USE\n", "kv"),  # the later wins
    ("    USE\n    kv = model_runner.dtype\n", None),
])
def test_reaching_assignments(body, kind):
    from fp8mla.tools.audit_flow import ModuleIndex
    src = "def f(w, kv, fast, model_runner):\n" + body.replace("USE", "w.plan(kv_data_type=kv)")
    index = ModuleIndex(ast.parse(src))
    (call, func), = index.plan_calls
    assert index.classify(call.keywords[0].value, func) == kind
