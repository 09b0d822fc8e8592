#!/usr/bin/env bash
# Fills .sgl_whl/ (git-ignored) with what lab/scripts/sglang_kit_device.sh installs on the H200 (Python 3.12, no
# network): sglang 0.5.23 and the packages SGLang's attention unit-test kit imports that the device image lacks
# (found on a CPU by importing the kit with only the device's packages, then again with CUDA reported present).
# Not carried: sglang-kernel (373 MB; lab/scripts/sglang_kit_stub stands in), and what the image has (torch,
# transformers 5.17, tokenizers, sentencepiece, numpy, aiohttp, ...). 47 MB in all.
set -eu
cd "$(git rev-parse --show-toplevel)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .sgl_whl \
  sglang==0.5.23 annotated-types==0.8.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 \
  fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 openai==2.8.0 \
  opentelemetry-api==1.45.2 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 traitlets==5.16.1 typing-inspection==0.4.5 \
  uvicorn==0.54.0
du -sh .sgl_whl && ls .sgl_whl | wc -l
