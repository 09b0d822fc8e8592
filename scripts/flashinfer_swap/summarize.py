"""Compare the two junit reports of run.sh (FlashInfer itself, fp8mla swapped in): counts, and every test that
did not pass with fp8mla with the first line of its failure, grouped by cause.

usage: python summarize.py flashinfer.xml fp8mla.xml [summary.md]
"""
from __future__ import annotations

import collections
import re
import sys
import xml.etree.ElementTree as ET

SUPERSET = ("test_fp8_kv_plan_rejects_fp16_q",)  # fp8mla accepts fp16 queries over FP8 by design


def outcomes(path: str) -> dict:
    """{test id: (outcome, first line of the message)} from a junit xml; missing file -> {}."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"summarize: cannot read {path}: {e}")
        return {}
    res = {}
    for tc in root.iter("testcase"):
        key = f"{tc.get('classname', '')}::{tc.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (el.get("message") or el.text or "").strip()
                msg = text.splitlines()[0][:200] if text else ""
                break
        res[key] = (outcome, msg)
    return res


def counts(res: dict) -> str:
    c = collections.Counter(o for o, _ in res.values())
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c[k]) or "nothing ran"


def cause(msg: str) -> str:
    """A short bucket for a failure message (numbers and tensor reprs stripped)."""
    m = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", msg)
    return m[:110]


def main(argv) -> int:
    fi, sw = outcomes(argv[1]), outcomes(argv[2])
    lines = ["# FlashInfer's MLA wrapper tests: FlashInfer vs fp8mla swapped in", "",
             f"- FlashInfer itself: {counts(fi)}", f"- fp8mla swapped in: {counts(sw)}"]
    bad = {k: v for k, v in sw.items() if v[0] in ("failed", "error")}
    superset = {k for k in bad if any(s in k for s in SUPERSET)}
    lines.append(f"- fp8mla failures that are the documented superset (fp16 queries over FP8): {len(superset)}")
    only_fp8mla = [k for k in bad if fi.get(k, ("?",))[0] == "passed"]
    lines.append(f"- failing with fp8mla but passing with FlashInfer: {len(only_fp8mla)}")
    both = [k for k in bad if fi.get(k, ("?",))[0] in ("failed", "error")]
    if both:
        lines.append(f"- failing with both (a FlashInfer-side or test-file issue): {len(both)}")
    fi_only = [k for k, v in fi.items() if v[0] in ("failed", "error") and sw.get(k, ("?",))[0] == "passed"]
    if fi_only:
        lines.append(f"- failing with FlashInfer only: {len(fi_only)}")
    groups = collections.defaultdict(list)
    for k, (o, msg) in bad.items():
        groups[cause(msg)].append(k)
    if groups:
        lines += ["", "## fp8mla failures by cause", ""]
        for c, ks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {len(ks)} x `{c}`")
            for k in sorted(ks)[:4]:
                lines.append(f"    - {k} (FlashInfer: {fi.get(k, ('not run',))[0]})")
            if len(ks) > 4:
                lines.append(f"    - ... {len(ks) - 4} more")
    for title, ks, src in (("Failing with FlashInfer itself", both + fi_only, fi),):
        if ks:
            lines += ["", f"## {title}", ""] + [f"- {k}: {src[k][1]}" for k in sorted(ks)[:20]]
    text = "\n".join(lines) + "\n"
    print(text)
    if len(argv) > 3:
        with open(argv[3], "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
