#!/usr/bin/env bash
# The heads-on-M build's GPU gate and A/B, and the conv2 experiment, in one run of <= 8 minutes on one H200
# (2026-12-02, 01:43 UTC), each phase under `timeout` inside TOTAL_S:
#   tests  tests/test_decode_sm90_heads_on_m.py's GPU cases (float64 checks through MLAPagedAttention)
#   ab     fp8mla bench decode, FP8 e4m3, H64/H128, page 64: the heads-on-M build (the new default there) beside the
#          wide build (heads_on_m=False) and the heads-on-M build in a CUDA-graph wrapper (the engines' launch),
#          the ceilings of the same process (skipped if the tests hung: the bench would hang the same way)
#   fi     fp8mla bench decode, BF16 pool, H64/H128, page 64, with FlashInfer fa3/fa2 (their JIT variants are
#          built in the background from the start)
#   conv2  lab/many_heads/check_device.py: the prototype's best build vs conv2 (two converter warpgroups), float64
#          checks then timings, beside the product's kernel
# Usage (repo root; with .whl/ present):  bash lab/scripts/h200_2026-12-02_heads_on_m_gate_ab.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/heads_on_m_gate && rm -rf "$work" && mkdir -p "$work"
total=${TOTAL_S:-470}
t0=$(date +%s)
export PYTHONUNBUFFERED=1
left() { echo $(( total - ($(date +%s) - t0) )); }
cap() { local c=$(( $(left) - $2 )); [ "$c" -gt "$1" ] && c=$1; [ "$c" -lt 10 ] && c=10; echo "$c"; }
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$work/pip.txt" 2>&1 || say "FlashInfer install failed"
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1; date -u; } \
  > "$out/environment.txt" 2>&1
nice -n 10 timeout 300 python3 scripts/flashinfer_swap/prebuild_jit.py --bench-bf16 > "$work/fi_prebuild.txt" 2>&1 &
prebuild=$!

# --- tests ---
timeout -s INT -k 10 "$(cap 150 300)" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --maxfail=5 \
    tests/test_decode_sm90_heads_on_m.py -k "not compiles" > "$work/tests.txt" 2>&1
trc=$?
say "tests rc $trc: $(tail -n 1 "$work/tests.txt")"
grep -E "^(FAILED|ERROR)" "$work/tests.txt" | head -20 | tee -a "$out/summary.txt"
pack

# --- ab ---
if [ "$trc" != 124 ]; then
  timeout -k 10 "$(cap 130 190)" python3 -m fp8mla bench decode --heads 64 128 --pages 64 --kv fp8_e4m3 \
      --compare wide_heads graph --reps 10 --out "$work/ab" > "$work/ab.txt" 2>&1
  say "ab rc $?"
  grep -E "ceiling|gluon|not taken|failed" "$work/ab.txt" | tee -a "$out/summary.txt"
  cp "$work/ab/decode.csv" "$out/ab.csv" 2>/dev/null
else
  say "ab skipped: the tests hung (rc 124)"
fi
pack

# --- fi ---
wait "$prebuild" 2>/dev/null; say "prebuild: $(tail -n 1 "$work/fi_prebuild.txt")"
timeout -k 10 "$(cap 90 100)" python3 -m fp8mla bench decode --heads 64 128 --pages 64 --kv bf16 \
    --compare flashinfer --reps 10 --out "$work/fi" > "$work/fi.txt" 2>&1
say "fi rc $?"
grep -E "ceiling|flashinfer|failed|not planned" "$work/fi.txt" | tee -a "$out/summary.txt"
cp "$work/fi/decode.csv" "$out/fi.csv" 2>/dev/null
pack

# --- conv2 ---
c=$(cap 150 5)
mkdir -p "$work/conv2"
timeout -k 10 "$c" python3 lab/many_heads/check_device.py --builds best,conv2 --no-flashinfer --check-timeout 90 \
    --reps 10 --out "$work/conv2" > "$work/conv2/log.txt" 2>&1
say "conv2 rc $? (cap $c s)"
tail -n 25 "$work/conv2/log.txt" | tee -a "$out/summary.txt"
cp "$work/conv2/many_heads.json" "$out/conv2.json" 2>/dev/null
pack
say "done"
