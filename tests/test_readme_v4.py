"""The README's DeepSeek V4 example runs as written and prints what its comment says."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_v4_example_runs():
    text = README.read_text()
    sec = text[text.index("## DeepSeek V4"):]
    code = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    expected = re.search(r"print\(.*\)\s+# (.*)", code).group(1).strip()
    assert buf.getvalue().strip() == expected
