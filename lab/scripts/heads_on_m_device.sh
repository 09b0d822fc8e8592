#!/usr/bin/env bash
# The heads-on-M build's GPU check on one H200, in one GPU run of ~5 min (limits sum to < 10 min):
#   1. tests/test_decode_sm90_heads_on_m.py (float64 checks of the build through MLAPagedAttention; its two
#      compile-only tests, checked on the CPU under triton 3.6 and 3.9, left out)                        ~1.5-2 min
#   2. the wide-heads GPU tests of tests/test_decode_sm90.py at page 64 (H 20, 32: the wide build; 64, 100, 128:
#      now heads-on-M; the 4-stage refusal that must stay)                                                 ~1 min
#   3. the A/B: fp8mla bench decode at H64/H128, page 64, FP8 e4m3, the heads-on-M build ("fp8mla gluon[mh]")
#      beside the wide build ("fp8mla gluon[wide]", heads_on_m=False), the heads-on-M build in a CUDA-graph
#      wrapper ("[mh,graph]": the grid of 256 requests' capacity, empty CTAs exit), fp8_math and FlashInfer ~2-3 min
# Usage (repo root; FlashInfer importable for the fa2/fa3 rows):  bash lab/scripts/heads_on_m_device.sh OUT
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# each step's timeout: its own budget, within what is left of ${TOTAL_S:-570} s for the whole script (one GPU
# run may take 600 s)
budget() { local left=$(( ${TOTAL_S:-570} - ($(date +%s) - t0) )); [ "$left" -lt "$1" ] && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true; date -u; } | tee "$out/environment.txt"

timeout -s INT -k 5 "$(budget 220)" python3 -m pytest -x -q -p no:cacheprovider -rfEs --tb=short \
    tests/test_decode_sm90_heads_on_m.py -k "not compiles" > "$out/tests_heads_on_m.txt" 2>&1
echo "exit $?" >> "$out/tests_heads_on_m.txt"
say "heads-on-M tests done"; tail -n 15 "$out/tests_heads_on_m.txt"

xd=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")   # (pytest-xdist where installed)
timeout -s INT -k 5 "$(budget 110)" python3 -m pytest -x -q -p no:cacheprovider -rfEs --tb=short $xd \
    tests/test_decode_sm90.py -k "wide and not 16" > "$out/tests_wide.txt" 2>&1
echo "exit $?" >> "$out/tests_wide.txt"
say "wide-heads tests done"; tail -n 10 "$out/tests_wide.txt"

timeout -s INT -k 5 "$(budget 250)" python3 -m fp8mla bench decode --heads 64 128 --pages 64 --kv fp8_e4m3 \
    --compare flashinfer wide_heads graph fp8_math --reps 20 --out "$out/bench" > "$out/bench.txt" 2>&1
echo "exit $?" >> "$out/bench.txt"
say "bench done"
# summary: ms per kernel and shape, and the heads-on-M build over the wide one
python3 - "$out/bench/decode.csv" <<'PY' || true
import csv, sys, collections
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError as e:
    sys.exit(f"no bench csv: {e}")
ms = collections.defaultdict(dict)
for r in rows:
    ms[(int(r["H"]), int(r["B"]), int(r["L"]))][r["kernel"]] = (float(r["ms"]), float(r["rel_l2"]))
names = sorted({r["kernel"] for r in rows})
print("shape".ljust(18) + "".join(n[:22].rjust(24) for n in names) + "   mh/wide")
for key in sorted(ms):
    d = ms[key]
    cells = "".join((f"{d[n][0]:.4f} ({d[n][1]:.0e})" if n in d else "-").rjust(24) for n in names)
    mh, wide = d.get("fp8mla gluon[mh]"), d.get("fp8mla gluon[wide]")
    ratio = f"{mh[0] / wide[0]:.3f}" if mh and wide else "-"
    print(f"H{key[0]} B{key[1]} L{key[2]}".ljust(18) + cells + "   " + ratio)
PY
say "all done"
