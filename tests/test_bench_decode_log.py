"""``fp8mla bench decode``'s failure lines: a competitor that cannot plan or run at a point (FlashInfer at page 1,
a JIT build error) is printed with the start and the end of its message, not cut to its first line (CPU)."""
from __future__ import annotations

from fp8mla.bench.decode import _why


def test_short_message_kept_whole():
    assert _why(ValueError("page_size 1 is not supported")) == "ValueError: page_size 1 is not supported"


def test_long_message_keeps_both_ends_on_one_line():
    msg = "ninja: build stopped\n" + "x" * 5000 + "\nerror: identifier 'cute::foo' is undefined"
    line = _why(RuntimeError(msg), head=40, tail=60)
    assert line.startswith("RuntimeError: ninja: build stopped")
    assert line.endswith("error: identifier 'cute::foo' is undefined")
    assert "[...]" in line and "\n" not in line
    assert len(line) < 40 + 60 + 40
