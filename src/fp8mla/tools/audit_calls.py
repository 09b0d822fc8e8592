"""Which function of the same module a call reaches, and what it passes for each parameter, for ``fp8mla
audit``'s KV001 rule: a pool handed to a helper (``_widen(k_buffer, q.dtype)``), a method (``self._upcast(k)``)
or a lambda (``up = lambda t: t.float(); up(kv_cache)``) is followed into its body.

Resolved by name inside one module, from the syntax tree alone (the module's data flow is not built for it): a
nested ``def`` or a lambda bound to a local name of the calling function, else a module-level function or
lambda; for ``self.name(...)``, a method of the calling method's class or of a base class defined in the module,
or a lambda kept in ``self.name``. A call that could reach more than one definition reaches each.
"""
from __future__ import annotations

import ast

__all__ = ["ModuleDefs", "bind_arguments"]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _lambda_targets(st):
    """Names a ``name = lambda ...`` / ``self.name = lambda ...`` statement binds to its lambda."""
    if isinstance(st, ast.Assign) and isinstance(st.value, ast.Lambda):
        for t in st.targets:
            if isinstance(t, ast.Name):
                yield t.id, st.value
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                yield "self." + t.attr, st.value


def _own_statements(func_node):
    """The statements of a function's own scope (nested defs and classes are not entered)."""
    stack = list(func_node.body)
    while stack:
        st = stack.pop()
        yield st
        if isinstance(st, (*_DEFS, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(st, field, None) or [])
        stack.extend(x for case in getattr(st, "cases", None) or [] for x in case.body)  # match statements


class ModuleDefs:
    """The functions, lambdas and classes of one module by name, built on first use."""

    def __init__(self, tree):
        self.functions = {}  # name -> [def or lambda] bound at module level
        self.classes = {}    # name -> ClassDef (module level)
        for st in tree.body:
            if isinstance(st, _DEFS):
                self.functions.setdefault(st.name, []).append(st)
            elif isinstance(st, ast.ClassDef):
                self.classes.setdefault(st.name, st)
            for name, lam in _lambda_targets(st):
                self.functions.setdefault(name, []).append(lam)
        self._local = {}

    def _locals(self, func_node) -> dict:
        got = self._local.get(id(func_node))
        if got is None:
            got = {}
            for st in _own_statements(func_node):
                if isinstance(st, _DEFS):
                    got.setdefault(st.name, []).append(st)
                for name, lam in _lambda_targets(st):
                    got.setdefault(name, []).append(lam)
            self._local[id(func_node)] = got
        return got

    def _methods(self, cls, name, seen) -> list:
        if cls is None or cls.name in seen:
            return []
        seen.add(cls.name)
        out = [st for st in cls.body if isinstance(st, _DEFS) and st.name == name]
        if not out:  # a lambda kept in the attribute by some method
            out = [lam for st in cls.body if isinstance(st, _DEFS) for s in _own_statements(st)
                   for n, lam in _lambda_targets(s) if n == "self." + name]
        if not out:
            for b in cls.bases:
                if isinstance(b, ast.Name):
                    out += self._methods(self.classes.get(b.id), name, seen)
        return out

    def callees(self, call, func, cls) -> list:
        """[(def or lambda, is_bound_method)] that ``call``, made inside def ``func`` (None: at module level)
        of class ``cls`` (a ClassDef, or None), reaches."""
        f = call.func
        if isinstance(f, ast.Name):
            local = self._locals(func).get(f.id, []) if func is not None else []
            return [(d, False) for d in (local or self.functions.get(f.id, []))]
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            return [(d, isinstance(d, _DEFS)) for d in self._methods(cls, f.attr, set())]
        return []


def bind_arguments(target, bound_method: bool, call) -> dict:
    """{parameter name: argument expression} of ``call`` to ``target`` (positional up to the first ``*args``,
    keywords by name; ``self`` is the receiver of a bound method)."""
    a = target.args
    params = [p.arg for p in a.posonlyargs + a.args]
    if bound_method:
        params = params[1:]
    out = {}
    for p, arg in zip(params, call.args):
        if isinstance(arg, ast.Starred):
            break
        out[p] = arg
    names = set(params) | {p.arg for p in a.kwonlyargs}
    for k in call.keywords:
        if k.arg in names:
            out[k.arg] = k.value
    return out
