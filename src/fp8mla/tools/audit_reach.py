"""Which bindings of a local name can reach one use of it, for ``fp8mla audit``'s data flow.

A classic reaching-definitions pass over one function's statements, for one name and one use: ``if``/``else``
branches join, loops run to a fixed point (a binding late in a loop body reaches an earlier use on the next
pass), a branch that returns or raises reaches nothing after it, ``try`` handlers see what the ``try`` body
may have bound. Only what it needs: an assignment after the use on another branch must not decide what a
forwarded parameter is (``if fast: plan(kv_data_type=kv_data_type) else: kv_data_type = ...``).
"""
from __future__ import annotations

import ast

__all__ = ["Reach", "reaching"]

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
PARAM, OUTER = "param", "outer"  # the incoming parameter value; a name not bound in the function (global)


class Reach:
    """``values``: ids of the assigned value expressions that may reach the use (as ``_Func.assigns`` holds
    them); ``param``: the parameter's incoming value may; ``outer``: the name may be unbound here (a global);
    ``opaque``: a binding whose value is not recorded (a ``for`` target, ``with ... as``, ``a, b = f()``) may."""

    __slots__ = ("values", "param", "outer", "opaque")

    def __init__(self, defs):
        self.values = {d for d in defs if isinstance(d, int)}
        self.param = PARAM in defs
        self.outer = OUTER in defs
        self.opaque = any(isinstance(d, tuple) for d in defs)


def _bound_values(target, value, name, st) -> list | None:
    """The defs a binding of ``target = value`` makes for ``name``: the id of the value expression the module
    index records for it, an opaque marker when it records none, or None when ``name`` is not bound."""
    if isinstance(target, ast.Name):
        if target.id != name:
            return None
        return [id(value)] if value is not None else [("opaque", id(st))]
    if isinstance(target, (ast.Tuple, ast.List)):
        vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(
            target.elts) else [None] * len(target.elts)
        for t, v in zip(target.elts, vals):
            got = _bound_values(t.value if isinstance(t, ast.Starred) else t, v, name, st)
            if got is not None:
                return got
        return None
    if isinstance(target, ast.Starred):
        return _bound_values(target.value, None, name, st)
    return None


def _walk_scope(node):
    """Nodes of ``node`` that belong to its own scope (nested functions, classes and lambdas left out)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(c for c in ast.iter_child_nodes(n) if not isinstance(c, _SCOPES))


def _binds(st, name):
    """The defs ``st`` itself makes for ``name`` (not counting statements nested in its body), or None."""
    if isinstance(st, ast.Assign):
        for t in st.targets:
            got = _bound_values(t, st.value, name, st)
            if got is not None:
                return got
    elif isinstance(st, ast.AnnAssign) and st.value is not None:
        return _bound_values(st.target, st.value, name, st)
    elif isinstance(st, ast.AugAssign):
        if isinstance(st.target, ast.Name) and st.target.id == name:
            return [("opaque", id(st))]
    elif isinstance(st, (ast.Import, ast.ImportFrom)):
        if any((a.asname or a.name.split(".")[0]) == name for a in st.names):
            return [("opaque", id(st))]
    elif isinstance(st, _SCOPES[:3]):
        if st.name == name:
            return [("opaque", id(st))]
    elif isinstance(st, ast.Delete):
        if any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
            return []
    return None


class _Run:
    def __init__(self, func_node, name, use):
        self.name, self.use = name, use
        self.path = set()  # ids of the nodes from the function down to the use
        self._find(func_node)
        self.seen = set()  # defs that reach the use
        self.loops = []    # per enclosing loop: [break states, continue states]
        self.tries = []    # per enclosing try: every def made inside its body

    def _find(self, root):
        parents = {}
        for n in ast.walk(root):
            for c in ast.iter_child_nodes(n):
                parents[id(c)] = n
        n = self.use
        while n is not None and n is not root:
            self.path.add(id(n))
            n = parents.get(id(n))
        self.found = n is root

    def _here(self, node, state):
        if id(node) in self.path:
            self.seen |= state

    def _expr_binds(self, nodes, state):
        """Walrus targets in expressions evaluated by a statement."""
        for e in nodes:
            if e is None:
                continue
            for n in _walk_scope(e):
                if isinstance(n, ast.NamedExpr) and n.target.id == self.name:
                    state = frozenset({id(n.value)})
        return state

    def _def(self, state, defs):
        """The state after a binding: its defs replace ``state``'s (and are seen by enclosing handlers)."""
        for t in self.tries:
            t.update(defs)
        return frozenset(defs)

    def body(self, stmts, state):
        for st in stmts:
            if state is None:
                return None  # unreachable: nothing after a return reaches anything
            state = self.stmt(st, state)
        return state

    def stmt(self, st, state):  # noqa: C901 - one case per statement kind
        name = self.name
        if isinstance(st, ast.If):
            self._here(st.test, state)
            state = self._expr_binds([st.test], state)
            return _join(self.body(st.body, state), self.body(st.orelse, state))
        if isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
            loop_for = not isinstance(st, ast.While)
            if loop_for:  # the iterable is evaluated once, before the first pass
                self._here(st.iter, state)
                state = self._expr_binds([st.iter], state)
            binds = _bound_values(st.target, None, name, st) if loop_for else None
            back, breaks = frozenset(), set()
            for _ in range(8):  # defs only grow: a fixed point within a few passes
                top = state | back
                if not loop_for:  # the test runs before every pass
                    self._here(st.test, top)
                entry = self._def(top, binds) if binds is not None else top
                self.loops.append([set(), set()])
                out = self.body(st.body, entry)
                brk, cont = self.loops.pop()
                breaks |= brk
                new = back | (out or frozenset()) | frozenset(cont)
                if new == back:
                    break
                back = new
            done = self.body(st.orelse, state | back)
            return _join(done, frozenset(breaks) if breaks else None)
        if isinstance(st, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            inside = set(state)
            self.tries.append(inside)
            out = self.body(st.body, state)
            self.tries.pop()
            if self.tries:
                self.tries[-1].update(inside)
            caught = frozenset(inside | set(state))
            outs = [self.body(st.orelse, out) if out is not None else None]
            for h in st.handlers:
                hs = caught
                if h.name == name:
                    hs = self._def(hs, [("opaque", id(h))])
                outs.append(self.body(h.body, hs))
            joined = _join(*outs)
            if st.finalbody:
                fin = self.body(st.finalbody, joined if joined is not None else caught)
                return fin if joined is not None else None
            return joined
        if isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                self._here(item.context_expr, state)
                state = self._expr_binds([item.context_expr], state)
                if item.optional_vars is not None and _bound_values(item.optional_vars, None, name, st) is not None:
                    state = self._def(state, [("opaque", id(st))])
            return self.body(st.body, state)
        if type(st).__name__ == "Match":
            self._here(st.subject, state)
            outs = [state]  # no case matched
            for case in st.cases:
                cs = state
                if any(isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name == name for n in ast.walk(case.pattern)):
                    cs = self._def(cs, [("opaque", id(case))])
                outs.append(self.body(case.body, cs))
            return _join(*outs)
        # a simple statement (or a nested def/class, which only binds its own name)
        if not isinstance(st, _SCOPES):
            self._here(st, state)
            state = self._expr_binds([st], state)
        if isinstance(st, (ast.Return, ast.Raise)):
            return None
        if isinstance(st, (ast.Break, ast.Continue)):
            if self.loops:
                self.loops[-1][0 if isinstance(st, ast.Break) else 1].update(state)
            return None
        defs = _binds(st, name)
        return self._def(state, defs) if defs is not None else state


def _join(*states):
    live = [s for s in states if s is not None]
    if not live:
        return None
    out = frozenset()
    for s in live:
        out |= s
    return out


def reaching(func_node, name: str, use, is_param: bool) -> Reach | None:
    """The bindings of ``name`` that may reach ``use`` (a node inside ``func_node``'s body); None when ``use``
    is not in the body (a default value, a decorator: evaluated outside the function)."""
    run = _Run(func_node, name, use)
    if not run.found or not any(id(st) in run.path for st in func_node.body):
        return None
    run.body(func_node.body, frozenset({PARAM if is_param else OUTER}))
    return Reach(run.seen)
