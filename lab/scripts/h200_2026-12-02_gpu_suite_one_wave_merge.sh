#!/usr/bin/env bash
# One H200 run of 2026-12-02 (<= 9 min): the GPU suite on the tree with the
# one-wave split merge and the SGLang test fixes.
#   files  scripts/gpu_suite_device.sh files (every GPU-relevant file but the grid's torch-backend cases; two parts
#          on the one GPU, 12 workers each)
#   grid   the grid's torch-backend cases not passed yet (DONE_IDS = lab/notebook/data/gpu_2026-12-02/grid/
#          passed_ids.txt: 1,793 of 2,000), one part, 15 workers
# OUT gets summary.txt, passed_ids.txt, logs.tgz.
# Usage (repo root; with .whl/ present for pytest-xdist):  bash lab/scripts/h200_2026-12-02_gpu_suite_one_wave_merge.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s3c2 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
SUITE_TIMEOUT=330 WORKERS=12 bash scripts/gpu_suite_device.sh "$work/files" files > "$work/files.txt" 2>&1
say "files:"; cat "$work/files.txt" >> "$out/summary.txt"; pack
SUITE_TIMEOUT=170 WORKERS=15 SHARDS=1 DONE_IDS=$PWD/lab/notebook/data/gpu_2026-12-02/grid/passed_ids.txt \
    bash scripts/gpu_suite_device.sh "$work/grid" grid > "$work/grid.txt" 2>&1
say "grid:"; cat "$work/grid.txt" >> "$out/summary.txt"
cp "$work/grid/passed_ids.txt" "$out/" 2>/dev/null
say "grid ids passed in all: $(wc -l < "$out/passed_ids.txt" 2>/dev/null)"
pack
say done
