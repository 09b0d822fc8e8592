#!/usr/bin/env bash
# One H200 run of 2026-12-02, 17:38 UTC (<= 9.5 min):
#   table  the decode table of docs/benchmarks.md (page 64, 16 and 128 heads, per-tensor / group / BF16 pool,
#          FlashInfer fa3 + fa2, fp8_math) on today's tree (heads-on-M picked at 128 heads), then 64 heads beside
#          FlashInfer (the side-by-side), then page 1 (no FlashInfer)
#   spread heads-on-M vs wide in CUDA-graph wrappers at spread lengths (lab/scripts/graph_spread_device.py)
# Usage (repo root, with the FlashInfer wheel in .whl/; the SGLang wheels in .sgl_whl/ do not fit beside it):  bash lab/scripts/h200_2026-12-02_decode_table_graph_spread.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s4c1 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > "$work/pip.txt" 2>&1 || say "pip install of .whl failed"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  PYTHONPATH=/tmp/site python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null || echo "commit: (no git here)"; date -u; } > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
# FlashInfer's bench JIT variants (the JIT builds go to the CPUs before the timing starts)
PYTHONPATH=$PWD/src:$PWD:/tmp/site nice -n 10 timeout 200 python3 scripts/flashinfer_swap/prebuild_jit.py --bench \
    > "$work/fi_prebuild.txt" 2>&1 &
prebuild=$!

export PYTHONPATH=$PWD/src:$PWD:/tmp/site
timeout -k 10 100 python3 lab/scripts/graph_spread_device.py --out "$work/graph_spread.json" > "$work/spread.txt" 2>&1
say "spread rc $?"; cat "$work/spread.txt" >> "$out/summary.txt"
cp "$work/graph_spread.json" "$out/" 2>/dev/null
pack
wait "$prebuild" 2>/dev/null; say "FlashInfer prebuild: $(tail -n 1 "$work/fi_prebuild.txt")"
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
timeout -k 10 290 python3 -m fp8mla bench decode --heads 16 128 --pages 64 --kv fp8_e4m3 fp8_e4m3_group bf16 \
    --compare flashinfer fp8_math wide_heads --reps 10 --out "$work/p64" > "$work/p64.txt" 2>&1
say "table p64 rc $?: $(grep -c ' ms ' "$work/p64.txt") timed rows"; grep -E "^ceil|failed|not planned" "$work/p64.txt" | head -20 | tee -a "$out/summary.txt"
cp "$work/p64/decode.csv" "$out/decode_p64.csv" 2>/dev/null; cp "$work/p64/decode.png" "$out/decode_p64.png" 2>/dev/null
pack
timeout -k 10 70 python3 -m fp8mla bench decode --heads 64 --pages 64 --kv fp8_e4m3 bf16 --shapes 64x8192 8x8192 1x32768 \
    --compare flashinfer wide_heads --reps 10 --out "$work/h64" > "$work/h64.txt" 2>&1
say "h64 rc $?"; grep -E " ms " "$work/h64.txt" | tee -a "$out/summary.txt"
cp "$work/h64/decode.csv" "$out/decode_h64.csv" 2>/dev/null
pack
left=$(( 560 - ($(date +%s) - t0) ))
if [ "$left" -gt 40 ]; then
  timeout -k 5 "$left" python3 -m fp8mla bench decode --heads 16 128 --pages 1 --kv fp8_e4m3 --reps 10 \
      --out "$work/p1" > "$work/p1.txt" 2>&1
  say "p1 rc $?"; cp "$work/p1/decode.csv" "$out/decode_p1.csv" 2>/dev/null
fi
pack; say done
