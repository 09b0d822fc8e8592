#!/usr/bin/env bash
# The model-step targets in one GPU run: the DeepSeek-V3 MLA layer stack's decode step (fp8mla bench step --model),
# eager vs the CUDA-graph runner, with begin_step's host time, the kernels' device time and the roofline floor;
# tensor parallel over 2 GPUs with the speed-up over tp 1 printed in the same run; generate's tokens/s with graphs
# on and off.
#
# Usage (repo root):
#   bash scripts/step_device.sh OUTDIR          GPU(s): TP 2 runs when 2 or more GPUs are visible, else says so
#   bash scripts/step_device.sh OUTDIR --dry    CPU plumbing check (tiny config, gloo, no graphs; not a benchmark)
# Env: LAYERS (default 4), REPS (default 20), PYTHON (default python3).
#
# Targets (H200, dsv3 shape, 128 heads; see docs/benchmarks.md):
#   B=1 ctx 4096: graph step <= 1.3x the kernels' device time    (column graph/kern of run 1, row B=1)
#   B=64 ctx 8192: graph step <= 1.5x the roofline floor          (column graph/floor of run 1, row B=64)
#   begin_step <= 0.3 ms at B=64 page 64 (run 1, begin_ms), <= 1 ms at B=64 ctx 8192 page 1 (run 2, begin_ms)
#   TP 2 at B=64 ctx 8192: >= 1.7x faster than one GPU             (run 3, "speed-up ... (graphs)")
set -u
out=${1:-out/step_device}
mode=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (KINDS.md): NCCL, PyTorch's symmetric memory, NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-4}
REPS=${REPS:-20}

if [ "$mode" = "--dry" ]; then
  model=(--config tiny --layers 1 --reps 2 --device cpu)
  p64=1x40,3x100; p1=3x100; ptp=3x100; ngpu=2
  gen=(--config tiny --layers 1 --prompts 4 --prompt-len 16 --max-new-tokens 4 --max-batch 4 --device cpu)
  export OMP_NUM_THREADS=1
else
  model=(--config dsv3 --layers "$LAYERS" --reps "$REPS")
  p64=1x4096,64x8192; p1=64x8192; ptp=64x8192
  ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
  gen=(--config dsv3 --layers "$LAYERS" --prompts 128 --prompt-len 256 --max-new-tokens 64 --max-batch 64)
fi
rc=0
run() {  # name, timeout, command...
  local name=$1 t=$2
  shift 2
  echo "== $name: $*"
  timeout "$t" "$@" 2>&1 | tee "$out/$name.txt"
  local s=${PIPESTATUS[0]}
  [ "$s" = 0 ] || { echo "== $name: exit status $s"; rc=1; }
}

run step_page64 150 $PY -m fp8mla bench step --model "${model[@]}" --points "$p64" --page-size 64 --out "$out"
run step_page1 120 $PY -m fp8mla bench step --model "${model[@]}" --points "$p1" --page-size 1 --out "$out"
if [ "$ngpu" -ge 2 ]; then
  run step_tp2 200 $PY -m torch.distributed.run --nproc-per-node 2 --master-port 29517 -m fp8mla bench step --tp 2 \
    "${model[@]}" --points "$ptp" --page-size 64 --out "$out"
else
  echo "== step_tp2: not run, $ngpu GPU(s) visible (needs 2: nvidia-h200-x2)" | tee "$out/step_tp2.txt"
fi
run generate_graphs 120 $PY -m fp8mla generate "${gen[@]}" --no-progress
run generate_eager 120 $PY -m fp8mla generate "${gen[@]}" --no-progress --eager
grep -h "speed-up\|tok/s\|CUDA graphs\|steps: eager" "$out"/step_tp2.txt "$out"/generate_*.txt 2>/dev/null
exit $rc
