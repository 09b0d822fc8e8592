#!/usr/bin/env bash
# On the GPU machine (no network, torch 2.11), from the checkout root, after the bundle's other parts were stashed
# (../shared/tools/vllm-gpu/README.md): unpacks vLLM 0.26.0 and fp8mla's wheel, then runs serve_compare.py.
#   B=<bundle dir, relative to the checkout> (default .vbundle): vsite parts, SHA256SUMS, assemble.sh, fp8mla/*.whl,
#   and serve_compare.py beside them.  DEADLINE=<seconds for serve_compare.py> (default 420).  OUT: where results go.
set -u
B=${B:-.vbundle}
t0=$(date +%s)
BUNDLE="$PWD/$B" bash "$B/assemble.sh" > /tmp/assemble.log 2>&1
rc=$?
tail -n 25 /tmp/assemble.log
[ $rc = 0 ] || exit 1
# the wheel is a zip: unpacked, its dist-info carries the vllm.general_plugins entry point
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$(ls "$B"/fp8mla/*.whl)" /tmp/fp8site
export PYTHONPATH=/tmp/fp8site:/tmp/site
FP8MLA_REV=$(cat "$B/fp8mla/SOURCE_REV" 2>/dev/null || echo unknown)
export FP8MLA_REV
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "device_run: bundle ready after $(( $(date +%s) - t0 )) s; fp8mla rev $FP8MLA_REV"
python3 "$B/serve_compare.py" --out "${OUT:-/tmp/out}" --deadline-s "${DEADLINE:-420}"
