"""Page-1 checks of the group build (kernel log 28: page ids two tiles ahead; the group build's page-1 producer is
the same code): two of scripts/group_device.py's page-1 cases plus B4 L8192, for a short GPU run (~20 s):

    PYTHONPATH=$PWD/src python3 scripts/group_page1_device.py
"""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("group_device", os.path.join(ROOT, "scripts/group_device.py"))
gd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gd)


def main() -> int:
    ok = gd.check("group H16 p1 odd lens", gd.group_case([1, 63, 65, 0, 700, 130], 16, 1, seed=4))
    ok &= gd.check("group H128 p1 odd lens", gd.group_case([1, 65, 0, 700], 128, 1, seed=5))
    ok &= gd.check("group H16 p1 B4 L8192", gd.group_case([8192] * 4, 16, 1, seed=6))
    gd.log(f"GROUP P1 {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
