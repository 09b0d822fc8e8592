#!/usr/bin/env bash
# Device call: decode tests + a sweep of the variants that the offline sm_90 compile (scripts/compile_decode_sm90.py)
# found free of spills, then the GPU tests of the other kernels and the prefill / write benchmarks.
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 150 python3 -m fp8mla bench decode --sweep --heads 16 --pages 64 --kv fp8_e4m3 \
  --variants w8 n32s3 s3 --shapes 64x8192 1x32768 8x8192 --err-requests 1 --reps 30 --out "$out/sweep16" 2>&1 \
  | grep -v Warn | tee "$out/sweep16.txt"
timeout 100 python3 -m fp8mla bench decode --sweep --heads 128 --pages 64 --kv fp8_e4m3 bf16 \
  --variants n32 w4 --shapes 64x8192 8x8192 --err-requests 1 --reps 20 --out "$out/sweep128" 2>&1 \
  | grep -v Warn | tee "$out/sweep128.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_triton.py tests/test_extend.py \
  tests/test_ragged.py tests/test_gather.py tests/test_quant_append.py 2>&1 | tail -15 | tee "$out/pytest_gpu.txt"
timeout 60 python3 -m fp8mla bench write --out "$out/write" 2>&1 | grep -v Warn | tail -12 | tee "$out/write.txt"
timeout 80 python3 -m fp8mla bench prefill --out "$out/prefill" 2>&1 | grep -v Warn | tail -12 | tee "$out/prefill.txt"
