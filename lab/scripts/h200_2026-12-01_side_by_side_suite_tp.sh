#!/usr/bin/env bash
# One GPU run prepared on 2026-12-01 (nothing here is new code). It refreshes what was measured that day only in
# pieces:
#   1. the side-by-side in one process per page size (README table): `fp8mla bench decode` with FlashInfer, page
#      64 (per-tensor, group, BF16) and page 1, with the request-aligned schedule (log 27) and page ids two tiles
#      ahead (log 28) in every row; <= 4 min;
#   2. the GPU suite's files phase (scripts/gpu_suite_device.sh OUT files), <= 5 min;
#   3. with two GPUs (nvidia-h200-x2), the grid phase on the other GPU in parallel and the model step with TP 2
#      (scripts/step_device.sh).
# Usage (repo root, FlashInfer and pytest-xdist wheels in .whl: ../shared/tools/flashinfer-wheels, then
# `pip download pytest-xdist execnet hypothesis sortedcontainers attrs` for cp312 into .whl; with .whl/ present):
#   bash scripts/h200_2026-12-01_side_by_side_suite_tp.sh OUTDIR
set -u
out=${1:-out/next}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/pip.txt" 2>&1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
bench() {
  timeout 300 python3 -m fp8mla bench decode --heads 16 128 --pages 64 --kv fp8_e4m3 fp8_e4m3_group bf16 \
      --compare flashinfer --reps 20 --out "$out/p64" > "$out/p64.txt" 2>&1; echo "rc $?" >> "$out/p64.txt"
  timeout 100 python3 -m fp8mla bench decode --heads 16 128 --pages 1 --kv fp8_e4m3 --reps 20 --out "$out/p1" \
      > "$out/p1.txt" 2>&1; echo "rc $?" >> "$out/p1.txt"
}
if [ "$ngpu" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; bench; SUITE_TIMEOUT=300 WORKERS=12 bash scripts/gpu_suite_device.sh "$out/suite" files ) &
  ( export CUDA_VISIBLE_DEVICES=1; SUITE_TIMEOUT=540 WORKERS=15 bash scripts/gpu_suite_device.sh "$out/grid" grid ) &
  wait
else
  bench
  SUITE_TIMEOUT=280 WORKERS=10 bash scripts/gpu_suite_device.sh "$out/suite" files
fi
grep -h "gluon\|rc \|ceil" "$out"/p64.txt "$out"/p1.txt | head -60
