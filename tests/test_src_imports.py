"""The product never imports the lab: no module under src/ imports ``lab``, ``scripts`` or ``devtools`` (lab/README.md),
nor loads a file from those folders by path."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
FORBIDDEN = ("lab", "scripts", "devtools")


def _violations(path: Path, root: Path = SRC) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a path handed to importlib / runpy / exec: "lab/...py", "scripts/...py"
            v = node.value.replace("\\", "/")
            if v.endswith(".py") and v.split("/")[0] in FORBIDDEN:
                bad.append(f"{path.relative_to(root)}:{node.lineno}: loads {v!r}")
        bad += [f"{path.relative_to(root)}:{node.lineno}: imports {n}" for n in names
                if n.split(".")[0] in FORBIDDEN]
    return bad


def test_src_imports_nothing_from_the_lab():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20, files   # the walk found the package
    bad = [v for f in files for v in _violations(f)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_lab_import(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("import lab.scripts.qk8_device\nfrom scripts import bench_table\nX = 'scripts/qk8_one.py'\n"
                 "from .lab import x\nimport fp8mla.layout\n")
    assert len(_violations(f, tmp_path)) == 3, _violations(f, tmp_path)
