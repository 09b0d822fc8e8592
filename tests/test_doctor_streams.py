"""fp8mla doctor reads a trace from a pipe (``fp8mla doctor <(zcat trace.json.gz)``: a FIFO that cannot seek) and
from standard input (``fp8mla doctor -``), gzip or plain, and gives the same report as from the file; bad data
on a stream is refused like bad data in a file (exit status 2). Both used to exit 2: "cannot be read"."""
from __future__ import annotations

import gzip
import io
import json
import os
import sys
import threading

import pytest

from fp8mla.cli import main as cli
from fp8mla.tools.doctor import diagnose
from fp8mla.tools.trace import TraceError, _Prefixed, load_trace

CAST = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
        "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)")


def _trace_bytes(gz: bool) -> bytes:
    ev = []
    for s in range(2):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                   "ts": s * 1000, "dur": 900})
        for i in range(4):
            ev.append({"ph": "X", "cat": "kernel", "name": CAST if i % 2 else "attn_kernel", "pid": 1, "tid": 7,
                       "ts": s * 1000 + i * 200, "dur": 150, "args": {}})
    raw = json.dumps({"schemaVersion": 1, "traceEvents": ev}).encode()
    return gzip.compress(raw) if gz else raw


def _fifo(tmp_path, data: bytes):
    """A named pipe with a writer thread: what ``<(zcat t.json.gz)`` hands a command."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    path = tmp_path / "pipe"
    os.mkfifo(path)

    def write():
        with open(path, "wb") as f:
            f.write(data)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return str(path), t


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gzip"])
def test_a_pipe_reads_like_the_file(tmp_path, gz):
    data = _trace_bytes(gz)
    f = tmp_path / "trace.json"
    f.write_bytes(data)
    want = diagnose(str(f))
    path, writer = _fifo(tmp_path, data)
    got = diagnose(path)
    writer.join(5)
    assert got.num_steps == want.num_steps == 2
    assert got.to_dict() | {"path": None} == want.to_dict() | {"path": None}


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gzip"])
def test_standard_input_reads_like_the_file(tmp_path, monkeypatch, capsys, gz):
    data = _trace_bytes(gz)
    f = tmp_path / "trace.json"
    f.write_bytes(data)
    assert cli(["doctor", str(f), "--json"]) == 1  # (a repeated cast: flagged)
    want = json.loads(capsys.readouterr().out)
    stdin = io.TextIOWrapper(io.BytesIO(data))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli(["doctor", "-", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["path"] == "<stdin>" and got | {"path": None} == want | {"path": None}
    assert not stdin.closed  # the caller's stream is left open


def test_bad_data_on_a_stream_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"{not json")))
    assert cli(["doctor", "-"]) == 2
    assert "<stdin>: not JSON" in capsys.readouterr().err
    path, writer = _fifo(tmp_path, gzip.compress(b"[]")[:-6])  # a cut-off gzip stream
    with pytest.raises(TraceError, match="damaged gzip|no complete"):
        load_trace(path)
    writer.join(5)


def test_prefixed_stream_gives_back_the_bytes_read_ahead():
    s = _Prefixed(b"ab", io.BytesIO(b"cdef"))
    assert s.read(1) == b"a" and s.read(3) == b"bcd" and s.read(-1) == b"ef" and s.read(2) == b""
    assert _Prefixed(b"ab", io.BytesIO(b"cd")).read() == b"abcd"
