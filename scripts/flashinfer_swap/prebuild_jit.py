"""Build, in parallel, the FlashInfer batch-MLA JIT variants that the selected tests use (one ninja run), so
the FlashInfer run does not compile them one by one inside the tests (18-27 s each on the H200).
``--bench``: only the two that ``fp8mla bench decode --kv fp8_e4m3 --compare flashinfer`` plans (bf16 queries
over e4m3 KV, rope 64, fa3 and fa2), so a GPU run can build them while an earlier phase runs; ``--bench-bf16``
likewise for ``--kv bf16`` (bf16 queries and KV)."""
import sys
import time

import torch
from flashinfer.jit import build_jit_specs
from flashinfer.jit.attention import gen_batch_mla_module

t0 = time.time()
h, b, e4 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
# (backend, q dtype, kv dtype, head_dim_kpe): fp16 paged/varlen/NaN tests, bf16 + FP8 KV (rope 64 and 0),
# fp16 rope-free, and fa2's FP8 row-aliasing case.
variants = [("fa3", h, h, 64), ("fa3", b, b, 64), ("fa3", b, e4, 64),
            ("fa2", h, h, 0), ("fa3", h, h, 0), ("fa2", b, b, 0), ("fa3", b, b, 0), ("fa2", b, e4, 0),
            ("fa3", b, e4, 0), ("fa2", b, b, 64), ("fa2", b, e4, 64)]
if "--bench" in sys.argv[1:]:
    variants = [("fa3", b, e4, 64), ("fa2", b, e4, 64)]
if "--bench-bf16" in sys.argv[1:]:   # ... and the two of `--kv bf16 --compare flashinfer` (the BF16-pool baseline)
    variants = [("fa3", b, b, 64), ("fa2", b, b, 64)]
specs = [gen_batch_mla_module(be, q, kv, q, torch.int32, 512, kpe, False) for be, q, kv, kpe in variants]
build_jit_specs(specs, verbose=False)
print(f"prebuild_jit: {len(specs)} batch-MLA variants ready in {time.time() - t0:.0f} s")
