#!/usr/bin/env bash
# The next decode-v2 device call, prepared after the device time was spent (kernel logs 20, 22, 24 and 25 of
# docs/benchmarks.md; updated 2026-12-01). On nvidia-h200-x2, <= 9.5 min:
#   GPU 1: scripts/ring_parity_device.py (log 25: the alternating-tile kernel's ready-barrier parity race at an odd
#          ring depth, NS 3 against NS 4, 1,000 bit-compared graph replays and the ring-only probe, each in its own
#          process), <= 5 min; then scripts/group_device.py (per-token group scales, never run yet: float64
#          checks, then timings against the per-tensor kernel and the Triton group path), <= 3.5 min.
#   GPU 0: scripts/consumer_experiments_device.py (pv_in_flight=2 at H16, wide_row_sums at H128, ns=4 at H16:
#          float64 checks, CUDA-graph timings, tile timelines), <= 7 min; then the GPU tests of
#          tests/test_decode_sm90_group.py (FP8MLA_GLUON_GROUP=1 inside) with what is left, <= 2.5 min.
# The launch-failure repro of log 20 (qk8_device.py chunks) is left out: log 25's race explains it, and
# ring_parity_device.py tests that directly.
# On one GPU: the race, then the group script, then the experiments with what is left of 9.5 min.
# Usage (repo root):  bash scripts/next_session_device.sh OUTDIR
set -u
out=${1:-out/next}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
race_and_group() {
  timeout 300 python3 scripts/ring_parity_device.py > "$out/ring_parity.txt" 2>&1; echo "rc $?" >> "$out/ring_parity.txt"
  timeout 210 python3 scripts/group_device.py > "$out/group.txt" 2>&1; echo "rc $?" >> "$out/group.txt"
}
if [ "$ngpu" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=1; race_and_group ) &
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 420 python3 scripts/consumer_experiments_device.py > "$out/experiments.txt" 2>&1
    echo "rc $?" >> "$out/experiments.txt"
    timeout 150 python3 -m pytest -q -x -k "not compiles" tests/test_decode_sm90_group.py > "$out/group_tests.txt" 2>&1
    echo "rc $?" >> "$out/group_tests.txt" ) &
  wait
else
  race_and_group
  timeout 100 python3 scripts/consumer_experiments_device.py > "$out/experiments.txt" 2>&1
  echo "rc $?" >> "$out/experiments.txt"
fi
grep -hE "RESULT|ring|replays|CHECK|BENCH|TIMELINE|rc |timing|passed|failed|Error" "$out"/*.txt | head -100
