#!/usr/bin/env bash
# The next decode-v2 device call, prepared after the device time was spent (kernel logs 20, 22 and 24 of
# docs/benchmarks.md; updated 2026-12-01). On nvidia-h200-x2, <= 9.5 min (GPU 1's part: 3.5 + 4 + 1.5 min at most):
#   GPU 0: scripts/consumer_experiments_device.py (pv_in_flight=2 at H16, wide_row_sums at H128, ns=4 at H16:
#          float64 checks, CUDA-graph timings against the default, tile timelines), <= 7 min
#   GPU 1: scripts/group_device.py (per-token group scales in the Gluon kernel, never run yet: float64 checks, then
#          timings against the per-tensor kernel and the Triton group path), <= 3.5 min; then the GPU tests of
#          tests/test_decode_sm90_group.py (FP8MLA_GLUON_GROUP=1 inside), <= 4 min; then the launch-failure repro
#          (kernel log 20: `qk8_device.py chunks`, the sequence that failed), plain, <= 1.5 min. (memcheck and synccheck
#          of that sequence: a later call.)
# On one GPU: the group script and its tests first (new code, never run), then what is left of 9.5 min for the
# experiments (their H16 part; the rest in a later call).
# Usage (repo root):  bash scripts/next_session_device.sh OUTDIR
set -u
out=${1:-out/next}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
group_part() {
  timeout 210 python3 scripts/group_device.py > "$out/group.txt" 2>&1; echo "rc $?" >> "$out/group.txt"
  timeout 240 python3 -m pytest -q -x -k "not compiles" tests/test_decode_sm90_group.py > "$out/group_tests.txt" 2>&1
  echo "rc $?" >> "$out/group_tests.txt"
}
if [ "$ngpu" -ge 2 ]; then
  ( CUDA_VISIBLE_DEVICES=0 timeout 420 python3 scripts/consumer_experiments_device.py > "$out/experiments.txt" 2>&1
    echo "rc $?" >> "$out/experiments.txt" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    group_part
    timeout 90 python3 scripts/qk8_device.py chunks > "$out/fault_plain.txt" 2>&1
    echo "rc $?" >> "$out/fault_plain.txt" ) &
  wait
else
  group_part
  timeout 100 python3 scripts/consumer_experiments_device.py > "$out/experiments.txt" 2>&1
  echo "rc $?" >> "$out/experiments.txt"
fi
grep -hE "CHECK|BENCH|TIMELINE|rc |timing|passed|failed|Error" "$out"/*.txt | head -100
