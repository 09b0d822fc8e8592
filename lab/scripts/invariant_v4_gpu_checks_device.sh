#!/usr/bin/env bash
# One GPU run (H100/H200), outputs under $OUT: the GPU tests of the batch-invariant mode and of the V4 attention,
# the CUDA-graph re-plan probe of the vLLM-style plans, and the batch-invariant mode's cost beside the default.
set -u
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T_TESTS:-130} python -m pytest -q -p no:cacheprovider -n 8 tests/test_batch_invariant.py \
  tests/test_sparse_batch_invariant.py tests/test_v4_attention.py tests/test_v4_formats.py tests/test_model_v4.py \
  > $OUT/tests.txt 2>&1; echo "tests exit $?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -12
timeout ${T_PROBE:-70} python lab/scripts/graph_backend_switch_probe.py > $OUT/probe.txt 2>&1; echo "probe exit $?"
grep -v "^ *$" $OUT/probe.txt | head -40
timeout ${T_BENCH:-80} python -m fp8mla bench decode --heads 16 128 --shapes 1x32768 64x8192 --pages 64 \
  --kv fp8_e4m3 --batch-invariant --reps 20 --out $OUT/bi > $OUT/bi.txt 2>&1; echo "bench exit $?"
grep -E " ms |ceil|failed|not taken" $OUT/bi.txt | head -30
