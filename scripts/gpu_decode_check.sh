#!/usr/bin/env bash
# One device call: the decode tests on the GPU, then a sweep of kernel variants on representative shapes.
# Usage (repo root): bash scripts/gpu_decode_check.sh OUTDIR
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -q -x tests/test_decode_triton.py -p no:cacheprovider 2>&1 | tail -25 | tee "$out/pytest_decode.txt"
timeout 330 python3 -m fp8mla bench decode --sweep --heads 16 --pages 64 --kv fp8_e4m3 \
  --shapes 64x8192 1x32768 128x2048 --err-requests 1 --reps 30 --out "$out/sweep16" 2>&1 | tee "$out/sweep16.txt"
