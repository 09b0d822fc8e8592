"""fp8mla doctor: trace loading, kernel names, cast recognition (CPU and GPU side), pool-cast flags, the CLI.

Synthetic traces follow the Kineto Chrome-trace layout (``ph: X`` events; kernels linked to their CPU op by
``External id``); one test profiles real torch ops on the CPU.
"""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from fp8mla.cli import main as cli
from fp8mla.tools.casts import classify_kernel
from fp8mla.tools.doctor import diagnose, format_report, parse_bytes, plot_report
from fp8mla.tools.trace import TraceError, kernel_label, load_trace, strip_templates

_DC = ("at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
       "{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}")
CAST_KERNEL = (f"void at::native::unrolled_elementwise_kernel<{_DC}, std::array<char*, 2ul>, "
               "TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
               "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, "
               f"{_DC}, std::array<char*, 2ul>, TrivialOffsetCalculator<1, unsigned int>, "
               "TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, "
               "at::native::memory::StoreWithCast<1>)")
SAME_COPY = (f"void at::native::vectorized_elementwise_kernel<4, {_DC}, std::array<char*, 2ul> >(int, {_DC}, "
             "std::array<char*, 2ul>)")
STRIDED_CAST = (f"void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<{_DC}>(at::"
                f"TensorIteratorBase&, {_DC} const&)::{{lambda(int)#1}}>(int, at::native::gpu_kernel_impl<{_DC}>"
                "(at::TensorIteratorBase&, {lambda(int)#1})")
STRIDED_SAME = STRIDED_CAST.replace("gpu_kernel_impl<", "gpu_kernel_impl_nocast<")
ATTN = "void flashinfer::mla::BatchMLAPagedAttentionKernel<flashinfer::mla::KernelTraits<128>, 2u>(Params)"


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 7 if cat in ("kernel", "gpu_memcpy") else 1,
            "ts": ts, "dur": dur, "args": args}


def _write(tmp_path, events, name="trace.json", gz=False, as_list=False):
    data = events if as_list else {"schemaVersion": 1, "traceEvents": events}
    p = tmp_path / name
    raw = json.dumps(data).encode()
    p.write_bytes(gzip.compress(raw) if gz else raw)
    return p


def _graph_trace(steps=2, layers=4, cast_us=800.0, attn_us=200.0):
    """A CUDA-graph decode: kernels only, a pool cast per layer, no CPU ops or shapes."""
    ev, t = [], 0.0
    for s in range(steps):
        step_start = t
        for _ in range(layers):
            for name, dur in ((CAST_KERNEL, cast_us), (ATTN, attn_us), (SAME_COPY, 20.0)):
                ev.append(_x(name, "kernel", t, dur))
                t += dur
            ev.append(_x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", t, 5.0))
            t += 5.0
        ev.append(_x(f"ProfilerStep#{s}", "user_annotation", step_start, t - step_start))
    return ev


def test_graph_trace_flags_by_kernel_names(tmp_path):
    r = diagnose(_write(tmp_path, _graph_trace()))
    assert r.num_steps == 2 and r.has_gpu and r.graph_kernels == 24
    top = r.kernels[0]
    assert top["name"] == "at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>"
    assert top["calls"] == 8 and top["share"] == pytest.approx(3200 / 4100)
    assert len(r.casts) == 1  # the same-dtype vectorized copy and the memcpy are not casts
    (g,) = r.findings
    assert g.side == "kernel" and g.dst == "bfloat16" and g.per_step == 4 and g.bytes_read is None
    assert g.ms_per_step == pytest.approx(3.2)
    assert "Suspected KV-pool cast" in r.diagnosis[0] and "4.10 -> 0.90 ms" in r.diagnosis[0]


def test_graph_trace_small_casts_are_not_flagged(tmp_path):
    r = diagnose(_write(tmp_path, _graph_trace(cast_us=10.0, attn_us=400.0)))
    assert len(r.casts) == 1 and not r.findings


@pytest.mark.parametrize("name, want", [
    (CAST_KERNEL, (True, None, "bfloat16")),
    (SAME_COPY, (False, None, "bfloat16")),
    (STRIDED_CAST, (True, None, "bfloat16")),
    (STRIDED_SAME, (False, None, "bfloat16")),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIterator"
     "Base&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)", (True, "float32", "bfloat16")),
    ("void at::native::unrolled_elementwise_kernel<at::native::float8_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda(c10::BFloat16)#3}, std::array<char*, 2ul> >(int, ...)", (True, "bfloat16", "float8")),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::float8_copy_"
     "kernel_cuda(at::TensorIteratorBase&)::{lambda(c10::Float8_e4m3fn)#4}>(...)::{lambda(int)#1}>(int, ...)",
     (False, "float8_e4m3fn", "float8_e4m3fn")),
    ("triton_poi_fused__to_copy_0", (True, None, None)),
    ("triton_poi_fused__to_copy_clone_index_3", (True, None, None)),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", (False, None, None)),  # an RMSNorm, not a cast
    ("triton_poi_fused__to_copy_add_mul_2", (False, None, None)),
    (ATTN, (False, None, None)),
])
def test_classify_kernel(name, want):
    assert classify_kernel(name) == want


def test_strip_templates():
    assert strip_templates(ATTN) == "flashinfer::mla::BatchMLAPagedAttentionKernel"
    assert strip_templates("void (anonymous namespace)::f<int>(x)") == "{anon}::f"
    assert strip_templates("triton_poi_fused__to_copy_0") == "triton_poi_fused__to_copy_0"
    assert kernel_label(SAME_COPY) == "at::native::vectorized_elementwise_kernel<direct_copy_kernel_cuda>"


def _linked_trace(n_tokens=100_000, layers=3, steps=2, same_dtype=False):
    """Eager GPU decode with shapes: aten::to > _to_copy > copy_ launching the cast kernel (linked by id)."""
    ev, t, eid = [], 0.0, 0
    src = "c10::BFloat16" if same_dtype else "c10::Float8_e4m3fn"
    for s in range(steps):
        t0 = t
        for _ in range(layers):
            dims = [[n_tokens, 1, 576], [n_tokens, 1, 576], []]
            ev.append(_x("aten::to", "cpu_op", t, 30, **{"External id": eid, "Input type": [src, "Scalar"],
                                                          "Input Dims": [[n_tokens, 1, 576], []]}))
            ev.append(_x("aten::_to_copy", "cpu_op", t + 1, 28, **{"External id": eid + 1, "Input type": [src],
                                                                   "Input Dims": [[n_tokens, 1, 576]],
                                                                   "Concrete Inputs": ["", "15"]}))
            ev.append(_x("aten::copy_", "cpu_op", t + 5, 20, **{"External id": eid + 2, "Input type": [
                "c10::BFloat16", src, "Scalar"], "Input Dims": dims}))
            ev.append(_x(SAME_COPY if same_dtype else CAST_KERNEL, "kernel", t + 10, 500,
                         **{"External id": eid + 2, "correlation": eid}))
            ev.append(_x(ATTN, "kernel", t + 520, 100, **{"External id": eid + 3}))
            ev.append(_x("flashinfer::mla_run", "cpu_op", t + 40, 10, **{"External id": eid + 3}))
            eid += 4
            t += 700
        ev.append(_x(f"ProfilerStep#{s}", "user_annotation", t0, t - t0))
    return ev


def test_linked_trace_sizes_casts_from_shapes(tmp_path):
    pool = 100_000 * 576
    r = diagnose(_write(tmp_path, _linked_trace(), gz=True, name="t.json.gz"), pool_bytes=pool)
    (g,) = r.findings
    assert g.side == "gpu" and g.op == "aten::to > aten::_to_copy > aten::copy_"
    assert (g.src, g.dst, g.shape, g.per_step) == ("float8_e4m3fn", "bfloat16", (100_000, 1, 576), 3)
    assert (g.bytes_read, g.bytes_written, g.pool_fraction) == (pool, 2 * pool, 1.0)
    assert g.ms_per_step == pytest.approx(1.5)  # kernel time, not the CPU op's
    ops = {o["name"]: o for o in r.cpu_ops}
    assert ops["aten::copy_"]["gpu_ms"] == pytest.approx(3.0) and r.cpu_ops[0]["name"] == "aten::copy_"
    text = r.diagnosis[0]
    assert "57.6 MB" in text and "1.50 ms per step" in text and "kv_data_type=float8_e4m3fn" in text
    assert "2.10 -> 0.60 ms" in text
    # a pool four times larger: the same cast is a quarter of it, not flagged
    assert not diagnose(tmp_path / "t.json.gz", pool_bytes=4 * pool).findings
    # no pool size given: inferred from the largest fp8 tensor a repeated cast reads
    r2 = diagnose(tmp_path / "t.json.gz")
    assert len(r2.findings) == 1 and r2.pool_source.startswith("inferred")


def test_same_dtype_copies_are_not_casts(tmp_path):
    r = diagnose(_write(tmp_path, _linked_trace(same_dtype=True)))
    assert r.casts == [] and r.findings == [] and r.diagnosis[0] == "No dtype casts in the trace."


def test_to_copy_without_shapes_is_a_cast_of_unknown_size(tmp_path):
    ev = [_x("aten::to", "cpu_op", 0, 10), _x("aten::_to_copy", "cpu_op", 1, 8), _x("aten::copy_", "cpu_op", 2, 6)]
    r = diagnose(_write(tmp_path, ev, as_list=True))
    (g,) = r.casts
    assert g.op == "aten::to > aten::_to_copy" and g.src is None and g.bytes_read is None
    assert any("record_shapes=True" in p for p in r.diagnosis) and any("--steps" in p for p in r.diagnosis)


def test_eager_gpu_trace_without_shapes(tmp_path):
    """No record_shapes: an aten::_to_copy is a cast when its kernel is one (dtype from the kernel name), and
    a device move when it only launched a memcpy. Repeated casts taking most of the step are flagged by time."""
    ev, t = [], 0.0
    for s in range(2):
        t0 = t
        for layer in range(3):
            ev += [_x("aten::_to_copy", "cpu_op", t, 20, **{"External id": 10 * s + 2 * layer}),
                   _x(CAST_KERNEL, "kernel", t + 5, 900, **{"External id": 10 * s + 2 * layer}),
                   _x("aten::_to_copy", "cpu_op", t + 950, 20, **{"External id": 10 * s + 2 * layer + 1}),
                   _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", t + 955, 30,
                      **{"External id": 10 * s + 2 * layer + 1})]
            t += 1000
        ev.append(_x(f"ProfilerStep#{s}", "user_annotation", t0, t - t0))
    r = diagnose(_write(tmp_path, ev))
    (g,) = r.casts
    assert (g.side, g.dst, g.per_step, g.bytes_read) == ("gpu", "bfloat16", 3, None)
    assert g.flagged and "judged by time" in g.why and r.diagnosis[0].startswith("Suspected KV-pool cast")


def test_real_cpu_trace(tmp_path):
    """torch.profiler on the CPU: one nested aten::to chain is one cast; clone and same-dtype copy_ are not."""
    x = torch.randn(64, 576)
    buf16, buf32 = torch.empty(64, 576, dtype=torch.bfloat16), torch.empty(64, 576)
    with torch.profiler.profile(record_shapes=True) as prof:
        x.to(torch.bfloat16)
        x.clone()
        buf32.copy_(x)
        buf16.copy_(x)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    r = diagnose(path)
    got = sorted((g.op, g.src, g.dst, g.bytes_read) for g in r.casts)
    assert got == [("aten::copy_", "float32", "bfloat16", 64 * 576 * 4),
                   ("aten::to > aten::_to_copy > aten::copy_", "float32", "bfloat16", 64 * 576 * 4)]
    assert not r.has_gpu and "none (a CPU-only trace)" in format_report(r)


@pytest.mark.parametrize("content, msg", [
    (None, "no such file"),
    (b"", "the file is empty"),
    (b"{not json", "not JSON"),
    (b'{"foo": 1}', "without a 'traceEvents' list"),
    (b'"a string"', "got a JSON str"),
    (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "no complete ('X') events"),
    (b"\x1f\x8b\x08\x00garbage", "damaged gzip"),
    (b"\xff\xfe\x00\x01", "not UTF-8"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, content, msg):
    p = tmp_path / "bad.json"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(TraceError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_trace(p)
    assert cli(["doctor", str(p)]) == 2
    assert msg in capsys.readouterr().err


def test_truncated_list_trace_is_read(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text('[{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 5},')
    assert load_trace(p).gpu[0].name == "k"


def test_cli_text_json_and_exit_status(tmp_path, capsys):
    bad = _write(tmp_path, _linked_trace(), name="bad.json")
    assert cli(["doctor", str(bad), "--pool-bytes", "57.6MB", "--top", "3"]) == 1
    out = capsys.readouterr().out
    assert "GPU time by kernel (top 3)" in out and "KV-pool cast" in out and "<--" in out
    assert cli(["doctor", str(bad), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["num_steps"] == 2 and len(d["findings"]) == 1 and d["findings"][0]["src"] == "float8_e4m3fn"
    good = _write(tmp_path, _linked_trace(same_dtype=True), name="good.json")
    assert cli(["doctor", str(good)]) == 0
    with pytest.raises(SystemExit):
        cli(["doctor", str(good), "--pool-bytes", "lots"])
    assert "expected a size like" in capsys.readouterr().err


def test_steps_override(tmp_path):
    ev = [e for e in _linked_trace() if not e["name"].startswith("ProfilerStep")]
    r = diagnose(_write(tmp_path, ev), pool_bytes=100_000 * 576, steps=2)
    assert r.num_steps == 2 and r.findings[0].per_step == 3
    with pytest.raises(ValueError):
        diagnose(tmp_path / "trace.json", steps=0)


def test_parse_bytes():
    assert parse_bytes("285MB") == 285_000_000 and parse_bytes("1MiB") == 2**20 and parse_bytes(42) == 42
    for bad in ("", "-5", "12 parsecs", "0", "1e999", "1e999GB"):  # 1e999: OverflowError in int(inf) before
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    r = diagnose(_write(tmp_path, _linked_trace()), pool_bytes=100_000 * 576)
    out = tmp_path / "step.png"
    plot_report(r, out)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_title_names_the_step(tmp_path, monkeypatch):
    """The demo's PNG says whose step it is (the cast_pool way's profiled one, not the timed median)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    titles = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (titles.append(fig.axes[0].get_title()),
                                                                   save(fig, *a, **k)))
    r = diagnose(_write(tmp_path, _linked_trace()), pool_bytes=100_000 * 576)
    plot_report(r, tmp_path / "a.png")
    plot_report(r, tmp_path / "b.png", step="cast_pool's profiled step")
    assert titles[0].startswith(f"Where a {r.step_ms:.2f} ms step goes\n("), titles
    assert titles[1].startswith("Where cast_pool's profiled step goes\n("), titles


def test_corrupt_gzip_body_is_a_trace_error(tmp_path, capsys):
    """A valid gzip header over damaged deflate data raised zlib.error, which the reader did not catch."""
    raw = bytearray(gzip.compress(json.dumps({"traceEvents": _linked_trace()}).encode()))
    raw[20:60] = bytes(range(40))  # inside the deflate stream, past the 10-byte header
    p = tmp_path / "t.json.gz"
    p.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="damaged gzip"):
        load_trace(p)
    assert cli(["doctor", str(p)]) == 2
    err = capsys.readouterr().err
    assert "damaged gzip" in err and "Traceback" not in err


@pytest.mark.parametrize("where, msg", [("missing/step.png", "does not exist"), ("", "is a folder")])
def test_plot_into_a_missing_folder_is_refused_before_reading(tmp_path, capsys, where, msg):
    """``--plot no/such/dir/x.png`` used to read the whole trace, then end in matplotlib's FileNotFoundError."""
    trace = _write(tmp_path, _linked_trace())
    target = str(tmp_path / where) if where else str(tmp_path)
    assert cli(["doctor", str(trace), "--plot", target]) == 2
    out = capsys.readouterr()
    assert "fp8mla doctor: --plot: " in out.err and msg in out.err and "Traceback" not in out.err
    assert out.out == ""  # refused before the trace was read: no report


# -- memory: the trace is streamed ---------------------------------------------------------------------------
def _kineto_decode(layers: int, keep_only: bool = False) -> list:
    """Events in the shape torch.profiler writes for an eager decode with record_shapes and with_stack: per layer
    a Python frame, an aten::to > _to_copy > copy_ chain with shapes (and the args the doctor does not read),
    its cudaLaunchKernel, the cast kernel with its launch details, and the flow events linking them.
    ``keep_only``: just what the doctor keeps of it (the reference for memory)."""
    ev, t, eid = [], 0.0, 0
    for layer in range(layers):
        frame = {} if keep_only else {"Python parent id": layer, "Python id": layer + 1}
        ev.append({"ph": "X", "cat": "python_function", "name": "model.py(42): forward", "ts": t, "dur": 60,
                   "pid": 1, "tid": 1, "args": frame})
        for i, (name, dims) in enumerate((("aten::to", [[4096, 576], []]), ("aten::_to_copy", [[4096, 576]]),
                                          ("aten::copy_", [[4096, 576], [4096, 576], []]))):
            args = {"External id": eid + i, "Input Dims": dims, "Concrete Inputs": [""] * len(dims),
                    "Input type": ["c10::BFloat16", "c10::Float8_e4m3fn", "Scalar"][:len(dims)]}
            if not keep_only:
                args.update({"Record function id": 0, "Ev Idx": eid + i, "Input Strides": [[576, 1]] * len(dims),
                             "Sequence number": eid, "Fwd thread id": 0})
            ev.append(_x(name, "cpu_op", t + 1 + i, 30 - 2 * i, **args))
        kargs = {"External id": eid + 2}
        if not keep_only:
            ev.append(_x("cudaLaunchKernel", "cuda_runtime", t + 10, 5, **{"External id": eid + 2, "cbid": 211}))
            ev.append({"ph": "s", "id": eid, "pid": 1, "tid": 1, "ts": t + 10, "cat": "ac2g", "name": "ac2g"})
            ev.append({"ph": "f", "id": eid, "pid": 1, "tid": 7, "ts": t + 12, "cat": "ac2g", "name": "ac2g"})
            kargs.update({"device": 0, "stream": 7, "correlation": eid, "registers per thread": 32,
                          "shared memory": 0, "blocks per SM": 12.5, "warps per SM": 50.0, "grid": [1024, 1, 1],
                          "block": [128, 1, 1], "est. achieved occupancy %": 100})
        ev.append(_x(CAST_KERNEL, "kernel", t + 12, 40, **kargs))
        t += 100
        eid += 4
    return ev


def _peak_load(path):
    import tracemalloc
    tracemalloc.start()
    try:
        trace = load_trace(path)
        return tracemalloc.get_traced_memory()[1], trace
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def kept_only_peak(tmp_path_factory):
    p = _write(tmp_path_factory.mktemp("kept"), _kineto_decode(2_000, keep_only=True))
    return _peak_load(p)[0]


@pytest.mark.parametrize("gz", [False, True])
def test_memory_follows_the_events_kept_not_the_file(tmp_path, kept_only_peak, gz):
    """The reader held the whole text, its JSON and every event (7.5x the trace: 1.5 GiB for 200 MiB). Now
    the file is a stream: the peak is what the doctor keeps, about that of a trace holding only those events
    (the same 2,000 layers without the runtime calls, flows and args the doctor never reads), plus one read
    window (1 MiB of text)."""
    p = _write(tmp_path, _kineto_decode(2_000), name="t.json.gz" if gz else "t.json", gz=gz)
    text_bytes = len(gzip.decompress(p.read_bytes())) if gz else p.stat().st_size
    peak, trace = _peak_load(p)
    window = 4 * 2**20  # the read window: 1 MiB of text with its bytes and one copy while it slides
    assert peak < 1.25 * kept_only_peak + window, (peak, kept_only_peak)
    assert peak < 1.25 * text_bytes + window, (peak, text_bytes)
    assert len(trace.cpu_ops) == 6_000 and len(trace.gpu) == 2_000
    r = diagnose(trace, pool_bytes=4096 * 576)
    assert r.casts and r.casts[0].calls == 2_000 and r.casts[0].src == "float8_e4m3fn"


def _summary(trace):
    return [(e.name, e.cat, e.ts, e.dur, e.pid, e.tid, e.args, e.parent.name if e.parent else None)
            for e in trace.events]


@pytest.mark.parametrize("chunk", [1, 2, 7, 64])
def test_a_stream_cut_anywhere_reads_the_same(tmp_path, monkeypatch, chunk):
    """Values, strings with escapes, numbers and keys cut by the read window at every position read the same
    as from one window; other top-level keys before and after traceEvents are read past."""
    import fp8mla.tools.trace as trace_mod
    ev = _linked_trace(n_tokens=7, layers=2, steps=2)
    ev[0]["name"] = "aten::to \"quoted\" \\\\ caf\u00e9 \u2603 \U0001f600"
    ev[1]["ts"] = 1.25e-3
    ev.append({"ph": "M", "name": "process_name", "args": {"name": "x" * 50}})
    data = {"schemaVersion": 1, "deviceProperties": [{"name": "H200", "mem": 2 ** 40}], "traceEvents": ev,
            "traceName": "t\u00e9st", "displayTimeUnit": "ms"}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    want = _summary(load_trace(p))
    monkeypatch.setattr(trace_mod, "_CHUNK", chunk)
    monkeypatch.setattr(trace_mod, "_MARGIN", min(chunk, 32))
    assert _summary(load_trace(p)) == want
    q = _write(tmp_path, ev, name="g.json.gz", gz=True)
    assert len(load_trace(q).events) == len(want)


@pytest.mark.parametrize("content, msg", [
    (b'{"traceEvents": [{"ph": "X", "ts": 1}] } extra', "Extra data"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1}]', "not JSON"),            # an object's array must be closed
    (b'{"traceEvents": [{"ph": "X", "ts": 1},]}', "not JSON"),
    (b'{"traceEvents": [{"ph": "X", "ts": 1} {"ph": "X"}]}', "Expecting ',' delimiter"),
    (b'{"a": 1 "traceEvents": []}', "Expecting ',' delimiter"),
    (b'{"traceEvents": {"ph": "X"}}', "without a 'traceEvents' list"),
    (b'[{"ph": "X", "ts": 1}, {"ph": "X", "ts"', "not JSON"),           # cut inside the last event
    (b"  \n\t ", "the file is empty"),
])
def test_malformed_streams_are_clear_errors(tmp_path, content, msg):
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(TraceError, match=msg):
        load_trace(p)


def test_error_position_is_in_the_file_not_the_window(tmp_path, monkeypatch):
    import fp8mla.tools.trace as trace_mod
    monkeypatch.setattr(trace_mod, "_CHUNK", 16)
    monkeypatch.setattr(trace_mod, "_MARGIN", 16)
    p = tmp_path / "bad.json"
    p.write_text('{"traceEvents": [\n' + '{"ph": "X", "ts": 1},\n' * 50 + '{"ph": "X", "ts": 1} oops]}\n')
    with pytest.raises(TraceError, match=r"Expecting ',' delimiter at line 52 column 22"):
        load_trace(p)
