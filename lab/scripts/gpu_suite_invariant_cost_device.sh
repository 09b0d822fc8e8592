#!/usr/bin/env bash
# One GPU run of <= 10 minutes (H100/H200), outputs under $OUT: the GPU suite's files phase
# (scripts/gpu_suite_device.sh; SUITE_TIMEOUT per part), then the batch-invariant mode's cost on the Gluon builds
# (named) and the Triton kernel (auto) beside the default.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s)
SUITE_TIMEOUT=${SUITE_TIMEOUT:-360} WORKERS=${WORKERS:-15} bash scripts/gpu_suite_device.sh $OUT/suite files .whl
echo "suite: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD/src:$PWD
timeout ${T_BENCH:-90} python -m fp8mla bench decode --heads 16 128 --shapes 1x32768 64x8192 --pages 64 \
  --kv fp8_e4m3 --batch-invariant --reps 20 --out $OUT/bi > $OUT/bi.txt 2>&1; echo "bench exit $?"
grep -E " ms |ceil|not taken|failed" $OUT/bi.txt | head -30
