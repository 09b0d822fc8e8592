"""``fp8mla demo`` end to end at a tiny size on the CPU (what it prints and the folder it leaves), and
``fp8mla bench step``'s refusal without CUDA."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re

import pytest
import torch

from fp8mla.cli import main
from fp8mla.formats import FORMATS

WAYS = ("cast_pool", "gather_cast", "native")
HAS_DOCTOR = importlib.util.find_spec("fp8mla.tools.doctor") is not None

# 2 layers so the pool cast repeats within a step (the doctor's signature of a per-layer cast); a pool much
# larger than the batch's tokens so that gather_cast's cast of the active tokens stays far below pool size.
TINY = ["demo", "--device", "cpu", "--scale", "small", "--layers", "2", "--heads", "16", "--pool-tokens", "8192",
        "--batch", "2", "--context", "300", "--reps", "2",
        "--threads", "1"]  # 1 thread: CI runs test files in parallel, and OpenMP threads spin when oversubscribed


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("demo") / "results"  # made by the demo
    torch.manual_seed(0)
    buf = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(TINY + ["--out", str(out_dir)])
    finally:
        torch.set_num_threads(threads)  # --threads 1 set it for the whole process
    return rc, buf.getvalue(), out_dir / "traces"


def _summary_rows(text: str) -> dict:
    summary = text[text.index("== Summary"):]
    rows = {}
    for line in summary.splitlines():
        parts = line.split()
        if parts and parts[0] in WAYS:
            rows[parts[0]] = line
    return rows


def test_demo_has_every_section(demo_output):
    rc, out, _ = demo_output
    assert rc == 0, out
    for section in ("== 1. KV formats", "== 2. The small scenario", "== Summary"):
        assert section in out, f"missing {section!r} in:\n{out}"
    formats = out[out.index("== 1."):out.index("== 2.")]
    for name in FORMATS:
        assert re.search(rf"^{name}\s+\d+", formats, re.M), f"no row for format {name}:\n{formats}"
    assert "n/a" not in formats, formats  # every format ran both steps on the torch backend
    rows = _summary_rows(out)
    assert set(rows) == set(WAYS), out
    assert "no CUDA device" in out  # the CPU run says that native is the torch backend here
    assert out.rstrip().splitlines()[-1].startswith("demo done in")


def test_demo_says_what_each_time_is_and_what_to_conclude(demo_output):
    """Two times per way (the timed steps, the profiled one), named apart; the timed repeats' spread; one line
    saying what to conclude as the summary's last."""
    _, out, _ = demo_output
    rows = _summary_rows(out)
    for way, line in rows.items():
        cells = line.split()
        med, (lo, hi), prof = float(cells[2]), map(float, cells[3].split("-")), float(cells[4])
        assert lo <= med <= hi and prof > 0, line
    assert "ms/step: the timed steps, without the profiler: median of 2, min-max their spread" in out
    assert "profiled: the one step run under torch.profiler" in out
    assert "the doctor's times are of the one step run under torch.profiler" in out
    lines = out.rstrip().splitlines()
    assert lines[-2].startswith("conclusion: "), lines[-2]
    assert "what holds on any device is the trace" in lines[-2] and "cast_pool spending" in lines[-2], lines[-2]


def test_demo_leaves_its_results_in_the_folder_it_names(demo_output):
    """The folder named on the last line holds the summary (Markdown, CSV), both PNGs and the traces; the CSV
    holds what the table printed."""
    import csv
    _, out, trace_dir = demo_output
    folder = trace_dir.parent
    last = out.rstrip().splitlines()[-1]
    assert f"results in {folder}/: " in last, last
    names = last.split(": ", 1)[1].split(", ")
    assert names[:6] == ["summary.md", "summary.csv", "formats.csv", "step_time.png", "cast_pool_step.png",
                         "traces/cast_pool.json"], names
    for name in names:
        assert (folder / name).stat().st_size > 0, name
    for png in ("step_time.png", "cast_pool_step.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    with open(folder / "summary.csv") as f:
        csv_rows = {r["way"]: r for r in csv.DictReader(f)}
    printed = _summary_rows(out)
    assert set(csv_rows) == set(WAYS)
    for way, r in csv_rows.items():
        assert abs(float(r["ms_median"]) - float(printed[way].split()[2])) <= 0.0051, (r, printed[way])
        assert int(r["timed_reps"]) == 2 and float(r["ms_min"]) <= float(r["ms_median"]) <= float(r["ms_max"])
        assert float(r["pool_cast_share_pct"]) > 0 if way == "cast_pool" else float(r["pool_cast_share_pct"]) == 0
    with open(folder / "formats.csv") as f:
        assert {r["format"] for r in csv.DictReader(f)} == set(FORMATS)
    md = (folder / "summary.md").read_text()
    for part in ("## 1. KV formats", "## 2. The small scenario", "| cast_pool | torch |", "**conclusion: ",
                 "`traces/native.json`"):
        assert part in md, part
    assert "| bf16 | 1152 | +0% |" in md and "-0%" not in md and "n/a%" not in md, md
    assert re.search(r"^bf16 +1152 +\+0% ", out, re.M), out


def test_default_out_dir_is_new_and_timestamped(tmp_path, monkeypatch):
    from fp8mla.commands.demo_output import default_out_dir
    monkeypatch.chdir(tmp_path)
    first = default_out_dir(now=0)
    assert first == str(tmp_path / "fp8mla-demo-19700101-000000")
    (tmp_path / "fp8mla-demo-19700101-000000").mkdir()
    assert default_out_dir(now=0) == first + "-2"  # never into an earlier run's folder


def _fake_result(native_times, cast_times, *, cuda=False):
    from types import SimpleNamespace
    doc = dict(available=True, cast_share=0.8, pool_cast_share=0.75)
    ways = {w: dict(backend="torch", graph=False, times=t, ms=sorted(t)[len(t) // 2], extra_mem=0, err=1e-3,
                    doctor=dict(doc, pool_cast_share=0.75 if w == "cast_pool" else 0.0))
            for w, t in (("cast_pool", cast_times), ("gather_cast", native_times), ("native", native_times))}
    return dict(sc=SimpleNamespace(context_lens=[10, 20]), ways=ways)


def test_conclusion_says_when_cpu_times_are_noise():
    from fp8mla.commands.demo_output import conclusion
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    overlap = conclusion(_fake_result([6.0, 37.0, 12.0], [9.0, 30.0, 20.0]), cpu)
    assert overlap.startswith("conclusion: the timed steps overlap here (native 6-37 ms, cast_pool 9-30 ms): on a "
                              "CPU the times are noise"), overlap
    assert "cast_pool spending 75% of its profiled step casting the whole pool, native 0%" in overlap
    apart = conclusion(_fake_result([5.0, 6.0, 7.0], [150.0, 160.0, 170.0]), cpu)
    assert "native beat cast_pool in every timed repeat here (5-7 vs 150-170 ms)" in apart, apart
    assert "x faster per step than casting it" in conclusion(_fake_result([1.0, 1.0], [10.0, 10.0]), gpu)


def test_numpy_is_a_dependency():
    """torch warns "NumPy is missing" on every command without it."""
    import tomllib
    from pathlib import Path
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in project["dependencies"])


def test_demo_errors_are_small(demo_output):
    _, out, _ = demo_output
    for way, line in _summary_rows(out).items():
        err = float(line.split()[-1])
        assert err < 1e-2, f"{way}: rel L2 {err} vs float64:\n{line}"
    formats = out[out.index("== 1."):out.index("== 2.")]
    for line in formats.splitlines():
        if line.split() and line.split()[0] in FORMATS:
            # the kernel's own error (on the dequantized KV) for both steps
            cells = line.split("|")
            for cell in cells[1:]:
                assert float(cell.split()[0]) < 1e-2, line


def test_traces_written(demo_output):
    _, _, trace_dir = demo_output
    for way in WAYS:
        assert (trace_dir / f"{way}.json").stat().st_size > 0


def test_readme_doctor_example_reads_a_trace_the_demo_writes(demo_output, capsys):
    """The README's doctor example names a file of the demo's folder (its default name pattern, its traces/),
    and the doctor's diagnosis of it starts as the README shows."""
    from pathlib import Path

    from fp8mla.commands.demo_output import default_out_dir
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    m = re.search(r"^\$ fp8mla doctor (fp8mla-demo-<UTC time>)/(\S+)", readme, re.M)
    assert m, "the README's doctor example"
    pattern = re.escape(m.group(1)).replace(re.escape("<UTC time>"), r"\d{8}-\d{6}")
    assert re.fullmatch(pattern, Path(default_out_dir(0)).name), (m.group(1), default_out_dir(0))
    _, _, trace_dir = demo_output
    trace = trace_dir.parent / m.group(2)
    assert trace.is_file(), f"the demo wrote no {m.group(2)}"
    capsys.readouterr()
    assert main(["doctor", str(trace)]) == 1  # exit 1: a pool cast found
    out = capsys.readouterr().out
    shown = readme[m.end():].split("\nDiagnosis\n", 1)[1].splitlines()[0].strip()
    assert shown.startswith("KV-pool cast: ") and out.split("\nDiagnosis\n", 1)[1].strip().startswith(
        shown[:shown.index(" of [")]), (shown, out)


@pytest.mark.skipif(not HAS_DOCTOR, reason="fp8mla.tools.doctor is not there yet")
def test_doctor_sees_the_pool_cast_only_in_cast_pool(demo_output):
    _, out, _ = demo_output
    rows = _summary_rows(out)
    shares = {}
    for way, line in rows.items():
        pct = re.findall(r"(\d+\.\d)%", line)
        assert len(pct) == 2, line  # casts, pool casts
        shares[way] = float(pct[1])
    assert shares["cast_pool"] > 0, rows["cast_pool"]
    assert shares["gather_cast"] == 0 and shares["native"] == 0, rows


def test_bench_step_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["bench", "step"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bench_step_dry_run_writes_results(tmp_path, capsys):
    """The benchmark's plumbing (batches, skips, CSV, Markdown) on the CPU at a tiny size; no timing claims."""
    import csv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in demo_output: OpenMP threads spin when parallel test files hold the cores
    try:
        rc = main(["bench", "step", "--device", "cpu", "--layers", "2", "--pool-tokens", "1024", "--batches",
                   "1,4", "--contexts", "256,512", "--reps", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "DRY RUN" in out
    assert "B=4 ctx=512: skipped" in out  # 4 x 512 tokens do not fit a 1,024-token pool
    with open(tmp_path / "step.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 3  # (1, 256), (1, 512), (4, 256) x three ways
    assert {r["way"] for r in rows} == set(WAYS)
    assert all(float(r["rel_l2"]) < 1e-2 for r in rows)
    assert "| 4 | 256 |" in (tmp_path / "step.md").read_text()


def test_step_scenario_set_batch_recovers_after_out_of_pages():
    """A batch the pool cannot hold raises OutOfPagesError without leaking pages or leaving freed ids behind:
    the next set_batch must work and the pool must hold exactly the new batch."""
    from fp8mla.bench.step import StepScenario
    from fp8mla.cache import OutOfPagesError
    sc = StepScenario(layers=1, heads=2, pool_tokens=256, page_size=64)  # 4 pages
    sc.set_batch([10])
    with pytest.raises(OutOfPagesError):
        sc.set_batch([100, 200])  # 2 + 4 pages > 4
    assert sc.cache.num_free_pages == sc.cache.num_pages
    sc.set_batch([65, 3])  # must not free the ids of the failed (or of the previous) batch again
    assert sc.cache.num_free_pages == sc.cache.num_pages - 3


@pytest.mark.parametrize("flag", ["--layers", "--heads", "--pool-tokens", "--batch", "--context", "--reps",
                                  "--threads"])
def test_demo_refuses_non_positive_sizes(flag, monkeypatch, capsys):
    """`--layers 0` (or any size <= 0) must be refused, not silently replaced by the scale's default."""
    from fp8mla.commands import demo
    ran = []
    monkeypatch.setattr(demo, "run_formats", lambda *a, **k: ran.append("formats") or [])
    monkeypatch.setattr(demo, "run_scenario", lambda *a, **k: ran.append("scenario"))
    threads = torch.get_num_threads()
    try:
        rc = main(["demo", "--device", "cpu", "--scale", "small", flag, "0"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2 and not ran
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--layers", "--pool-tokens", "--reps"])
def test_bench_step_refuses_non_positive_sizes(flag, tmp_path, capsys):
    rc = main(["bench", "step", "--device", "cpu", "--pool-tokens", "1024", "--batches", "1", "--contexts", "256",
               "--reps", "1", "--out", str(tmp_path), flag, "0"])
    assert rc == 2
    assert flag in capsys.readouterr().err


def test_each_row_says_its_backend_and_gather_cast_is_the_strategy(demo_output):
    """gather_cast used to be the torch backend on every device, measured on a GPU at 0.4x of the legacy cast;
    it is now the gather-then-cast strategy on the backend native gets (Triton on a GPU, torch here), and the
    summary names each row's backend."""
    from fp8mla.commands.demo import gather_cast_attention
    _, out, _ = demo_output
    rows = _summary_rows(out)
    assert rows["gather_cast"].split()[1] == "gather_cast+torch", rows["gather_cast"]
    assert rows["native"].split()[1].startswith("torch"), rows["native"]
    assert rows["cast_pool"].split()[1].startswith("torch"), rows["cast_pool"]
    assert "gather_cast+X = the batch's tokens gathered and cast to BF16" in out
    scenario = out[out.index("== 2."):out.index("== Summary")]
    assert "gather_cast  (gather_cast+torch) doctor:" in scenario, scenario
    # On a GPU the same object plans Triton under the strategy: backend "auto", never "torch".
    a = gather_cast_attention()
    assert a._strategy == "gather_cast" and a._backend == "auto"


@pytest.mark.parametrize("device, msg", [
    ("tpu9", "expected cpu, cuda or cuda:N, got 'tpu9'"),
    ("meta", "the demo runs on CPUs and CUDA GPUs"),
    ("cuda", "torch sees no CUDA device"),
])
def test_demo_refuses_a_device_it_cannot_use(device, msg, monkeypatch, capsys):
    """``--device tpu9`` used to end in torch's RuntimeError traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "fp8mla demo: --device: " in err and msg in err and "Traceback" not in err


def test_demo_refuses_an_out_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "results"
    f.write_text("not a folder")
    assert main(["demo", "--device", "cpu", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "fp8mla demo: --out: " in err and "is a file; expected a folder" in err and "Traceback" not in err


def test_demo_refuses_a_trace_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    """``--trace-dir <a file>`` used to run the whole scenario, then end in FileExistsError."""
    monkeypatch.chdir(tmp_path)  # (a refused run makes no default folder: checked below)
    f = tmp_path / "traces"
    f.write_text("not a folder")
    assert main(["demo", "--device", "cpu", "--trace-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert "fp8mla demo: --trace-dir: " in err and "is a file; expected a folder" in err and "Traceback" not in err
    assert main(["demo", "--device", "cpu", "--trace-dir", str(f / "below")]) == 2
    assert "cannot make the folder" in capsys.readouterr().err
    assert not list(tmp_path.glob("fp8mla-demo-*"))
