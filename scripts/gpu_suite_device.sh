#!/usr/bin/env bash
# The test suite on a GPU machine in one device call (<= 10 min): the attention grid on one GPU, every other
# GPU-relevant file on the next (or both on the one GPU when only one is visible), pytest-xdist workers per GPU.
# CPU-only files (audit, doctor, compile targets, README) are left out: CI runs them.
#
# Usage (repo root):  bash scripts/gpu_suite_device.sh OUTDIR [WHEEL_DIR]
#   WHEEL_DIR (default .whl): pytest-xdist / execnet / hypothesis wheels, installed with --no-index when the
#   machine lacks them (the device has no network). Prints one summary line per part and a failure list;
#   OUTDIR gets each part's verbose log.
# Env: SUITE_TIMEOUT (s per part, default 500), WORKERS (per part, default cores / parts - 1).
set -u
out=${1:-out/gpu_suite}
whl=${2:-.whl}
mkdir -p "$out"
PY=${PYTHON:-python3}
if ! $PY -c 'import xdist, hypothesis' 2>/dev/null; then
  mkdir -p /tmp/suite_pkgs
  pip install -q --no-index --no-deps --target /tmp/suite_pkgs "$whl"/pytest_xdist*.whl "$whl"/execnet*.whl \
      "$whl"/hypothesis*.whl "$whl"/sortedcontainers*.whl "$whl"/attrs*.whl > "$out/pip.txt" 2>&1
  export PYTHONPATH=/tmp/suite_pkgs${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
cores=$(nproc)
cpu_only="test_audit.py test_audit_cli.py test_compile_targets.py test_readme.py test_doctor.py test_fuzz_doctor.py"
rest=()
for f in tests/test_*.py; do
  b=$(basename "$f")
  case " $cpu_only test_attention_grid.py " in *" $b "*) continue ;; esac
  rest+=("$f")
done
T=${SUITE_TIMEOUT:-500}
part() {  # name gpu workers files...
  local name=$1 gpu=$2 w=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$T" $PY -m pytest -v -p no:cacheprovider -n "$w" "$@" > "$out/$name.log" 2>&1
  echo "$name exit $?" >> "$out/$name.log"
}
if [ "$ngpu" -ge 2 ]; then
  w=${WORKERS:-$(( cores / 2 - 1 ))}
  part grid 0 "$w" tests/test_attention_grid.py &
  part rest 1 "$w" "${rest[@]}" &
  wait
else
  w=${WORKERS:-$(( cores - 1 ))}
  part all 0 "$w" tests/test_attention_grid.py "${rest[@]}"
fi
for f in "$out"/*.log; do
  n=$(basename "$f" .log)
  p=$(grep -c " PASSED" "$f"); s=$(grep -c " SKIPPED" "$f"); x=$(grep -c -E " XFAIL| XPASS" "$f")
  fl=$(grep -c -E " FAILED| ERROR" "$f")
  items=$(grep -m1 -o -E "\[[0-9]+ items?\]" "$f")
  echo "$n: $items passed $p, skipped $s, xfail/xpass $x, failed/error $fl; $(tail -1 "$f")"
done
grep -h -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$out"/*.log | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -60
