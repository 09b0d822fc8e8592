#!/usr/bin/env bash
# One H200 run of 2026-12-02, 18:04 UTC, after the longest-first heads-on-M schedule (<= 5 min):
#   lpt    lab/scripts/mh_lpt_device.py: wide / heads-on-M longest first / heads-on-M old cut / auto, plain plans
#   tests  the heads-on-M GPU tests, the Gluon decode file, the merge grid, the longest-first schedule (xdist)
#   sgl    SGLang's attention kit after the stored-value fix of the fresh-latents test
# Usage (repo root; with .sgl_whl/ present, which holds the xdist wheels too):  bash lab/scripts/h200_2026-12-02_longest_first_ab.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s4c2 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p /tmp/xd && python3 -m pip install -q --no-index --no-deps --target /tmp/xd .sgl_whl/pytest_xdist*.whl .sgl_whl/execnet*.whl > /dev/null 2>&1
PYTHONPATH=$PWD/src:$PWD/lab/scripts timeout -k 10 100 python3 lab/scripts/mh_lpt_device.py --out "$work/mh_lpt.json" > "$work/lpt.txt" 2>&1
say "lpt rc $?"; cat "$work/lpt.txt" >> "$out/summary.txt"; cp "$work/mh_lpt.json" "$out/" 2>/dev/null
pack
PYTHONPATH=$PWD/src:$PWD/scripts:/tmp/xd timeout -s INT -k 10 120 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -n 8 \
    tests/test_decode_sm90_heads_on_m.py tests/test_sm90_merge_grid.py tests/test_sm90_longest_first.py tests/test_decode_sm90.py \
    > "$work/tests.txt" 2>&1
say "tests rc $?: $(tail -n 1 "$work/tests.txt")"; grep -E "^(FAILED|ERROR)" "$work/tests.txt" | head -20 | tee -a "$out/summary.txt"
pack
mkdir -p "$work/sgl"
KIT_TIMEOUT=90 WORKERS=8 timeout 130 bash lab/scripts/sglang_kit_device.sh "$work/sgl" > "$work/sgl.txt" 2>&1
say "sgl rc $?"; tail -n 12 "$work/sgl.txt" >> "$out/summary.txt"
pack; say done
