#!/usr/bin/env bash
# Same-process-machine A/B of `fp8mla generate` (CUDA graphs) and begin_step's host time: the tree of the tag
# pre-sm90-redesign (f9adfa7, exported into the git-ignored .old_tree/src and carried) against the current src/,
# interleaved old, new, old, new so a drift of the machine shows as a drift, not as a difference.
# Why: generate measured 9.1-9.3k decode tok/s on 2026-12-01 06:13 and 5.7-7.5k at 22:37 after the redesign;
# the CPU profiles of both trees are equal (lab/hostperf/README.md), so either the GPU path changed or the machine.
# Prepare (here):  mkdir -p .old_tree && git archive f9adfa7 src | tar -x -C .old_tree
# Device (repo root, with .old_tree/ present):  bash lab/scripts/ab_generate_device.sh OUT     (~2-3 min)
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gen=(--config dsv3 --layers 4 --prompts 128 --prompt-len 256 --max-new-tokens 64 --max-batch 64 --no-progress)
for round in 1 2; do
  for tree in old new; do
    src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old_tree/src
    echo "== generate $tree round $round" | tee -a "$out/ab_generate.txt"
    PYTHONPATH=$src timeout 100 python3 -m fp8mla generate "${gen[@]}" 2>&1 | tail -n 4 | tee -a "$out/ab_generate.txt"
  done
done
for tree in old new; do
  src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old_tree/src
  echo "== begin_step host time, $tree tree (current lab/hostperf script)" | tee -a "$out/ab_generate.txt"
  PYTHONPATH=$src timeout 60 python3 lab/hostperf/begin_step_host.py --device cuda --config dsv3 --layers 4 \
      --batch 64 --ctx 8192 2>&1 | grep -v "^ " | head -n 12 | tee -a "$out/ab_generate.txt"
done
