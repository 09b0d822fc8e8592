#!/usr/bin/env bash
# One H200 run of 2026-12-02, 09:13 UTC (<= 9.5 min):
#   merge   lab/merge_grid/device.sh: the strided/flat split merge against the product's in 256-slot CUDA-graph
#           plans and plain plans, both Gluon builds (this also times heads-on-M against wide in graph mode)
#   sgl     SGLang 0.5.23's attention test kit on the GPU (lab/scripts/sglang_kit_device.sh; with .sgl_whl/ present)
#   golden  python -m devtools.sass check under the device's triton (in parallel with sgl: CPU only)
#   qmag    lab/scripts/qmag_ab_device.py (large-query error, heads-on-M vs wide vs Triton; in parallel with sgl)
# OUT gets summary.txt and logs.tgz (every log), plus ab.json.
# Usage (repo root; with .sgl_whl/ and .whl/ present):  bash lab/scripts/h200_2026-12-02_merge_grid_sglang_golden.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s3c1 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } \
  > "$work/environment.txt" 2>&1
say "$(tr '\n' ' ' < "$work/environment.txt")"
OUT=$work/merge timeout -k 5 300 bash lab/merge_grid/device.sh > "$work/merge.txt" 2>&1
say "merge rc $?"; tail -n 45 "$work/merge.txt" >> "$out/summary.txt"; cp "$work/merge/ab.json" "$out/" 2>/dev/null; pack
( PYTHONPATH=$PWD/src:$PWD timeout 150 python3 -m devtools.sass check > "$work/golden.txt" 2>&1; echo "rc $?" >> "$work/golden.txt" ) &
( sleep 5; PYTHONPATH=$PWD/src timeout 100 python3 lab/scripts/qmag_ab_device.py > "$work/qmag.txt" 2>&1; echo "rc $?" >> "$work/qmag.txt" ) &
mkdir -p "$work/sgl"
KIT_TIMEOUT=130 WORKERS=6 timeout 200 bash lab/scripts/sglang_kit_device.sh "$work/sgl" > "$work/sgl.txt" 2>&1
say "sgl rc $?"; tail -n 30 "$work/sgl.txt" >> "$out/summary.txt"
wait
say "golden:"; tail -n 15 "$work/golden.txt" >> "$out/summary.txt"
say "qmag:"; tail -n 40 "$work/qmag.txt" >> "$out/summary.txt"
pack
say "done"
