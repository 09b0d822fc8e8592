#!/usr/bin/env bash
# One device call: the full decode grid of issue 3, with FlashInfer (wheels in .whl/, see
# ../shared/tools/flashinfer-wheels) and the gather_cast strategy on the same pools.
# Usage (repo root): bash scripts/gpu_decode_grid.sh OUTDIR
set -u
out=${1:-gpu_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
for H in 16 128; do
  timeout 290 python3 -m fp8mla bench decode --heads $H --compare flashinfer gather_cast --reps 30 \
    --out "$out/grid$H" 2>&1 | grep -v Warning | tee "$out/grid$H.txt"
done
