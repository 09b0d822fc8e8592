#!/usr/bin/env bash
# One device run (H100/H200): the heads-on-M CUDA-graph re-plan probe and its GPU tests, then fp8mla beside
# FlashMLA's ops (.fmla, from ../shared/tools/flashmla-ops) in one process, dense and sparse. Outputs under $OUT.
set -u
export PYTHONPATH=$PWD/src:$PWD:$PWD/.fmla PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/gpu.txt
git log -1 --format=%h >> $OUT/gpu.txt 2>/dev/null
timeout 150 python lab/scripts/heads_on_m_graph_replan_probe.py > $OUT/probe.txt 2>&1; echo "probe exit $?"
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_decode_sm90_heads_on_m.py tests/test_sm90_longest_first.py \
  > $OUT/mh_tests.txt 2>&1; echo "mh tests exit $?"; tail -3 $OUT/mh_tests.txt
timeout ${BENCH_S:-200} python -m fp8mla bench decode --heads 64 128 --shapes 1x32768 8x8192 64x8192 128x2048 \
  --pages 64 --kv fp8_e4m3 --compare flashmla graph --out $OUT/dense > $OUT/dense.txt 2>&1; echo "dense exit $?"
timeout ${SPARSE_S:-120} python -m fp8mla bench decode --sparse --heads 16 128 --shapes 1x8192 8x8192 64x8192 \
  --pages 64 --compare flashmla --out $OUT/sparse > $OUT/sparse.txt 2>&1; echo "sparse exit $?"
grep -E "ms|skipped|failed|not taken" $OUT/dense.txt $OUT/sparse.txt | head -80
