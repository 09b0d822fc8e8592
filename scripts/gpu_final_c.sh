#!/usr/bin/env bash
# Device call C: re-check the kernels after the last changes (extend tiles, gather_cast strategy, gather refactor).
set -u
final=${1:-gpu_out}
mkdir -p "$final"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_triton.py tests/test_extend.py tests/test_gather.py \
  tests/test_attention_grid.py -m "triton or not triton" -k "triton or gather or extend or h128 or large" -x 2>&1 \
  | tail -6 | tee "$final/pytest_c.txt"
timeout 80 python3 -m fp8mla bench decode --heads 16 --kv fp8_e4m3 --pages 64 --shapes 1x32768 64x8192 \
  --strategy gather_cast --reps 20 --out /tmp/gc 2>&1 | grep -e "^fp8mla" -e ceilings | tee "$final/gather_cast.txt"
