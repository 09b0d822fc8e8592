#!/usr/bin/env bash
# FlashInfer's own MLA wrapper tests, run twice on the GPU: with FlashInfer 0.6.18.post1 itself, then with
# fp8mla.MLAPagedAttention swapped in for BatchMLAPagedAttentionWrapper (fi_swap.py). Prints both counts and the
# fp8mla failures grouped by cause; writes flashinfer.{txt,xml}, fp8mla.{txt,xml} and summary.md to OUTDIR.
#
# Needs, in the repo root (both git-ignored, both copied to the GPU machine with the tree):
#   .whl/        FlashInfer wheels:  bash /work/shared/tools/flashinfer-wheels
#   .fi_tests/   FlashInfer's test files + a conftest-free harness (see README.md; checked by sha256 below)
# On the GPU machine (repo root):  bash scripts/flashinfer_swap/run.sh "$OUT"
# FI_MODES="flashinfer fp8mla" (default) picks the runs; one of them alone fits a shorter run. FI_CONTRACT=0
# skips fp8mla's own tests/test_flashinfer_contract.py, which otherwise runs last, in what is left of the budget.
# FI_RUN_CAP (s, default 240) caps each test run on top of FI_BUDGET: raise both for a run that has the time to
# finish the whole selection in one mode (e.g. FI_MODES=fp8mla FI_BUDGET=330 FI_RUN_CAP=320 in a 6-minute run).
set -u
root=$(pwd)
here=$root/scripts/flashinfer_swap
out=${1:-${OUT:-$root/fi_swap_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
modes=${FI_MODES:-flashinfer fp8mla}
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# One device command has 5 minutes here: each phase gets at most what is left of FI_BUDGET (s). A test run cut
# short is interrupted (SIGINT), so pytest still writes its junit report for what ran.
left() {  # left RESERVE CAP: seconds for the next phase
  local l=$(( ${FI_BUDGET:-285} - ($(date +%s) - t0) - $1 ))
  [ "$l" -gt "$2" ] && l=$2; [ "$l" -lt 5 ] && l=5; echo "$l"; }

(cd .fi_tests && sha256sum -c --quiet "$here/fi_tests.sha256") || {
  echo "run.sh: .fi_tests/ is missing or differs from the fetched FlashInfer test files (README.md)"; exit 2; }
# Our own harness (the tests' import of tests.test_helpers, importlib import mode) is kept in the repository.
cp -r "$here/harness/." .fi_tests/
if ! python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import flashinfer" 2>/dev/null; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "run.sh: no .whl/*.whl (run /work/shared/tools/flashinfer-wheels)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$root/src:$here:$root/.fi_tests PYTHONUNBUFFERED=1
python3 - <<'EOF' | tee "$out/versions.txt"
import flashinfer, fp8mla, torch, triton
print(f"flashinfer {flashinfer.__version__}  fp8mla {getattr(fp8mla, '__version__', '?')}  torch {torch.__version__}"
      f"  triton {triton.__version__}  {torch.cuda.get_device_name()}")
EOF
step "installed"

case " $modes " in *" flashinfer "*)
  timeout "$(left 150 110)" python3 "$here/prebuild_jit.py" 2>&1 | tail -n 3
  step "FlashInfer JIT variants built" ;;
esac

cd .fi_tests
for mode in $modes; do
  swap=0; [ "$mode" = fp8mla ] && swap=1
  reserve=10; [ "${FI_CONTRACT:-1}" = 1 ] && reserve=40      # seconds kept for what comes after this run
  [ "$mode" = flashinfer ] && case " $modes " in *" fp8mla "*) reserve=$(( reserve + 100 )) ;; esac
  cap=$(left $reserve "${FI_RUN_CAP:-240}")
  FI_SWAP=$swap timeout -s INT -k 10 "$cap" python3 -m pytest -q -p fi_swap --tb=line -rfE \
    fi_pre_nope/test_deepseek_mla.py fi_nope/test_deepseek_mla.py --junitxml="$out/$mode.xml" \
    > "$out/$mode.txt" 2>&1
  echo "exit $? ($mode)" >> "$out/$mode.txt"
  tail -n 4 "$out/$mode.txt"
  step "$mode run done (cap $cap s)"
done
cd "$root"
if [ "${FI_CONTRACT:-1}" = 1 ]; then  # fp8mla's own contract tests on the GPU, with what is left
  PYTHONPATH=$root/src timeout -s INT -k 10 "$(left 5 60)" python3 -m pytest -q -p no:cacheprovider \
    tests/test_flashinfer_contract.py > "$out/contract.txt" 2>&1
  echo "exit $? (contract)" >> "$out/contract.txt"; tail -n 3 "$out/contract.txt"
  step "contract tests done"
fi

python3 "$here/summarize.py" "$out/flashinfer.xml" "$out/fp8mla.xml" "$out/summary.md"
step "done"
