"""The ``fp8mla`` command at its edges: no Python traceback reaches a user, ever.

An exception a subcommand does not turn into a message itself becomes one line on stderr and exit status 2
(``FP8MLA_DEBUG=1`` shows the traceback); a seeded fuzz throws bad arguments at every cheap subcommand.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import fp8mla.commands.doctor
from fp8mla.cli import build_parser
from fp8mla.cli import main as cli


def _raise(exc):
    def main(args):
        raise exc
    return main


# -- the top-level handler -----------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, want", [
    (ValueError("bad\nthing"), "fp8mla doctor: ValueError: bad thing while reading t.json"),
    (KeyError("pid"), "fp8mla doctor: KeyError: 'pid' while reading t.json"),
    (RecursionError("maximum recursion depth exceeded"), "nests too deeply for Python's recursion limit"),
    (MemoryError(), "ran out of memory (MemoryError) on this input while reading t.json"),
    (FileNotFoundError(2, "No such file or directory", "/x/y.png"), "fp8mla doctor: /x/y.png: No such file"),
    (RuntimeError("x" * 1000), "RuntimeError: " + "x" * 280),
])
def test_unexpected_exception_is_one_line_and_exit_2(monkeypatch, capsys, exc, want):
    monkeypatch.setattr(fp8mla.commands.doctor, "main", _raise(exc))
    monkeypatch.delenv("FP8MLA_DEBUG", raising=False)
    assert cli(["doctor", "t.json"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], out.err
    assert lines[0].endswith("(FP8MLA_DEBUG=1 shows the traceback)") and len(lines[0]) < 500
    assert "Traceback" not in out.err and out.out == ""


def test_fp8mla_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setattr(fp8mla.commands.doctor, "main", _raise(ValueError("boom")))
    monkeypatch.setenv("FP8MLA_DEBUG", "1")
    with pytest.raises(ValueError, match="boom"):
        cli(["doctor", "t.json"])


def test_ctrl_c_is_exit_130(monkeypatch, capsys):
    monkeypatch.setattr(fp8mla.commands.doctor, "main", _raise(KeyboardInterrupt()))
    assert cli(["doctor", "t.json"]) == 130
    assert capsys.readouterr().err.strip() == "fp8mla doctor: interrupted"


# -- audit on pathological sources (the audit's internals belong elsewhere: caught at the CLI boundary) ------
HEADER = "k = get_key_buffer(0).to(q.dtype)\n"  # a pool read, so the file is not skipped as irrelevant


@pytest.mark.parametrize("body", [
    "x = " + "-" * 100_000 + "1\n",            # MemoryError in Python's parser (3.11)
    "x = " + "+".join(["a"] * 30_000) + "\n",  # RecursionError building or walking the tree
    "x = a" + ".b" * 100_000 + "\n",
])
def test_audit_on_pathological_expressions(tmp_path, capsys, body):
    p = tmp_path / "patho.py"
    p.write_text(HEADER + body)
    rc = cli(["audit", str(p)])
    out = capsys.readouterr()
    assert rc == 2 and "Traceback" not in out.err, out.err
    err = [line for line in out.err.splitlines() if line.strip()]
    assert err and all(line.startswith("fp8mla audit: ") for line in err), out.err
    assert "patho.py" in out.err


def test_no_traceback_from_a_real_process(tmp_path):
    """The same through ``python -m fp8mla``, as a user runs it: stderr holds one line, no traceback."""
    p = tmp_path / "patho.py"
    p.write_text(HEADER + "x = " + "-" * 100_000 + "1\n")
    env = {k: v for k, v in os.environ.items() if k != "FP8MLA_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "fp8mla", "audit", str(p)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("fp8mla audit: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- fuzz: bad arguments to every cheap subcommand ----------------------------------------------------------------
def _actions(command: str):
    """(positionals, options) of one subcommand, read from its argparse parser: positionals as nargs, options
    as (flag, takes_a_value)."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    acts = sub.choices[command]._actions
    pos = [a.nargs for a in acts if not a.option_strings]
    opts = [(s, a.nargs != 0) for a in acts for s in a.option_strings[-1:] if s not in ("-h", "--help")]
    return pos, opts + [("--nope", True)]


@pytest.fixture
def bad_values(tmp_path):
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i}", "ts": i * 3.7, "dur": 1 + i % 7, "pid": 1,
               "tid": 1, "args": {"External id": i}} for i in range(2000)]
    raw = bytearray(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    raw[100:140] = bytes(range(40))  # inside the deflate stream: zlib.error, not a bad header
    (tmp_path / "corrupt.json.gz").write_bytes(bytes(raw))
    for e in events[::2]:
        e["pid"], e["args"]["External id"], e["args"]["Input type"] = [1], {"id": 1}, [15, None]
    (tmp_path / "types.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "bad.py").write_text("def f(:\n")
    return ["", "0", "-1", "nan", "1e999", "abc", "1GB", "-", "x" * 5000, "/nonexistent/file", str(tmp_path),
            str(tmp_path / "empty.json"), str(tmp_path / "binary.bin"), str(tmp_path / "corrupt.json.gz"),
            str(tmp_path / "types.json"), str(tmp_path / "bad.py"), "tpu9", "cuda:7", "\u2603", "a,b,,", "3",
            "/nonexistent/dir/out.png", str(tmp_path / "binary.bin") + "/below"]


@pytest.mark.parametrize("command", ["doctor", "audit", "demo", "info"])
def test_fuzz_bad_arguments(command, bad_values, tmp_path, monkeypatch, capsys):
    """Random flags of the subcommand (and unknown ones) with random bad values, seeded. Every outcome is an
    exit status with a message, never an exception. The demo's two parts are stubbed: arguments that pass its
    checks would otherwise start the real run."""
    import fp8mla.commands.demo as demo
    monkeypatch.setattr(demo, "run_formats", lambda *a, **k: [])
    monkeypatch.setattr(demo, "run_scenario", lambda *a, **k: None)
    monkeypatch.setattr(demo, "print_scenario", lambda *a, **k: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FP8MLA_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)  # a value that names a relative folder or plot is made here
    pos, opts = _actions(command)
    good = ["1", "3", "64", "10MB", "cpu", str(tmp_path / "types.json"), "out.png"]  # so some calls get far
    for seed in range(120):
        rng = random.Random(f"{command}-{seed}")
        pick = lambda: rng.choice(bad_values if rng.random() < 0.6 else good)  # noqa: E731
        argv = [command]
        for nargs in pos:  # the right number of positionals (mostly): bad files and paths
            argv += [pick() for _ in range(rng.randint(1, 2) if nargs == "+" else 1)]
        if rng.random() < 0.1:
            argv.append(pick())  # a stray word
        for _ in range(rng.randint(0, 3)):
            flag, takes = rng.choice(opts)
            argv += [flag, pick()] if takes else [flag]
        try:
            rc = cli(argv)
        except SystemExit as e:  # argparse: usage and a message on stderr, status 2
            rc = e.code
        except BaseException as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{argv!r}: {type(e).__name__}: {e}")
        err = capsys.readouterr().err
        assert rc in (0, 1, 2), (argv, rc, err)
        assert "Traceback" not in err, (argv, err)
        # and each was answered by the command itself, naming what was wrong, not by the last-resort handler
        assert "FP8MLA_DEBUG=1" not in err, (argv, err)
        if rc == 2:
            assert err.strip(), f"{argv!r}: exit 2 without a message"


# -- scripts/reproduce_benchmarks.sh ---------------------------------------------------------------------------
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "reproduce_benchmarks.sh")


def _fp8mla_commands(path: str) -> list:
    """Every ``-m fp8mla ...`` command line of a shell script, continuation lines joined, shell variables
    replaced by sample values."""
    text = open(path).read().replace("\\\n", " ")
    sample = {'"$H"': "16", '"$reps"': "30", "$compare": "flashinfer gather_cast", '"$limit"': "1"}
    cmds = []
    for line in text.splitlines():
        if "-m fp8mla " not in line or line.lstrip().startswith("#"):
            continue
        line = line.split("-m fp8mla ", 1)[1].split(";;")[0]
        for k, v in sample.items():
            line = line.replace(k, v)
        line = line.replace('"$out/', "/tmp/out/").replace('"', "")
        cmds.append(line.split())
    return cmds


def test_one_documented_benchmark_script():
    """The leftovers of past device runs are gone; one script reproduces the benchmarks, docs/benchmarks.md
    cites it, and every fp8mla command in it parses with today's flags (a renamed flag fails here, not on a
    GPU)."""
    scripts = os.listdir(os.path.join(ROOT, "scripts"))
    assert not [s for s in scripts if s.startswith(("gpu_final_", "gpu_sweep2", "gpu_decode_"))], scripts
    assert "scripts/reproduce_benchmarks.sh" in open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    cmds = _fp8mla_commands(SCRIPT)
    assert {c[0] for c in cmds} == {"bench", "demo", "generate"} and {c[1] for c in cmds if c[0] == "bench"} == {
        "decode", "step", "prefill", "write"}
    for argv in cmds:
        parser = build_parser(argv[0])
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"scripts/reproduce_benchmarks.sh: `fp8mla {' '.join(argv)}` does not parse")
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", SCRIPT, "/tmp/unused", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown part 'nope'" in r.stderr and not os.path.exists("/tmp/unused")


def test_bench_without_what_says_so_on_stderr(capsys):
    assert cli(["bench"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: fp8mla bench {decode,")
