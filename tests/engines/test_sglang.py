"""fp8mla as SGLang's attention backend ``fp8mla``, through SGLang's own attention unit-test kit on the CPU.

The kit (sglang/test/kits/attention_unittest, MLA methods) builds SGLang's real ModelRunner pieces
(``MLATokenToKVPool`` with an FP8 pool stored as uint8, ``ReqToTokenPool``, shuffled page locations, a
``ForwardBatch``), creates the backend from ``ATTENTION_BACKENDS["fp8mla"]`` (the registry our plugin fills),
runs a DeepSeek-style absorbed-MLA module through ``RadixAttention`` and compares with its float32 reference on
the unquantized latents. DeepSeek widths: kv_lora_rank 512, rope 64, 4 heads, bf16. Every case runs once per
fp8mla kernel backend (FP8MLA_BACKEND): torch, and triton (on the CPU in Triton's interpreter); on a CUDA machine
(lab/scripts/sglang_kit_device.sh) the kit builds its pools on the GPU and gluon joins where it can run (a plan the
Gluon kernel refuses, e.g. an extend longer than its multi-token decode, is a skip that says so).

Tolerances: the kit's own (3e-2) against its reference computed on the latents the pool holds (for an FP8 pool:
rounded to e4m3 and scaled back, which separates the kernel's error from quantization); 0.25 against the
unquantized reference for an FP8 pool (e4m3 keeps 3 mantissa bits). Measured errors are printed (-s). Every forward runs under forbid_pool_casts of the
pool, so a cast of the whole pool (SGLang's FlashInfer MLA backend's ``get_key_buffer(...).to(q.dtype)``) fails.

Skipped unless SGLang is importable (the engine venv that .ci/run builds; see docs/engines.md).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:  # before touching the environment of the main test run
    pytest.skip("SGLang is not installed (engine tests run in .ci/run's engine venv)", allow_module_level=True)

import torch  # noqa: E402

if not torch.cuda.is_available():  # fp8mla's Triton kernels run in Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("sglang", reason="SGLang is not importable here")

from fp8mla.integrations import versions  # noqa: E402

if not versions.is_supported("sglang", versions.engine_version("sglang") or "0"):
    pytest.skip(f"SGLang {versions.engine_version('sglang')} is not a supported version "
                f"({versions.describe('sglang')})", allow_module_level=True)

K = pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.mla_attention",
                        reason="SGLang's attention unit-test kit is not importable")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402

from fp8mla import available_backends  # noqa: E402
from fp8mla.integrations import sglang as plugin  # noqa: E402
from fp8mla.sentinel import forbid_pool_casts  # noqa: E402

# fp8mla's kernel backends run under the engine (FP8MLA_BACKEND): torch, triton where it can run here, gluon on Hopper
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [b for b in ("torch", "triton", "gluon") if b in available_backends(DEVICE)]
DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=64, max_context_len=64)
ATOL = {False: K.MLA_ATOL, True: 0.25}  # vs the unquantized reference: fp8_kv_cache -> atol = rtol
# FP8MLA_BACKEND=gluon forces the Gluon kernel on every call: a plan it does not take (a BF16 pool, an extend of
# more than 8 tokens per request) raises this, naming backend='triton' (auto picks Triton for those plans)
GLUON_REFUSES = "'gluon' does not support this plan"


class _Case:
    """The kit's ``testcase``: it calls skipTest when the backend cannot be built; here that is a failure."""

    def skipTest(self, reason):  # noqa: N802 (unittest's name)
        raise AssertionError(f"the kit could not build the fp8mla backend: {reason}")


@pytest.fixture(scope="module", autouse=True)
def registered():
    plugin.register()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    assert "fp8mla" in ATTENTION_BACKENDS


def _cases():
    """The kit's MLA cases for fp8mla (extend at page 1/16/32 with and without cached prefixes, decode at page
    16) plus decode at page 1."""
    cases = list(K.make_mla_cases("fp8mla"))
    cases += [K.MLAAttentionCase(name="mla_decode_page_size_1", backend="fp8mla", forward_mode=ForwardMode.DECODE,
                                 num_heads=4, page_size=1, prefix_lens=(1, 9, 30)),
              K.MLAAttentionCase(name="mla_decode_page16_long", backend="fp8mla", forward_mode=ForwardMode.DECODE,
                                 num_heads=4, page_size=16, prefix_lens=(33, 47))]
    return cases


def _pools(fixture):
    return list(fixture.runner.token_to_kv_pool.kv_buffer)


def _e4m3(t, scale):
    """``t / scale`` saturated to e4m3, the pool's rule: an IEEE fp32 division by an fp32 tensor (a Python-number
    divisor is a multiply by its reciprocal on CUDA, which moves the last bit and now and then an e4m3 value)."""
    q = torch.div(t.float(), torch.tensor(float(scale), dtype=torch.float32, device=t.device))
    return q.clamp(-448, 448).to(torch.float8_e4m3fn)


def _expected(fixture, rounded=None):
    """The kit's reference; with ``rounded`` ("all" or "prefix"), on the latents an e4m3 pool holds (``k /
    k_scale`` rounded to e4m3, times ``k_scale``) for every token or for the cached prefix only: the reference on
    the dequantized KV, which separates the kernel's error from the FP8 quantization error."""
    if rounded is None:
        return K.expected_mla_fixture_output(fixture)
    ref = fixture.reference_module
    scale = float(getattr(fixture.actual_module.attn_mqa, "k_scale_float", None) or 1.0)
    prefix_ids = {id(t) for t in fixture.prefix_hidden}
    project = ref.project_latent_qk

    def rq(t):
        return (_e4m3(t, scale).float() * scale).to(t.dtype)

    def project_rounded(hidden):
        q, k, q_rope, k_rope = project(hidden)
        if rounded == "all" or id(hidden) in prefix_ids:
            k, k_rope = rq(k), rq(k_rope)
        return q, k, q_rope, k_rope

    ref.project_latent_qk = project_rounded
    try:
        return K.expected_mla_fixture_output(fixture)
    finally:
        del ref.project_latent_qk


def _check(actual, fixture, fp8, rounded="all"):
    """Against the reference on the stored (dequantized) latents at the kit's tolerance, and, for an FP8 pool,
    against the unquantized reference at the FP8 tolerance; returns both max errors."""
    exact = _expected(fixture, rounded if fp8 else None)
    torch.testing.assert_close(actual, exact, atol=K.MLA_ATOL, rtol=K.MLA_RTOL)
    plain = _expected(fixture)
    torch.testing.assert_close(actual, plain, atol=ATOL[fp8], rtol=ATOL[fp8])
    return [round((actual.float() - e.float()).abs().max().item(), 4) for e in (exact, plain)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FP8MLA_BACKEND", request.param)
    return request.param


# The Triton kernels run in the interpreter here: a subset keeps CI short (decode at page 1 and 16, extend at page
# 1, 16 and 32 with cached prefixes); the torch backend runs every case.
TRITON_CASES = {"mla_decode_page_size_1", "mla_decode_page16_long", "mla_extend_page_size_1",
                "mla_extend_ragged_page_boundary", "mla_extend_page32_cross_boundary"}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_pool", "fp8_pool"])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_kit_mla_case(case, fp8, backend):
    from fp8mla.integrations.sglang_backend import FP8MLAAttnBackend, STATS
    if DEVICE == "cpu" and backend == "triton" and case.name not in TRITON_CASES:
        pytest.skip("the triton backend runs a subset of the kit's cases on the CPU (TRITON_CASES)")
    fixture = K.build_mla_attention_fixture(_Case(), case, dtype=torch.bfloat16, device=DEVICE, fp8_kv_cache=fp8,
                                            **DIMS)
    assert isinstance(fixture.backend, FP8MLAAttnBackend)
    pools = _pools(fixture)
    assert all(p.dtype == (torch.uint8 if fp8 else torch.bfloat16) for p in pools)
    STATS.reset()
    with forbid_pool_casts(*pools):
        try:
            actual = K.run_mla_fixture_eager(fixture)
        except ValueError as e:
            if backend == "gluon" and GLUON_REFUSES in str(e):
                pytest.skip(f"the gluon kernel refuses this plan: {e}")
            raise
    err = _check(actual, fixture, fp8)
    calls = STATS.decode_calls if case.forward_mode.is_decode() else STATS.extend_calls
    assert calls == 1 and STATS.pool_dtypes == {torch.float8_e4m3fn if fp8 else torch.bfloat16}
    assert STATS.backends == {backend}
    print(f"{case.name} {'fp8' if fp8 else 'bf16'} {backend}: max |err| vs stored values, vs unquantized: {err}")


@pytest.mark.parametrize("k_scale", [1.0, 0.3])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_fresh_latents_and_cached_prefix(page_size, k_scale, backend):
    """The DeepSeek model's path: the layer hands the fresh latents to the backend, which writes them (k / k_scale
    into the FP8 pool) and runs them ragged, plus the cached prefix paged, merged by LSE."""
    from fp8mla.integrations.sglang_backend import STATS
    case = K.MLAAttentionCase(name=f"fresh_p{page_size}", backend="fp8mla", forward_mode=ForwardMode.EXTEND,
                              num_heads=4, page_size=page_size, prefix_lens=(0, 7, 17), extend_lens=(5, 3, 16))
    fixture = K.build_mla_attention_fixture(_Case(), case, dtype=torch.bfloat16, device=DEVICE, fp8_kv_cache=True,
                                            **DIMS)
    mod, fb = fixture.actual_module, fixture.forward_batch
    layer = mod.attn_mqa
    # the prefix was written by the kit with scale 1: rewrite it under this k_scale, as SGLang would have
    layer.k_scale_float = k_scale
    layer.k_scale = torch.tensor(k_scale)
    pool = fixture.runner.token_to_kv_pool
    if k_scale != 1.0:
        for b, prefix in enumerate(fixture.prefix_hidden):
            if prefix.shape[0]:
                _, k_nope, _, k_rope = mod.forward_absorb_prepare(prefix)
                locs = fixture.runner.req_to_token_pool.req_to_token[b, : prefix.shape[0]].long()
                pool.kv_buffer[0][locs] = _e4m3(torch.cat([k_nope, k_rope], -1), k_scale).view(torch.uint8)
    STATS.reset()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)), \
            forbid_pool_casts(*_pools(fixture)):
        q_nope, k_nope, q_rope, k_rope = mod.forward_absorb_prepare(fixture.input_hidden)
        q = torch.cat([q_nope, q_rope], dim=-1).flatten(1, 2)
        try:  # the plan (init_forward_metadata) is where a forced gluon backend refuses
            fixture.backend.init_forward_metadata(fb)
            o = layer(q, k_nope, k_nope, fb, save_kv_cache=True, k_rope=k_rope)
        except ValueError as e:
            if backend == "gluon" and GLUON_REFUSES in str(e):
                pytest.skip(f"the gluon kernel refuses this plan: {e}")
            raise
        o = o.view(-1, mod.num_heads, mod.kv_lora_rank)
        actual = mod.o_proj(torch.bmm(o.transpose(0, 1), mod.w_vc).transpose(0, 1).flatten(1, 2))
    # on CUDA only fp8mla's triton ragged kernel takes the fresh tokens; otherwise they are read back from the
    # pool, FP8-rounded like the prefix
    md = fixture.backend.forward_metadata
    ragged = DEVICE == "cpu" or (md.ragged is not None and md.ragged.backend == "triton")
    err = _check(actual, fixture, True, rounded="prefix" if ragged else "all")
    assert STATS.writes == 1 and STATS.extend_ragged_calls == int(ragged) and STATS.extend_calls == 1
    assert STATS.backends == {backend}  # the cached prefix's paged run
    # the fresh tokens went into the pool as k / k_scale
    locs = fb.out_cache_loc.long()
    stored = pool.kv_buffer[0][locs].view(torch.float8_e4m3fn).float()
    want = _e4m3(torch.cat([k_nope, k_rope], -1), k_scale).float()
    assert torch.equal(stored, want)
    print(f"fresh latents, page {page_size}, k_scale {k_scale}, {backend}: max |err| vs stored values, vs unquantized: {err}")


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_hooks_plan_decode_into_fixed_buffers(page_size, backend):
    """The decode graph hooks (init_cuda_graph_state, init_forward_metadata_out_graph, nothing in graph): the batch
    is planned into a wrapper with fixed buffers (use_cuda_graph=True) and run from them, for two batches of the
    same size. On the CPU nothing is captured; this checks the planning side of the hooks."""
    from fp8mla.integrations.sglang_backend import STATS
    results = []
    for prefix in ((14, 15, 16), (3, 40, 1)):
        case = K.MLAAttentionCase(name=f"graph_p{page_size}", backend="fp8mla", forward_mode=ForwardMode.DECODE,
                                  num_heads=4, page_size=page_size, prefix_lens=prefix)
        fixture = K.build_mla_attention_fixture(_Case(), case, dtype=torch.bfloat16, device=DEVICE,
                                                fp8_kv_cache=True, **DIMS)
        be = fixture.backend
        be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
        STATS.reset()
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=be)), forbid_pool_casts(*_pools(fixture)):
            be.init_forward_metadata_out_graph(fixture.forward_batch, in_capture=False)
            be.init_forward_metadata_in_graph(fixture.forward_batch)
            actual = fixture.actual_module(fixture.input_hidden, fixture.forward_batch)
        results.append(_check(actual, fixture, True))
        assert STATS.decode_calls == 1 and STATS.backends == {backend}
        assert be.get_cuda_graph_seq_len_fill_value() == 1
    print(f"graph hooks, page {page_size}, {backend}: {results}")


def test_plugin_entry_point_and_cli_choice():
    from importlib.metadata import entry_points

    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
    eps = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("fp8mla") == "fp8mla.integrations.sglang:register"
    assert "fp8mla" in ATTENTION_BACKEND_CHOICES
    assert AttentionBackendRegistry.get_handler("fp8mla").__name__ == "handle_attention_fp8mla"


def test_unsupported_sglang_version_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    with pytest.raises(versions.UnsupportedEngineVersion, match=r"supports sglang 0\.5\.23"):
        versions.check_version("sglang", "0.5.22")
