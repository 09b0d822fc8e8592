"""``fp8mla demo`` end to end at a tiny size on the CPU, and ``fp8mla bench step``'s refusal without CUDA."""
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
        "--batch", "2", "--context", "300", "--reps", "1",
        "--threads", "1"]  # 1 thread: CI runs test files in parallel, and OpenMP threads spin when oversubscribed


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("traces")
    torch.manual_seed(0)
    buf = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(TINY + ["--trace-dir", str(trace_dir)])
    finally:
        torch.set_num_threads(threads)  # --threads 1 set it for the whole process
    return rc, buf.getvalue(), trace_dir


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


def test_demo_refuses_a_trace_dir_that_is_a_file(tmp_path, capsys):
    """``--trace-dir <a file>`` used to run the whole scenario, then end in FileExistsError."""
    f = tmp_path / "traces"
    f.write_text("not a folder")
    assert main(["demo", "--device", "cpu", "--trace-dir", str(f)]) == 2
    err = capsys.readouterr().err
    assert "fp8mla demo: --trace-dir: " in err and "is a file; expected a folder" in err and "Traceback" not in err
    assert main(["demo", "--device", "cpu", "--trace-dir", str(f / "below")]) == 2
    assert "cannot make the folder" in capsys.readouterr().err
