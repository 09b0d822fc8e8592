"""fp8mla audit as a CI gate: exit status, encodings, newer syntax, output formats, rule selection, inline
suppression, no torch on the audit path, the FlashInfer signature table, and a whole-tree run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8mla.cli import main as cli
from fp8mla.tools.audit import AuditError, audit_file, audit_paths, audit_source, exit_status
from fp8mla.tools.flashinfer_signatures import SIGNATURES, signatures_for

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
BUGGY = "def f(q, kv_cache):\n    return kv_cache.to(q.dtype)\n"


def _twins():
    return sorted(p.name.removeprefix("clean_") for p in FIXTURES.glob("clean_*.py")
                  if (FIXTURES / ("bad_" + p.name.removeprefix("clean_"))).exists())


def test_false_alarm_fixtures_have_buggy_twins():
    # each false-alarm pattern the audit once raised has a twin that must be flagged (marks checked in test_audit.py)
    assert {"ctor_kv_dtype.py", "engine_wrapper_kwargs.py", "guarded_cache_cast.py", "library_cached_module.py",
            "model_dtype_positional.py"} <= set(_twins())
    for name in _twins():
        assert audit_file(FIXTURES / ("bad_" + name)), name
        assert audit_file(FIXTURES / ("clean_" + name)) == [], name


# -- exit status ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("files, status", [
    ({"a.py": BUGGY}, 1),
    ({"a.py": BUGGY, "b.py": "x = kv_cache.to(\n"}, 1),        # flagged, and an error: still 1 (errors listed)
    ({"b.py": "x = kv_cache.to(\n", "c.py": "y = 1\n"}, 2),  # only an error
    ({"c.py": "y = 1\n"}, 0),
])
def test_exit_status(tmp_path, capsys, files, status):
    for name, src in files.items():
        (tmp_path / name).write_text(src)
    assert cli(["audit", "-j", "1", str(tmp_path)]) == status
    out, err = capsys.readouterr()
    if "b.py" in files:
        assert "b.py: not valid Python" in err
    if status == 1:
        assert "KV001" in out
    findings, errors, _ = audit_paths([tmp_path])
    assert exit_status(findings, errors) == status


def test_missing_path_with_findings_is_still_1(tmp_path, capsys):
    (tmp_path / "a.py").write_text(BUGGY)
    assert cli(["audit", str(tmp_path / "a.py"), str(tmp_path / "nope.py")]) == 1
    assert "nope.py: no such file or directory" in capsys.readouterr().err


def test_help_documents_exit_status_and_rules(capsys):
    with pytest.raises(SystemExit):
        cli(["audit", "--help"])
    out = capsys.readouterr().out
    for s in ("exit status:", "1  something was flagged", "2  nothing was flagged", "KV001", "KV002", "KV003",
              "# fp8mla: ignore[KV001]", "--format", "--select", "--ignore"):
        assert s in out, s


# -- reading -------------------------------------------------------------------------------------------------
def test_utf8_bom_file_is_read(tmp_path):
    p = tmp_path / "bom.py"
    p.write_bytes(b"\xef\xbb\xbf" + BUGGY.encode())
    (f,) = audit_file(p)
    assert (f.line, f.rule) == (2, "KV001")
    q = tmp_path / "bom_clean.py"
    q.write_bytes(b"\xef\xbb\xbf# caf\xc3\xa9\nkv_cache = None\n")
    assert audit_paths([q]) == ([], [], 1)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the running Python parses PEP 695 itself")
@pytest.mark.parametrize("src", [
    "type Pool = dict[str, int]\nkv_cache.to(x)\n",
    "def first[T](xs: list[T]) -> T:\n    return xs[0].to(kv_cache)\n",
    "class Box[T]:\n    kv_cache: T = kv_cache.to(x)\n",
])
def test_pep695_file_says_which_python_and_the_run_goes_on(tmp_path, capsys, src):
    (tmp_path / "new.py").write_text(src)
    (tmp_path / "old.py").write_text(BUGGY)
    with pytest.raises(AuditError, match=r"needs Python >= 3\.12 syntax \(PEP 695\) — run fp8mla audit on 3\.12\+"):
        audit_file(tmp_path / "new.py")
    assert cli(["audit", str(tmp_path)]) == 1  # the other file was still audited and flagged
    out, err = capsys.readouterr()
    assert "old.py:2:" in out and "new.py: needs Python >= 3.12" in err


def test_syntax_error_that_is_not_pep695_says_not_valid_python():
    with pytest.raises(AuditError, match=r"x\.py: not valid Python \(line 1"):
        audit_source("kv_cache.to(\n", "x.py")


# -- output formats ------------------------------------------------------------------------------------------
def test_json_output(tmp_path, capsys):
    (tmp_path / "a.py").write_text(BUGGY)
    (tmp_path / "b.py").write_text("kv_cache.to(\n")
    assert cli(["audit", "--format", "json", str(tmp_path)]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["exit_status"] == 1 and d["files_checked"] == 1 and len(d["errors"]) == 1
    (f,) = d["findings"]
    assert f["rule"] == "KV001" and f["line"] == 2 and f["path"].endswith("a.py") and f["fix"]


def test_sarif_output(tmp_path, capsys):
    (tmp_path / "a.py").write_text(BUGGY)
    assert cli(["audit", "--format", "sarif", str(tmp_path)]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["version"] == "2.1.0"
    run = d["runs"][0]
    assert {r["id"] for r in run["tool"]["driver"]["rules"]} == {"KV001", "KV002", "KV003"}
    (r,) = run["results"]
    loc = r["locations"][0]["physicalLocation"]
    assert r["ruleId"] == "KV001" and loc["region"] == {"startLine": 2, "startColumn": 12}
    assert loc["artifactLocation"]["uri"].endswith("a.py")


# -- selecting rules, suppressing lines ----------------------------------------------------------------------
def test_select_and_ignore(capsys):
    bad = str(FIXTURES / "bad_decode_updater.py")
    rules = lambda out: [ln.split(": ")[1].split()[0] for ln in out.splitlines() if ln.startswith(bad)]  # noqa: E731
    assert cli(["audit", "--select", "KV002", bad]) == 1
    assert rules(capsys.readouterr().out) == ["KV002"]
    assert cli(["audit", "--ignore", "kv002", bad]) == 1
    assert rules(capsys.readouterr().out) == ["KV001", "KV001"]
    assert cli(["audit", "--ignore", "KV001,KV002", bad]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli(["audit", "--select", "KV009", bad])
    assert "unknown rule code(s) KV009" in capsys.readouterr().err
    with pytest.raises(ValueError, match="select: unknown rule code"):
        audit_source(BUGGY, select=["KV9"])


@pytest.mark.parametrize("comment, n", [
    ("  # fp8mla: ignore[KV001]", 0),
    ("  # fp8mla: ignore[KV002, KV001]", 0),
    ("  # fp8mla: ignore", 0),
    ("  # fp8mla: ignore[KV002]", 1),   # another rule: still reported
    ("  # noqa", 1),
])
def test_inline_ignore(comment, n):
    assert len(audit_source(BUGGY.rstrip("\n") + comment + "\n")) == n


def test_inline_ignore_on_a_later_line_of_a_multiline_plan():
    src = (FIXTURES / "bad_model_dtype_positional.py").read_text()
    assert [f.line for f in audit_source(src)] == [30, 38]
    src = src.replace("self.data_type, self.data_type,\n", "self.data_type, self.data_type,  # fp8mla: ignore[KV002]\n")
    assert [f.line for f in audit_source(src)] == [38]


# -- no torch on the audit path ------------------------------------------------------------------------------
def test_audit_command_does_not_import_torch(tmp_path):
    (tmp_path / "a.py").write_text(BUGGY)
    code = ("import sys\nfrom fp8mla.cli import main\nrc = main(['audit', sys.argv[1]])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.py")], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "KV001" in r.stdout
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "fp8mla", "audit", str(tmp_path / "a.py")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "torch" not in r.stderr


def test_lazy_package_keeps_public_names():
    r = subprocess.run([sys.executable, "-c", (
        "import sys, fp8mla\nassert 'torch' not in sys.modules\n"
        "from fp8mla import MLAPagedAttention, sentinel, FORMATS\n"
        "assert fp8mla.sentinel.forbid_pool_casts and fp8mla.get_format and fp8mla.tools.forbid_pool_casts\n"
        "assert set(fp8mla.__all__) <= set(dir(fp8mla))\n"
        "try:\n    fp8mla.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n")],
        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- the signature table -------------------------------------------------------------------------------------
def test_signature_table_dtype_positions():
    (mla,) = signatures_for("BatchMLAPagedAttentionWrapper")
    assert mla.params.index("q_data_type") == 10 and mla.params.index("kv_data_type") == 11 and not mla.kv_default_q
    for s in signatures_for("BatchDecodeWithPagedKVCacheWrapper"):
        assert s.params.index("q_data_type") == 10 and s.params.index("kv_data_type") == 11 and s.kv_default_q
    (old,) = signatures_for("BatchDecodeMlaWithPagedKVCacheWrapper")
    assert old.params.index("data_type") == 9 and old.params.index("q_data_type") == 10  # KV first here
    assert signatures_for("CUDAGraphBatchDecodeWithPagedKVCacheWrapper") == signatures_for(
        "BatchDecodeWithPagedKVCacheWrapper")
    pre = signatures_for("BatchPrefillWithPagedKVCacheWrapper")
    assert len({s.params.index("q_data_type") for s in pre}) == 2  # head_dim_vo moved it: not judged by position
    assert not signatures_for("BatchPrefillWithRaggedKVCacheWrapper")[0].paged
    assert signatures_for("SomethingElse") == ()
    for s in SIGNATURES:
        assert len(set(s.params)) == len(s.params) and s.required <= len(s.params)


def test_prefill_dtypes_by_position_are_not_judged_when_versions_disagree():
    head = ("from flashinfer import BatchPrefillWithPagedKVCacheWrapper\nkv_cache_dtype = 1\n"
            "w = BatchPrefillWithPagedKVCacheWrapper(ws)\n")
    args = ", ".join(["qo_indptr", "kv_indptr", "kv_indices", "last_page_len", "8", "8", "128", "16"] + ["None"] * 11)
    # 21 positionals: under 0.2.0 the last two are the dtypes, under 0.2.1+ they are not
    assert audit_source(head + f"w.plan({args}, torch.bfloat16, torch.bfloat16)\n") == []
    (f,) = audit_source(head + f"w.plan({args}, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)\n")
    assert f.rule == "KV002"


def test_old_mla_decode_wrapper_reads_data_type_as_kv():
    head = ("from flashinfer import BatchDecodeMlaWithPagedKVCacheWrapper as W\nkv_cache_dtype = 1\nw = W(ws)\n"
            "def f(model_dtype, kv_cache_dtype):\n    w.plan(indptr, indices, last_page_len, 16, 512, 1, 0.1, -1, "
            "None, {kv}, {q})\n")
    assert audit_source(head.format(kv="kv_cache_dtype", q="model_dtype")) == []
    (f,) = audit_source(head.format(kv="model_dtype", q="model_dtype"))
    assert f.rule == "KV002" and "BatchDecodeMlaWithPagedKVCacheWrapper" in f.message


# -- a whole tree --------------------------------------------------------------------------------------------
_FILLER = '''"""Module {i}: engine code with no attention backend in it."""
import os


class Thing{i}:
    def __init__(self, cfg):
        self.cfg = cfg
        self.kv_cache = None  # a pool name and a conversion: every file is parsed, the slow path
        self.scale = cfg.scale.to("cpu")
        self.items = [x * {i} for x in range(16)]

    def step(self, batch):
        out = []
        for b in batch:
            if b.ready:
                out.append(self.cfg.scale * b.value + len(self.items))
        return out
''' + "\n".join(f"def helper_{{i}}_{k}(x):\n    return x + {k}\n" for k in range(40))

_BACKEND = '''"""Backend {i}."""
from flashinfer import BatchMLAPagedAttentionWrapper


class Updater{i}:
    def __init__(self, model_runner, backend):
        self.data_type = model_runner.dtype
        self.wrapper = BatchMLAPagedAttentionWrapper(backend.ws)

    def update(self, qo_indptr, kv_indptr, kv_indices, kv_lens, scale):
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, scale,
                          self.data_type, self.data_type)

    def forward(self, q, layer, forward_batch):
        k = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return k.to(q.dtype)
'''


def test_tree_of_3000_files(tmp_path):
    """The audit's speed target (an engine tree of ~3,400 files in <= 20 s on 2 cores) is a benchmark
    figure in docs/tools.md, not an assertion here: this prints the time and checks the results. Every file
    names a pool, so none is skipped unparsed (the worst case; real trees skip most files)."""
    for i in range(3000):
        d = tmp_path / f"pkg{i // 100}"
        d.mkdir(exist_ok=True)
        (d / f"mod{i}.py").write_text((_BACKEND if i % 100 == 7 else _FILLER).format(i=i))
    t0 = time.perf_counter()
    findings, errors, n = audit_paths([tmp_path], jobs=None)
    dt = time.perf_counter() - t0
    print(f"\naudit of 3,000 files: {dt:.2f} s ({os.cpu_count()} CPUs, {len(findings)} findings)")
    assert n == 3000 and errors == []
    assert sorted({f.rule for f in findings}) == ["KV001", "KV002"] and len(findings) == 60


def test_kv002_says_where_the_dtype_came_from():
    f = audit_file(FIXTURES / "bad_model_dtype_positional.py")[0]
    assert f.rule == "KV002" and "BatchMLAPagedAttentionWrapper" in f.message
    assert "`self.data_type` (= `model_runner.dtype`, line 19)" in f.message


def test_parallel_run_gives_the_serial_results(tmp_path):
    for i in range(240):  # enough files for the worker pool
        (tmp_path / f"m{i}.py").write_text(BUGGY if i % 40 == 3 else "kv_cache.to(device)\n")
    (tmp_path / "broken.py").write_text("kv_cache.to(\n")
    serial = audit_paths([tmp_path], jobs=1)
    parallel = audit_paths([tmp_path], jobs=2)
    key = lambda r: ([(f.path, f.line, f.rule) for f in r[0]], sorted(r[1]), r[2])  # noqa: E731
    assert key(serial) == key(parallel) and len(serial[0]) == 6 and len(serial[1]) == 1 and serial[2] == 240


def test_a_file_nested_too_deeply_is_an_error_not_a_crash(tmp_path, capsys):
    (tmp_path / "deep.py").write_text("x = kv_cache.to(q.dtype)" + " + 1" * 20000 + "\n")
    (tmp_path / "a.py").write_text(BUGGY)
    findings, errors, n = audit_paths([tmp_path])
    assert n == 1 and len(findings) == 1 and errors == [f"{tmp_path / 'deep.py'}: nests too deeply to analyse "
                                                        "(RecursionError)"]
    assert cli(["audit", str(tmp_path / "deep.py")]) == 2


@pytest.mark.parametrize("extra, n", [
    ("kv_cache_dtype = cfg.kv_cache_dtype\n", 1),   # an FP8-capable cache in the module: the missing KV dtype is it
    ("", 0),                                        # a BF16-only module: planning the KV as the query dtype is right
])
def test_decode_plan_with_only_a_query_dtype(extra, n):
    src = ("from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n" + extra +
           "def plan(w: BatchDecodeWithPagedKVCacheWrapper, kv_indptr, kv_indices, last, model_config):\n"
           "    w.plan(kv_indptr, kv_indices, last, 32, 8, 128, 16, q_data_type=model_config.dtype)\n")
    got = audit_source(src)
    assert [(f.line, f.rule) for f in got] == [(4, "KV002")] * n
    if n:
        assert "passes only a query dtype" in got[0].message


@pytest.mark.parametrize("kv, n", [("self.kv_cache_dtype", 0), ("self.model_config.dtype", 1)])
def test_kv_dtype_forwarded_through_a_helper_function(kv, n):
    """vLLM's `fast_plan_decode(wrapper, ..., kv_data_type=...)` shape: the helper forwards its parameter to
    FlashInfer's plan(); the call site is what is judged."""
    src = ("from flashinfer import BatchDecodeWithPagedKVCacheWrapper\n"
           "def fast_plan(self, indptr, indices, last, heads, kv_heads, dim, page, q_data_type, kv_data_type):\n"
           "    self.plan(indptr, indices, last, heads, kv_heads, dim, page, q_data_type=q_data_type,\n"
           "              kv_data_type=kv_data_type)\n"
           "class Builder:\n"
           "    def __init__(self, model_config, kv_cache_dtype, ws):\n"
           "        self.model_config, self.kv_cache_dtype = model_config, kv_cache_dtype\n"
           "        self.w = BatchDecodeWithPagedKVCacheWrapper(ws)\n"
           "    def build(self, indptr, indices, last):\n"
           "        fast_plan(self.w, indptr, indices, last, 8, 8, 128, 16, q_data_type=self.model_config.dtype,\n"
           f"                  kv_data_type={kv})\n")
    got = audit_source(src)
    assert [(f.line, f.rule) for f in got] == [(10, "KV002")] * n
    if n:
        assert "which `fast_plan()` forwards as the KV data type" in got[0].message
