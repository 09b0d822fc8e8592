#!/usr/bin/env bash
# Device call B: every kernel's tests on the GPU, the scenario step again (graph buffers sized for decode),
# and the extend tile candidates.
set -u
final=${1:-gpu_out}
out=/tmp/res
mkdir -p "$out" "$final"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 170 python3 -m fp8mla bench step --scale glm5 --batches 1,8,32,64 --contexts 4k,8k,32k --reps 10 \
  --no-ceilings --out "$out/step" 2>&1 | grep -v Warning | tail -16
timeout 100 python3 -m fp8mla bench prefill --what extend --sweep --variants default h64q1n16w8s3 h64q1n32w8s3 \
  h64q1n64w8s2 h32q2n32w8s2 --out "$out/prefill" 2>&1 | grep -v Warning | tee "$out/prefill.txt" | tail -12
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_decode_triton.py tests/test_quant_append.py \
  tests/test_extend.py tests/test_gather.py tests/test_ragged.py tests/test_sentinel.py tests/test_profile_casts.py \
  2>&1 | tail -12 | tee "$out/pytest_gpu.txt"
cp "$out/step/step.md" "$out/step/step.png" "$out/step/step.csv" "$out/prefill.txt" "$out/pytest_gpu.txt" "$final/"
