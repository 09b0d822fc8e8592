"""``fp8mla audit``: a static check of attention-backend sources for the KV-pool cast bug class.

It reads Python with :mod:`ast` (nothing is imported or run) and reports, with file:line, the reason and the fix:

- ``KV001`` a KV-pool read (``get_key_buffer(...)``, ``kv_cache``, ``k_buffer``, ... — configurable), or a view of
  one (subscripts by layer or slices, ``view``/``reshape``/``flatten``/...), converted to another dtype:
  ``.to(q.dtype)``, ``.to(torch.bfloat16)``, ``.to(dtype=...)``, ``.float()``, ``.half()``, ``.bfloat16()``,
  ``.type_as(q)``, ``.type(torch.float16)``; directly or through variables. Gathering first
  (``pool[kv_indices]``, ``index_select``) ends the pool: casting what a gather returns is the fix, not the bug.
- ``KV002`` a ``plan(...)``/``begin_forward(...)`` call that passes the same compute dtype as the query data type
  and the KV data type (by keyword, or positionally in FlashInfer's MLA order where they are arguments 11 and 12)
  while a KV-cache dtype is available in the class or module: the kernel is then planned for a BF16 pool and the
  FP8 pool has to be converted before every call.
- ``KV003`` a class that holds a KV-dtype attribute (``self.kv_data_type = ...``, or any attribute assigned from
  a ``kv_cache_dtype``-like value) but has a paged ``plan``/``begin_forward`` call that does not use it (the call
  site that was missed). Ragged-prefill calls (receiver named ``*ragged*``, or no page/index arguments) take
  fresh BF16 K/V and correctly pass only a query dtype; they are not flagged.

Heuristic by nature: names are matched, not types. A finding is a line to read, not a proof.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import asdict, dataclass

__all__ = ["Finding", "AuditError", "DEFAULT_POOL_NAMES", "audit_source", "audit_file", "audit_paths",
           "format_findings", "findings_json"]

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
_KV_DTYPE = re.compile(r"(kv|cache).*(dtype|data_type)|(dtype|data_type).*(kv|cache)", re.I)
_Q_DTYPE = re.compile(r"^(q|query|model|compute|act|activation|torch)?_?(dtype|data_type)$|^q_", re.I)
_PAGED_HINT = re.compile(r"indices|page|block_table|kv_len|slot", re.I)
_GATHER_INDEX = re.compile(r"layer", re.I)  # a subscript by these names selects a layer: still the pool
_PLAN_CALLS = {"plan", "begin_forward"}

_FIX1 = ("read the pool in its own dtype: plan attention with kv_data_type=<the pool's dtype> and pass the pool "
         "unconverted (fp8mla.MLAPagedAttention takes BF16 queries over an FP8 pool); or gather the active tokens "
         "first and cast only those: pool[kv_indices].to(q.dtype)")


class AuditError(Exception):
    """A path could not be audited (missing, unreadable, not Python)."""


@dataclass
class Finding:
    path: str
    line: int
    col: int
    rule: str      # KV001, KV002, KV003
    message: str
    fix: str
    code: str      # the source line

    def __str__(self):
        return f"{self.path}:{self.line}:{self.col + 1}: {self.rule} {self.message}"


def _text(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - unparse of odd nodes must not stop the audit
        return "<expr>"


def _dotted(node) -> str | None:
    """``self.a.b`` -> "self.a.b"; None for anything that is not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _leaf(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mentions(node, regex) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and regex.search(_leaf(n) or "") for n in ast.walk(node))


# -- rule 1: pool reads converted to another dtype ------------------------------------------------------------
class _PoolCasts:
    def __init__(self, pool_names, emit):
        self.names = set(pool_names)
        self.emit = emit

    def pool(self, node, env: dict):
        """A description of the pool ``node`` reads (or is a view of), else None."""
        # env maps a name to the pool it holds, or to "" once it was rebound to something else
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id] or None
            return node.id if node.id in self.names else None
        if isinstance(node, ast.Attribute):
            d = _dotted(node)
            if d and d in env:
                return env[d] or None
            return _text(node) if node.attr in self.names else None
        if isinstance(node, ast.Call):
            f = node.func
            if _leaf(f) in self.names and not (isinstance(f, ast.Attribute) and f.attr in _VIEWS):
                return _text(node)
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
            if isinstance(i, (ast.Name, ast.Attribute)) and _GATHER_INDEX.search(_dotted(i) or ""):
                continue
            return False
        return True

    @staticmethod
    def target_dtype(call: ast.Call) -> str | None:
        """What ``call`` converts its receiver to, when it is a dtype conversion; else None."""
        f = call.func
        if not isinstance(f, ast.Attribute):
            return None
        if f.attr in _TO_DTYPE_METHODS and not call.args:
            return f"torch.{f.attr}"
        if f.attr == "type_as" and call.args:
            return f"the dtype of {_text(call.args[0])}"
        if f.attr == "type" and call.args:
            return _text(call.args[0])
        if f.attr != "to":
            return None
        cands = [k.value for k in call.keywords if k.arg == "dtype"]
        if cands:
            return None if _mentions(cands[0], _KV_DTYPE) else _text(cands[0])
        for a in call.args[:2]:
            if _mentions(a, _KV_DTYPE):
                return None  # .to(kv_cache_dtype): the pool's own dtype, no conversion
            if isinstance(a, ast.Attribute) and (re.search(r"dtype|data_type", a.attr) or (
                    _dotted(a.value) == "torch" and a.attr in _TORCH_FLOATS)):
                return _text(a)
            if isinstance(a, ast.Name) and (re.search(r"dtype|data_type", a.id) or a.id in ("q", "query")):
                return _text(a)
        return None

    def check(self, node, env):
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                target = self.target_dtype(n)
                src = target and self.pool(n.func.value, env)
                if src:
                    self.emit(n, "KV001", f"`{_text(n)}` converts a KV-pool read ({src}) to {target}: this copies "
                              "the whole pool on every call (every layer of every step)", _FIX1)

    def bind(self, target, value, env, pooled=None):
        """Track names that hold the pool (or a view of it) after ``target = value``."""
        src = pooled if pooled is not None else (self.pool(value, env) if value is not None else None)
        if isinstance(target, (ast.Tuple, ast.List)):
            vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            for t, v in zip(target.elts, vals):
                self.bind(t, v, env, pooled=src if v is None else None)
            return
        key = target.id if isinstance(target, ast.Name) else _dotted(target)
        if key is None:
            return
        env[key] = src or ""

    def run(self, body, env):
        for st in body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in st.decorator_list:
                    self.check(d, env)
                self.run(st.body, dict(env))  # a closure sees the names bound so far
            elif isinstance(st, ast.ClassDef):
                self.run(st.body, {})
            elif isinstance(st, (ast.Assign, ast.AnnAssign)):
                if st.value is not None:
                    self.check(st.value, env)
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                    self.bind(t, st.value, env)
            elif isinstance(st, (ast.For, ast.AsyncFor)):
                self.check(st.iter, env)
                # iterating a list of per-layer pools (kv_caches) yields pools
                self.bind(st.target, None, env, pooled=self.pool(st.iter, env) or "")
                self.run(st.body, env)
                self.run(st.orelse, env)
            elif isinstance(st, (ast.If, ast.While)):
                self.check(st.test, env)
                self.run(st.body, env)
                self.run(st.orelse, env)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                for item in st.items:
                    self.check(item.context_expr, env)
                self.run(st.body, env)
            elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
                self.run(st.body, env)
                for h in st.handlers:
                    self.run(h.body, env)
                self.run(st.orelse, env)
                self.run(st.finalbody, env)
            elif type(st).__name__ == "Match":
                self.check(st.subject, env)
                for case in st.cases:
                    self.run(case.body, env)
            else:
                self.check(st, env)


# -- rules 2 and 3: plan() calls and the KV dtype -------------------------------------------------------------
def _plan_dtypes(call: ast.Call):
    """(q expr, kv expr) passed to a plan()/begin_forward() call; positional in FlashInfer's MLA order."""
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    q = kw.get("q_data_type")
    kv = kw.get("kv_data_type", kw.get("data_type", kw.get("kv_dtype")))
    if q is None and len(call.args) >= 11:
        q = call.args[10]
    if kv is None and len(call.args) >= 12:
        kv = call.args[11]
    return q, kv


def _is_paged(call: ast.Call) -> bool:
    if "ragged" in _text(call.func.value).lower():
        return False
    names = [k.arg for k in call.keywords if k.arg] + [_text(a) for a in call.args]
    return any(_PAGED_HINT.search(n) for n in names)


class _PlanCalls:
    def __init__(self, tree, emit):
        self.emit = emit
        self.module_kv = _mentions(tree, _KV_DTYPE)
        self.tree = tree

    def run(self):
        classes = [n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]
        in_class = set()
        for c in classes:
            calls = [n for n in ast.walk(c) if self._is_plan(n)]
            in_class.update(id(n) for n in calls)
            self._check(c, calls)
        self._check(self.tree, [n for n in ast.walk(self.tree) if self._is_plan(n) and id(n) not in in_class])

    @staticmethod
    def _is_plan(n) -> bool:
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _PLAN_CALLS

    def _check(self, scope, calls):
        if not calls:
            return
        kv_attrs = self._kv_attrs(scope) if isinstance(scope, ast.ClassDef) else {}
        available = _mentions(scope, _KV_DTYPE) or bool(kv_attrs) or self.module_kv
        aliases = self._aliases(scope, kv_attrs)
        for call in calls:
            if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
                continue  # **kwargs / *args: the dtypes cannot be seen
            q, kv = _plan_dtypes(call)
            paged = _is_paged(call)

            def kv_like(e):
                return e is not None and (_mentions(e, _KV_DTYPE) or any(
                    (_dotted(n) in kv_attrs or _dotted(n) in aliases) for n in ast.walk(e)
                    if isinstance(n, (ast.Name, ast.Attribute))))

            if paged and available and kv is not None and q is not None and not kv_like(kv) and (
                    ast.dump(q) == ast.dump(kv) or self._compute_like(kv)):
                where = ", ".join(sorted(kv_attrs)) or "a kv_cache_dtype in this module"
                self.emit(call, "KV002",
                          f"`{call.func.attr}()` plans the KV data type as `{_text(kv)}`, the same compute dtype as "
                          f"the query (`{_text(q)}`), although the KV-cache dtype is available ({where}): the "
                          "kernel expects a compute-dtype pool, so the FP8 pool gets converted before every call",
                          f"pass the pool's dtype as the KV data type (kv_data_type="
                          f"{sorted(kv_attrs)[0] if kv_attrs else 'the kv_cache_dtype'}) and the pool unconverted")
            elif paged and kv_attrs and not kv_like(kv):
                got = f"passes `{_text(kv)}` as the KV data type" if kv is not None else \
                    "passes no KV data type (FlashInfer then plans the KV as the query dtype)"
                self.emit(call, "KV003",
                          f"`{call.func.attr}()` on a paged KV cache {got}, but this class keeps the KV dtype in "
                          f"{', '.join(sorted(kv_attrs))}: this call site was missed",
                          f"pass kv_data_type={sorted(kv_attrs)[0]} here as at the other plan() calls")

    @staticmethod
    def _kv_attrs(cls: ast.ClassDef) -> dict:
        """``self.x`` attributes that hold the KV dtype: named like one, or assigned from a kv-dtype value."""
        out = {}
        for n in ast.walk(cls):
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    d = _dotted(t)
                    # a dtype attribute (not self.kv_cache = empty(..., dtype=kv_cache_dtype)) that is the KV one
                    if d and d.startswith("self.") and re.search(r"dtype|data_type", t.attr, re.I) and (
                            _KV_DTYPE.search(t.attr) or _mentions(n.value, _KV_DTYPE)):
                        out[d] = _text(n.value)
        return out

    @staticmethod
    def _aliases(scope, kv_attrs) -> set:
        """Local names assigned from a KV-dtype attribute (``dt = self.kv_data_type``)."""
        out = set()
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Attribute, ast.Name)):
                if _dotted(n.value) in kv_attrs or _mentions(n.value, _KV_DTYPE):
                    out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        return out

    @staticmethod
    def _compute_like(e) -> bool:
        d = _dotted(e) or ""
        if d.startswith("torch.") and d.split(".", 1)[1] in _TORCH_FLOATS:
            return True
        leaf = _leaf(e) or ""
        return bool(_Q_DTYPE.search(leaf)) or (isinstance(e, ast.Attribute) and e.attr == "dtype")


# -- entry points ---------------------------------------------------------------------------------------------
def audit_source(source: str, path: str = "<string>", pool_names=DEFAULT_POOL_NAMES) -> list:
    """Findings in one Python source text. Raises :class:`AuditError` on a syntax error."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise AuditError(f"{path}: not valid Python (line {e.lineno}: {e.msg})") from None
    lines = source.splitlines()
    found: dict = {}

    def emit(node, rule, message, fix):
        key = (node.lineno, node.col_offset, rule)
        if key not in found:
            code = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
            found[key] = Finding(path, node.lineno, node.col_offset, rule, message, fix, code)

    _PoolCasts(pool_names, emit).run(tree.body, {})
    _PlanCalls(tree, emit).run()
    return sorted(found.values(), key=lambda f: (f.line, f.col, f.rule))


def audit_file(path, pool_names=DEFAULT_POOL_NAMES) -> list:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise AuditError(f"{path}: no such file or directory")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        source = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise AuditError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise AuditError(f"{path}: cannot read ({e.strerror})") from None
    if "\x00" in source:
        raise AuditError(f"{path}: a binary file, expected Python source")
    return audit_source(source, path, pool_names)


def _python_files(path: str):
    if not os.path.isdir(path):
        yield path
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(root, f)


def audit_paths(paths, pool_names=DEFAULT_POOL_NAMES):
    """Audit files and directories (``*.py`` below them). Returns ``(findings, errors, files_checked)``."""
    findings, errors, n = [], [], 0
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            errors.append(f"{p}: no such file or directory")
            continue
        for f in _python_files(p):
            try:
                findings += audit_file(f, pool_names)
                n += 1
            except AuditError as e:
                errors.append(str(e))
    return findings, errors, n


def format_findings(findings, files_checked: int) -> str:
    out = []
    for f in findings:
        out += [str(f), f"    {f.code}", f"    fix: {f.fix}"]
    if findings:
        out.append(f"{len(findings)} finding(s) in {len({f.path for f in findings})} of {files_checked} file(s)")
    else:
        out.append(f"no KV-pool casts or KV-dtype plan mistakes found in {files_checked} file(s)")
    return "\n".join(out)


def findings_json(findings) -> list:
    return [asdict(f) for f in findings]
