"""Reading a vLLM release's Python source without importing it (the conformance tests' tool).

A release is a directory holding its ``vllm/`` package, such as a wheel unpacked with
``unzip vllm-0.34.0-*.whl 'vllm/*.py'``: CUDA wheels of releases whose torch pin this machine cannot meet are
read as text, with :mod:`ast`, so nothing of them runs.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

# where the MLA backend's base classes live (the same paths in vLLM 0.24 through 0.34)
BASE_MODULES = ("vllm.model_executor.layers.attention.mla_attention", "vllm.v1.attention.backend")


@dataclass(frozen=True)
class Params:
    """A function's signature as a caller sees it."""

    kind: str  # "static", "class" or "method"
    positional: tuple[str, ...]  # after self/cls
    required: tuple[str, ...]
    keyword_only: tuple[str, ...]
    var_positional: bool
    var_keyword: bool

    @classmethod
    def of(cls, fn: ast.FunctionDef) -> "Params":
        decorators = {ast.unparse(d) for d in fn.decorator_list}
        kind = "static" if "staticmethod" in decorators else "class" if "classmethod" in decorators else "method"
        a = fn.args
        names = [x.arg for x in a.posonlyargs + a.args]
        if kind != "static" and names:
            names = names[1:]
        n_defaults = len(a.defaults)
        required = names[: len(names) - n_defaults] if n_defaults else names
        kw_required = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
        return cls(kind, tuple(names), tuple(required) + tuple(kw_required), tuple(k.arg for k in a.kwonlyargs),
                   a.vararg is not None, a.kwarg is not None)

    def accepts_call_of(self, base: "Params", by_keyword: bool = False) -> list[str]:
        """Why a call written against ``base`` would fail on this signature (empty: every such call binds).
        ``by_keyword``: the release's callers pass every argument by name (checked at the call sites), so only
        names count, not positions."""
        why = []
        if self.kind != base.kind:
            why.append(f"a {self.kind} method where the release has a {base.kind} method")
        for i, name in enumerate(base.positional):
            if name in self.positional or name in self.keyword_only:
                if not by_keyword and name in self.positional and self.positional.index(name) != i:
                    why.append(f"{name!r} is parameter {self.positional.index(name) + 1}, the release's is {i + 1}")
            elif not (self.var_keyword if by_keyword else self.var_positional):
                why.append(f"the release's parameter {name!r} is not accepted")
        for name in base.keyword_only:
            if name not in self.positional + self.keyword_only and not self.var_keyword:
                why.append(f"the release's keyword {name!r} is not accepted")
        for name in self.required:
            if name not in base.positional + base.keyword_only and not (base.var_positional or base.var_keyword):
                why.append(f"requires {name!r}, which the release's callers do not pass")
        return why


class Release:
    """One vLLM release's source tree, parsed on demand."""

    def __init__(self, root):
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise ValueError(f"root: expected a directory holding vllm/__init__.py, got {self.root}")
        self.version = _version(self.root)
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = self.root.joinpath(*dotted.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            self._trees[dotted] = ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else None
        return self._trees[dotted]

    def defines(self, dotted: str, name: str) -> bool:
        """Whether ``from dotted import name`` finds ``name`` (a top-level definition, assignment or import)."""
        tree = self.module(dotted)
        if tree is None:
            return False
        if self.module(f"{dotted}.{name}") is not None:  # a submodule
            return True
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                    return True
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and _serves(node, name):
                return True   # a module-level __getattr__ that answers this name (vllm.platforms.current_platform)
        return False

    def find_class(self, name: str, modules=BASE_MODULES) -> ast.ClassDef | None:
        for dotted in modules:
            tree = self.module(dotted)
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return node
        return None

    def class_chain(self, name: str) -> list[ast.ClassDef]:
        """``name`` and its bases found in :data:`BASE_MODULES`, nearest first (generic arguments dropped)."""
        chain, todo, seen = [], [name], set()
        while todo:
            cls = self.find_class(todo.pop(0))
            if cls is None or cls.name in seen:
                continue
            seen.add(cls.name)
            chain.append(cls)
            for b in cls.bases:
                todo.append(re.sub(r"\[.*\]$", "", ast.unparse(b)).split(".")[-1])
        return chain

    def method(self, class_name: str, method: str, interface: bool = False) -> ast.FunctionDef | None:
        """``method`` as ``class_name`` inherits it (the nearest definition), or with ``interface`` the
        farthest one: what generic callers are written against (a constructor's subclasses may narrow it)."""
        found = [node for cls in self.class_chain(class_name) for node in cls.body
                 if isinstance(node, ast.FunctionDef) and node.name == method]
        return (found[-1] if interface else found[0]) if found else None

    def abstract_methods(self, class_name: str) -> set[str]:
        """Methods marked ``@abstractmethod`` in ``class_name``'s chain and not defined concretely nearer."""
        concrete, abstract = set(), set()
        for cls in self.class_chain(class_name):
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name not in concrete | abstract:
                    decorators = {ast.unparse(d) for d in node.decorator_list}
                    (abstract if "abstractmethod" in decorators else concrete).add(node.name)
        return abstract

    def assigns_attribute(self, class_name: str, attribute: str) -> bool:
        """Whether ``class_name``'s chain sets ``self.attribute`` or declares it in a class body."""
        for cls in self.class_chain(class_name):
            for node in ast.walk(cls):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == attribute and ast.unparse(t.value) == "self":
                        return True
                    if isinstance(t, ast.Name) and t.id == attribute and node in cls.body:
                        return True
        return False

    def calls(self, dotted: str, attribute_call: str) -> list[ast.Call]:
        """Every call ``<...>.attribute_call(...)`` in module ``dotted`` (for example ``self._build_decode``)."""
        tree = self.module(dotted)
        return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == attribute_call]


def _version(root: Path) -> str:
    path = root / "vllm" / "_version.py"
    m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", path.read_text()) if path.is_file() else None
    if m is None:
        raise ValueError(f"root: no vllm/_version.py with a version under {root}")
    return m.group(1)


def vllm_imports(path) -> list[tuple[str, str]]:
    """Every ``from vllm... import name`` in the file at ``path`` (top level and inside functions)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return [(n.module, a.name) for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "vllm" for a in n.names]


def class_methods(path, class_name: str) -> dict[str, Params]:
    """The methods ``class_name`` defines in the file at ``path``, as :class:`Params`."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {m.name: Params.of(m) for m in node.body if isinstance(m, ast.FunctionDef)}
    raise ValueError(f"class_name: no class {class_name!r} in {path}")


def _serves(getattr_def: ast.FunctionDef, name: str) -> bool:
    """Whether a module's ``__getattr__(name)`` compares its argument with this name (``if name == "x":``)."""
    arg = getattr_def.args.args[0].arg if getattr_def.args.args else None
    for node in ast.walk(getattr_def):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == arg:
            if any(isinstance(c, ast.Constant) and c.value == name for c in node.comparators):
                return True
    return False
