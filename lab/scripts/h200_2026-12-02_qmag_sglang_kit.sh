#!/usr/bin/env bash
# One H200 run of 2026-12-02: the large-query error A/B of the heads-on-M build (lab/scripts/qmag_ab_device.py)
# and SGLang's attention test kit on the GPU (lab/scripts/sglang_kit_device.sh; with .sgl_whl/ present).
set -u
out=${1:?OUT}
mkdir -p "$out"
PYTHONPATH=$PWD/src timeout 75 python3 lab/scripts/qmag_ab_device.py > "$out/qmag.txt" 2>&1; echo "rc $?" >> "$out/qmag.txt"
cat "$out/qmag.txt"
mkdir -p "$out/sgl"
KIT_TIMEOUT=105 timeout 175 bash lab/scripts/sglang_kit_device.sh "$out/sgl" 2>&1 | tail -n 25
