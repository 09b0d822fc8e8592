#!/usr/bin/env bash
# The ported warp-specialized Gluon sparse build (src/fp8mla/kernels/sm90/sparse.py + sparse_partitions.py, branch
# sparse_port) on one H200, in one GPU run of <= 150 s (each step's limit within what is left of TOTAL_S):
#   1. tests/test_sparse_gluon.py: float64 checks through MLASparseAttention(backend="gluon") and "auto" (odd topk,
#      fixed and one-wave splits, NaN records, -1 / out-of-pool entries, poisoned outputs, rerun, CUDA graph) ~60 s
#   2. fp8mla bench decode --sparse at H128 / H16 / H8, topk 2048 of 4,096 tokens, B64, page 64 (the shape of
#      docs/benchmarks.md's sparse table): auto's pick ("fp8mla sparse [gluon]") beside the Triton kernel
#      ("[triton]"), with the dense decode over the same requests and the ceilings of the same process      ~50 s
#   3. the other sparse tests (tests/test_sparse_triton.py, tests/test_sparse_attention.py), in what time is left
# Usage (repo root):  bash lab/scripts/sparse_port_device.sh OUT
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
budget() { local left=$(( ${TOTAL_S:-145} - ($(date +%s) - t0) )); [ "$left" -lt "$1" ] && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null || true; date -u; } > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

# SIGINT: pytest stops and still prints its summary (-rfEs: failures, errors, skips with their reasons)
timeout -s INT -k 5 "$(budget 70)" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    -n 8 tests/test_sparse_gluon.py -k sparse > "$out/tests_sparse_gluon.txt" 2>&1
echo "exit $?" >> "$out/tests_sparse_gluon.txt"
say "gluon sparse tests done"; tail -n 12 "$out/tests_sparse_gluon.txt"

timeout -s INT -k 5 "$(budget 55)" python3 -m fp8mla bench decode --sparse --topk 2048 --heads 128 16 8 \
    --shapes 64x4096 --pages 64 --reps 20 --out "$out/sparse" > "$out/bench_sparse.txt" 2>&1
echo "exit $?" >> "$out/bench_sparse.txt"
say "sparse bench done"; grep -E "fp8mla sparse|fp8mla dense|exit|Error" "$out/bench_sparse.txt" | tail -n 12

timeout -s INT -k 5 "$(budget 60)" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    -n 8 tests/test_sparse_triton.py tests/test_sparse_attention.py -k sparse > "$out/tests_sparse_other.txt" 2>&1
echo "exit $?" >> "$out/tests_sparse_other.txt"
say "other sparse tests done"; tail -n 8 "$out/tests_sparse_other.txt"
