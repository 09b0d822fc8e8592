#!/usr/bin/env bash
# Reproduce the numbers of docs/benchmarks.md on one GPU. Each part is one `fp8mla` command that measures its own
# ceilings (read bandwidth, bf16 matmul peak) in the same process and checks its outputs against a float64
# reference; the results (CSV, Markdown, PNG, text) go to OUTDIR/<part>/.
#
# Usage (repo root, a CUDA GPU, the package importable or run from the checkout):
#   bash scripts/reproduce_benchmarks.sh OUTDIR [PART ...]
# PARTS (default: all, in this order; each under a time limit, 31 minutes in all; written from the commands of
# the device runs behind the docs, not yet run end to end as one script):
#   decode     paged MLA decode grid, H16 and H128, page 64 and 1, FP8 and BF16 pools, next to FlashInfer (when
#              installed) and the gather_cast strategy        docs: "Decode", "strategy=gather_cast"
#   step       the 69%-cast scenario at GLM-5 size: one decode step's attention over 78 layers, cast_pool vs
#              gather_cast vs native, B 1-64 x context 4K-32K docs: "The 69%-cast scenario"
#   demo       `fp8mla demo --scale glm5 --part scenario`: the same scenario profiled and read by the doctor
#   prefill    paged extend and ragged prefill vs the bf16 matmul ceiling     docs: "Prefill and write paths"
#   write      quantize-on-write and gather-then-cast vs the bandwidth ceiling
#   decode_v2  the Gluon sm_90 decode kernel (Hopper only): scripts/decode_v2_device.py all
#                                                             docs: "Decode v2"
# Env: PYTHON (default python3); REPS (timed replays per point, default 30); FLASHINFER_WHEELS (a folder of
# FlashInfer wheels installed into a scratch --target for the side-by-side; default .whl/ when it holds any).
# Not here: the model-stack step and tensor parallel (scripts/step_device.sh), kernel SASS checks without a GPU
# (scripts/compile_*). Each part runs under `timeout` so that one hung part cannot take the others down;
# the exit status is the number of parts that failed.
set -u
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  grep '^#' "$0" | tail -n +2
  exit 2
fi
out=$1
shift
parts=${*:-decode step demo prefill write decode_v2}
py=${PYTHON:-python3}
reps=${REPS:-30}
for part in $parts; do  # every name checked before anything runs
  case $part in decode|step|demo|prefill|write|decode_v2) ;;
    *) echo "unknown part '$part'; expected: decode step demo prefill write decode_v2" >&2; exit 2 ;;
  esac
done
mkdir -p "$out" || exit 2
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

wheels=${FLASHINFER_WHEELS:-.whl}
compare="gather_cast"
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fp8mla-site \
    "$wheels"/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/fp8mla-site
fi
if "$py" -c "import flashinfer" >/dev/null 2>&1; then
  compare="flashinfer gather_cast"
else
  echo "note: flashinfer does not import: the decode part runs without the side-by-side" >&2
fi

{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
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
      for H in 16 128; do
        # shellcheck disable=SC2086  # $compare is a list of words
        run "decode_h$H" 300 "$py" -m fp8mla bench decode --heads "$H" --compare $compare --reps "$reps" \
          --out "$out/decode_h$H"
      done
      run decode_gather_cast 120 "$py" -m fp8mla bench decode --heads 16 --kv fp8_e4m3 --pages 64 \
        --shapes 1x32768 64x8192 --strategy gather_cast --reps "$reps" --out "$out/decode_gather_cast" ;;
    step)
      run step 300 "$py" -m fp8mla bench step --scale glm5 --batches 1,8,32,64 --contexts 4k,8k,32k \
        --reps 10 --out "$out/step" ;;
    demo)
      run demo 200 "$py" -m fp8mla demo --scale glm5 --part scenario ;;
    prefill)
      run prefill 200 "$py" -m fp8mla bench prefill --out "$out/prefill" ;;
    write)
      run write 120 "$py" -m fp8mla bench write --out "$out/write" ;;
    decode_v2)
      if "$py" -c "import torch, sys; sys.exit(torch.cuda.get_device_capability() != (9, 0))"; then
        export OUT="$out/decode_v2"  # where decode_v2_device.py writes its JSON
        run decode_v2 300 "$py" scripts/decode_v2_device.py all
        unset OUT
      else
        echo "== decode_v2: skipped (the Gluon kernel needs sm_90)" >&2
      fi ;;
  esac
done
echo "results in $out/ ($failed part(s) failed)" >&2
exit "$failed"
