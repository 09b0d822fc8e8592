"""Recognise dtype casts in a profiler trace, CPU side and GPU side, and size them from recorded shapes.

A cast is found three ways, in this order, and each event is counted once:

1. CPU ops with recorded types: ``aten::copy_`` whose destination and source types differ (``aten::to`` >
   ``aten::_to_copy`` > ``aten::copy_`` is one cast, reported under the whole chain); ``aten::_to_copy`` whose
   target dtype (``Concrete Inputs``) differs from its input's when it has no typed ``copy_`` inside. Same-dtype
   copies (``clone``, ``contiguous``, ``copy_`` between equal types) are not casts. Kernels launched by a cast
   op give its time on a GPU trace; shapes give its bytes.
2. CPU ops without recorded types: ``aten::_to_copy`` (a dtype *or device* conversion; sizes unknown).
3. GPU kernels with no typed CPU op (CUDA-graph replays, ``record_shapes=False``), by name:
   ``direct_copy_kernel_cuda`` with ``LoadWithCast``/``StoreWithCast`` (contiguous) or ``gpu_kernel_impl<``
   (strided; same-dtype copies go through ``gpu_kernel_impl_nocast``), ``bfloat16_copy_kernel_cuda``,
   ``float16_copy_kernel_cuda``, ``float8_copy_kernel_cuda`` (unless fp8 to fp8) and inductor's
   ``triton_poi_fused__to_copy_*`` when it fuses nothing but data movement.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .trace import SCALAR_TYPES, Trace, dtype_bytes, dtype_name, kernel_label

__all__ = ["Cast", "find_casts", "classify_kernel", "is_float"]

# ops that only wrap a conversion: a cast is reported under the chain of these around its copy_
_WRAPPERS = {"aten::to", "aten::_to_copy", "aten::type_as", "aten::copy_", "aten::_copy_from", "aten::float",
             "aten::half", "aten::bfloat16", "aten::double", "aten::type", "aten::_to_copy_out"}
# view-like ops inductor may fuse into a cast kernel without making it anything but a cast
_MOVES = {"clone", "view", "slice", "select", "index", "cat", "copy", "unsqueeze", "squeeze", "permute",
          "transpose", "expand", "reshape", "as", "strided", "unbind", "split", "narrow"}
_LAMBDA = re.compile(r"\{lambda\(([^()]*)\)#\d+\}")


def is_float(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith("float") or dtype == "bfloat16")


@dataclass
class Cast:
    op: str                  # "aten::to > aten::_to_copy > aten::copy_" or a kernel label
    side: str                # "cpu": CPU op and CPU time; "gpu": kernel time, sizes from its CPU op;
                             # "kernel": kernel name only (CUDA graph / no shapes)
    src: str | None          # torch dtype names ("float8_e4m3fn"), None when not recorded
    dst: str | None
    shape: tuple | None      # source shape
    numel: int | None
    bytes_read: int | None
    bytes_written: int | None
    time_us: float
    ts: float
    site: str | None = None  # innermost user Python frame (with_stack=True) or record_function scope
    events: tuple = field(default=(), repr=False)  # the trace events this cast is made of (ops and kernels)

    @property
    def bytes_moved(self):
        if self.bytes_read is None or self.bytes_written is None:
            return None
        return self.bytes_read + self.bytes_written


def _numel(dims) -> int | None:
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


def _types(op):
    t = op.args.get("Input type")
    return t if isinstance(t, list) else None


def _dims(op, i):
    d = op.args.get("Input Dims")
    return d[i] if isinstance(d, list) and len(d) > i and isinstance(d[i], list) else None


def _typed_copy(op):
    """(dst, src) dtypes of a copy_ with recorded types, else None."""
    t = _types(op)
    if op.name != "aten::copy_" or not t or len(t) < 2:
        return None
    dst, src = dtype_name(t[0]), dtype_name(t[1])
    return (dst, src) if dst and src else None


def _to_copy_target(op):
    """(src, dst) of an aten::_to_copy from its own args; dst is None when not recorded, src==dst if no dtype."""
    t = _types(op)
    src = dtype_name(t[0]) if t else None
    ci = op.args.get("Concrete Inputs")
    if not isinstance(ci, list) or len(ci) < 2:
        return src, None
    if ci[1] in ("", None):
        return src, src  # .to(device) only: no dtype argument
    try:
        return src, SCALAR_TYPES.get(int(ci[1]))
    except (ValueError, TypeError, OverflowError):  # not a ScalarType number (a foreign or damaged trace)
        return src, None


def _site(op) -> str | None:
    scope = None
    for a in op.ancestors():
        if a.cat == "python_function":
            n = a.name
            if not (n.startswith(("<built-in", "<frozen", "torch/")) or "/torch/" in n
                    or "fp8mla/tools/" in n):
                return n
        elif a.cat == "user_annotation" and scope is None and not a.name.startswith("ProfilerStep#"):
            scope = a.name
    return scope


def _lambda_types(name: str) -> list:
    """Argument types of the lambdas in a kernel name, in order (the dispatch lambdas take none)."""
    return [a for a in _LAMBDA.findall(name) if a.strip()]


def classify_kernel(name: str):
    """``(is_cast, src, dst)`` from a kernel name alone; dtypes None where the name does not tell."""
    if "direct_copy_kernel_cuda" in name:
        cast = "LoadWithCast" in name or "StoreWithCast" in name or "gpu_kernel_impl<" in name
        lam = _lambda_types(name)
        dst = dtype_name(lam[0]) if lam else None  # the copy lambda takes and returns the destination type
        return cast, None, dst
    for fn, src, dst in (("bfloat16tofloat32_copy_kernel_cuda", "bfloat16", "float32"),
                         ("float16tofloat32_copy_kernel_cuda", "float16", "float32"),
                         ("bfloat16_copy_kernel_cuda", "float32", "bfloat16"),
                         ("float16_copy_kernel_cuda", "float32", "float16")):
        if fn in name:
            return True, src, dst
    if "float8_copy_kernel_cuda" in name:
        lam = _lambda_types(name)
        src = dtype_name(lam[0]) if lam else None
        if src and src.startswith("float8") and "LoadWithCast" not in name and "gpu_kernel_impl<" not in name:
            return False, src, src  # fp8 -> same fp8 (strided copy)
        return True, src, "float8"
    m = re.match(r"triton_poi_fused_(\w+?)_\d+$", name)
    if m and "_to_copy" in m.group(1):
        ops = [o for o in m.group(1).replace("_to_copy", " ").replace("_", " ").split() if o]
        return all(o in _MOVES or o.isdigit() for o in ops), None, None
    return False, None, None


def find_casts(trace: Trace) -> list[Cast]:
    """Every dtype cast in the trace, counted once, in time order."""
    kernels_by_id: dict = {}
    for k in trace.gpu:
        if k.ext_id is not None:
            kernels_by_id.setdefault(k.ext_id, []).append(k)
    used: set = set()   # kernel events already accounted for (launched by a typed CPU copy)
    casts: list[Cast] = []
    for op in trace.cpu_ops:
        src = dst = shape = None
        if op.name == "aten::copy_":
            td = _typed_copy(op)
            if td is None:
                continue  # types not recorded: the enclosing _to_copy (if any) decides
            dst, src = td
            shape = _dims(op, 1)
        elif op.name == "aten::_to_copy":
            if any(_typed_copy(d) for d in op.descendants()):
                continue  # its copy_ carries the types
            src, dst = _to_copy_target(op)
            shape = _dims(op, 0)
        else:
            continue
        root = op
        while root.parent is not None and root.parent.name in _WRAPPERS:
            root = root.parent
        ids = {e.ext_id for e in [root, *root.descendants()] if e.ext_id is not None}
        ks = [k for i in ids for k in kernels_by_id.get(i, [])]
        used.update(id(k) for k in ks)
        if src is not None and src == dst:
            continue  # same dtype: a copy, not a cast
        if src is None and dst is None and ks:
            # types not recorded: the kernels tell a cast from a device move or a same-dtype copy
            kinds = [classify_kernel(k.name) for k in ks if k.cat.lower() == "kernel"]
            kinds = [c for c in kinds if c[0]]
            if not kinds:
                continue
            src, dst = kinds[0][1], kinds[0][2]
        chain, a = [op.name], op
        while a is not root:
            a = a.parent
            chain.append(a.name)
        chain.reverse()
        n = _numel(shape)
        sb, db = dtype_bytes(src), dtype_bytes(dst)
        casts.append(Cast(
            op=" > ".join(chain), side="gpu" if ks else "cpu", src=src, dst=dst,
            shape=tuple(shape) if n is not None else None, numel=n,
            bytes_read=n * sb if n is not None and sb else None,
            bytes_written=n * db if n is not None and db else None,
            time_us=sum(k.dur for k in ks) if ks else root.dur, ts=root.ts, site=_site(root),
            events=(root, *root.descendants(), *ks)))
    for k in trace.gpu:
        if id(k) in used or k.cat.lower() != "kernel":
            continue
        is_cast, src, dst = classify_kernel(k.name)
        if not is_cast:
            continue
        op = trace.ops_by_ext_id.get(k.ext_id)
        casts.append(Cast(op=kernel_label(k.name), side="kernel", src=src, dst=dst, shape=None, numel=None,
                          bytes_read=None, bytes_written=None, time_us=k.dur, ts=k.ts,
                          site=_site(op) if op is not None else None, events=(k,)))
    casts.sort(key=lambda c: c.ts)
    return casts


def gather_inputs(trace: Trace) -> dict:
    """Largest tensor, in bytes per dtype, that a gather or a cast reads: the best guess of the KV pool's size
    when none is given (a correct decode gathers from the pool; a buggy one casts the pool)."""
    best: dict = {}
    for op in trace.cpu_ops:
        if op.name not in ("aten::index_select", "aten::index", "aten::gather", "aten::embedding",
                           "aten::take", "aten::_to_copy", "aten::copy_"):
            continue
        t = _types(op)
        if not t:
            continue
        i = 1 if op.name == "aten::copy_" else 0  # copy_(dst, src); the others read argument 0
        if len(t) <= i:
            continue
        dt = dtype_name(t[i])
        n = _numel(_dims(op, i))
        if dt and n is not None and dtype_bytes(dt):
            best[dt] = max(best.get(dt, 0), n * dtype_bytes(dt))
    return best
