"""Fuzz of the doctor's trace reader: real and synthetic traces with fields swapped for values of other types.

Traces come from many profilers and versions, and some are damaged; a field of an unexpected type (a list as a
pid, a number as an "Input type", an object as an External id) used to end ``fp8mla doctor`` in a Python
traceback (``unhashable type``, ``'int' object has no attribute 'strip'``). The contract checked here: reading
any such trace either gives a report (that prints as text and as JSON) or raises ``TraceError`` with a reason;
nothing else. Seeded: a failing case names its seed and the mutations, and reruns the same.
"""
from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch

from fp8mla.cli import main as cli
from fp8mla.tools.doctor import diagnose, format_report
from fp8mla.tools.trace import TraceError
from test_doctor import _graph_trace, _linked_trace

# values of every JSON type, including ones that are hashable in Python but meaningless here
VALUES = [None, True, False, 0, -1, 7, 2 ** 70, 1.5, -0.0, math.nan, math.inf, "", "x", "c10::BFloat16", "15",
          [], [1, 2], [[1], "a"], [None], {}, {"a": [1]}, {"External id": 3}]
CASES = 400


@pytest.fixture(scope="module")
def base_traces(tmp_path_factory):
    """Three traces to mutate: a real CPU torch.profiler trace with shapes, a linked eager GPU decode with a
    pool cast per layer (synthetic, Kineto layout), and a CUDA-graph decode (kernels only)."""
    x = torch.randn(64, 576)
    buf = torch.empty(64, 576, dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof:
        with torch.profiler.record_function("ProfilerStep#1"):
            x.to(torch.bfloat16)
            buf.copy_(x)
            x.index_select(0, torch.arange(8))
    path = tmp_path_factory.mktemp("real") / "cpu.json"
    prof.export_chrome_trace(str(path))
    real = json.loads(path.read_text())
    return [real, {"traceEvents": _linked_trace(n_tokens=5_000)}, {"traceEvents": _graph_trace(layers=3)}]


def _mutate(rng: random.Random, trace: dict, n: int) -> list:
    """Replace ``n`` fields of random complete events (top level, ``args``, or an element of an args list) with
    values of other types, or delete them. Returns what was done, for the failure message."""
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    done = []
    for _ in range(n):
        e = rng.choice(events)
        where = rng.random()
        if where < 0.4 or not isinstance(e.get("args"), dict) or not e["args"]:
            target, key = e, rng.choice(sorted(e))
        else:
            args = e["args"]
            key = rng.choice(sorted(args))
            target = args
            if isinstance(args[key], list) and args[key] and rng.random() < 0.5:
                target, key = args[key], rng.randrange(len(args[key]))
        if rng.random() < 0.1 and isinstance(target, dict):
            del target[key]
            done.append(f"del {key!r}")
        else:
            v = copy.deepcopy(rng.choice(VALUES))
            target[key] = v
            done.append(f"{key!r} = {v!r}")
    return done


@pytest.mark.parametrize("chunk", range(4))
def test_type_mutated_traces_give_a_report_or_a_trace_error(base_traces, tmp_path, chunk):
    for seed in range(chunk * CASES // 4, (chunk + 1) * CASES // 4):
        rng = random.Random(seed)
        trace = copy.deepcopy(base_traces[seed % len(base_traces)])
        done = _mutate(rng, trace, rng.randint(1, 6))
        path = tmp_path / f"m{seed}.json"
        path.write_text(json.dumps(trace))  # NaN and inf as the NaN / Infinity literals Python's json reads
        try:
            r = diagnose(path)
        except TraceError:
            continue
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"seed {seed}: {done} -> {type(e).__name__}: {e}")
        try:
            format_report(r)
            json.dumps(r.to_dict(), default=str)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"seed {seed}: {done} -> the report does not print: {type(e).__name__}: {e}")


def test_the_mutations_reached_the_fields_that_used_to_crash(base_traces):
    """The fuzz is only worth something if it swaps the fields that mattered: pid/tid, External id and Input
    type each get an unhashable or non-string value in some case."""
    hit = set()
    for seed in range(CASES):
        rng = random.Random(seed)
        trace = copy.deepcopy(base_traces[seed % len(base_traces)])
        for d in _mutate(rng, trace, rng.randint(1, 6)):
            key, _, value = d.partition(" = ")
            if value[:1] in "[{":
                hit.add(key)
            if key == "'Input type'" or key.isdigit():
                hit.add("Input type or an element of it")
    assert {"'pid'", "'tid'", "'External id'", "Input type or an element of it"} <= hit


@pytest.mark.parametrize("field, value", [
    ("pid", [1]), ("tid", {"a": 1}), ("External id", [3]), ("Input type", 5), ("Input type", [5, None]),
    ("Concrete Inputs", ["", [15]]), ("Concrete Inputs", ["", 1e300]),
])
def test_each_field_that_crashed(tmp_path, capsys, field, value):
    """The crashes the fuzz found, one by one, through the API and the command."""
    ev = _linked_trace(n_tokens=5_000)
    for e in ev:
        if field == "Concrete Inputs" and e["name"] == "aten::copy_":
            del e["args"]["Input type"]  # untyped copy_: the _to_copy's dtype argument decides
        if field in ("pid", "tid"):
            e[field] = value
        elif e["name"] in ("aten::copy_", "aten::_to_copy") or field == "External id":
            e["args"][field] = value
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = diagnose(p)
    assert format_report(r)
    assert cli(["doctor", str(p)]) in (0, 1)
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "fp8mla doctor:" in out.out


def test_deeply_nested_and_huge_number_json(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match="nested too deeply"):
        diagnose(p)
    p.write_text('{"traceEvents": [{"ph": "X", "ts": ' + "9" * 5000 + "}]}")
    with pytest.raises(TraceError, match="not a readable JSON trace"):
        diagnose(p)
