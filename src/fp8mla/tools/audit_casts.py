"""Rule KV001 of ``fp8mla audit``: a KV-pool read (or a view of one) converted to another dtype.

Statement by statement, a small environment maps names (and ``self.x``) to the pool they hold; a gather
(``pool[kv_indices]``, ``index_select``) ends the pool. A conversion is not reported when its target is a
KV-cache dtype (``.to(self.kv_dtype)``, or any name whose value the module's data flow says is the KV-cache
dtype), nor when it is a guarded conversion to a configured dtype that is not a compute dtype
(``if self.kv_dtype != k_cache.dtype: k_cache = k_cache.to(self.kv_dtype)``): only conversions of the pool to
the compute dtype are the bug.
"""
from __future__ import annotations

import ast
import re

from .audit_flow import COMPUTE, KV, MIXED, dotted, leaf, text

__all__ = ["DEFAULT_POOL_NAMES", "check_casts"]

DEFAULT_POOL_NAMES = (
    "get_key_buffer", "get_value_buffer", "get_kv_buffer", "kv_cache", "kv_caches", "k_cache", "v_cache",
    "key_cache", "value_cache", "kv_buffer", "k_buffer", "v_buffer", "key_buffer", "value_buffer", "ckv_cache",
    "kpe_cache", "kv_c_and_k_pe_cache", "kv_pool",
)
_VIEWS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "permute", "transpose", "t",
          "contiguous", "narrow", "select", "expand", "as_strided", "split", "chunk", "unbind", "detach", "clone",
          "movedim", "view_as", "reshape_as"}
_TO_DTYPE_METHODS = {"float", "half", "bfloat16", "double"}
_TORCH_FLOATS = {"bfloat16", "float16", "half", "float32", "float", "float64", "double"}
_GATHER_INDEX = re.compile(r"layer", re.I)  # a subscript by these names selects a layer: still the pool

FIX = ("read the pool in its own dtype: plan attention with kv_data_type=<the pool's dtype> and pass the pool "
       "unconverted (fp8mla.MLAPagedAttention takes BF16 queries over an FP8 pool); or gather the active tokens "
       "first and cast only those: pool[kv_indices].to(q.dtype)")


class _PoolCasts:
    def __init__(self, pool_names, get_index, emit):
        self.names = set(pool_names)
        self.get_index = get_index  # the module's data flow, built only if a conversion needs judging
        self.emit = emit

    def pool(self, node, env: dict):
        """A description of the pool ``node`` reads (or is a view of), else None."""
        # env maps a name to the pool it holds, or to "" once it was rebound to something else
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id] or None
            return node.id if node.id in self.names else None
        if isinstance(node, ast.Attribute):
            d = dotted(node)
            if d and d in env:
                return env[d] or None
            return text(node) if node.attr in self.names else None
        if isinstance(node, ast.Call):
            f = node.func
            if leaf(f) in self.names and not (isinstance(f, ast.Attribute) and f.attr in _VIEWS):
                return text(node)
            if isinstance(f, ast.Attribute) and f.attr in _VIEWS:
                if isinstance(f.value, ast.Name) and f.value.id == "torch":  # torch.flatten(pool, ...)
                    return self.pool(node.args[0], env) if node.args else None
                return self.pool(f.value, env)
            return None
        if isinstance(node, ast.Subscript):
            src = self.pool(node.value, env)
            return src if src and self._view_index(node.slice) else None
        return None

    @staticmethod
    def _view_index(idx) -> bool:
        """Slices, constants and layer ids give views; anything else (an index tensor) is a gather."""
        items = idx.elts if isinstance(idx, ast.Tuple) else [idx]
        for i in items:
            if isinstance(i, (ast.Slice, ast.Constant)):
                continue
            if isinstance(i, ast.UnaryOp) and isinstance(i.operand, ast.Constant):
                continue
            if isinstance(i, (ast.Name, ast.Attribute)) and _GATHER_INDEX.search(dotted(i) or ""):
                continue
            return False
        return True

    @staticmethod
    def target(call: ast.Call):
        """(description, target expr or None) of what ``call`` converts its receiver to; None if no conversion."""
        f = call.func
        if not isinstance(f, ast.Attribute):
            return None
        if f.attr in _TO_DTYPE_METHODS and not call.args:
            return f"torch.{f.attr}", None
        if f.attr == "type_as" and call.args:
            return f"the dtype of {text(call.args[0])}", None
        if f.attr == "type" and call.args:
            return text(call.args[0]), call.args[0]
        if f.attr != "to":
            return None
        cands = [k.value for k in call.keywords if k.arg == "dtype"]
        if cands:
            return text(cands[0]), cands[0]
        for a in call.args[:2]:
            if isinstance(a, ast.Attribute) and (re.search(r"dtype|data_type", a.attr) or (
                    dotted(a.value) == "torch" and a.attr in _TORCH_FLOATS)):
                return text(a), a
            if isinstance(a, ast.Name) and (re.search(r"dtype|data_type", a.id) or a.id in ("q", "query")):
                return text(a), a
        return None

    @staticmethod
    def _guarded(target, guards) -> bool:
        """``target`` is compared with some ``<x>.dtype`` in an enclosing ``if`` (normalising a cache)."""
        want = ast.dump(target)
        for g in guards:
            for n in ast.walk(g):
                if isinstance(n, ast.Compare):
                    sides = [n.left] + n.comparators
                    dumps = [ast.dump(s) for s in sides]
                    if want in dumps and any(isinstance(s, ast.Attribute) and s.attr == "dtype" for s in sides):
                        return True
        return False

    def _own_dtype(self, call, src, env) -> bool:
        """The conversion's target is the dtype of the very pool it converts: ``.to(pool.dtype)``,
        ``.to(dtype=pool.dtype)``, ``.type(pool.dtype)``, ``.type_as(pool)``, through any name or view of it."""
        f = call.func
        if f.attr == "type_as":
            return bool(call.args) and self.pool(call.args[0], env) == src
        tgts = [k.value for k in call.keywords if k.arg == "dtype"] + list(call.args[:2])
        return any(isinstance(t, ast.Attribute) and t.attr == "dtype" and self.pool(t.value, env) == src
                   for t in tgts)

    def check(self, node, env, func, guards):
        for n in ast.walk(node):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            got = self.target(n)
            src = got and self.pool(n.func.value, env)
            if not src:
                continue
            desc, tgt = got
            if self._own_dtype(n, src, env):
                continue  # `k.to(k.dtype)`: the pool's own dtype, a no-op by construction
            if tgt is not None:
                index = self.get_index()
                kind = index.classify(tgt, index.funcs.get(id(func)) if func is not None else None)
                if kind in (KV, MIXED):
                    continue  # converted to the KV cache's own dtype: no widening to the compute dtype
                if kind != COMPUTE and self._guarded(tgt, guards):
                    continue  # `if X != cache.dtype: cache = cache.to(X)` with X not a compute dtype
            self.emit(n, "KV001", f"`{text(n)}` converts a KV-pool read ({src}) to {desc}: this copies "
                      "the whole pool on every call (every layer of every step)", FIX)

    def bind(self, target, value, env, pooled=None):
        """Track names that hold the pool (or a view of it) after ``target = value``."""
        src = pooled if pooled is not None else (self.pool(value, env) if value is not None else None)
        if isinstance(target, (ast.Tuple, ast.List)):
            vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            for t, v in zip(target.elts, vals):
                self.bind(t, v, env, pooled=src if v is None else None)
            return
        key = target.id if isinstance(target, ast.Name) else dotted(target)
        if key is None:
            return
        env[key] = src or ""

    def run(self, body, env, func=None, guards=()):
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in st.decorator_list:
                    self.check(d, env, func, guards)
                # a closure sees the names bound so far
                self.run(st.body, dict(env), st, ())
            elif isinstance(st, ast.ClassDef):
                self.run(st.body, {}, None, ())
            elif isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is not None:
                    self.check(st.value, env, func, guards)
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    self.bind(t, st.value, env)
            elif isinstance(st, (ast.For, ast.AsyncFor)):
                self.check(st.iter, env, func, guards)
                # iterating a list of per-layer pools (kv_caches) yields pools
                self.bind(st.target, None, env, pooled=self.pool(st.iter, env) or "")
                self.run(st.body, env, func, guards)
                self.run(st.orelse, env, func, guards)
            elif isinstance(st, (ast.If, ast.While)):
                self.check(st.test, env, func, guards)
                # a branch that always leaves (return/raise/...) keeps its bindings to itself
                self.run(st.body, dict(env) if _leaves(st.body) else env, func, guards + (st.test,))
                self.run(st.orelse, dict(env) if _leaves(st.orelse) else env, func, guards)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                for item in st.items:
                    self.check(item.context_expr, env, func, guards)
                self.run(st.body, env, func, guards)
            elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
                self.run(st.body, env, func, guards)
                for h in st.handlers:
                    self.run(h.body, env, func, guards)
                self.run(st.orelse, env, func, guards)
                self.run(st.finalbody, env, func, guards)
            elif type(st).__name__ == "Match":
                self.check(st.subject, env, func, guards)
                for case in st.cases:
                    self.run(case.body, env, func, guards)
            else:
                self.check(st, env, func, guards)


def _leaves(body) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def check_casts(tree, get_index, pool_names, emit) -> None:
    """``get_index()`` returns the module's :class:`ModuleIndex` (built on first use)."""
    _PoolCasts(pool_names, get_index, emit).run(tree.body, {})
