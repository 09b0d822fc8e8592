"""fp8mla audit: the fixtures in tests/fixtures/audit mark each line that must be reported with
``# expect: RULE``; every finding must be marked and every mark found (clean fixtures have none)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp8mla.cli import main as cli
from fp8mla.tools.audit import DEFAULT_POOL_NAMES, AuditError, audit_file, audit_paths, audit_source

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
BAD = sorted(FIXTURES.glob("bad_*.py"))
CLEAN = sorted(FIXTURES.glob("clean_*.py"))


def _expected(path: Path) -> list:
    return [(i, m.group(1)) for i, line in enumerate(path.read_text().splitlines(), 1)
            for m in [re.search(r"#\s*expect:\s*(KV\d{3})", line)] if m]


@pytest.mark.parametrize("path", BAD + CLEAN, ids=lambda p: p.stem)
def test_fixture_findings_match_the_marks(path):
    got = [(f.line, f.rule) for f in audit_file(path)]
    assert got == _expected(path)
    assert bool(got) == path.stem.startswith("bad_")


def test_every_rule_and_shape_is_covered():
    marks = [rule for p in BAD for _, rule in _expected(p)]
    assert {"KV001", "KV002", "KV003"} <= set(marks)
    assert len(BAD) >= 4 and len(CLEAN) >= 2


def test_finding_says_where_why_and_how_to_fix():
    (f,) = [f for f in audit_file(FIXTURES / "bad_missed_call_site.py") if f.rule == "KV003"]
    assert f.path.endswith("bad_missed_call_site.py") and f.code.startswith("wrapper.begin_forward(")
    assert "self.kv_data_type" in f.message and "missed" in f.message
    assert "BatchDecodeWithPagedKVCacheWrapper" in f.message
    assert f.fix == "pass kv_data_type=self.kv_data_type here as at the other plan() calls"
    assert str(f).startswith(f"{f.path}:{f.line}:9: KV003 ")


def test_pool_names_are_configurable():
    src = "def f(q, store):\n    lat = store.latent_pages(3)\n    return lat.to(q.dtype)\n"
    assert audit_source(src) == []
    (f,) = audit_source(src, pool_names=DEFAULT_POOL_NAMES + ("latent_pages",))
    assert (f.line, f.rule) == (3, "KV001")
    assert audit_source("def f(kv_cache):\n    return kv_cache.float()\n", pool_names=("other",)) == []


@pytest.mark.parametrize("src, n", [
    ("x = get_key_buffer(0)\ny = x[slot_mapping].float()\n", 0),          # gather first
    ("x = get_key_buffer(0)\ny = x[layer_id].float()\n", 1),              # a layer view is still the pool
    ("x = get_key_buffer(0)\nx = x.index_select(0, idx)\ny = x.float()\n", 0),
    ("for kv in kv_caches:\n    kv.to(torch.float16)\n", 1),
    ("k, v = get_kv_buffer(1)\nk.float()\nv.to(q)\n", 2),
    ("kv_cache.to(q.device)\nkv_cache.view(torch.uint8)\n", 0),
    ("def f():\n    k = kv_cache\n    def g():\n        return k.half()\n", 1),  # a closure sees k
    # a branch that returns keeps its binding; one that falls through may leave the pool in the name
    ("def f(q, k):\n    if k is None:\n        k = kv_cache\n        return g(k)\n    return k.to(q.dtype)\n", 0),
    ("def f(q, k):\n    if k is None:\n        k = kv_cache\n    return k.to(q.dtype)\n", 1),
])
def test_taint_cases(src, n):
    assert len(audit_source(src)) == n, [str(f) for f in audit_source(src)]


def test_star_kwargs_plan_is_not_guessed():
    src = ("class B:\n    def __init__(s, r):\n        s.kv_data_type = r.kv_cache_dtype\n"
           "    def p(s, w, kw):\n        w.plan(kv_indptr, kv_indices, **kw)\n")
    assert audit_source(src) == []


def test_cli_exit_status_and_output(tmp_path, capsys):
    assert cli(["audit", "-j", "1", *map(str, CLEAN)]) == 0
    assert "no KV-pool casts" in capsys.readouterr().out
    assert cli(["audit", str(FIXTURES)]) == 1
    out = capsys.readouterr().out
    n_marks = sum(len(_expected(p)) for p in BAD)
    assert f"{n_marks} finding(s) in {len(BAD)} of {len(BAD) + len(CLEAN)} file(s)" in out
    assert "    fix: " in out
    assert cli(["audit", "--json", str(FIXTURES / "bad_decode_updater.py")]) == 1
    d = json.loads(capsys.readouterr().out)
    assert [f["rule"] for f in d["findings"]] == ["KV002", "KV001", "KV001"] and d["errors"] == []


@pytest.mark.parametrize("content, msg", [
    (None, "no such file or directory"),
    (b"def broken(kv_cache.to(:\n", "not valid Python (line 1"),
    (b"\xff\xfe\x00bin", "not a UTF-8 text file"),
])
def test_unreadable_input_exits_2_when_nothing_is_flagged(tmp_path, capsys, content, msg):
    p = tmp_path / "x.py"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(AuditError, match=re.escape(msg)):
        audit_file(p)
    assert cli(["audit", str(p), str(FIXTURES / "clean_casts.py")]) == 2
    assert msg in capsys.readouterr().err


def test_audit_paths_walks_directories(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("kv_cache.float()\n")
    (tmp_path / "pkg" / "notes.txt").write_text("kv_cache.float()\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "b.py").write_text("kv_cache.float()\n")
    findings, errors, n = audit_paths([tmp_path])
    assert n == 1 and errors == [] and [f.rule for f in findings] == ["KV001"]
