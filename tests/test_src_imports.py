"""The product imports nothing of the repository's workshop: no module under ``src/`` imports ``lab`` (experiments),
``scripts`` (device and benchmark scripts) or ``devtools`` (the SASS reader of the compile tests), at any depth,
absolutely or through a relative import that climbs out of the package."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "src")
FORBIDDEN = ("lab", "scripts", "devtools")


def _imports(path: str):
    """(line, top-level module name) of every import in a file: ``import a.b`` and ``from a.b import c`` give
    "a"; a relative import gives the name it resolves to from the file's package (climbing out of src/ gives the
    first name past the top, e.g. ``from ... import lab`` in fp8mla/x/y.py)."""
    rel = os.path.relpath(path, SRC).split(os.sep)[:-1]   # the file's package, as names
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, (node.module or "").split(".")[0]
                continue
            base = rel[: len(rel) - (node.level - 1)] if node.level - 1 <= len(rel) else None
            parts = (base if base is not None else []) + (node.module.split(".") if node.module else [])
            if base is None or not base:   # climbed to (or past) src/ itself: the names are top-level modules
                names = parts[:1] if parts else [a.name for a in node.names]
                for n in names:
                    yield node.lineno, n
            else:
                yield node.lineno, parts[0]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
            yield node.lineno, node.args[0].value.split(".")[0]


def _py_files():
    for d, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


def test_src_never_imports_lab_scripts_or_devtools():
    bad = [f"{os.path.relpath(p, ROOT)}:{line} imports {name}" for p in _py_files() for line, name in _imports(p)
           if name in FORBIDDEN]
    assert not bad, "\n".join(bad)


def test_the_check_sees_each_form_of_import(tmp_path, monkeypatch):
    """Every form the check reads is seen: absolute, from-import, dotted, importlib, and a relative import that
    climbs out of the package."""
    pkg = tmp_path / "fp8mla" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("import devtools.sass\nfrom lab.sm90 import x\nimport importlib\n"
                              "importlib.import_module('scripts.compile_kernels')\nfrom ... import lab\n"
                              "from . import fine\nfrom ..kernels import decode\n")
    monkeypatch.setattr(__import__(__name__), "SRC", str(tmp_path))
    got = [name for _, name in _imports(str(pkg / "m.py"))]
    assert got.count("devtools") == 1 and got.count("lab") == 2 and got.count("scripts") == 1
    assert "fp8mla" in got   # the relative imports inside the package resolve to it


def _path_loads(path: str):
    """(line, path) of every string constant naming a ``.py`` file under lab/, scripts/ or devtools/ (a file handed
    to importlib / runpy / exec by path, which no import statement shows)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value.replace("\\", "/")
            if v.endswith(".py") and v.split("/")[0] in FORBIDDEN:
                yield node.lineno, v


def test_src_never_loads_a_lab_file_by_path(tmp_path):
    bad = [f"{os.path.relpath(p, ROOT)}:{line} loads {v!r}" for p in _py_files() for line, v in _path_loads(p)]
    assert not bad, "\n".join(bad)
    probe = tmp_path / "probe.py"
    probe.write_text("X = 'scripts/qk8_one.py'\nY = 'lab/sm90/x.py'\nZ = 'src/fp8mla/layout.py'\n")
    assert [v for _, v in _path_loads(str(probe))] == ["scripts/qk8_one.py", "lab/sm90/x.py"]
