"""Page-1 checks of the group build (three of scripts/group_device.py's cases plus B4 L8192), for a short device call."""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("gd", "scripts/group_device.py"); gd = importlib.util.module_from_spec(spec); spec.loader.exec_module(gd)
ok = gd.check("group H16 p1 odd lens", gd.group_case([1, 63, 65, 0, 700, 130], 16, 1, seed=4))
ok &= gd.check("group H128 p1 odd lens", gd.group_case([1, 65, 0, 700], 128, 1, seed=5))
ok &= gd.check("group H16 p1 B4 L8192", gd.group_case([8192] * 4, 16, 1, seed=6))
print("GROUP P1", "PASS" if ok else "FAIL"); sys.exit(0 if ok else 1)
