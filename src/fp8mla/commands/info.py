"""``fp8mla info``: versions, device, formats and backends."""
from __future__ import annotations

import platform

import torch

from .. import __version__
from ..attention import available_backends
from ..formats import FORMATS, SPARSE_FORMATS


def add_arguments(p):
    pass


def main(args) -> int:
    print(f"fp8mla {__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"triton: not available ({type(e).__name__})")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
        device = "cuda"
    else:
        print("device: cpu (no CUDA device)")
        device = "cpu"
    print(f"backends on {device}: {', '.join(available_backends(device))}")
    print("formats (512 + 64 dims):")
    for f in FORMATS.values():
        print(f"  {f.name:15s} storage {str(f.storage_dtype):22s} scales {f.scale_kind:6s} "
              f"{f.bytes_per_token():5d} B/token")
    _sparse_info(device)
    _v4_info(device)
    _engines_info()
    return 0


def _engines_info() -> None:
    """The serving engines installed here (read from package metadata: nothing of them is imported) and whether
    fp8mla's backend supports that version (docs/engines.md)."""
    from ..integrations.versions import SUPPORTED, describe, engine_version, is_supported
    print("engines (fp8mla's attention backend inside them; docs/engines.md):")
    for engine in SUPPORTED:
        version = engine_version(engine)
        if version is None:
            state = f"not installed (fp8mla supports {engine} {describe(engine)})"
        elif is_supported(engine, version):
            state = f"{version}: supported"
        else:
            state = f"{version}: NOT supported (fp8mla supports {describe(engine)})"
        print(f"  {engine:14s} {state}")


def _sparse_info(device) -> None:
    """The sparse (DSA) kernels: what fp8mla.MLASparseAttention can run here, and on which formats."""
    from ..runtime import triton_usable
    rec = SPARSE_FORMATS["fp8_ds_mla"]
    print("sparse attention (DSA: GLM-5, DeepSeek-V3.2; fp8mla.MLASparseAttention):")
    print(f"  {rec.name:15s} storage {str(rec.storage_dtype):22s} scales {rec.scale_kind:6s} "
          f"{rec.bytes_per_token():5d} B/token (512 e4m3 | 4 fp32 scales | 64 bf16)")
    print("  torch          fp32 gather of the selected rows, every format, any topk: available")
    ok = "available" if triton_usable(device) else "not available here (needs CUDA, or TRITON_INTERPRET=1)"
    print(f"  triton         kernels/sparse_decode.py, every format, topk a multiple of 64: {ok}")
    from ..runtime import gluon_usable
    ok = "available" if gluon_usable(device) else "not available here (needs an sm_90 GPU and Gluon)"
    print(f"  gluon          kernels/sm90/sparse.py, fp8_ds_mla, bf16 queries, H <= 128, any topk (auto's pick on "
          f"Hopper): {ok}")


def _v4_info(device) -> None:
    """The DeepSeek V4 kernels: what fp8mla.V4SparseAttention can run here, and on which pool formats."""
    from ..formats_v4 import V4_FORMATS
    from ..runtime import triton_usable
    print("DeepSeek V4 attention (window + compressed rows + sinks; fp8mla.V4SparseAttention):")
    what = {"fp8_v4": "448 e4m3 | 64 bf16 per token, 7 ue8m0 scales in the page's scale rows (vLLM)",
            "fp8_v41": "512 e4m3 | 16 ue8m0 scales per token (FlashMLA V4.1)", "bf16": "512 bf16"}
    for f in V4_FORMATS.values():
        print(f"  {f.name:15s} {f.token_bytes:5d} B/token ({what[f.name]})")
    print("  torch          fp32 gather of the selected rows, every V4 format, any topk: available")
    ok = "available" if triton_usable(device) else "not available here (needs CUDA, or TRITON_INTERPRET=1)"
    print(f"  triton         kernels/v4_attention.py (+ kernels/quant_v4.py writes), every V4 format, any topk, "
          f"H <= 128: {ok}")
    from ..runtime import gluon_usable
    ok = "available" if gluon_usable(device) else "not available here (needs an sm_90 GPU and Gluon)"
    print(f"  gluon          kernels/sm90/v4.py, every V4 format, bf16 queries, H <= 128, any topk (auto's pick on "
          f"Hopper): {ok}")
