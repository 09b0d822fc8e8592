#!/usr/bin/env bash
# SGLang 0.5.23's attention unit-test kit (tests/engines/test_sglang.py) on one H200, with
# fp8mla's torch, triton and gluon backends under SGLang's own pools and ForwardBatch (the pools on the GPU).
# The device has no network: SGLang and the part of its dependency set the kit imports travel as wheels in
# .sgl_whl/ (47 MB; the list and why in docs/engines.md). SGLang's CUDA kernel package sgl_kernel (373 MB) does
# not fit one run: lab/scripts/sglang_kit_stub/ stands in for it at import (a call of it is printed as
# "sgl_kernel stand-in called: NAME"). <= 3 min. OUT gets environment.txt, imports.txt, sglang.txt (the pytest
# log), sglang.xml and pip.txt.
# Usage (repo root; .sgl_whl filled by lab/scripts/sglang_kit_wheels.sh; with .sgl_whl/ present):
#   bash lab/scripts/sglang_kit_device.sh "$OUT"
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
site=/tmp/sgl_site
ls .sgl_whl/*.whl > /dev/null 2>&1 || { echo "no .sgl_whl/*.whl: with .sgl_whl/ present"; exit 2; }
timeout 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .sgl_whl/*.whl \
    > "$out/pip.txt" 2>&1 || echo "pip install of .sgl_whl failed (pip.txt)"
# fp8mla's own metadata (the plugin's entry point that one test reads); the sources stay those of src/ (first)
timeout 60 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target /tmp/fp8mla_site . >> "$out/pip.txt" 2>&1 || echo "pip install of fp8mla's metadata failed (pip.txt)"
export PYTHONPATH=$PWD/src:$site:/tmp/fp8mla_site:$PWD/lab/scripts/sglang_kit_stub
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib.metadata as md
for name in ("torch", "triton", "sglang", "transformers", "pydantic", "fastapi"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
  git log --oneline -1 2>/dev/null || true; date -u; } > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
timeout 120 python3 - > "$out/imports.txt" 2>&1 <<'EOF'
import importlib, time, traceback
t = time.time()
for m in ("sglang.test.kits.attention_unittest.attention_methods.mla_attention",
          "fp8mla.integrations.sglang_backend"):
    try:
        importlib.import_module(m)
        print("OK", m, f"{time.time() - t:.1f} s")
    except BaseException as e:  # noqa: BLE001 - the point is to say what blocks
        traceback.print_exc()
        print("FAIL", m, type(e).__name__, e)
import fp8mla, torch
print("fp8mla backends on cuda:", fp8mla.available_backends("cuda"),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA device)")
EOF
cat "$out/imports.txt" | tail -n 8
timeout -s INT -k 15 "${KIT_TIMEOUT:-150}" python3 -m pytest -v -p no:cacheprovider -n "${WORKERS:-8}" -rfEs \
    --confcutdir=tests/engines tests/engines/test_sglang.py --junitxml="$out/sglang.xml" > "$out/sglang.txt" 2>&1
echo "exit $?" >> "$out/sglang.txt"
grep -c " PASSED" "$out/sglang.txt" | sed 's/^/passed: /'
grep -E "^(FAILED|ERROR|SKIPPED)|stand-in called|[0-9]+ (passed|failed)|^exit " "$out/sglang.txt" \
    | sort | uniq -c | sort -rn | head -40
