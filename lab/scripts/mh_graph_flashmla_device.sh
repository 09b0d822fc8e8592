#!/usr/bin/env bash
# Device runs (H100/H200), outputs under $OUT. Part "mh": the heads-on-M CUDA-graph re-plan probe, its GPU tests,
# and the graph-mode A/B of the wide and heads-on-M builds at spread lengths (device lengths: the longest-first
# device schedule). Part "bench": fp8mla beside FlashMLA's ops (.fmla, from ../shared/tools/flashmla-ops) in one
# process, dense and sparse. Part "tests": the GPU tests the auto change touches.
# Usage: bash lab/scripts/mh_graph_flashmla_device.sh mh|tests|bench
set -u
export PYTHONPATH=$PWD/src:$PWD:$PWD/.fmla PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/gpu.txt
if [ "$1" = mh ]; then
  timeout 120 python lab/scripts/heads_on_m_graph_replan_probe.py > $OUT/probe.txt 2>&1; echo "probe exit $?"
  grep -E "request|first replay|rep 0" $OUT/probe.txt | head -40
  timeout 200 python -m pytest -q -p no:cacheprovider -n 8 tests/test_decode_sm90_heads_on_m.py \
    tests/test_sm90_longest_first.py > $OUT/mh_tests.txt 2>&1; echo "mh tests exit $?"; tail -15 $OUT/mh_tests.txt
  timeout 220 python lab/scripts/graph_spread_device.py --out $OUT/graph_spread.json --reps 20 > $OUT/graph_spread.txt 2>&1
  echo "graph_spread exit $?"; cat $OUT/graph_spread.txt
elif [ "$1" = tests ]; then
  timeout ${TESTS_S:-240} python -m pytest -q -p no:cacheprovider -n 12 tests/test_decode_sm90_heads_on_m.py \
    tests/test_sm90_longest_first.py tests/test_decode_sm90.py tests/test_runner.py tests/test_plan_host_work.py \
    tests/test_flashinfer_contract.py tests/test_sm90_merge_grid.py tests/test_bench_flashmla.py \
    > $OUT/tests.txt 2>&1; echo "tests exit $?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -15
else
  timeout ${DENSE_S:-300} python -m fp8mla bench decode --heads 64 128 --shapes ${DENSE_SHAPES:-1x32768 8x8192 64x8192 128x2048} \
    --pages 64 --kv fp8_e4m3 --compare flashmla graph --out $OUT/dense > $OUT/dense.txt 2>&1; echo "dense exit $?"
  timeout ${SPARSE_S:-200} python -m fp8mla bench decode --sparse --heads ${SPARSE_HEADS:-16 128} --shapes ${SPARSE_SHAPES:-1x8192 8x8192 64x8192} \
    --pages 64 --compare flashmla --out $OUT/sparse > $OUT/sparse.txt 2>&1; echo "sparse exit $?"
  grep -E " ms |skipped|failed|not taken|ceil" $OUT/dense.txt $OUT/sparse.txt | head -90
fi
