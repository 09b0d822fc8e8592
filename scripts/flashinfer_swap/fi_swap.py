"""pytest plugin: run FlashInfer's own MLA wrapper tests against FlashInfer, or with fp8mla swapped in.

Load with ``-p fi_swap`` (this folder on PYTHONPATH). Environment:
  FI_SWAP=1    flashinfer's BatchMLAPagedAttentionWrapper becomes fp8mla.MLAPagedAttention: the class itself,
               not an adapter, so every constructor / plan() / run() argument reaches fp8mla unchanged
               (positional order, keywords, backend="fa2"/"fa3", the CUDA-graph buffers, scales).
  FI_SELECT=0  run every collected test instead of the selection below.
Both runs: ``flashinfer.utils.has_flashinfer_jit_cache`` answers True while the test modules are imported, so
their module-level warmup fixture (six JIT builds, four of them prefill kernels these tests do not use) is
off; run.sh pre-builds the MLA variants the selection needs, in parallel.
"""
from __future__ import annotations

import os

ANY = None
# (folder of the test file, test function) -> {parameter: allowed values}; ANY = every value.
# ~120 wrapper tests: decode and multi-token, page 1/16/64, causal, kv_len 0/97/1024/2743, batch up to 157,
# NaN past kv_len, mixed lengths, rope-free, FP8 per-tensor and group scales, the FP8 API contract.
SELECTION = {
    ("fi_pre_nope", "test_batch_mla_varlen_page_attention"): dict(
        batch_size={1, 3, 7}, kv_len_0={0, 11}, kv_len_1={33}, kv_len_2={2743}, qo_len={1, 7}, num_heads={16},
        causal=ANY, backend={"fa3"}),
    ("fi_pre_nope", "test_batch_mla_oob_kv_nan"): dict(
        batch_size={1, 157}, kv_len={17, 197}, qo_len={7}, causal=ANY, page_size={16}, backend={"fa3"}),
    ("fi_pre_nope", "test_batch_mla_page_attention"): dict(
        batch_size={1, 157}, kv_len={0, 97, 1024}, qo_len={1, 7}, causal=ANY, page_size={1, 16},
        backend={"fa3"}),
    ("fi_pre_nope", "test_batch_mla_fp8_kv_matches_bf16_reference"): dict(
        batch_size={1, 16}, kv_len={256, 1024}, qo_len={1, 16}, page_size={64}, num_heads={16, 128},
        causal=ANY),
    ("fi_pre_nope", "test_batch_mla_fp8_kv_scale_sensitivity"): {},
    ("fi_pre_nope", "test_batch_mla_fp8_kv_zero_kv_gives_zero_output"): {},
    ("fi_pre_nope", "test_fp8_kv_kpe_dominant_no_row_aliasing"): {},
    ("fi_pre_nope", "test_fp8_kv_plan_rejects_fp16_q"): {},       # fp8mla's superset: expected to differ
    ("fi_pre_nope", "test_fp8_kv_scales_are_keyword_only"): {},
    ("fi_pre_nope", "test_fp8_kv_run_rejects_dtype_mismatch"): {},
    ("fi_pre_nope", "test_fp8_kv_requires_scales"): {},
    # From the later file: only its tests that call the 0.6.18 API (rope-free MLA, group scales, fa2 FP8).
    ("fi_nope", "test_batch_mla_without_kpe"): {},
    ("fi_nope", "test_batch_mla_fp8_nope_group_scales_matches_bf16_reference"): {},
    ("fi_nope", "test_fp8_kv_kpe_dominant_no_row_aliasing"): dict(backend={"fa2"}),
}
# Expected to fail with fp8mla by design (documented superset), counted apart in the summary.
SUPERSET = {"test_fp8_kv_plan_rejects_fp16_q"}


def _selected(item) -> bool:
    key = (item.path.parent.name, getattr(item, "originalname", item.name))
    if key not in SELECTION:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, allowed in SELECTION[key].items():
        if allowed is not ANY and params.get(name) not in allowed:
            return False
    return True


def pytest_configure(config):
    import flashinfer
    import flashinfer.jit.env
    import flashinfer.utils

    flashinfer.utils.has_flashinfer_jit_cache = lambda: True     # see the module docstring
    flashinfer.jit.env.has_flashinfer_jit_cache = lambda: True
    swap = os.environ.get("FI_SWAP") == "1"
    if swap:
        import flashinfer.mla
        import fp8mla

        cls = fp8mla.MLAPagedAttention
        for mod_name in ("flashinfer", "flashinfer.mla", "flashinfer.mla._core"):
            mod = __import__(mod_name, fromlist=["_"])
            if hasattr(mod, "BatchMLAPagedAttentionWrapper"):
                setattr(mod, "BatchMLAPagedAttentionWrapper", cls)
        what = f"fp8mla {getattr(fp8mla, '__version__', '?')} swapped in"
    else:
        what = "FlashInfer itself"
    print(f"fi_swap: BatchMLAPagedAttentionWrapper = {what}; flashinfer {getattr(flashinfer, '__version__', '?')}",
          flush=True)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FI_SELECT", "1") == "0":
        return
    keep, drop = [], []
    for item in items:
        (keep if _selected(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep

