#!/usr/bin/env bash
# The GPU re-verification of a merged tree on one H200, in phases that each fit one GPU run.
#   suite   the GPU test suite (every file but the CPU-only ones; the attention grid's 2,000 torch-backend cases
#           only as far as GRID_SHARDS/GRID_SHARD pick), xdist over the 16 cores, one GPU
#   bench   the decode side-by-side with FlashInfer (page 64 and page 1; FP8 per-tensor, group, BF16; fp8_math),
#           then the model step (B=1, B=64) and `fp8mla generate` with CUDA graphs and eager; the golden SASS file of
#           the device's triton when devtools can record it
#   swap    FlashInfer's own MLA wrapper tests, FlashInfer alone and with fp8mla swapped in
# Usage (repo root; with .whl/ for FlashInfer and .fi_tests for swap):  bash lab/scripts/gpu_suite_bench_swap_device.sh OUT PHASE...
set -u
out=${1:?OUT}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      > "$out/pip.txt" 2>&1
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/site
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true; date -u; } | tee "$out/environment.txt"
for phase in "$@"; do
  case $phase in
    suite)
      cpu_only=" test_audit.py test_audit_cli.py test_compile_targets.py test_compile_sparse.py test_readme.py
                 test_doctor.py test_fuzz_doctor.py test_sm90_golden.py test_imports.py "
      files=()
      for f in tests/test_*.py; do
        n=$(basename "$f"); case "$cpu_only" in *" $n "*) continue ;; esac; files+=("$f")
      done
      G=tests/test_attention_grid.py
      desel=()
      if [ -z "${GRID_SHARDS:-}" ]; then
        for t in test_batch1_h16 test_batched_h16 test_batch1_h128 test_batched_h128; do desel+=(--deselect "$G::$t"); done
      fi
      timeout -s INT -k 20 "${SUITE_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-14}" \
          -rfE --tb=short "${files[@]}" "${desel[@]}" --junitxml="$out/suite.xml" > "$out/suite.txt" 2>&1
      echo "exit $?" >> "$out/suite.txt"
      tail -n 40 "$out/suite.txt"
      say "suite done" ;;
    bench)
      timeout 330 python3 -m fp8mla bench decode --heads 16 128 --pages 64 --kv fp8_e4m3 fp8_e4m3_group bf16 \
          --compare flashinfer fp8_math --reps 20 --out "$out/p64" > "$out/p64.txt" 2>&1; echo "rc $?" >> "$out/p64.txt"
      say "decode page 64 done"; tail -n 30 "$out/p64.txt"
      timeout 120 python3 -m fp8mla bench decode --heads 16 128 --pages 1 --kv fp8_e4m3 --compare flashinfer --reps 20 \
          --out "$out/p1" > "$out/p1.txt" 2>&1; echo "rc $?" >> "$out/p1.txt"
      say "decode page 1 done"; tail -n 20 "$out/p1.txt"
      if [ "${STEP:-1}" = 1 ]; then
        sd=$(ls scripts/step_device.sh lab/scripts/step_device.sh 2>/dev/null | head -1)
        LAYERS=4 REPS=20 timeout 330 bash "$sd" "$out/step" > "$out/step.txt" 2>&1
        say "step done"; grep -h "B=\|speed\|tok/s\|graph\|begin" "$out/step.txt" | head -30
      fi ;;
    golden)
      timeout 200 python3 -m devtools.sass record --out "$out/golden" > "$out/golden.txt" 2>&1; echo "rc $?" >> "$out/golden.txt"
      tail -n 5 "$out/golden.txt"; say "golden done" ;;
    swap)
      FI_BUDGET=${FI_BUDGET:-285} timeout 320 bash scripts/flashinfer_swap/run.sh "$out/swap" > "$out/swap.txt" 2>&1
      tail -n 40 "$out/swap.txt"; say "swap done" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
