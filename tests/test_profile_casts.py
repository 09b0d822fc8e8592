"""Profile fp8mla decode with torch.profiler and let the doctor check the trace: no cast may read more than the
active tokens hold. The counter-test profiles the legacy pattern (the whole pool cast in a layer loop) and shows
the same check fails on it and the doctor flags it, so a regression cannot pass unnoticed.

On the CPU this runs the torch backend (gather-then-cast: a cast as large as the active tokens is expected);
on a GPU it runs the default backend and profiles the kernels too.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import fp8mla
from fp8mla.tools.doctor import diagnose

LAYERS, PAGES, PAGE, HEADS = 2, 256, 16, 16     # one layer's fp8 pool: 256 x 16 x 576 B = 2.36 MB
KV_LENS = [128, 128]                           # equal lengths: the torch backend pads requests to the longest
STEPS = 2


def _cache(device):
    cache = fp8mla.PagedMLACache(LAYERS, PAGES, PAGE, "fp8_e4m3", device=device)
    seqs = [cache.add_sequence(num_tokens=n) for n in KV_LENS]
    for layer in range(LAYERS):
        cache.append(layer, seqs, torch.randn(sum(KV_LENS), 512, device=device),
                     torch.randn(sum(KV_LENS), 64, device=device))
    return cache, seqs


def _profile(step_fn, device, path) -> str:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=STEPS, repeat=1)) as prof:
        for _ in range(STEPS + 1):
            step_fn()
            if device == "cuda":
                torch.cuda.synchronize()
            prof.step()
    prof.export_chrome_trace(str(path))
    return str(path)


def _decode_step(cache, seqs, device, backend, legacy=False):
    attn = fp8mla.MLAPagedAttention(backend=backend)
    attn.plan(**cache.plan_inputs(seqs), num_heads=HEADS, causal=True, sm_scale=192 ** -0.5,
              q_data_type=torch.bfloat16)
    q_nope = torch.randn(len(seqs), HEADS, 512, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(len(seqs), HEADS, 64, device=device, dtype=torch.bfloat16)
    bf16 = fp8mla.MLAPagedAttention(backend=backend)
    bf16.plan(**{**cache.plan_inputs(seqs), "kv_data_type": torch.bfloat16}, num_heads=HEADS, causal=True,
              sm_scale=192 ** -0.5, q_data_type=torch.bfloat16)

    def step():
        for layer in range(LAYERS):
            with record_function(f"layer{layer}"):
                if legacy:  # the bug: the whole pool converted to the query dtype, every layer
                    kv = cache.pool[layer].to(q_nope.dtype)
                    bf16.run(q_nope, q_pe, kv[..., :512], kv[..., 512:])
                else:
                    attn.run(q_nope, q_pe, **cache.run_inputs(layer))
    return step


def cast_budget_violations(report, active_tokens: int, bytes_per_token: int, width: int = 576) -> list:
    """Casts that read more than the active tokens hold (bytes in the pool's storage, or elements)."""
    bad = []
    for g in report.casts:
        if g.bytes_read is None:
            bad.append((g, "size not recorded"))
        elif g.bytes_read > active_tokens * bytes_per_token or (g.shape is not None and
                                                                 _numel(g.shape) > active_tokens * width):
            bad.append((g, f"reads {g.bytes_read} B > {active_tokens} active tokens x {bytes_per_token} B"))
    return bad


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_decode_casts_stay_within_the_active_tokens(device, tmp_path):
    cache, seqs = _cache(device)
    backend = "torch" if device == "cpu" else "auto"
    trace = _profile(_decode_step(cache, seqs, device, backend), device, tmp_path / "decode.json")
    layer_pool = PAGES * PAGE * cache.bytes_per_token
    report = diagnose(trace, pool_bytes=layer_pool)
    assert report.num_steps == STEPS
    assert not report.findings, report.diagnosis
    if backend == "torch":  # gather-then-cast: the doctor must see the casts, or the check below is vacuous
        assert any(g.src == "float8_e4m3fn" for g in report.casts)
    bad = cast_budget_violations(report, sum(KV_LENS), cache.bytes_per_token)
    assert not bad, "\n".join(f"{g.op} {g.src}->{g.dst} {g.shape}: {why}" for g, why in bad)


def test_pool_cast_in_a_layer_loop_is_flagged(device, tmp_path):
    cache, seqs = _cache(device)
    backend = "torch" if device == "cpu" else "auto"
    trace = _profile(_decode_step(cache, seqs, device, backend, legacy=True), device, tmp_path / "legacy.json")
    layer_pool = PAGES * PAGE * cache.bytes_per_token
    # the same check as the decode test fails here ...
    bad = cast_budget_violations(diagnose(trace), sum(KV_LENS), cache.bytes_per_token)
    assert any(g.src == "float8_e4m3fn" and g.bytes_read == layer_pool for g, _ in bad)
    # ... and the doctor flags the cast, with the pool size given or inferred
    for report in (diagnose(trace, pool_bytes=layer_pool), diagnose(trace)):
        assert len(report.findings) == 1, report.diagnosis
        g = report.findings[0]
        assert (g.src, g.dst, g.per_step, g.bytes_read) == ("float8_e4m3fn", "bfloat16", LAYERS, layer_pool)
        assert g.pool_fraction == pytest.approx(1.0)
        text = report.diagnosis[0]
        assert "KV-pool cast" in text and "ms per step" in text and "kv_data_type=float8_e4m3fn" in text
