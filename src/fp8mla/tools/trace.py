"""Read a torch profiler Chrome trace (``.json`` or ``.json.gz``) into plain events with their nesting.

Written for the traces ``torch.profiler.profile(...).export_chrome_trace()`` produces (Kineto), which is also
what SGLang's ``/start_profile`` and vLLM's profiler write. What the doctor relies on:

- CPU ops: ``"ph": "X"``, ``"cat": "cpu_op"`` (``"Operator"`` in old traces); with ``record_shapes=True`` their
  ``args`` hold ``"Input type"`` (``"c10::BFloat16"``, ``"float"``, ...), ``"Input Dims"`` and, on recent torch,
  ``"Concrete Inputs"`` (scalar arguments as strings: the target dtype of ``aten::_to_copy`` is its ScalarType
  number). Nested ops (``aten::to`` > ``aten::_to_copy`` > ``aten::copy_``) are separate events; nesting is
  recovered from time intervals on one thread.
- GPU work: ``"cat": "kernel"`` / ``"gpu_memcpy"`` / ``"gpu_memset"``; ``args["External id"]`` equals the
  ``External id`` of the CPU op that launched it. Kernels replayed from a CUDA graph have no such op.
- Steps: ``ProfilerStep#N`` user annotations, written when ``prof.step()`` is called under a schedule.
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import sys
import zlib
from dataclasses import dataclass, field

__all__ = ["TraceError", "Event", "Trace", "load_trace", "kernel_label", "dtype_name", "dtype_bytes",
           "SCALAR_TYPES"]


class TraceError(ValueError):
    """The input is not a readable torch profiler Chrome trace. The message says what was wrong."""


# C++ type strings of "Input type" (and of lambda arguments in kernel names) -> (torch name, bytes).
_TYPES = {
    "c10::Float8_e4m3fn": ("float8_e4m3fn", 1), "c10::Float8_e5m2": ("float8_e5m2", 1),
    "c10::Float8_e4m3fnuz": ("float8_e4m3fnuz", 1), "c10::Float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
    "c10::Float8_e8m0fnu": ("float8_e8m0fnu", 1),
    "c10::BFloat16": ("bfloat16", 2), "c10::Half": ("float16", 2), "float": ("float32", 4),
    "double": ("float64", 8), "bool": ("bool", 1), "unsigned char": ("uint8", 1), "signed char": ("int8", 1),
    "short int": ("int16", 2), "short": ("int16", 2), "int": ("int32", 4), "long int": ("int64", 8),
    "long": ("int64", 8), "c10::complex<float>": ("complex64", 8), "c10::complex<double>": ("complex128", 16),
    "c10::complex<c10::Half>": ("complex32", 4),
    # names used in kernel templates without the c10:: prefix
    "BFloat16": ("bfloat16", 2), "Half": ("float16", 2), "at::BFloat16": ("bfloat16", 2),
    "at::Half": ("float16", 2), "Float8_e4m3fn": ("float8_e4m3fn", 1), "Float8_e5m2": ("float8_e5m2", 1),
}
_BYTES = {name: b for name, b in _TYPES.values()}

# c10::ScalarType numbers, as "Concrete Inputs" print the dtype argument of aten::_to_copy.
SCALAR_TYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
                7: "float64", 8: "complex32", 9: "complex64", 10: "complex128", 11: "bool", 15: "bfloat16",
                23: "float8_e5m2", 24: "float8_e4m3fn", 25: "float8_e5m2fnuz", 26: "float8_e4m3fnuz"}


def dtype_name(type_str: str) -> str | None:
    """``"c10::BFloat16"`` -> ``"bfloat16"``; None for non-tensor entries (``"Scalar"``, ``""``) and for
    anything that is not a string (a trace written by another tool, or damaged)."""
    if not isinstance(type_str, str):
        return None
    t = _TYPES.get(type_str.strip())
    return t[0] if t else None


def dtype_bytes(name: str | None) -> int | None:
    return _BYTES.get(name) if name else None


@dataclass(eq=False, slots=True)
class Event:
    """One complete ("X") event. ``parent``/``children`` link CPU-side events of one thread by time nesting."""

    name: str
    cat: str
    ts: float   # us
    dur: float  # us
    pid: object
    tid: object
    args: dict
    parent: "Event | None" = None
    children: list = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def ext_id(self):
        return self.args.get("External id")

    def ancestors(self):
        e = self.parent
        while e is not None:
            yield e
            e = e.parent

    def descendants(self):
        stack = list(self.children)
        while stack:
            e = stack.pop()
            yield e
            stack.extend(e.children)


CPU_OP_CATS = {"cpu_op", "operator"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_NESTED_CATS = CPU_OP_CATS | {"user_annotation", "python_function"}
_STEP = re.compile(r"^ProfilerStep#\d+$")


@dataclass
class Trace:
    path: str
    events: list          # every complete event
    cpu_ops: list         # CPU ops (aten::..., custom ops)
    gpu: list             # kernels, memcpys, memsets
    steps: list           # CPU-side ProfilerStep#N annotations, in time order
    shapes_recorded: bool
    ops_by_ext_id: dict   # External id -> CPU op
    span_all_us: float = 0.0  # first start to last end over every complete event, kept or not

    @property
    def span_us(self) -> float:
        """Wall time covered by the CPU-side and GPU events (first start to last end); by every complete event
        when there are none."""
        evs = [e for e in self.events if e.cat.lower() in _KEEP_CATS]
        if not evs:
            return self.span_all_us
        return max(e.end for e in evs) - min(e.ts for e in evs)


# -- reading: a stream of events, never the whole file in memory ------------------------------------------------
_CHUNK = 1 << 20        # characters read at a time
_MARGIN = 32            # a decode error this close to the end of what was read may be a value cut by the chunk
_WS = re.compile(r"[ \t\n\r]*")
# the args the doctor reads; the rest (strides, sequence numbers, occupancy, ...) is dropped on reading
_KEEP_ARGS = ("External id", "Input type", "Input Dims", "Concrete Inputs")
_KEEP_CATS = _NESTED_CATS | GPU_CATS
_NO_ARGS: dict = {}     # shared by the many events with none the doctor reads (Python frames); never written to


STDIN = "-"  # the path that means standard input


class _Prefixed:
    """A binary stream whose first bytes were read already (to test for gzip), given back on the first reads: a
    pipe or standard input cannot seek back to them."""

    def __init__(self, head: bytes, file):
        self.head, self.file = head, file

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.file.read(n)
        if n is None or n < 0:
            h, self.head = self.head, b""
            return h + self.file.read()
        h, self.head = self.head[:n], self.head[n:]
        return h + (self.file.read(n - len(h)) if n > len(h) else b"")


class _Text:
    """The characters of a trace file, a pipe (``<(zcat t.json.gz)``) or standard input (``"-"``), a chunk at a
    time: gzip by its magic bytes (not the file name), UTF-8 decoded incrementally. Read once, front to back."""

    def __init__(self, path: str):
        self.path = "<stdin>" if path == STDIN else path
        try:
            self.file = sys.stdin.buffer if path == STDIN else open(path, "rb")
            head = self.file.read(2)
        except OSError as e:  # permission denied, a device, a vanished file
            raise TraceError(f"{self.path}: cannot be read ({e.strerror or type(e).__name__})") from None
        self.gz = head == b"\x1f\x8b"
        stream = _Prefixed(head, self.file)
        self.raw = gzip.GzipFile(fileobj=stream, mode="rb") if self.gz else stream
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.eof = False

    def read(self, n: int) -> str:
        try:
            b = self.raw.read(n)
        except (OSError, EOFError, zlib.error) as e:  # a bad header, a cut-off stream, corrupt deflate data
            if self.gz:
                raise TraceError(f"{self.path}: a damaged gzip file ({e})") from None
            raise TraceError(f"{self.path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
        self.eof = not b
        try:
            return self.utf8.decode(b, final=self.eof)
        except UnicodeDecodeError:
            raise TraceError(f"{self.path}: not a text file (not UTF-8); expected a Chrome trace .json or "
                             ".json.gz") from None

    def close(self):
        if self.gz:
            self.raw.close()
        if self.file is not sys.stdin.buffer:  # standard input stays open: it is the caller's
            self.file.close()


class _Scanner:
    """JSON values one at a time from a :class:`_Text` (``json.JSONDecoder.raw_decode`` over a window of the
    text), so that a trace of a million events is never one string nor one list in memory."""

    def __init__(self, text: _Text):
        self.text, self.buf, self.pos = text, "", 0
        self.decoder = json.JSONDecoder()
        self.lines, self.col = 1, 0  # line and column at the start of buf (for error messages)

    def more(self, n=_CHUNK) -> bool:
        if self.text.eof:
            return False
        got = self.text.read(n)
        done = self.buf[:self.pos]
        nl = done.count("\n")
        self.lines += nl
        self.col = len(done) - done.rfind("\n") - 1 if nl else self.col + len(done)
        self.buf, self.pos = self.buf[self.pos:] + got, 0
        return bool(got) or not self.text.eof

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end of the file)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def fail(self, msg: str, pos: int):
        before = self.buf[:pos]
        nl = before.count("\n")
        line = self.lines + nl
        col = (pos - before.rfind("\n") if nl else self.col + pos + 1)
        raise TraceError(f"{self.text.path}: not JSON ({msg} at line {line} column {col}); expected a Chrome "
                         "trace from torch.profiler export_chrome_trace")

    def value(self):
        self.peek()
        n = _CHUNK
        while True:
            try:
                v, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut = e.pos >= len(self.buf) - _MARGIN or e.msg.startswith("Unterminated string")
                if cut and self.more(n):
                    n *= 2  # a value longer than a chunk: read geometrically more, linear time overall
                    continue
                self.fail(e.msg, e.pos)
            except RecursionError:
                raise TraceError(f"{self.text.path}: JSON nested too deeply to read; expected a Chrome trace (a "
                                 "flat list of events)") from None
            except ValueError as e:  # JSON the decoder refuses past parsing: an integer of over 4300 digits
                raise TraceError(f"{self.text.path}: not a readable JSON trace ({e})") from None
            if end >= len(self.buf) and self.more():
                continue  # a number at the end of the window may go on in the next chunk
            self.pos = end
            return v

    def expect(self, ch: str, what: str):
        if self.peek() != ch:
            self.fail(f"Expecting {what}", self.pos)
        self.pos += 1

    def items(self, cut_ok: bool):
        """The elements of the array at the current position, one by one. ``cut_ok``: the file may end before
        the closing bracket (the Chrome trace format allows it for a trace written as a bare array)."""
        self.expect("[", "'['")
        first = True
        while True:
            ch = self.peek()
            if ch == "]":
                self.pos += 1
                return
            if ch == "":
                if cut_ok:
                    return
                self.fail("Expecting value" if first else "Expecting ',' delimiter", self.pos)
            if not first:
                if ch != ",":
                    self.fail("Expecting ',' delimiter", self.pos)
                self.pos += 1
                if self.peek() == "" and cut_ok:
                    return  # `[ev, ev,` cut after a comma
            first = False
            yield self.value()


def _raw_events(scan: _Scanner, path: str):
    """The raw event objects of a Chrome trace: a JSON array of events (its closing bracket may be missing) or
    an object with a ``traceEvents`` array, whatever other keys it has, in any order."""
    ch = scan.peek()
    if ch == "":
        raise TraceError(f"{path}: the file is empty")
    if ch == "[":
        yield from scan.items(cut_ok=True)
    elif ch == "{":
        scan.pos += 1
        keys, found, first = [], False, True
        while True:
            ch = scan.peek()
            if ch == "}":
                scan.pos += 1
                break
            if not first:
                scan.expect(",", "',' delimiter")
            first = False
            if scan.peek() != '"':
                scan.fail("Expecting property name enclosed in double quotes", scan.pos)
            key = scan.value()
            scan.expect(":", "':' delimiter")
            keys.append(key)
            if key == "traceEvents" and scan.peek() == "[":
                found = True
                yield from scan.items(cut_ok=False)
            else:
                scan.value()  # another key's value (deviceProperties, schemaVersion, ...): read and dropped
        if not found:
            raise TraceError(f"{path}: a JSON object without a 'traceEvents' list; expected a Chrome trace "
                             f"(keys found: {sorted(keys)[:8]})")
    else:
        v = scan.value()
        if scan.peek() != "":
            scan.fail("Extra data", scan.pos)
        raise TraceError(f"{path}: expected a Chrome trace (a JSON object with 'traceEvents' or a list of "
                         f"events), got a JSON {type(v).__name__}")
    if scan.peek() != "":
        scan.fail("Extra data", scan.pos)


def _key(v):
    """A value usable as a dict key. pid, tid and External id are numbers or strings in every profiler's
    traces; a damaged or foreign trace may hold lists or objects there, which would end the run in
    ``unhashable type``. They become their JSON text, which still tells equal values from different ones."""
    try:
        hash(v)
        return v
    except TypeError:
        return json.dumps(v, sort_keys=True, default=str)


def _link(events: list) -> None:
    """Parent/child links between CPU-side events of each thread, from interval nesting."""
    by_thread: dict = {}
    for e in events:
        if e.cat.lower() in _NESTED_CATS:
            by_thread.setdefault((e.pid, e.tid), []).append(e)
    eps = 0.01  # us: timestamps are rounded to ns, a child may seem to end a hair after its parent
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list = []
        for e in evs:
            # pop what ended before e starts, and what e overlaps without nesting in (async annotations)
            while stack and (e.ts >= stack[-1].end or e.end > stack[-1].end + eps):
                stack.pop()
            if stack:
                e.parent = stack[-1]
                stack[-1].children.append(e)
            stack.append(e)


def load_trace(path) -> Trace:
    """Parse a Chrome trace file, a pipe (``<(zcat trace.json.gz)``, ``/dev/fd/N``) or standard input (``"-"``);
    raises :class:`TraceError` with a plain reason when it cannot.

    The file is read as a stream of events: what stays in memory is the events the doctor uses (CPU ops, GPU
    work, annotations and Python frames, with only the args it reads), not the file nor its JSON."""
    path = os.fspath(path)
    if path != STDIN and not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if path != STDIN and os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, expected a trace file (.json or .json.gz)")
    text = _Text(path)
    events, names = [], {}
    intern = lambda s: names.setdefault(s, s)  # noqa: E731 - a million events share a few hundred names
    first, last = float("inf"), float("-inf")
    try:
        for r in _raw_events(_Scanner(text), text.path):
            if not isinstance(r, dict) or r.get("ph") != "X" or "ts" not in r:
                continue  # metadata, flows, counters, instant events
            try:
                ts, dur = float(r["ts"]), float(r.get("dur", 0.0))
            except (TypeError, ValueError):
                continue
            first, last = min(first, ts), max(last, ts + dur)
            cat = intern(str(r.get("cat", "")))
            if cat.lower() not in _KEEP_CATS:
                continue  # cuda_runtime, ac2g, ...: only their time span is used
            raw_args = r.get("args") if isinstance(r.get("args"), dict) else {}
            args = {k: raw_args[k] for k in _KEEP_ARGS if k in raw_args} or _NO_ARGS
            if "External id" in args:
                args["External id"] = _key(args["External id"])
            t = args.get("Input type")
            if isinstance(t, list):
                args["Input type"] = [intern(x) if isinstance(x, str) else x for x in t]
            events.append(Event(intern(str(r.get("name", ""))), cat, ts, dur, _key(r.get("pid")),
                                _key(r.get("tid")), args))
    finally:
        text.close()
    if not events and first == float("inf"):
        raise TraceError(f"{text.path}: no complete ('X') events: the trace is empty (was the profiler active while "
                         "the steps ran?)")
    _link(events)
    cpu_ops = [e for e in events if e.cat.lower() in CPU_OP_CATS]
    gpu = [e for e in events if e.cat.lower() in GPU_CATS]
    steps = sorted((e for e in events if _STEP.match(e.name) and e.cat != "gpu_user_annotation"),
                   key=lambda e: e.ts)
    shapes = any("Input type" in e.args for e in cpu_ops)
    by_id = {e.ext_id: e for e in cpu_ops if e.ext_id is not None}
    return Trace(text.path, events, cpu_ops, gpu, steps, shapes, by_id, last - first)


# -- kernel names ---------------------------------------------------------------------------------------------
_FUNCTOR = re.compile(r"(\w+_kernel_cuda)\b")


def strip_templates(name: str) -> str:
    """``void ns::f<A, B<C> >(int, X)`` -> ``ns::f``: drop template arguments, the parameter list and ``void``."""
    s = name.replace("(anonymous namespace)", "{anon}")
    out, depth = [], 0
    for ch in s:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out)
    paren = s.find("(")
    if paren > 0:
        s = s[:paren]
    s = s.strip()
    for prefix in ("void ", "static "):
        if s.startswith(prefix):
            s = s[len(prefix):]
    return s.strip() or name


def kernel_label(name: str) -> str:
    """Short, stable label of a kernel: templates stripped; for ATen's generic elementwise kernels the functor
    that says what they do is kept (``at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>``),
    because without it every pointwise op would share one name."""
    base = strip_templates(name)
    if base.endswith("elementwise_kernel") or base.endswith("elementwise_kernel_with_index"):
        m = _FUNCTOR.search(name)
        if m:
            return f"{base}<{m.group(1)}>"
    return base
