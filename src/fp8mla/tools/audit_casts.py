"""Rule KV001 of ``fp8mla audit``: a KV-pool read (or a view of one) converted to another dtype.

Statement by statement, a small environment maps names (and ``self.x``) to the pool they hold; a gather
(``pool[kv_indices]``, ``index_select``) ends the pool. A conversion is not reported when its target is a
KV-cache dtype (``.to(self.kv_dtype)``, or any name whose value the module's data flow says is the KV-cache
dtype), nor when it is a guarded conversion to a configured dtype that is not a compute dtype
(``if self.kv_dtype != k_cache.dtype: k_cache = k_cache.to(self.kv_dtype)``), nor when its target is computed
from the very pool it converts (``k.to(k.dtype)``, ``k.to(pick_dtype(q, k))``): only conversions of the pool to the
compute dtype are the bug.

A dtype given by a name that does not say "dtype" (``BF16 = torch.bfloat16``, ``target = q.dtype``,
``self.act = runner.dtype``, ``torch.get_default_dtype()``) is resolved by the same data flow the plan rules use.
A name bound to the pool on any branch of an ``if`` (or in a loop body) still holds it after; a pool handed to a
helper function, a method or a lambda of the same module is followed into it (two calls deep), and the finding,
at the conversion, names the call that reached it. Comprehensions over a list of pools, ``enumerate``/``zip``
of them, ``torch.Tensor.to(pool, ...)`` and ``getattr(pool, "to")(...)`` are read like the plain spellings.
"""
from __future__ import annotations

import ast
import re

from .audit_calls import ModuleDefs, bind_arguments
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
_CONVERSIONS = _TO_DTYPE_METHODS | {"to", "type", "type_as"}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPREHENSIONS = {ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp}
_LEAVES = {ast.Name, ast.Constant}
# `.to(x)` arguments that name a device or a copy option: never looked up as dtypes
_NOT_A_DTYPE = re.compile(r"device|^dev$|cpu|cuda|gpu|npu|xpu|memory_format|non_blocking|copy|stream", re.I)
_FOLLOW_DEPTH = 2  # calls followed into helpers: `forward -> _helper -> _cast` and no deeper
_GATHER_INDEX = re.compile(r"layer", re.I)  # a subscript by these names selects a layer: still the pool

FIX = ("read the pool in its own dtype: plan attention with kv_data_type=<the pool's dtype> and pass the pool "
       "unconverted (fp8mla.MLAPagedAttention takes BF16 queries over an FP8 pool); or gather the active tokens "
       "first and cast only those: pool[kv_indices].to(q.dtype)")


def _conversion(call: ast.Call):
    """(receiver, method, args, keywords) when ``call`` is a conversion method call, else None:
    ``x.to(...)``, ``torch.Tensor.to(x, ...)`` (an unbound method), ``getattr(x, "to")(...)``."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in _CONVERSIONS:
        if leaf(f.value) == "Tensor" and dotted(f.value) in ("Tensor", "torch.Tensor"):
            return (call.args[0], f.attr, call.args[1:], call.keywords) if call.args else None
        return f.value, f.attr, call.args, call.keywords
    if isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id == "getattr" and len(f.args) == 2:
        name = f.args[1]
        if isinstance(name, ast.Constant) and name.value in _CONVERSIONS:
            return f.args[0], name.value, call.args, call.keywords
    return None


def _join(envs) -> dict:
    """The names after branches that each may run: a name holds the pool if it does on any branch (a name one
    branch leaves unbound in ``env`` keeps its default: a pool name is a pool)."""
    out = dict(envs[0])
    for e in envs[1:]:
        for key in {k for k, _ in out.items() ^ e.items()}:  # only the names the branches disagree on
            a, b = out.get(key), e.get(key)
            if a or b:
                out[key] = a or b
            elif a is None or b is None:
                out.pop(key, None)
            else:
                out[key] = ""
    return out


class _PoolCasts:
    def __init__(self, tree, pool_names, get_index, emit):
        self.tree = tree
        self.names = set(pool_names)
        self.get_index = get_index  # the module's data flow, built only if a conversion needs judging
        self.emit = emit
        self.via = ()         # the calls that led into the helper being read (outermost first)
        self.subst = {}       # a helper's parameter -> (argument, calling def, its env) of the call followed
        self.followed = set()
        self.defs = None      # the module's functions by name (ModuleDefs), built when a pool is passed on
        self.cls_of = {}      # id(method def) -> its ClassDef

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

    # -- what a conversion converts to ------------------------------------------------------------------------
    def _resolve(self, expr, func):
        """(expr, the def whose data flow reads it, env): a helper's parameter stands for what the followed call
        passes for it."""
        if isinstance(expr, ast.Name) and expr.id in self.subst:
            return self.subst[expr.id]
        return expr, func, None

    def _kind(self, expr, func):
        expr, func, _ = self._resolve(expr, func)
        index = self.get_index()
        return index.classify(expr, index.funcs.get(id(func)) if func is not None else None)

    def target(self, method, args, keywords, func):
        """(description, target expr or None) of what a ``method(*args, **keywords)`` conversion converts its
        receiver to; None if it is no dtype conversion."""
        if method in _TO_DTYPE_METHODS and not args:
            return f"torch.{method}", None
        if method == "type_as" and args:
            return f"the dtype of {text(args[0])}", None
        if method == "type" and args:
            return text(args[0]), args[0]
        if method != "to":
            return None
        cands = [k.value for k in keywords if k.arg == "dtype"]
        if cands:
            return text(cands[0]), cands[0]
        for a in args[:2]:
            if isinstance(a, ast.Attribute) and (re.search(r"dtype|data_type", a.attr) or (
                    dotted(a.value) == "torch" and a.attr in _TORCH_FLOATS)):
                return text(a), a
            if isinstance(a, ast.Name) and (re.search(r"dtype|data_type", a.id) or a.id in ("q", "query")):
                return text(a), a
        for a in args[:2]:  # an alias whose name does not say so: `BF16`, `target`, `self.act`
            if isinstance(a, (ast.Name, ast.Attribute, ast.Call)) and not _NOT_A_DTYPE.search(
                    leaf(a) or "") and self._kind(a, func) is not None:
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

    def _from_pool(self, expr, src, env, func, depth=0) -> bool:
        """``expr`` is computed from the very pool being converted: ``pool.dtype``, a call that is given the pool
        (``_scoring_dtype(q, k_cache)``), or a local name assigned only such values."""
        expr, func, outer = self._resolve(expr, func) if depth == 0 else (expr, func, None)
        env = outer if outer is not None else env
        if isinstance(expr, ast.Attribute) and expr.attr == "dtype":
            return self.pool(expr.value, env) == src
        if isinstance(expr, ast.Call):
            return any(self.pool(a, env) == src or (isinstance(a, ast.Attribute) and self._from_pool(
                a, src, env, func, depth + 1)) for a in list(expr.args) + [k.value for k in expr.keywords])
        if isinstance(expr, ast.Name) and func is not None and depth < 2:
            info = self.get_index().funcs.get(id(func))
            vals = info.assigns.get(expr.id, []) if info is not None and expr.id not in info.params else []
            return bool(vals) and all(self._from_pool(v, src, env, func, depth + 1) for v in vals)
        return False

    def _own_dtype(self, method, args, keywords, src, env) -> bool:
        """The conversion's target is the dtype of the very pool it converts: ``.to(pool.dtype)``,
        ``.to(dtype=pool.dtype)``, ``.type(pool.dtype)``, ``.type_as(pool)``, through any name or view of it."""
        if method == "type_as":
            return bool(args) and self.pool(args[0], env) == src
        tgts = [k.value for k in keywords if k.arg == "dtype"] + list(args[:2])
        return any(isinstance(t, ast.Attribute) and t.attr == "dtype" and self.pool(t.value, env) == src
                   for t in tgts)

    # -- the walk ---------------------------------------------------------------------------------------------
    def _calls(self, node, env):
        """(call, env) for every call in ``node``; a comprehension's targets bound to what they iterate."""
        stack = [node]
        while stack:
            n = stack.pop()
            cls = n.__class__
            if cls in _LEAVES:
                continue  # nothing below a name or a constant but its context
            if cls is ast.Call:
                yield n, env
            elif cls in _COMPREHENSIONS:
                inner = dict(env)
                parts = [n.key, n.value] if isinstance(n, ast.DictComp) else [n.elt]
                for i, g in enumerate(n.generators):
                    if i == 0:
                        stack.append(g.iter)  # the first iterable is evaluated outside
                    else:
                        parts.append(g.iter)
                    self.bind_iter(g.target, g.iter, inner)
                    parts += g.ifs
                for p in parts:
                    yield from self._calls(p, inner)
                continue
            stack.extend(ast.iter_child_nodes(n))

    def check(self, node, env, func, guards):
        for n, e in self._calls(node, env):
            conv = _conversion(n)
            if conv is None:
                if len(self.via) < _FOLLOW_DEPTH and (n.args or n.keywords):
                    self._follow(n, e, func)
                continue
            recv, method, args, keywords = conv
            src = self.pool(recv, e)
            if not src:
                continue
            got = self.target(method, args, keywords, func)
            if not got:
                continue
            desc, tgt = got
            if self._own_dtype(method, args, keywords, src, e):
                continue  # `k.to(k.dtype)`: the pool's own dtype, a no-op by construction
            if tgt is not None:
                if self._from_pool(tgt, src, e, func):
                    continue  # a dtype computed from the pool itself: `k.to(pick(q, k))`
                kind = self._kind(tgt, func)
                if kind in (KV, MIXED):
                    continue  # converted to the KV cache's own dtype: no widening to the compute dtype
                if kind != COMPUTE and self._guarded(tgt, guards):
                    continue  # `if X != cache.dtype: cache = cache.to(X)` with X not a compute dtype
            how = ", passed in by " + ", then ".join(f"`{_short(c)}` (line {c.lineno})" for c in self.via) \
                if self.via else ""
            if isinstance(tgt, ast.Name) and tgt.id in self.subst:
                desc += f" (= `{_short(self.subst[tgt.id][0])}`)"
            self.emit(n, "KV001", f"`{text(n)}` converts a KV-pool read ({src}{how}) to {desc}: this copies "
                      "the whole pool on every call (every layer of every step)", FIX)

    def _follow(self, call, env, func):
        """A call that passes a pool to a function, method or lambda of this module: read its body with the
        parameter bound to the pool."""
        f = call.func
        if not (f.__class__ is ast.Name or (f.__class__ is ast.Attribute and f.value.__class__ is ast.Name
                                            and f.value.id == "self")):
            return  # only `helper(...)` and `self.method(...)` can reach a function of this module
        if not any(self.pool(a, env) for a in list(call.args) + [k.value for k in call.keywords]):
            return
        if self.defs is None:
            self.defs = ModuleDefs(self.tree)
        for target, bound, args in self._targets(call, func, env):
            pools = {p: self.pool(a, env) for p, a in args.items()}
            inner = {p: s for p, s in pools.items() if s}
            key = (id(target), id(call))  # each call once: another call may pass another dtype
            if not inner or key in self.followed:
                continue
            self.followed.add(key)
            saved = self.via, self.subst
            self.via = self.via + (call,)
            self.subst = {p: (a, func, env) for p, a in args.items() if not pools[p]}
            try:
                if isinstance(target, ast.Lambda):
                    self.check(target.body, inner, func, ())
                else:
                    self.run(target.body, inner, target, ())
            finally:
                self.via, self.subst = saved

    def _targets(self, call, func, env):
        """(def or lambda, bound method, {parameter: argument}) that ``call`` hands its arguments to; for
        ``map(f, pools)``, ``f`` is given one pool of the list."""
        f = call.func
        if isinstance(f, ast.Name) and f.id == "map" and len(call.args) == 2 and self.pool(call.args[1], env):
            fn = call.args[0]
            one = ast.Call(func=fn, args=[call.args[1]], keywords=[])  # each item of a list of pools is a pool
            found = [(fn, False)] if isinstance(fn, ast.Lambda) else self.defs.callees(one, func, self.cls_of.get(
                id(func))) if isinstance(fn, ast.Name) else []
            return [(t, b, bind_arguments(t, b, one)) for t, b in found]
        return [(t, b, bind_arguments(t, b, call)) for t, b in self.defs.callees(call, func, self.cls_of.get(id(func)))]

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

    def bind_iter(self, target, it, env):
        """Bind a loop or comprehension target to what iterating ``it`` yields: the pools of a list of per-layer
        pools (``kv_caches``), through ``enumerate``, ``zip``, ``reversed``, ``.values()`` and ``.items()``."""
        pairs = isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args:
            name = it.func.id
            if name == "enumerate" and pairs:
                self.bind(target.elts[0], None, env, pooled="")
                return self.bind_iter(target.elts[1], it.args[0], env)
            if name == "zip" and isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == len(it.args):
                for t, a in zip(target.elts, it.args):
                    self.bind_iter(t, a, env)
                return None
            if name in ("reversed", "list", "tuple", "iter") and len(it.args) == 1:
                return self.bind_iter(target, it.args[0], env)
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and not it.args:
            if it.func.attr == "values":
                return self.bind_iter(target, it.func.value, env)
            if it.func.attr == "items" and pairs:
                self.bind(target.elts[0], None, env, pooled="")
                return self.bind_iter(target.elts[1], it.func.value, env)
        return self.bind(target, None, env, pooled=self.pool(it, env) or "")

    def _branches(self, bodies, env, func, guards_each):
        """Run each body on its own copy of ``env``, then keep in ``env`` what any body that can fall through
        (or ``env`` itself, when ``bodies`` may all be skipped) leaves."""
        live = []
        for body, guards in zip(bodies, guards_each):
            e = dict(env)
            self.run(body, e, func, guards)
            if not _leaves(body):
                live.append(e)
        return live

    def run(self, body, env, func=None, guards=()):  # noqa: C901 - one case per statement kind
        for st in body:
            if isinstance(st, _DEFS):
                for d in st.decorator_list:
                    self.check(d, env, func, guards)
                # a closure sees the names bound so far
                self.run(st.body, dict(env), st, ())
            elif isinstance(st, ast.ClassDef):
                self.cls_of.update((id(d), st) for d in st.body if isinstance(d, _DEFS))
                self.run(st.body, {}, None, ())
            elif isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is not None:
                    self.check(st.value, env, func, guards)
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    self.bind(t, st.value, env)
            elif isinstance(st, (ast.For, ast.AsyncFor)):
                self.check(st.iter, env, func, guards)
                e = dict(env)
                self.bind_iter(st.target, st.iter, e)
                self.run(st.body, e, func, guards)
                _update(env, _join([env, e]))  # the body may run no time or many
                self.run(st.orelse, env, func, guards)
            elif isinstance(st, ast.If):
                self.check(st.test, env, func, guards)
                live = self._branches([st.body, st.orelse], env, func, [guards + (st.test,), guards])
                if live:  # a branch that always leaves (return/raise/...) keeps its bindings to itself
                    _update(env, _join(live))
            elif isinstance(st, ast.While):
                self.check(st.test, env, func, guards)
                live = self._branches([st.body], env, func, [guards + (st.test,)])
                _update(env, _join([env] + live))
                self.run(st.orelse, env, func, guards)
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


def _update(env, joined):
    env.clear()
    env.update(joined)


def _short(call) -> str:
    s = text(call)
    return s if len(s) <= 80 else s[:77] + "..."


def _leaves(body) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def check_casts(tree, get_index, pool_names, emit) -> None:
    """``get_index()`` returns the module's :class:`ModuleIndex` (built on first use)."""
    _PoolCasts(tree, pool_names, get_index, emit).run(tree.body, {})
