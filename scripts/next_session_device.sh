#!/usr/bin/env bash
# The next decode-v2 device call, prepared 2026-11-30 after the device time was spent (kernel logs 20 and 22 of
# docs/benchmarks.md). On nvidia-h200-x2, <= 8 min (one GPU: the experiments, then only the plain repro, <= 9.5 min):
#   GPU 0: scripts/consumer_experiments_device.py (pv_in_flight=2 at H16, wide_row_sums at H128, ns=4 at H16:
#          float64 checks, CUDA-graph timings against the default, tile timelines)
#   GPU 1: the launch-failure repro (kernel log 20): `qk8_device.py chunks`, the sequence that failed, plain (does it
#          fail again, and at which variant), then under compute-sanitizer memcheck and synccheck with few reps.
# Usage (repo root):  bash scripts/next_session_device.sh OUTDIR
set -u
out=${1:-out/next}; mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
g1=$(( ngpu >= 2 ? 1 : 0 ))
(
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 scripts/consumer_experiments_device.py > "$out/experiments.txt" 2>&1
  echo "rc $?" >> "$out/experiments.txt"
) &
[ "$g1" = 0 ] && wait
(
  export CUDA_VISIBLE_DEVICES=$g1
  timeout 120 python3 scripts/qk8_device.py chunks > "$out/fault_plain.txt" 2>&1; echo "rc $?" >> "$out/fault_plain.txt"
  if [ "$g1" = 1 ]; then   # (one GPU: no time left for the sanitizers within one 10-minute call)
    QK8_REPS=3 timeout 180 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/qk8_device.py chunks \
        > "$out/fault_memcheck.txt" 2>&1; echo "rc $?" >> "$out/fault_memcheck.txt"
    QK8_REPS=3 timeout 150 compute-sanitizer --tool synccheck --print-limit 20 python3 scripts/qk8_device.py chunks \
        > "$out/fault_synccheck.txt" 2>&1; echo "rc $?" >> "$out/fault_synccheck.txt"
  fi
) &
wait
grep -hE "CHECK|BENCH|TIMELINE|rc |timing|ERROR SUMMARY|Error" "$out"/*.txt | head -80
