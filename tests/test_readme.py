"""The README's API example runs as written and prints what its comment says."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_api_example_runs():
    text = README.read_text()
    api = text[text.index("## The API"):]
    code = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    expected = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    assert buf.getvalue().strip() == expected


def test_readme_quickstart_matches_ci():
    """.ci/run must run the README's test command verbatim."""
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = [line for line in text.splitlines() if "pytest" in line and line.startswith("python3 -m venv")]
    assert len(test_cmd) == 1 and test_cmd[0] in ci
