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

import gzip
import json
import os
import re
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


@dataclass(eq=False)
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

    @property
    def span_us(self) -> float:
        """Wall time covered by the events (first start to last end)."""
        evs = [e for e in self.events if e.cat.lower() in _NESTED_CATS | GPU_CATS]
        evs = evs or self.events
        return max(e.end for e in evs) - min(e.ts for e in evs)


def _read_json(path: str):
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, expected a trace file (.json or .json.gz)")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:  # permission denied, a device, a vanished file
        raise TraceError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic: trust the bytes, not the file name
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # a bad header, a cut-off stream, corrupt deflate data
            raise TraceError(f"{path}: a damaged gzip file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (not UTF-8); expected a Chrome trace .json or .json.gz") \
            from None
    if not text.strip():
        raise TraceError(f"{path}: the file is empty")
    try:
        return json.loads(text)
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply to read; expected a Chrome trace (a flat list of "
                         "events)") from None
    except json.JSONDecodeError as e:
        # The Chrome trace format allows an array with its closing bracket missing (a profile cut short).
        stripped = text.rstrip().rstrip(",")
        if stripped.startswith("[") and not stripped.endswith("]"):
            try:
                return json.loads(stripped + "]")
            except json.JSONDecodeError:
                pass
        raise TraceError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); expected a Chrome "
                         "trace from torch.profiler export_chrome_trace") from None
    except ValueError as e:  # JSON that the decoder refuses past parsing: an integer of over 4300 digits
        raise TraceError(f"{path}: not a readable JSON trace ({e})") from None


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
    """Parse a Chrome trace file; raises :class:`TraceError` with a plain reason when it cannot."""
    path = os.fspath(path)
    data = _read_json(path)
    if isinstance(data, dict):
        raw = data.get("traceEvents")
        if not isinstance(raw, list):
            raise TraceError(f"{path}: a JSON object without a 'traceEvents' list; expected a Chrome trace "
                             f"(keys found: {sorted(data)[:8]})")
    elif isinstance(data, list):
        raw = data
    else:
        raise TraceError(f"{path}: expected a Chrome trace (a JSON object with 'traceEvents' or a list of "
                         f"events), got a JSON {type(data).__name__}")
    events = []
    for r in raw:
        if not isinstance(r, dict) or r.get("ph") != "X" or "ts" not in r:
            continue  # metadata, flows, counters, instant events
        try:
            ts, dur = float(r["ts"]), float(r.get("dur", 0.0))
        except (TypeError, ValueError):
            continue
        args = r.get("args") if isinstance(r.get("args"), dict) else {}
        if "External id" in args:
            args = {**args, "External id": _key(args["External id"])}
        events.append(Event(str(r.get("name", "")), str(r.get("cat", "")), ts, dur, _key(r.get("pid")),
                            _key(r.get("tid")), args))
    if not events:
        raise TraceError(f"{path}: no complete ('X') events: the trace is empty (was the profiler active while "
                         "the steps ran?)")
    _link(events)
    cpu_ops = [e for e in events if e.cat.lower() in CPU_OP_CATS]
    gpu = [e for e in events if e.cat.lower() in GPU_CATS]
    steps = sorted((e for e in events if _STEP.match(e.name) and e.cat != "gpu_user_annotation"),
                   key=lambda e: e.ts)
    shapes = any("Input type" in e.args for e in cpu_ops)
    by_id = {e.ext_id: e for e in cpu_ops if e.ext_id is not None}
    return Trace(path, events, cpu_ops, gpu, steps, shapes, by_id)


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
