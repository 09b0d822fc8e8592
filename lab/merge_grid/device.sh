#!/bin/bash
# The device call of lab/merge_grid on one H200 (~3-5 min, compiles included): the A/B (ab_device.py), then the
# bit-identity cases on the GPU (check.py --gpu). Writes ab.txt, ab.json, check_gpu.txt under $OUT.
#   bash lab/merge_grid/device.sh
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/merge_grid_out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
timeout -s INT -k 5 330 python3 lab/merge_grid/ab_device.py --out "$OUT" 2>&1 | tee "$OUT/ab.txt"
echo "ab_device rc ${PIPESTATUS[0]}"
timeout -s INT -k 5 200 python3 lab/merge_grid/check.py --gpu > "$OUT/check_gpu.txt" 2>&1
echo "check --gpu rc $?"
grep -E "FAIL|bit-identical|Error" "$OUT/check_gpu.txt" | tail -20
