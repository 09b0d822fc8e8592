"""Every ```python block of the README runs as written (CPU), and prints what its comments say.

Each block runs on its own, in a fresh namespace, as a reader would paste it: a block that needs ``torch`` imports
it. Signature listings that are not runnable code belong in a ```text fence. A ``print(...)  # expected`` line
says what the block prints: the block's output lines must be those comments, in order.
"""
from __future__ import annotations

import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# A fence line, possibly indented (a block inside a list item), then everything up to the closing fence at the
# same indentation.
_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, dedented code) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group("code"))) for m in _BLOCK.finditer(text)]


def test_the_readme_has_python_blocks():
    """The collector finds the blocks (a test over none would pass for nothing): every ```python fence opens
    one."""
    text = README.read_text()
    blocks = python_blocks(text)
    assert len(blocks) >= 2 and len(blocks) == text.count("```python"), blocks


@pytest.mark.parametrize("line, code", python_blocks(README.read_text()),
                         ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_python_block_runs(line, code):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, f"README.md, block at line {line}", "exec"), {"__name__": "__readme__"})
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.*)$", code, re.M)]
    if expected:
        assert buf.getvalue().strip().splitlines() == expected


def test_readme_quickstart_matches_ci():
    """.ci/run must run the README's test command verbatim."""
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = [line for line in text.splitlines() if "pytest" in line and line.startswith("python3 -m venv")]
    assert len(test_cmd) == 1 and test_cmd[0] in ci
