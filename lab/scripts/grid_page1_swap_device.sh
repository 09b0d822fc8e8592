#!/usr/bin/env bash
# Three GPU checks in one run of <= 8 minutes on one H200 (first used 2026-12-02):
#   grid   the attention grid's torch-backend cases missing from an earlier run (every node id in
#          lab/notebook/data/gpu_2026-12-02/grid/passed_ids.txt is deselected), one part, 15 workers; the ids that
#          pass are merged with that file into OUT/passed_ids.txt (feed it back as DONE_IDS if the cap cuts again)
#   p1     `fp8mla bench decode` at page 1, FP8 e4m3, 16 and 128 heads, with FlashInfer fa3 and fa2 attempted at
#          every point (a point FlashInfer cannot plan or run prints its error); their JIT variants are built in
#          the background while the grid runs, so the phase's time goes to timing
#   swap   FlashInfer's MLA wrapper tests with fp8mla swapped in, alone, without the 240 s per-run cut of
#          run.sh's default (FI_RUN_CAP lifted to what is left); then FlashInfer itself if >= 100 s are left
# Every phase runs under `timeout` inside a total of TOTAL_S (default 475 s); a phase that fails or is cut does
# not stop the next. OUT gets <= 7 files: summary.txt (each phase's result lines, written as it goes),
# environment.txt, passed_ids.txt, decode_p1.csv, swap_summary.md, logs.tgz (every log; re-packed after each
# phase, so a run cut short still brings back what ran).
# Usage (repo root, with the FlashInfer wheel in .whl/ and its tests in .fi_tests/):
#   bash lab/scripts/grid_page1_swap_device.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=${WORK:-/tmp/grid_page1_swap}
rm -rf "$work" && mkdir -p "$work"
total=${TOTAL_S:-475}
t0=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
elapsed() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( total - $(elapsed) )); }
cap() {  # cap NOMINAL RESERVE: NOMINAL, or what is left less RESERVE (the later phases' share), at least 10
  local c=$(( $(left) - $2 )); [ "$c" -gt "$1" ] && c=$1; [ "$c" -lt 10 ] && c=10; echo "$c"; }
say() { echo "[$(elapsed) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }

# FlashInfer wheels into /tmp/site (the phases below find it on PYTHONPATH; run.sh checks before installing).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl > "$work/pip.txt" 2>&1 || say "pip install of .whl failed (see logs.tgz pip.txt)"
else
  say "no .whl/*.whl: FlashInfer will be missing (bash /work/shared/tools/flashinfer-wheels, then pass .whl/ along)"
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null || echo "commit: (no git here)"; date -u; } > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
say "setup done"

# FlashInfer's two JIT variants of the page-1 bench, built on the side while the grid runs (CPU only; niced).
nice -n 10 timeout 200 python3 scripts/flashinfer_swap/prebuild_jit.py --bench > "$work/fi_prebuild.txt" 2>&1 &
prebuild=$!

# --- grid: the remainder of the attention grid's torch-backend cases -------------------------------------------
done_ids=lab/notebook/data/gpu_2026-12-02/grid/passed_ids.txt
if [ -f "$done_ids" ]; then
  c=$(cap 160 305)   # the grid gives way first: the swap is the phase that must finish
  DONE_IDS=$PWD/$done_ids SHARDS=1 WORKERS=15 SUITE_TIMEOUT=$c timeout -k 10 $(( c + 25 )) \
      bash scripts/gpu_suite_device.sh "$work/grid" grid > "$work/grid_summary.txt" 2>&1
  echo "rc $?" >> "$work/grid_summary.txt"
  [ -f "$work/grid/passed_ids.txt" ] && cp "$work/grid/passed_ids.txt" "$out/passed_ids.txt"
  n=$(wc -l < "$out/passed_ids.txt" 2>/dev/null || echo '?')
  say "grid (cap $c s): $(head -1 "$work/grid_summary.txt"); passed ids now $n of 2000"
  grep -E "FAILED|ERROR" "$work/grid_summary.txt" | head -20 | tee -a "$out/summary.txt"
else
  say "grid skipped: $done_ids missing"
fi
# A grid worker still on the GPU would be timed with the bench: say so (timeout ends the part's process group).
n=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)
say "GPU compute processes after the grid: $n"
pack

# --- p1: the decode side-by-side at page 1 with FlashInfer ------------------------------------------------------
wait "$prebuild" 2>/dev/null; say "FlashInfer prebuild: $(tail -n 1 "$work/fi_prebuild.txt")"
c=$(cap 100 205)
timeout -k 10 "$c" python3 -m fp8mla bench decode --heads 16 128 --pages 1 --kv fp8_e4m3 --compare flashinfer \
    --reps 20 --out "$work/p1" > "$work/p1.txt" 2>&1
echo "rc $?" >> "$work/p1.txt"
[ -f "$work/p1/decode.csv" ] && cp "$work/p1/decode.csv" "$out/decode_p1.csv"
say "decode page 1 (cap $c s): $(tail -n 1 "$work/p1.txt"), $(grep -c " ms " "$work/p1.txt") timed rows"
grep -E "ceil|GB/s|flashinfer|failed|not planned|not taken" "$work/p1.txt" | head -60 | tee -a "$out/summary.txt"
pack

# --- swap: FlashInfer's own MLA tests with fp8mla swapped in, to the end of the selection -----------------------
c=$(cap 240 8)
FI_MODES=fp8mla FI_CONTRACT=0 FI_BUDGET=$(( c + 5 )) FI_RUN_CAP=$c timeout -k 10 $(( c + 20 )) \
    bash scripts/flashinfer_swap/run.sh "$work/swap_fp8mla" > "$work/swap_fp8mla.txt" 2>&1
echo "rc $?" >> "$work/swap_fp8mla.txt"
res=$(grep -E "[0-9]+ (passed|failed|skipped|error)|^exit " "$work/swap_fp8mla/fp8mla.txt" 2>/dev/null | tr '\n' ' ')
say "swap fp8mla (cap $c s): $res"
tail -n 25 "$work/swap_fp8mla.txt" | tee -a "$out/summary.txt"
[ -f "$work/swap_fp8mla/summary.md" ] && cp "$work/swap_fp8mla/summary.md" "$out/swap_summary.md"
pack

# --- FlashInfer itself on the same selection, only if the run has the time -------------------------------------
if [ "$(left)" -ge 100 ]; then
  c=$(( $(left) - 15 ))
  FI_MODES=flashinfer FI_CONTRACT=0 FI_BUDGET=$(( c + 5 )) FI_RUN_CAP=$c timeout -k 10 $(( c + 10 )) \
      bash scripts/flashinfer_swap/run.sh "$work/swap_flashinfer" > "$work/swap_flashinfer.txt" 2>&1
  say "swap FlashInfer itself (cap $c s): $(tail -n 6 "$work/swap_flashinfer.txt" | tr '\n' ' ')"
  pack
else
  say "FlashInfer-alone swap run not attempted: $(left) s left"
fi
say "done"
