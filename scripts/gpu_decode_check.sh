#!/usr/bin/env bash
# One device call: the decode tests on the GPU, then sweeps of kernel variants on representative shapes.
# Usage (repo root): bash scripts/gpu_decode_check.sh OUTDIR
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
timeout 200 python3 -m pytest -q tests/test_decode_triton.py -p no:cacheprovider 2>&1 | tail -15 | tee "$out/pytest_decode.txt"
timeout 200 python3 -m fp8mla bench decode --sweep --heads 16 --pages 64 --kv fp8_e4m3 \
  --variants n32s3 n32s4 s3 noevict cta1 cta4 chunk512 chunk128 chunk1024 \
  --shapes 64x8192 1x32768 128x2048 --err-requests 1 --reps 30 --out "$out/sweep16" 2>&1 | tee "$out/sweep16.txt"
timeout 170 python3 -m fp8mla bench decode --sweep --heads 128 --pages 64 --kv fp8_e4m3 \
  --variants m32 m16 w4 s1 s3 n32 cta1 \
  --shapes 64x8192 8x8192 --err-requests 1 --reps 20 --out "$out/sweep128" 2>&1 | tee "$out/sweep128.txt"
