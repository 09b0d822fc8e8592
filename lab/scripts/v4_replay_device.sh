#!/usr/bin/env bash
# One device run (H100/H200), outputs under $OUT: the GPU tests of the Hopper V4 build, of the V4 batch-invariant
# mode and of the replayed CUDA-graph schedule; the vLLM backend's per-step plan cost; V4 decode beside FlashMLA's
# sparse decode (vLLM 0.34's ops in .fmla, from ../shared/tools/flashmla-ops) and the V4 invariant mode's cost.
set -u
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
if ! python -c 'import xdist' 2>/dev/null; then
  pip install -q --no-index --no-deps --target /tmp/suite_pkgs .whl/pytest_xdist*.whl .whl/execnet*.whl > /dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/suite_pkgs
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T_TESTS:-200} python -m pytest -q -p no:cacheprovider -n 12 tests/test_graph_schedule_replay.py \
  tests/test_v4_gluon.py tests/test_v4_batch_invariant.py tests/test_graph_wrapper_backend.py \
  > $OUT/tests.txt 2>&1; echo "tests exit $?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -15
timeout ${T_PROBE:-40} python lab/scripts/vllm_plan_cost_device.py > $OUT/plan_cost.txt 2>&1; echo "plan probe exit $?"
cat $OUT/plan_cost.txt | tail -8
PYTHONPATH=$PYTHONPATH:$PWD/.fmla timeout ${T_BENCH:-150} python -m fp8mla bench decode --v4 --compare flashmla \
  --batch-invariant --v4-kv fp8_v4 fp8_v41 --heads 64 128 --shapes 1x8192 8x8192 64x8192 --reps 20 --out $OUT/v4 > $OUT/v4.txt 2>&1
echo "v4 bench exit $?"; grep -v "^ *$" $OUT/v4.txt | tail -40
