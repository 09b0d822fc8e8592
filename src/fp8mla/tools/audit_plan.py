"""Rules KV002/KV003 of ``fp8mla audit``: ``plan()``/``begin_forward()`` calls of FlashInfer wrappers that plan
the KV as the query/model dtype.

1. Which wrapper: the receiver's class from the module's data flow (``self.decode_wrapper =
   BatchMLAPagedAttentionWrapper(...)``, parameter annotations, ``List[...]`` of wrappers, subclasses); when that
   is unknown, every FlashInfer signature the call fits (argument count, keywords, required parameters, and no
   argument whose name is another parameter's), provided the call looks like a wrapper's plan (a dtype keyword,
   or an ``*indptr`` first and enough positionals to reach the dtypes). A receiver of a class that is not a
   FlashInfer wrapper (a library's compiled ``_cached_module``, an engine's own wrapper class) is not judged.
2. Which arguments are the dtypes: resolved against :mod:`flashinfer_signatures`; when the candidate signatures
   disagree (versions, or ragged vs paged), the call is not judged.
3. What they are: :meth:`ModuleIndex.classify` (compute dtype / KV-cache dtype / unknown). Ragged prefill takes
   fresh K/V and is never judged; an unknown KV dtype is never flagged.
"""
from __future__ import annotations

import ast
import re

from .audit_flow import COMPUTE, ModuleIndex, dotted, text
from .flashinfer_signatures import SIGNATURES, signatures_for

__all__ = ["check_plans"]

# an FP8 pool (or its dtype) is visible somewhere in the module: only then is a compute-dtype KV a finding
# (the names of plan()'s own parameters, kv_data_type / kv_dtype, are not evidence of a pool)
KV_EVIDENCE = re.compile(r"kv_cache_dtype|cache_dtype|store_dtype|token_to_kv_pool|float8|fp8|get_key_buffer|"
                         r"kv_cache|kv_pool|kv_buffer", re.I)
_NOT_A_WRAPPER = re.compile(r"module|^_?ops?$|_op$|^lib|kernel|^torch$", re.I)
_SUFFIX = re.compile(r"(_cpu|_host|_gpu|_device|_buf|_buffer|_tensor|_list)+$")


def _norm(name: str) -> str:
    return _SUFFIX.sub("", name.lower()).removeprefix("paged_").removeprefix("self.")


def _loose(name: str) -> str:
    return re.sub(r"^(kv_|qo_|q_|paged_kv_)", "", name)


def _keywords(sig, call):
    """``({parameter: value}, [keywords that bind none])`` of ``call``'s keywords under ``sig``. A keyword that
    is not a parameter's name binds the one parameter it names once host/device suffixes and ``paged_`` are
    stripped, as positional arguments' names are read: an engine's faster plan passes ``qo_indptr_cpu=``,
    ``kv_len_arr_cpu=`` (CUDA-graph replays), FlashInfer's own names them ``qo_indptr``, ``kv_len_arr``."""
    names = sig.names()
    bound = {k.arg: k.value for k in call.keywords if k.arg in names}
    taken = set(sig.params[:len(call.args)]) | set(bound)
    by_norm: dict = {}
    for p in sig.params + sig.kwonly:
        by_norm.setdefault(_norm(p), []).append(p)
    extra = []
    for k in call.keywords:
        if k.arg in names:
            continue
        cands = [p for p in by_norm.get(_norm(k.arg), []) if p not in taken]
        if len(cands) == 1:
            bound[cands[0]] = k.value
            taken.add(cands[0])
        else:
            extra.append(k.arg)
    return bound, extra


def _fits(sig, call, strict=True) -> bool:
    """``call`` could be a call of ``sig`` (count, keywords, required args, argument names). Not ``strict``
    (the receiver is known to be this wrapper): extra keywords are allowed -- engines replace ``plan`` with a
    faster copy that takes a few more (SGLang's ``fast_decode_plan``)."""
    args = call.args
    bound, extra = _keywords(sig, call)
    if len(args) > len(sig.params) or (strict and extra):
        return False
    given = set(sig.params[:len(args)]) | set(bound)
    if not set(sig.params[:sig.required]) <= given:
        return False
    norm = [_norm(p) for p in sig.params]
    loose = [_loose(n) for n in norm]
    dtypes = set(sig.q) | set(sig.kv) | {"o_data_type"}
    for i, a in enumerate(args):
        d = dotted(a)
        if d is None or sig.params[i] in dtypes or re.search(r"dtype|data_type", d):
            continue  # dtype arguments are what is judged, whatever their names say
        n = _norm(d.split(".")[-1])
        if n in norm and norm.index(n) != i:
            return False  # e.g. `sm_scale` passed where this signature has `data_type`
        ln = _loose(n)
        if loose.count(ln) == 1 and loose.index(ln) != i and n != norm[i]:
            return False  # `kv_indptr` in the `indices` slot of the decode signature
        if strict and n in _ALL_NAMES and n not in norm and ln not in loose:
            return False  # `indices` / `last_page_len` passed to what would be a ragged prefill: another wrapper
    return True


_ALL_NAMES = {_norm(p) for sig in SIGNATURES for p in sig.params}


def _looks_like_plan(sig, call) -> bool:
    kws = set(_keywords(sig, call)[0])
    if kws & (set(sig.q) | set(sig.kv)):
        return True
    first = dotted(call.args[0]) if call.args else None
    pos = [sig.params.index(p) for p in sig.q + sig.kv if p in sig.params]
    return bool(first and "indptr" in first.lower() and pos and len(call.args) > min(pos))


def _bind(sig, call):
    """(q expr or None, kv expr or None) of ``call`` under ``sig``; first passed parameter wins."""
    got = dict(zip(sig.params, call.args))
    got.update(_keywords(sig, call)[0])
    q = next((got[p] for p in sig.q if p in got), None)
    kv = next((got[p] for p in sig.kv if p in got), None)
    return q, kv


def _candidates(index: ModuleIndex, call, func):
    """The signatures this call is judged against: None when it is not a FlashInfer wrapper call we can read."""
    recv = call.func.value
    types = index.wrapper_types(recv, func)
    if types:
        fi = {index.flashinfer_class(t) for t in types}
        if None not in fi:
            return [s for c in fi for s in signatures_for(c) if _fits(s, call, strict=False)] or None
        # FlashInfer's wrapper or an engine's own class (vLLM's DCP prefill wrapper with its own plan()): judged
        # only as a FlashInfer call the arguments fit exactly
        return [s for c in fi - {None} for s in signatures_for(c) if _fits(s, call)] or None
    name = (dotted(recv) or text(recv)).split(".")[-1]
    if _NOT_A_WRAPPER.search(name):
        return None
    sigs = [s for s in SIGNATURES if _fits(s, call) and _looks_like_plan(s, call)]
    if "ragged" in text(recv).lower():
        sigs = [s for s in sigs if not s.paged]
    return sigs or None


def _call_sites(index: ModuleIndex, func):
    """Calls of ``func`` (a module function, or a method of a class of this module) with the arguments bound to
    its parameter names: [(call, caller _Func, {param: expr})]."""
    node = func.node
    params = [a.arg for a in node.args.posonlyargs + node.args.args]
    out = []
    for call, caller in index.calls.get(node.name, []) + (
            index.plan_calls if node.name in ("plan", "begin_forward") else []):
        f = call.func
        if func.cls is None:
            if not isinstance(f, ast.Name):
                continue  # `x.fast_plan(...)` is some other object's method
            names = params
        else:
            if not isinstance(f, ast.Attribute):
                continue
            recv = f.value
            own = isinstance(recv, ast.Name) and recv.id == "self" and caller is not None and caller.cls is func.cls
            if not own and func.cls.name not in index.wrapper_types(recv, caller):
                continue
            names = params[1:]  # bound method: `self` is the receiver
        if any(isinstance(a, ast.Starred) for a in call.args):
            continue
        bound = dict(zip(names, call.args))
        bound.update({k.arg: k.value for k in call.keywords if k.arg})
        out.append((call, caller, bound))
    return out


def _check_forwarded(index, forwarders, evidence, emit):
    """A FlashInfer plan() whose KV dtype is a parameter of the enclosing function: judge what the module's own
    callers pass for it (one level: ``fast_plan_decode(wrapper, ..., kv_data_type=X)``, an engine's wrapper class
    whose ``plan(..., kv_cache_dtype)`` forwards to FlashInfer)."""
    for func, param, call, wrapper in forwarders:
        for site, caller, bound in _call_sites(index, func):
            arg = bound.get(param)
            if arg is None or index.classify(arg, caller) != COMPUTE or not evidence:
                continue
            emit(site, "KV002",
                 f"`{text(site.func)}()` passes `{text(arg)}`{index.origin(arg, caller)}, a compute dtype, as "
                 f"`{param}`, which `{func.node.name}()` forwards as the KV data type of {wrapper}.{call.func.attr}()"
                 f" (line {call.lineno}), while an FP8-capable KV pool is visible in this module: the FP8 pool "
                 "then gets converted before every call",
                 f"pass the pool's dtype as `{param}` and the pool unconverted")


def _literal_dict(expr, func):
    """{key: value} of a ``{"k": v}`` or ``dict(k=v)`` literal, or of a local name assigned one once and never
    changed after (no item assignment, no mutating method); None for anything else."""
    if isinstance(expr, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in expr.keys):
            return {k.value: v for k, v in zip(expr.keys, expr.values)}
        return None  # `{**other}` or a computed key
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict" and not expr.args:
        if all(k.arg for k in expr.keywords):
            return {k.arg: k.value for k in expr.keywords}
        return None
    if isinstance(expr, ast.Name) and func is not None and expr.id not in func.params:
        vals = func.assigns.get(expr.id, [])
        if len(vals) != 1 or isinstance(vals[0], ast.Name) or _mutated(func.node, expr.id):
            return None
        return _literal_dict(vals[0], None)
    return None


def _mutated(func_node, name) -> bool:
    for n in ast.walk(func_node):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)) and \
                isinstance(n.value, ast.Name) and n.value.id == name:
            return True
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return True
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name and \
                n.attr in ("update", "setdefault", "pop", "popitem", "clear", "__setitem__"):
            return True
    return False


def _spread(call, func):
    """``call`` with its ``**{...}`` literal-dict keywords written out (a copy at the same place); None when a
    ``**`` argument is not a literal dict (its keys cannot be seen)."""
    if all(k.arg is not None for k in call.keywords):
        return call
    keywords = []
    for k in call.keywords:
        if k.arg is not None:
            keywords.append(k)
            continue
        got = _literal_dict(k.value, func)
        if got is None:
            return None
        keywords += [ast.keyword(arg=name, value=v) for name, v in got.items()]
    return ast.copy_location(ast.Call(func=call.func, args=call.args, keywords=keywords), call)


def check_plans(index: ModuleIndex, source: str, emit) -> None:
    # evidence of an FP8-capable pool: its names in the source, or a class that keeps a KV-cache dtype in an
    # attribute (`self.kv_dtype = kv_dtype`), whatever plan()'s own keywords are called
    evidence = bool(KV_EVIDENCE.search(source)) or any(index.kv_attrs(c) for c in index.classes.values())
    forwarders = []
    for call, func in index.plan_calls:
        call = _spread(call, func)
        if call is None or any(isinstance(a, ast.Starred) for a in call.args):
            continue  # **kwargs / *args: the dtypes cannot be seen
        sigs = _candidates(index, call, func)
        if not sigs or len({s.paged for s in sigs}) > 1 or not sigs[0].paged:
            continue  # unknown, ambiguous, or ragged prefill (fresh K/V, the query dtype is right)
        binds = {(id(q), id(kv), s.kv_default_q) for s in sigs for q, kv in [_bind(s, call)]}
        if len(binds) > 1:
            continue  # the versions disagree on which argument is which
        q, kv = _bind(sigs[0], call)
        cls = func.cls if func is not None else None
        kv_attrs = index.kv_attrs(cls)
        method = call.func.attr
        wrapper = sigs[0].cls
        if kv is not None:
            if isinstance(kv, ast.Name) and func is not None and kv.id in func.params:
                r = index.reach(func, kv.id, kv)  # only bindings that reach this call, not a later one
                if (r.param if r is not None else kv.id not in func.assigns):
                    forwarders.append((func, kv.id, call, wrapper))
            kind = index.classify(kv, func)
            if kind == COMPUTE and evidence:
                where = f"kv_data_type={kv_attrs[0]}" if kv_attrs else \
                    "kv_data_type=<the pool's dtype>, e.g. the KV-cache dtype or the pool tensor's .dtype"
                qs = f" (the query's is `{text(q)}`)" if q is not None else ""
                emit(call, "KV002",
                     f"`{method}()` of {wrapper} plans the KV data type as `{text(kv)}`"
                     f"{index.origin(kv, func)}, a compute dtype{qs}, while an FP8-capable KV pool is visible in "
                     "this module: the kernel then expects a compute-dtype pool, so the FP8 pool gets converted "
                     "before every call",
                     f"plan the KV as the pool's dtype ({where}) and pass the pool unconverted")
            continue
        if not sigs[0].kv_default_q:
            continue  # a required argument is missing: a TypeError at run time, not this bug
        if kv_attrs:
            emit(call, "KV003",
                 f"`{method}()` of {wrapper} on a paged KV cache passes no KV data type (FlashInfer then plans "
                 f"the KV as the query dtype), but this class keeps the KV dtype in {', '.join(kv_attrs)}: "
                 "this call site was missed",
                 f"pass kv_data_type={kv_attrs[0]} here as at the other plan() calls")
        elif q is not None and evidence and index.classify(q, func) == COMPUTE and re.search(
                r"kv_cache_dtype|kv_dtype|store_dtype|float8|fp8", source, re.I):
            emit(call, "KV002",
                 f"`{method}()` of {wrapper} passes only a query dtype (`{text(q)}`, a compute dtype): FlashInfer "
                 "then plans the KV as that dtype, while this module has an FP8-capable KV cache",
                 "pass kv_data_type=<the pool's dtype> as well, and the pool unconverted")
    _check_forwarded(index, forwarders, evidence, emit)

