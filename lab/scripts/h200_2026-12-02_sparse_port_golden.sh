#!/usr/bin/env bash
# One H200 run of 2026-12-02, 18:30 UTC (<= 4 min; LPT=1 adds the A/B re-run):
#   golden  python -m devtools.sass check under the device's triton (in the background: CPU only)
#   sparse  lab/scripts/sparse_port_device.sh: the product's new warp-specialized sparse build's GPU tests and the
#           sparse decode bench (auto = the Gluon build now, beside the Triton kernel)
#   lpt     lab/scripts/mh_lpt_device.py again: the aligned cut kept within 6 tiles (ONE_WAVE_SLACK), predicted to
#           take the old cut's times at B8-B16 and keep the rest; and both builds in CUDA-graph wrappers with host
#           lengths (heads-on-M now longest first there too)
#   tests   the heads-on-M GPU tests, the longest-first schedule, the decode runner, the graph re-plan tests
# Usage (repo root; with .sgl_whl/ present for the xdist wheels):  bash lab/scripts/h200_2026-12-02_sparse_port_golden.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s4c3 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p /tmp/xd && python3 -m pip install -q --no-index --no-deps --target /tmp/xd .sgl_whl/pytest_xdist*.whl .sgl_whl/execnet*.whl > /dev/null 2>&1
( PYTHONPATH=$PWD/src:$PWD timeout 190 nice -n 10 python3 -m devtools.sass check > "$work/golden.txt" 2>&1; echo "rc $?" >> "$work/golden.txt" ) &
golden=$!
mkdir -p "$work/sparse"
PYTHONPATH=/tmp/xd TOTAL_S=118 timeout -k 10 125 bash lab/scripts/sparse_port_device.sh "$work/sparse" > "$work/sparse.txt" 2>&1
say "sparse rc $?"; tail -n 30 "$work/sparse.txt" >> "$out/summary.txt"
cp "$work/sparse/sparse/"*.csv "$out/" 2>/dev/null
pack
PYTHONPATH=$PWD/src:$PWD/scripts:/tmp/xd timeout -s INT -k 10 85 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -n 8 \
    tests/test_decode_sm90_heads_on_m.py tests/test_sm90_longest_first.py tests/test_runner.py \
    "tests/test_decode_sm90.py::test_cuda_graph_capture_then_replan" "tests/test_decode_sm90.py::test_wide_cuda_graph_capture_then_replan" \
    > "$work/tests.txt" 2>&1
say "tests rc $?: $(tail -n 1 "$work/tests.txt")"; grep -E "^(FAILED|ERROR)" "$work/tests.txt" | head -20 | tee -a "$out/summary.txt"
pack
[ "${LPT:-0}" = 1 ] && PYTHONPATH=$PWD/src:$PWD/lab/scripts timeout -k 10 80 python3 lab/scripts/mh_lpt_device.py --reps 10 --out "$work/mh_lpt2.json" > "$work/lpt.txt" 2>&1
say "lpt rc $?"; cat "$work/lpt.txt" >> "$out/summary.txt"; cp "$work/mh_lpt2.json" "$out/" 2>/dev/null
wait "$golden"; say "golden: $(tail -n 12 "$work/golden.txt" | tr '\n' ' ')"
pack; say done
