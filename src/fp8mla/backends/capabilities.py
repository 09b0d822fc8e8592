"""What each build supports: one record per build, in the order ``select`` prefers them.

A record is data only (no kernel is imported to read it): the device kind it runs on, the formats, query dtypes,
head counts, head dims, page sizes, query tokens per request and topk it takes, whether it has the batch-invariant
mode and which kernel options it honours. Parts of a choice that are not a table lookup (whether a Gluon ring of
the asked depth fits shared memory, and which named variant a plan compiles) are the record's ``finish``: a
function of the backend module, imported only for a plan the record takes. The kernels' own launch checks stay
as guards; ``tests/test_selection_table.py`` checks these numbers against the kernels' constants.

Every build takes CUDA-graph plans and device-only KV lengths; only the Gluon dense builds need the query lengths
on the host (``max_qo``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BUILDS", "Capability", "DEFAULT_STAGES", "NAMED"]

DEFAULT_STAGES = 3   # the wide Gluon build's ring (gluon.DEFAULTS); another num_stages asks for that build
# ``Capability.batch_invariant``: the build takes the mode only when its backend is named (``auto`` keeps the
# builds whose bits per request the CPU tests prove: the Triton kernels)
NAMED = "named"
SM90_HEAD_DIMS = ((512, 64),)
SM90_MAX_HEADS = 128


@dataclass(frozen=True)
class Capability:
    """What one build takes. ``device``: "any", "triton" (CUDA, or the CPU under ``TRITON_INTERPRET=1``) or
    "sm90" (an sm_90 GPU with Gluon); ``auto_device``: what ``auto`` needs besides ("cuda": the interpreter runs
    the Triton kernels only by name). None in a field: any value. ``max_qo``: query tokens per request (None: any,
    device-only lengths too), ``max_rows``: query tokens x heads. ``fp8_math_formats``: the formats it runs the
    opt-in FP8 tensor-core math on; ``num_stages``: whether it takes that option (False: its ring is fixed, and
    asking another depth asks for another build). ``option``: the kernel option that asks for this build (True)
    or excludes it (False). ``auto``: whether ``auto`` may pick it. ``falls_back``: whether ``auto`` goes on to
    the next build when this one's device fits but the plan does not. ``finish``: ``"module:function"`` of
    ``fp8mla.backends`` turning a taken question into the named variant, or a reason."""

    name: str
    backend: str
    module: str
    api: str
    title: str
    device: str = "any"
    auto_device: str = "any"
    formats: frozenset | None = None
    q_dtypes: tuple | None = None
    heads: tuple = (1, 1 << 30)
    head_dims: tuple | None = None
    pow2_dims: bool = False
    page_sizes: tuple = ()
    page_multiple: int = 1
    max_qo: int | None = None
    max_rows: int | None = None
    topk_multiple: int = 1
    batch_invariant: bool | str = True   # True, False or NAMED
    fp8_math_formats: frozenset = frozenset()
    num_stages: bool = True
    option: str | None = None
    auto: bool = True
    falls_back: bool = True
    finish: str | None = None


HALF = (torch.bfloat16, torch.float16)

# -- dense (MLAPagedAttention): the Hopper builds first, then the portable kernels, then the torch code -----------
# heads-on-M before the wide build wherever it takes a plan: measured faster at every shape timed (gluon.py's
# heads_on_m_build)
GLUON_HEADS_ON_M = Capability(
    "gluon-heads-on-m", "gluon", "gluon", "dense", "the heads-on-M build", device="sm90", auto_device="cuda",
    formats=frozenset({"fp8_e4m3"}), q_dtypes=HALF, heads=(33, SM90_MAX_HEADS), head_dims=SM90_HEAD_DIMS,
    page_multiple=64, max_qo=1, batch_invariant=NAMED, num_stages=False, option="heads_on_m",
    finish="gluon:heads_on_m_build")
GLUON_WIDE = Capability(
    "gluon-wide", "gluon", "gluon", "dense", "the gluon kernel", device="sm90", auto_device="cuda",
    formats=frozenset({"fp8_e4m3", "fp8_e4m3_group"}), q_dtypes=HALF, heads=(1, SM90_MAX_HEADS),
    head_dims=SM90_HEAD_DIMS, page_sizes=(1, 16, 32), page_multiple=64, max_qo=8, max_rows=512,
    batch_invariant=NAMED, fp8_math_formats=frozenset({"fp8_e4m3"}), finish="gluon:wide_build")
TRITON = Capability("triton", "triton", "triton", "dense", "the triton backend", device="triton",
                    auto_device="cuda", pow2_dims=True)
TORCH = Capability("torch", "torch", "torch", "dense", "the torch backend")

# -- sparse (MLASparseAttention) ----------------------------------------------------------------------------------
# auto takes the Gluon build on Hopper for every plan it takes (H200, topk 2048, B64: 6.5x the Triton sparse kernel
# at 128 heads, 2.4x at 16 and 8; docs/benchmarks.md)
GLUON_SPARSE = Capability(
    "gluon-sparse", "gluon", "sparse_gluon", "sparse", "the gluon sparse build", device="sm90", auto_device="cuda",
    formats=frozenset({"fp8_ds_mla"}), q_dtypes=(torch.bfloat16,), heads=(1, SM90_MAX_HEADS),
    batch_invariant=NAMED)
TRITON_SPARSE = Capability("triton-sparse", "triton", "sparse_triton", "sparse", "the triton sparse kernel",
                           device="triton", auto_device="cuda", topk_multiple=64, falls_back=False)
TORCH_SPARSE = Capability("torch-sparse", "torch", "sparse_torch", "sparse", "the torch sparse code")

# -- DeepSeek V4 (V4SparseAttention): the Hopper build first, then the portable kernel, then the torch code --------
GLUON_V4 = Capability("gluon-v4", "gluon", "v4_gluon", "v4", "the gluon V4 build", device="sm90", auto_device="cuda",
                      formats=frozenset({"bf16", "fp8_v4", "fp8_v41"}), q_dtypes=(torch.bfloat16,), heads=(1, 128),
                      batch_invariant=False)
TRITON_V4 = Capability("triton-v4", "triton", "v4_triton", "v4", "the triton V4 kernel", device="triton",
                       auto_device="cuda")
TORCH_V4 = Capability("torch-v4", "torch", "v4_torch", "v4", "the torch V4 code")

BUILDS = {"dense": (GLUON_HEADS_ON_M, GLUON_WIDE, TRITON, TORCH),
          "sparse": (GLUON_SPARSE, TRITON_SPARSE, TORCH_SPARSE),
          "v4": (GLUON_V4, TRITON_V4, TORCH_V4)}
