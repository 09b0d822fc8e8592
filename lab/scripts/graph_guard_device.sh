#!/usr/bin/env bash
# One short device run: the vLLM-style graph re-plan probe after the one-backend rule, and the GPU tests it touches.
set -u
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
timeout 45 python lab/scripts/graph_backend_switch_probe.py > $OUT/probe.txt 2>&1; echo "probe exit $?"
grep -v "^ *$" $OUT/probe.txt | head -30
timeout 75 python -m pytest -q -p no:cacheprovider -n 12 tests/test_graph_wrapper_backend.py tests/test_batch_invariant.py \
  tests/test_decode_triton.py tests/test_runner.py > $OUT/tests.txt 2>&1; echo "tests exit $?"
grep -E "passed|failed|FAILED" $OUT/tests.txt | tail -8
