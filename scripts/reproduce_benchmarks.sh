#!/usr/bin/env bash
# Reproduce the numbers of docs/benchmarks.md on one GPU (two for the TP row). Each part is `fp8mla` commands that
# measure their own ceilings (read bandwidth, bf16 matmul peak) in the same process and check their outputs against
# a float64 reference; the results (CSV, Markdown, PNG, text) go to OUTDIR/<part>/ and OUTDIR/<part>.txt.
#
# Usage (repo root, a CUDA GPU, the package importable or run from the checkout):
#   bash scripts/reproduce_benchmarks.sh OUTDIR [PART ...]
# PARTS (default: all, in this order; each command under a time limit, the limits summing to ~40 minutes):
#   decode     the decode table: H16 and H128, page 64 (FP8 per-tensor, FP8 group scales, BF16 pool) and page 1
#              (FP8), next to FlashInfer fa2/fa3 (when installed) and `fp8_math`; then `strategy=gather_cast`
#                                                             docs/benchmarks.md: "Decode"
#   model      the DeepSeek-V3 MLA stack's decode step (4 layers): page 64 and page 1, eager vs the CUDA-graph
#              runner; TP 2 when two GPUs are visible; `fp8mla generate` with graphs and eager
#                                                             docs: "Model decode step and tensor parallel"
#   step       the KV-cast scenario at GLM-5 size (78 layers, 8 heads per GPU): cast_pool vs gather_cast vs native
#   demo       `fp8mla demo --scale glm5 --part scenario`: the same scenario profiled and read by the doctor
#                                                             docs: "The KV-cast scenario"
#   prefill    paged extend and ragged prefill vs the bf16 matmul ceiling
#   write      quantize-on-write and gather-then-cast vs the bandwidth ceiling
#                                                             docs: "Prefill and write"
# Env: PYTHON (default python3); REPS (timed replays per decode point, default 20); FLASHINFER_WHEELS (a folder of
# FlashInfer wheels installed into a scratch --target for the side-by-side; default .whl/ when it holds any).
# Not here: the GPU test suite (scripts/gpu_suite_device.sh), kernel SASS checks without a GPU
# (scripts/compile_kernels.py). One hung command cannot take the others down (`timeout`); the exit status is the
# number of commands that failed.
set -u
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  grep '^#' "$0" | tail -n +2
  exit 2
fi
out=$1
shift
parts=${*:-decode model step demo prefill write}
py=${PYTHON:-python3}
reps=${REPS:-20}
for part in $parts; do  # every name checked before anything runs
  case $part in decode|model|step|demo|prefill|write) ;;
    *) echo "unknown part '$part'; expected: decode model step demo prefill write" >&2; exit 2 ;;
  esac
done
mkdir -p "$out" || exit 2
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off for the TP run (NCCL, PyTorch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

wheels=${FLASHINFER_WHEELS:-.whl}
compare=""
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fp8mla-site \
    "$wheels"/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/fp8mla-site
fi
if "$py" -c "import flashinfer" >/dev/null 2>&1; then
  compare="flashinfer"
else
  echo "note: flashinfer does not import: the decode part runs without the side-by-side" >&2
fi

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: none"
  git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown"
  date -u
} | tee "$out/environment.txt"

failed=0
run() {  # run PART SECONDS COMMAND...: output to OUTDIR/PART.txt, a line saying how it ended
  local part=$1 limit=$2
  shift 2
  mkdir -p "$out/$part"
  echo "== $part: $*" >&2
  timeout "$limit" "$@" > "$out/$part.txt" 2>&1
  local rc=$?
  tail -5 "$out/$part.txt" >&2
  echo >&2
  if [ $rc -ne 0 ]; then
    echo "== $part: FAILED (exit $rc; $([ $rc -eq 124 ] && echo "over ${limit}s" || echo "see $out/$part.txt"))" >&2
    failed=$((failed + 1))
  fi
}

for part in $parts; do
  case $part in
    decode)
      # shellcheck disable=SC2086  # $compare is a list of words
      run decode_p64 420 "$py" -m fp8mla bench decode --heads 16 128 --pages 64 --kv fp8_e4m3 fp8_e4m3_group bf16 \
        --compare $compare fp8_math --reps "$reps" --out "$out/decode_p64"
      run decode_p1 240 "$py" -m fp8mla bench decode --heads 16 128 --pages 1 --kv fp8_e4m3 --reps "$reps" \
        --out "$out/decode_p1"
      run decode_gather_cast 120 "$py" -m fp8mla bench decode --heads 16 --kv fp8_e4m3 --pages 64 \
        --shapes 1x32768 64x8192 --strategy gather_cast --reps "$reps" --out "$out/decode_gather_cast" ;;
    model)
      run model_p64 150 "$py" -m fp8mla bench step --model --config dsv3 --layers 4 --reps 10 \
        --points 1x4096,64x8192 --page-size 64 --out "$out/model_p64"
      run model_p1 120 "$py" -m fp8mla bench step --model --config dsv3 --layers 4 --reps 10 \
        --points 64x8192 --page-size 1 --out "$out/model_p1"
      if [ "$("$py" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        run model_tp2 200 "$py" -m torch.distributed.run --nproc-per-node 2 --master-port 29517 -m fp8mla bench step \
          --tp 2 --config dsv3 --layers 4 --reps 10 --points 64x8192 --page-size 64 --out "$out/model_tp2"
      else
        echo "== model_tp2: skipped (needs 2 GPUs)" >&2
      fi
      run generate_graphs 120 "$py" -m fp8mla generate --config dsv3 --layers 4 --prompts 128 --prompt-len 256 \
        --max-new-tokens 64 --max-batch 64 --no-progress
      run generate_eager 120 "$py" -m fp8mla generate --config dsv3 --layers 4 --prompts 128 --prompt-len 256 \
        --max-new-tokens 64 --max-batch 64 --no-progress --eager ;;
    step)
      run step 300 "$py" -m fp8mla bench step --scale glm5 --batches 1,8,32,64 --contexts 4k,8k,32k \
        --reps 10 --out "$out/step" ;;
    demo)
      run demo 200 "$py" -m fp8mla demo --scale glm5 --part scenario ;;
    prefill)
      run prefill 200 "$py" -m fp8mla bench prefill --out "$out/prefill" ;;
    write)
      run write 120 "$py" -m fp8mla bench write --out "$out/write" ;;
  esac
done
echo "results in $out/ ($failed command(s) failed)" >&2
exit "$failed"
