"""Intra-module data flow for ``fp8mla audit``: where a name or ``self.<attr>`` got its value, enough to tell a
*compute* dtype (the model's dtype, the query's) from a *KV-cache* dtype (``kv_cache_dtype``, the pool's
``dtype``/``store_dtype``), and which FlashInfer wrapper class a ``plan()`` receiver holds.

One :class:`ModuleIndex` per file, built in one walk of the tree. Everything is by name, inside one module:
``self.x = ...`` in any method of the class, local assignments and parameters (with annotations, defaults and,
for ``__init__``, the arguments of the module's own ``ClassName(...)`` calls), module-level assignments.
"""
from __future__ import annotations

import ast
import re

from .audit_reach import reaching
from .flashinfer_signatures import WRAPPER_CLASSES

__all__ = ["ModuleIndex", "KV", "COMPUTE", "MIXED", "dotted", "leaf", "text"]

KV, COMPUTE, MIXED = "kv", "compute", "mixed"

_TORCH_COMPUTE = {"bfloat16", "float16", "half", "float32", "float", "float64", "double"}
# names that say "the KV cache's dtype" / "a compute dtype"
KV_DTYPE_NAME = re.compile(
    r"(kv|cache|store|pool|ckv|kpe|latent|fp8|quant)\w*(dtype|data_type)|(dtype|data_type)\w*(kv|cache)", re.I)
COMPUTE_DTYPE_NAME = re.compile(
    r"^_?(q|query|model|compute|act|activation|attn|input|hidden|out|o|output|param|params|weight|torch|"
    r"logits|infer|inference|runtime)_?(dtype|data_type)$", re.I)
# receivers whose ``.dtype`` is the pool's / the compute dtype
_POOLISH = re.compile(r"cache|pool|buffer|buf$|^ckv|^kpe|^kv|latent", re.I)
_COMPUTEISH = re.compile(
    r"^(q|query|queries|qall|q_\w+|\w+_q|hidden_states?|x|inputs?|out|output|o|attn_output|model_runner|runner|"
    r"model_config|config|model|server_args|weight|params?|embed\w*|logits)$", re.I)


def text(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - unparse of odd nodes must not stop the audit
        return "<expr>"


def dotted(node) -> str | None:
    """``self.a.b`` -> "self.a.b"; None for anything that is not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def leaf(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return leaf(node.value)
    if isinstance(node, ast.Call):
        return leaf(node.func)
    return None


def cls_vals(func, expr) -> list:
    """The values assigned to ``self.<attr>`` inside the class (not by its constructor's callers)."""
    if func is None or func.cls is None or not isinstance(expr, ast.Attribute):
        return []
    return [v for v, _ in func.cls.attrs.get(expr.attr, [])]


def _combine(kinds) -> str | None:
    known = {k for k in kinds if k}
    if not known:
        return None
    if len(known) == 1:
        return known.pop()
    return MIXED


class _Func:
    __slots__ = ("node", "cls", "params", "assigns", "loops")

    def __init__(self, node, cls):
        self.node, self.cls = node, cls
        a = node.args
        args = a.posonlyargs + a.args
        defaults = [None] * (len(args) - len(a.defaults)) + list(a.defaults)
        self.params = {p.arg: (p.annotation, d) for p, d in zip(args, defaults)}
        self.params.update({p.arg: (p.annotation, d) for p, d in zip(a.kwonlyargs, a.kw_defaults)})
        self.assigns = {}   # local name -> [value]
        self.loops = {}     # loop target name -> [iterable]


class _Class:
    __slots__ = ("node", "name", "bases", "attrs", "fields", "init")

    def __init__(self, node):
        self.node, self.name = node, node.name
        self.bases = [leaf(b) for b in node.bases]
        self.attrs = {}     # attr -> [(value, _Func)]
        self.fields = {}    # class-body annotations: attr -> annotation
        self.init = None    # _Func of __init__


class ModuleIndex:
    """What one module assigns where, and the ``plan``/``begin_forward`` calls in it."""

    def __init__(self, tree):
        self.classes = {}        # name -> _Class
        self.funcs = {}          # id(def node) -> _Func
        self.module_assigns = {}
        self.attr_assigns = {}   # attr leaf -> [(value, _Func|None)] for any `<x>.attr = value`
        self.attr_fields = {}    # attr leaf -> [annotation] from class bodies (dataclass fields)
        self.appends = {}        # receiver leaf -> [value] for `<x>.append(value)`
        self.ctor_calls = {}     # class name -> [(call, _Func|None)]
        self.calls = {}          # other callee leaf name -> [(call, _Func|None)] (for forwarded dtypes)
        self.plan_calls = []     # (call, _Func|None)
        self.aliases = {}        # import alias -> imported name
        self.returns = {}        # function name -> [(_Func, returned expr or annotation)] (getters of wrappers)
        self.properties = set()  # names of @property / @cached_property methods
        self._memo = {}
        self._visit_body(tree.body, None, None)

    # -- the one walk -------------------------------------------------------------------------------------
    def _visit_body(self, body, cls, func):
        for st in body:
            self._visit(st, cls, func)

    def _visit(self, node, cls, func):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            f = _Func(node, cls)
            self.funcs[id(node)] = f
            if cls is not None and node.name == "__init__" and func is None:
                cls.init = f
            if node.returns is not None:
                self.returns.setdefault(node.name, []).append((f, node.returns))
            for n in ast.walk(node):
                if isinstance(n, ast.Return) and n.value is not None:
                    self.returns.setdefault(node.name, []).append((f, n.value))
            if any(leaf(d) in ("property", "cached_property") for d in node.decorator_list):
                self.properties.add(node.name)
            for d in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d]:
                self._exprs(d, cls, func)
            self._visit_body(node.body, cls if func is None else None, f)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:  # `from flashinfer import BatchMLAPagedAttentionWrapper as MLAWrapper`
                if a.asname:
                    self.aliases[a.asname] = a.name.split(".")[-1]
            return
        if isinstance(node, ast.ClassDef):
            c = _Class(node)
            self.classes.setdefault(node.name, c)
            for d in node.decorator_list + node.bases:
                self._exprs(d, cls, func)
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    c.fields[st.target.id] = st.annotation
                    self.attr_fields.setdefault(st.target.id, []).append(st.annotation)
            self._visit_body(node.body, c, None)
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if value is not None and not isinstance(node, ast.AugAssign):
                for t in targets:
                    self._bind(t, value, cls, func)
            if isinstance(node, ast.AnnAssign) and value is None and func is not None and isinstance(
                    node.target, ast.Name):  # `w: BatchMLAPagedAttentionWrapper` declared, assigned later
                func.params.setdefault(node.target.id, (node.annotation, None))
            if value is not None:
                self._exprs(value, cls, func)
            for t in targets:
                if not isinstance(t, (ast.Name,)):
                    self._exprs(t, cls, func)
            return
        if isinstance(node, (ast.For, ast.AsyncFor)):
            if func is not None:
                for n in ast.walk(node.target):
                    if isinstance(n, ast.Name):
                        func.loops.setdefault(n.id, []).append(node.iter)
            self._exprs(node.iter, cls, func)
            self._visit_body(node.body, cls, func)
            self._visit_body(node.orelse, cls, func)
            return
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                for v in value:
                    if isinstance(v, ast.stmt):
                        self._visit(v, cls, func)
                    elif isinstance(v, ast.AST):
                        self._visit(v, cls, func) if hasattr(v, "body") and not isinstance(v, ast.expr) \
                            else self._exprs(v, cls, func)
            elif isinstance(value, ast.AST):
                self._exprs(value, cls, func) if isinstance(value, ast.expr) else self._visit(value, cls, func)

    def _bind(self, target, value, cls, func):
        if isinstance(target, (ast.Tuple, ast.List)):
            vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(
                target.elts) else [None] * len(target.elts)
            for t, v in zip(target.elts, vals):
                if v is not None:
                    self._bind(t, v, cls, func)
            return
        if isinstance(target, ast.Name):
            if func is not None:
                func.assigns.setdefault(target.id, []).append(value)
            elif cls is not None:  # a class-body attribute, read as self.<name>
                cls.attrs.setdefault(target.id, []).append((value, None))
            else:
                self.module_assigns.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Attribute):
            self.attr_assigns.setdefault(target.attr, []).append((value, func))
            owner = func.cls if func is not None else None
            if owner is not None and isinstance(target.value, ast.Name) and target.value.id == "self":
                owner.attrs.setdefault(target.attr, []).append((value, func))

    def _exprs(self, node, cls, func):
        """Record the calls inside an expression (constructor calls, ``.append``, ``plan``)."""
        for n in ast.walk(node):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = leaf(f)
            if isinstance(f, ast.Attribute) and f.attr in ("plan", "begin_forward"):
                self.plan_calls.append((n, func))
            elif isinstance(f, ast.Attribute) and f.attr == "append" and n.args:
                r = leaf(f.value)
                if r:
                    self.appends.setdefault(r, []).append(n.args[0])
            if name and name[:1].isupper():
                self.ctor_calls.setdefault(name, []).append((n, func))
            elif name:
                self.calls.setdefault(name, []).append((n, func))

    # -- dtype classification -----------------------------------------------------------------------------
    def classify(self, expr, func, depth=0) -> str | None:
        """``KV`` (a KV-cache dtype), ``COMPUTE`` (model/query dtype), ``MIXED`` (either, by branch) or None."""
        if expr is None or depth > 8:
            return None
        key = (id(expr), id(func))
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = None  # cycles read as unknown
        out = self._classify(expr, func, depth)
        self._memo[key] = out
        return out

    def _classify(self, e, func, depth):
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            v = e.value.lower()
            return KV if ("float8" in v or "fp8" in v) else COMPUTE if v in _TORCH_COMPUTE else None
        if isinstance(e, ast.IfExp):
            return _combine([self.classify(e.body, func, depth + 1), self.classify(e.orelse, func, depth + 1)])
        if isinstance(e, ast.BoolOp):
            return _combine([self.classify(v, func, depth + 1) for v in e.values])
        if isinstance(e, ast.Call):
            name = leaf(e.func) or ""
            if KV_DTYPE_NAME.search(name):
                return KV
            if name in ("getattr",) and len(e.args) >= 2:  # getattr(torch, kv_cache_dtype)
                return self.classify(e.args[1], func, depth + 1)
            if name == "get_default_dtype" and not e.args:  # torch.get_default_dtype(): the model's
                return COMPUTE
            return None
        d = dotted(e)
        if d is None:
            return None
        parts = d.split(".")
        last = parts[-1]
        if parts[0] == "torch" and len(parts) == 2:
            return KV if last.startswith("float8") else COMPUTE if last in _TORCH_COMPUTE else None
        by_name = KV if KV_DTYPE_NAME.search(last) else COMPUTE if COMPUTE_DTYPE_NAME.search(last) else None
        if len(parts) >= 2 and parts[0] != "self" and re.search(r"dtype|data_type", last) and _POOLISH.search(
                parts[-2]):
            return KV  # a dtype of the cache's own object: cache_config.torch_dtype, k_cache.dtype
        if by_name and not (isinstance(e, ast.Name) or (len(parts) == 2 and parts[0] == "self")):
            return by_name  # another object's attribute (model_runner.kv_cache_dtype): its name is all we have
        if last == "dtype" and len(parts) >= 2:
            base = parts[-2]
            if _POOLISH.search(base):
                return KV
            if _COMPUTEISH.search(base) and not (len(parts) == 2 and parts[0] == "self"):
                return COMPUTE
        # a local name or self.<attr>: where its value came from wins over what it is called (a `data_type`
        # assigned the KV-cache dtype is the KV dtype; a `kv_dtype` assigned the model dtype is not)
        if isinstance(e, ast.Name):
            return self._name_flow(e.id, func, depth, use=e) or by_name
        if parts[0] == "self" and len(parts) == 2 and func is not None and func.cls is not None:
            got = self._attr_flow(func.cls, last, depth)
            if got or by_name:
                return got or by_name
        # another object's attribute: what this module assigns to `<anything>.<last>`
        return _combine([self.classify(v, f, depth + 1) for v, f in self.attr_assigns.get(last, [])][:8])

    def reach(self, func, name, use):
        """The bindings of local ``name`` that reach ``use`` in ``func`` (:func:`audit_reach.reaching`)."""
        key = ("reach", id(func), name, id(use))
        if key not in self._memo:
            self._memo[key] = reaching(func.node, name, use, name in func.params)
        return self._memo[key]

    def _name_flow(self, name, func, depth, use=None):
        r = self.reach(func, name, use) if func is not None and use is not None and (
            name in func.assigns or name in func.params) else None
        if r is not None:
            # only the assignments that reach this use, the parameter's value if it may arrive unchanged, and
            # the module's if the name may be unbound here (a global)
            kinds = [self.classify(v, func, depth + 1) for v in func.assigns.get(name, []) if id(v) in r.values]
            if r.param:
                kinds += self._param_kinds(name, func, depth)
            if r.outer:
                kinds += [self.classify(v, None, depth + 1) for v in self.module_assigns.get(name, [])]
            return _combine(kinds)
        if func is not None and r is None:
            if name in func.assigns:
                return _combine([self.classify(v, func, depth + 1) for v in func.assigns[name]])
            if name in func.params:
                return _combine(self._param_kinds(name, func, depth))
        if name in self.module_assigns:
            return _combine([self.classify(v, None, depth + 1) for v in self.module_assigns[name]])
        return None

    def _param_kinds(self, name, func, depth):
        """What a parameter may hold: its default, and for ``__init__`` what the module's constructor calls pass."""
        ann, default = func.params[name]
        kinds = [self.classify(default, func, depth + 1)] if default is not None else []
        if func.cls is not None and func.cls.init is func:
            kinds += self._ctor_args(func, name, depth)
        return kinds

    def _attr_flow(self, cls, attr, depth):
        kinds = [self.classify(v, f, depth + 1) for v, f in cls.attrs.get(attr, [])]
        if cls.init is None and attr in cls.fields:  # a dataclass field: what the constructor calls pass
            kinds += self._field_args(cls, attr, depth)
        for b in cls.bases:  # a base class defined in this module
            if b in self.classes and self.classes[b] is not cls:
                kinds.append(self._attr_flow(self.classes[b], attr, depth + 1))
        return _combine(kinds)

    def _ctor_args(self, init, param, depth):
        """What the module's own ``ClassName(...)`` calls pass for ``__init__``'s ``param``."""
        names = [a.arg for a in init.node.args.posonlyargs + init.node.args.args][1:]
        kinds = []
        for call, f in self.ctor_calls.get(init.cls.name, [])[:16]:
            for k in call.keywords:
                if k.arg == param:
                    kinds.append(self.classify(k.value, f, depth + 1))
            if param in names and names.index(param) < len(call.args):
                a = call.args[names.index(param)]
                if not isinstance(a, ast.Starred):
                    kinds.append(self.classify(a, f, depth + 1))
        return kinds

    def _field_args(self, cls, field, depth):
        order = list(cls.fields)
        kinds = []
        for call, f in self.ctor_calls.get(cls.name, [])[:16]:
            for k in call.keywords:
                if k.arg == field:
                    kinds.append(self.classify(k.value, f, depth + 1))
            i = order.index(field)
            if i < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:i + 1]):
                kinds.append(self.classify(call.args[i], f, depth + 1))
        return kinds

    def origin(self, expr, func) -> str:
        """" (= `model_runner.dtype`, line 19)" for a local name or ``self.<attr>`` assigned in this module."""
        vals, where = [], ""
        if isinstance(expr, ast.Name) and func is not None:
            vals = func.assigns.get(expr.id, [])
        elif isinstance(expr, ast.Attribute) and dotted(expr) == f"self.{expr.attr}" and func is not None \
                and func.cls is not None:
            cls = func.cls
            vals = [v for v, _ in cls.attrs.get(expr.attr, [])]
            if cls.init is None and expr.attr in cls.fields:  # a dataclass field: the constructor's keyword
                vals += [k.value for c, _ in self.ctor_calls.get(cls.name, []) for k in c.keywords
                         if k.arg == expr.attr]
                where = " at the constructor call"
        vals = [v for v in vals if not (isinstance(v, ast.Constant) and v.value is None)]
        if not vals:
            return ""
        v = vals[0]
        return f" (= `{text(v)}`{where if v not in cls_vals(func, expr) else ''}, line {v.lineno})"

    def kv_attrs(self, cls) -> list:
        """``self.<attr>`` of ``cls`` whose value is a KV-cache dtype."""
        if cls is None:
            return []
        return sorted(f"self.{a}" for a in cls.attrs if self._attr_flow(cls, a, 0) == KV and (
            re.search(r"dtype|data_type", a, re.I)))

    # -- which wrapper a receiver holds ---------------------------------------------------------------------
    def wrapper_types(self, expr, func, depth=0) -> set:
        """Class names (FlashInfer wrappers or classes of this module) ``expr`` may hold; empty if unknown."""
        if expr is None or depth > 6:
            return set()
        if isinstance(expr, ast.Call):
            name = leaf(expr.func)
            name = self.aliases.get(name, name)
            if name in WRAPPER_CLASSES or name in self.classes:
                return {name}
            return self._returned(name, depth)  # `self._get_decode_wrapper()`
        if isinstance(expr, ast.Subscript):
            return self.wrapper_types(expr.value, func, depth + 1)
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return set().union(*[self.wrapper_types(e, func, depth + 1) for e in expr.elts]) if expr.elts else set()
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return self.wrapper_types(expr.elt, func, depth + 1)
        if isinstance(expr, ast.DictComp):
            return self.wrapper_types(expr.value, func, depth + 1)
        if isinstance(expr, ast.Dict):
            return set().union(*[self.wrapper_types(v, func, depth + 1) for v in expr.values]) if expr.values \
                else set()
        if isinstance(expr, (ast.BoolOp,)):
            return set().union(*[self.wrapper_types(v, func, depth + 1) for v in expr.values])
        if isinstance(expr, ast.IfExp):
            return self.wrapper_types(expr.body, func, depth + 1) | self.wrapper_types(expr.orelse, func, depth + 1)
        if isinstance(expr, ast.Name):
            out = set()
            if func is not None:
                if expr.id in func.params:
                    out |= self._ann_types(func.params[expr.id][0])
                for v in func.assigns.get(expr.id, []):
                    out |= self.wrapper_types(v, func, depth + 1)
                for it in func.loops.get(expr.id, []):
                    out |= self.wrapper_types(it, func, depth + 1)
            if not out:
                for v in self.module_assigns.get(expr.id, []):
                    out |= self.wrapper_types(v, None, depth + 1)
            return out or self._leaf_types(expr.id, depth)
        if isinstance(expr, ast.Attribute):
            out = self._leaf_types(expr.attr, depth)
            return out or (self._returned(expr.attr, depth) if expr.attr in self.properties else set())
        return set()

    def _returned(self, name, depth) -> set:
        """Wrapper classes a module function/method ``name`` returns (its annotation or return values)."""
        out = set()
        for f, r in self.returns.get(name, [])[:8]:
            out |= self._ann_types(r) if r is f.node.returns else self.wrapper_types(r, f, depth + 1)
        return out

    def _leaf_types(self, name, depth):
        out = set()
        for v, f in self.attr_assigns.get(name, [])[:16]:
            out |= self.wrapper_types(v, f, depth + 1)
        for ann in self.attr_fields.get(name, []):
            out |= self._ann_types(ann)
        for v in self.appends.get(name, [])[:16]:
            out |= self.wrapper_types(v, None, depth + 1)
        return out

    def _ann_types(self, ann) -> set:
        if ann is None:
            return set()
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return set()
        names = (leaf(x) for x in ast.walk(ann) if isinstance(x, (ast.Name, ast.Attribute)))
        return {n for n in (self.aliases.get(m, m) for m in names) if n in WRAPPER_CLASSES or n in self.classes}

    def flashinfer_class(self, name) -> str | None:
        """The FlashInfer wrapper ``name`` is or derives from (within this module); None for other classes."""
        name = self.aliases.get(name, name)
        seen = set()
        while name not in WRAPPER_CLASSES:
            c = self.classes.get(name)
            if c is None or name in seen:
                return None
            seen.add(name)
            bases = [self.aliases.get(b, b) for b in c.bases]
            bases = [b for b in bases if b in WRAPPER_CLASSES or b in self.classes]
            if not bases:
                return None
            name = bases[0]
        return name
