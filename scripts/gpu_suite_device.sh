#!/usr/bin/env bash
# The test suite on a GPU machine, in the layout that passed whole on an nvidia-h200-x2 (2026-11-30,
# lab/notebook/gpu_suite_runs.md): two phases of <= 10 min each, each split over two GPUs (one GPU: both parts on it).
#   files: every GPU-relevant file except the attention grid's torch-backend cases, in two parts (A, B) (~4 min)
#   grid:  the grid's 2,000 torch-backend cases, SHARDS-way over the GPUs (~13 min of GPU time: give it two runs,
#          the second with DONE_IDS=<file of node ids that passed> to run only the rest; see scripts/pytest_shard.py)
# CPU-only files (audit, doctor, compile targets, README) are left out: CI runs them.
#
# Usage (repo root):  bash scripts/gpu_suite_device.sh OUTDIR files|grid [WHEEL_DIR]
#   WHEEL_DIR (default .whl): pytest-xdist / execnet / hypothesis wheels, installed with --no-index when the
#   machine lacks them (the device has no network). Prints one summary line per part and a failure list;
#   OUTDIR gets each part's verbose log and, for grid, passed_ids.txt (feed it back as DONE_IDS).
# Env: SUITE_TIMEOUT (s per part, default 530), WORKERS (per part, default 15), DONE_IDS, SHARDS (grid parts,
# default 2).
set -u
out=${1:-out/gpu_suite}
phase=${2:-files}
whl=${3:-.whl}
mkdir -p "$out"
PY=${PYTHON:-python3}
if ! $PY -c 'import xdist, hypothesis' 2>/dev/null; then
  mkdir -p /tmp/suite_pkgs
  pip install -q --no-index --no-deps --target /tmp/suite_pkgs "$whl"/pytest_xdist*.whl "$whl"/execnet*.whl \
      "$whl"/hypothesis*.whl "$whl"/sortedcontainers*.whl "$whl"/attrs*.whl > "$out/pip.txt" 2>&1
  export PYTHONPATH=/tmp/suite_pkgs${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD/scripts:${PYTHONPATH:-} PYTHONUNBUFFERED=1
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
T=${SUITE_TIMEOUT:-530}
W=${WORKERS:-15}
G=tests/test_attention_grid.py
part() {  # name gpu files...
  local name=$1 gpu=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout "$T" $PY -m pytest -v -p no:cacheprovider -p pytest_shard -n "$W" "$@" \
      > "$out/$name.log" 2>&1
  echo "$name exit $?" >> "$out/$name.log"
}
g1=$(( ngpu >= 2 ? 1 : 0 ))
if [ "$phase" = files ]; then
  a=()
  for f in $G::test_backend_slice $G::test_query_dtypes $G::test_requests_without_queries \
      $G::test_scales_as_tensors_match_floats $G::test_causal_alignment_exact tests/test_decode_sm90.py \
      tests/test_decode_sm90_qk8.py tests/test_decode_sm90_split.py tests/test_decode_sm90_pipe.py tests/test_extend.py \
      tests/test_ragged.py tests/test_runner.py tests/test_generate.py tests/test_plan_host_work.py tests/test_tp.py \
      tests/test_nan_inputs.py tests/test_profile_casts.py tests/test_hostile_inputs.py; do
    [ -e "${f%%::*}" ] && a+=("$f")   # a file that has moved to lab/ (or gone) is not an error of the run
  done
  part A 0 "${a[@]}" &
  # B: every other test file (globbed, so a new GPU test file lands here), less the CPU-only ones and A's
  a_files=" test_attention_grid.py test_decode_sm90.py test_decode_sm90_qk8.py test_decode_sm90_split.py
            test_decode_sm90_pipe.py test_extend.py test_ragged.py test_runner.py test_generate.py
            test_plan_host_work.py test_tp.py test_nan_inputs.py test_profile_casts.py test_hostile_inputs.py "
  cpu_only=" test_audit.py test_audit_cli.py test_compile_targets.py test_readme.py test_doctor.py test_fuzz_doctor.py
             test_src_imports.py test_step_scales.py "
  cpu_only=" $(echo $cpu_only) "
  a_files=" $(echo $a_files) "   # one space between names
  b=()
  for f in tests/test_*.py; do
    n=$(basename "$f")
    case "$a_files$cpu_only" in *" $n "*) continue ;; esac
    b+=("$f")
  done
  part B $g1 "${b[@]}" &
  wait
else
  # SHARDS parts (default 2: one per GPU of an x2, both on the one GPU otherwise), each with WORKERS workers;
  # SHARDS=1 runs one part with all the workers (a remainder run with DONE_IDS).
  export SHARDS=${SHARDS:-2}
  for s in $(seq 0 $(( SHARDS - 1 ))); do
    SHARD=$s part grid$s $(( s % (ngpu >= 2 ? 2 : 1) )) $G::test_batch1_h16 $G::test_batched_h16 \
        $G::test_batch1_h128 $G::test_batched_h128 &
  done
  wait
  # this run's passes plus those of DONE_IDS: feed the file to the next run whatever number of runs it takes
  { grep -h " PASSED" "$out"/grid*.log | grep -o "tests/[^ ]*::[^ ]*"; [ -n "${DONE_IDS:-}" ] && cat "$DONE_IDS"; } \
      | sort -u > "$out/passed_ids.new" && mv "$out/passed_ids.new" "$out/passed_ids.txt"
fi
for f in "$out"/*.log; do
  n=$(basename "$f" .log)
  p=$(grep -c " PASSED" "$f"); s=$(grep -c " SKIPPED" "$f"); x=$(grep -c -E " XFAIL| XPASS" "$f")
  fl=$(grep -c -E " FAILED| ERROR" "$f")
  echo "$n: passed $p, skipped $s, xfail/xpass $x, failed/error $fl; $(tail -1 "$f")"
done
grep -h -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$out"/*.log | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -60
