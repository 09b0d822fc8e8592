#!/usr/bin/env bash
# One H200 run of 2026-12-02 (<= 7 min): the two-converter heads-on-M build's GPU
# gate and A/B, the group tests the suite run's cap cut, SGLang's kit after the test fixes.
# Usage (repo root; with .whl/ and .sgl_whl/ present):  bash lab/scripts/h200_2026-12-02_heads_on_m_conv2_gate.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=/tmp/s3c3 && rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar -czf "$out/logs.tgz" -C "$work" . 2>/dev/null; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p /tmp/suite_pkgs && pip install -q --no-index --no-deps --target /tmp/suite_pkgs .whl/pytest_xdist*.whl .whl/execnet*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/src:$PWD/scripts:/tmp/suite_pkgs
timeout -s INT -k 10 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -n 8 \
    tests/test_decode_sm90_heads_on_m.py tests/test_sm90_merge_grid.py "tests/test_decode_sm90_group.py::test_group_odd_lengths_nan_pools" > "$work/tests.txt" 2>&1
trc=$?
say "tests rc $trc: $(tail -n 1 "$work/tests.txt")"; grep -E "^(FAILED|ERROR)" "$work/tests.txt" | head -20 | tee -a "$out/summary.txt"; pack
if [ "$trc" != 124 ]; then
  timeout -k 10 150 python3 -m fp8mla bench decode --heads 64 128 --pages 64 --kv fp8_e4m3 --shapes 64x8192 8x8192 1x32768 \
      --compare wide_heads graph --reps 10 --out "$work/ab" > "$work/ab.txt" 2>&1
  say "ab rc $?"; grep -E "ceiling|gluon|not taken|failed" "$work/ab.txt" | tee -a "$out/summary.txt"
  cp "$work/ab/decode.csv" "$out/ab.csv" 2>/dev/null
fi
pack
mkdir -p "$work/sgl"
KIT_TIMEOUT=100 WORKERS=8 timeout 150 bash lab/scripts/sglang_kit_device.sh "$work/sgl" > "$work/sgl.txt" 2>&1
say "sgl rc $?"; tail -n 12 "$work/sgl.txt" >> "$out/summary.txt"
pack; say done
