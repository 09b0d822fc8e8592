#!/usr/bin/env bash
# Device call A: the decode grid with FlashInfer, the 69%-cast scenario (bench step, demo) at deployment scale.
set -u
final=${1:-gpu_out}
out=/tmp/res
mkdir -p "$out" "$final"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for H in 16 128; do
  timeout 170 python3 -m fp8mla bench decode --heads $H --compare flashinfer gather_cast --reps 30 \
    --out "$out/decode$H" 2>&1 | grep -v -e Warning -e capture_end | tee "$out/decode$H.txt" | tail -3
done
timeout 150 python3 -m fp8mla bench step --scale glm5 --batches 1,8,32,64 --contexts 4k,8k,32k --reps 10 \
  --out "$out/step" 2>&1 | grep -v Warning | tee "$out/step.txt" | tail -25
timeout 90 python3 -m fp8mla demo --scale glm5 --part scenario 2>&1 | grep -v Warning | tail -22 | tee "$out/demo.txt"
# At most 8 files come back from the device: keep the ones the docs need.
cp "$out/decode16.txt" "$out/decode128.txt" "$out/demo.txt" "$final/"
cp "$out/decode16/decode.csv" "$final/decode16.csv"; cp "$out/decode128/decode.csv" "$final/decode128.csv"
cp "$out/decode16/decode.png" "$final/decode16.png"
cp "$out/step/step.md" "$final/step.md"; cp "$out/step/step.png" "$final/step.png"
