"""SGLang's own DeepSeek attention layer (``sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA``) through the
``fp8mla`` backend on the CPU, with real ``ForwardBatch`` es over SGLang's FP8 ``MLATokenToKVPool``.

One tiny random DeepSeek-V2 attention layer (hidden 64, 4 heads, qk_nope 128, v 128, kv_lora_rank 512, rope 64,
bf16 weights; without q LoRA (V2-Lite's ``q_proj``) and with q_lora_rank 96 (V3/R1's fused ``qkv_a`` projection,
its input handed over as SGLang's decoder layer does)), built by SGLang's constructor from a transformers
``DeepseekV2Config``, with ``w_kc`` / ``w_vc`` split from ``kv_b_proj`` as SGLang's weight loader does. Three
requests run three steps through the layer's ``forward`` (SGLang's dispatch picks the absorbed-MLA path through
fp8mla's DeepSeek handler): an extend with no cached prefix (the layer writes its latents into the pool), an
extend over that cached prefix, and a decode step. The pool's pages are shuffled and every slot no step wrote
holds NaN. Each case runs on an FP8
(e4m3, k_scale 1) and a bf16 pool, once per fp8mla kernel backend (torch; triton in Triton's interpreter). Not
covered here: the rest of the decoder layer (MoE/MLP, its communicator), a whole model, k_scale other than 1
(test_sglang.py covers that on the kit's module), the server.

Reference: the same weights in float64, un-absorbed (q, k_nope and v from ``kv_b_proj``, causal softmax), over
each request's whole sequence. Two comparisons per step: against the reference whose latents read from the pool
are rounded to e4m3 as the pool stores them (tolerance 3e-2, the kit's; bf16 model arithmetic), and against the
unquantized reference (0.25, as in test_sglang.py). Measured errors are printed (-s).

What the harness supplies, because SGLang's server would (no product code is patched): the kit's stand-in model
runner (pools, server args), ``get_parallel()`` values a server publishes (``attn_dcp_rank`` 0, no ``tp_group``
at TP 1), and, while the layer is built only, ``rotary_embedding.base._is_cpu = True``: otherwise SGLang's
``RotaryEmbedding.__init__`` on a machine without CUDA imports ``vllm._custom_ops`` (not installed), and
``SGLANG_USE_CPU_ENGINE=1`` cannot be set instead since ``memory_pool`` then imports ``sgl_kernel``'s CPU build.
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (engine tests run in .ci/run's engine venv)", allow_module_level=True)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp8mla.integrations import versions  # noqa: E402

if not versions.is_supported("sglang", versions.engine_version("sglang") or "0"):
    pytest.skip(f"SGLang {versions.engine_version('sglang')} is not a supported version", allow_module_level=True)

K = pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.mla_attention",
                        reason="SGLang's attention unit-test kit is not importable")
deepseek_v2 = pytest.importorskip("sglang.srt.models.deepseek_v2", reason="SGLang's DeepSeek model code")

import sglang.srt.layers.rotary_embedding.base as rope_base  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.layer_boundary.adapters.attention import AttentionInputs, get_attn_tp_context  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.utils import BumpAllocator  # noqa: E402
from transformers import DeepseekV2Config  # noqa: E402

from fp8mla import available_backends  # noqa: E402
from fp8mla.integrations import sglang as plugin  # noqa: E402
from fp8mla.sentinel import forbid_pool_casts  # noqa: E402

BACKENDS = [b for b in ("torch", "triton") if b in available_backends("cpu")]
HIDDEN, HEADS, NOPE, V, LORA, ROPE, PAGE, CTX = 64, 4, 128, 128, 512, 64, 16, 64
PREFIX = (7, 17, 3)       # step 1 extends these from nothing; step 2 extends EXTEND over them as a cached prefix
EXTEND = (5, 3, 16)
ATOL_STORED, ATOL_PLAIN = 3e-2, 0.25


@pytest.fixture(scope="module", autouse=True)
def sglang_process_state():
    plugin.register()
    assert "fp8mla" in ATTENTION_BACKENDS
    with get_parallel().override(attn_dcp_rank=0, tp_group=None):
        yield


@contextmanager
def _building_layer():
    """bf16 parameters (SGLang's loader sets the default dtype) and the CPU rope branch (see the docstring)."""
    old_dtype, old_cpu = torch.get_default_dtype(), rope_base._is_cpu
    torch.set_default_dtype(torch.bfloat16)
    rope_base._is_cpu = True
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        rope_base._is_cpu = old_cpu


def _layer(q_lora):
    cfg = DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                           qk_nope_head_dim=NOPE, v_head_dim=V, q_lora_rank=q_lora, rms_norm_eps=1e-6,
                           max_position_embeddings=CTX)
    with _building_layer():
        attn = deepseek_v2.DeepseekV2AttentionMLA(
            cfg, hidden_size=HIDDEN, num_heads=HEADS, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
            q_lora_rank=q_lora, kv_lora_rank=LORA, max_position_embeddings=CTX, reduce_results=False, layer_id=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        # as SGLang's weight loader (post_load_weights) splits kv_b_proj for the absorbed path
        w_kc, w_vc = attn.kv_b_proj.weight.unflatten(0, (-1, NOPE + V)).split([NOPE, V], dim=1)
        attn.w_kc, attn.w_vc = w_kc.contiguous(), w_vc.contiguous().transpose(1, 2)
    return attn


def _runner(fp8):
    case = K.MLAAttentionCase(name="model", backend="fp8mla", forward_mode=ForwardMode.EXTEND, num_heads=HEADS,
                              page_size=PAGE, prefix_lens=(0,) * len(PREFIX), extend_lens=PREFIX)
    cfg = K.TinyMLAModelConfig(num_heads=HEADS, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, hidden_size=HIDDEN,
                               context_len=CTX)
    # the kit's config describes a model with qk_nope = v = kv_lora_rank; this one's heads are DeepSeek's
    cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.scaling = NOPE, V, (NOPE + ROPE) ** -0.5
    return K.MockMLAModelRunner(case=case, model_config=cfg, dtype=torch.bfloat16, device="cpu",
                                max_context_len=CTX, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, fp8_kv_cache=fp8)


def _rope(x, pos):
    """GPT-J (interleaved) rotary embedding, SGLang's DeepSeek default (rope_interleave), in float64."""
    inv = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def _rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _reference(attn, hidden, stored):
    """float64 un-absorbed attention over one request's tokens ``hidden`` [L, HIDDEN]; ``stored[i]``: token i's
    latents are read back from an e4m3 pool (rounded as stored) rather than taken fresh."""
    w = {n: p.double() for n, p in attn.named_parameters()}
    h = hidden.double()
    L = h.shape[0]
    pos = torch.arange(L)
    if attn.q_lora_rank is None:
        q = h @ w["q_proj.weight"].T
        lat = h @ w["kv_a_proj_with_mqa.weight"].T
    else:
        q_lat, lat = (h @ w["fused_qkv_a_proj_with_mqa.weight"].T).split([attn.q_lora_rank, LORA + ROPE], -1)
        q = _rms(q_lat, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(L, HEADS, NOPE + ROPE)
    c = _rms(lat[:, :LORA], w["kv_a_layernorm.weight"])
    k_pe = _rope(lat[:, None, LORA:], pos)[:, 0]
    if stored.any():
        def e4m3(t):
            return t.bfloat16().clamp(-448, 448).to(torch.float8_e4m3fn).double()
        c = torch.where(stored[:, None], e4m3(c), c)
        k_pe = torch.where(stored[:, None], e4m3(k_pe), k_pe)
    kv = (c @ w["kv_b_proj.weight"].T).view(L, HEADS, NOPE + V)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    q_nope, q_pe = q[..., :NOPE], _rope(q[..., NOPE:], pos)
    s = (torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_pe, k_pe)) * attn.scaling
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(L, HEADS * V)
    return o @ w["o_proj.weight"].T


@pytest.mark.parametrize("q_lora", [None, 96], ids=["v2_lite_q", "q_lora_96"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_pool", "bf16_pool"])
def test_deepseek_v2_attention_extend_cached_prefix_decode(fp8, q_lora, backend):
    from fp8mla.integrations.sglang_backend import STATS, FP8MLAAttnBackend
    torch.manual_seed(0)
    runner = _runner(fp8)
    be = ATTENTION_BACKENDS["fp8mla"](runner)
    assert isinstance(be, FP8MLAAttnBackend)
    attn = _layer(q_lora)
    assert attn.attn_mqa.scaling == runner.model_config.scaling
    pool = runner.token_to_kv_pool
    assert pool.kv_buffer[0].dtype == (torch.uint8 if fp8 else torch.bfloat16)
    pool.kv_buffer[0].fill_(0x7F if fp8 else float("nan"))  # NaN (e4m3 0x7f) in every slot not written by a step
    perm = torch.randperm(len(PREFIX) * CTX // PAGE, generator=torch.Generator().manual_seed(1)) + 1

    def loc(req, pos):  # shuffled pages (page 0 unused), as SGLang's page allocator hands them out
        return int(perm[req * (CTX // PAGE) + pos // PAGE]) * PAGE + pos % PAGE

    def step(mode, prefix, extend, hidden):
        case = K.MLAAttentionCase(name="model", backend="fp8mla", forward_mode=mode, num_heads=HEADS,
                                  page_size=PAGE, prefix_lens=prefix, extend_lens=extend)
        fb = K._make_forward_batch(case, runner, max_context_len=CTX, device="cpu", loc_fn=loc)
        STATS.reset()
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=be)), \
                forbid_pool_casts(*pool.kv_buffer):
            be.init_forward_metadata(fb)
            if q_lora is not None:  # what the decoder layer's communicator does before attention
                get_attn_tp_context().set_attn_inputs(AttentionInputs(hidden, fb, attn.prepare_qkv_latent))
            try:
                out = attn(fb.positions, hidden, fb, BumpAllocator(256, torch.float32, "cpu"))
            finally:
                get_attn_tp_context().clear_attn_inputs()
        assert attn.current_attention_backend == "fp8mla"
        assert STATS.writes == 1 and STATS.pool_dtypes == {torch.float8_e4m3fn if fp8 else torch.bfloat16}
        return out, dict(vars(STATS))

    seqs = [torch.randn(CTX, HIDDEN).bfloat16() for _ in PREFIX]
    total = tuple(p + e for p, e in zip(PREFIX, EXTEND))
    o1, s1 = step(ForwardMode.EXTEND, (0,) * len(PREFIX), PREFIX, torch.cat([s[:n] for s, n in zip(seqs, PREFIX)]))
    o2, s2 = step(ForwardMode.EXTEND, PREFIX, EXTEND,
                  torch.cat([s[p:t] for s, p, t in zip(seqs, PREFIX, total)]))
    o3, s3 = step(ForwardMode.DECODE, total, (), torch.stack([s[t] for s, t in zip(seqs, total)]))
    assert s1["extend_ragged_calls"] == 1 and s1["decode_calls"] == 0 and not s1["backends"]  # no cached prefix
    assert s2["extend_ragged_calls"] == 1 and s2["backends"] == {backend}  # + the cached prefix, paged
    assert s3["decode_calls"] == 1 and s3["backends"] == {backend}

    errs = []
    for b, seq in enumerate(seqs):
        p, t = PREFIX[b], total[b]
        n = t + 1
        # what each step read from the pool: step 2 the cached prefix, the decode step every token
        got = [o1[sum(PREFIX[:b]):sum(PREFIX[:b + 1])], o2[sum(EXTEND[:b]):sum(EXTEND[:b + 1])], o3[b:b + 1]]
        rows = [slice(0, p), slice(p, t), slice(t, n)]
        from_pool = [torch.zeros(n, dtype=torch.bool), torch.arange(n) < p, torch.ones(n, dtype=torch.bool)]
        plain = _reference(attn, seq[:n], torch.zeros(n, dtype=torch.bool))
        for i, (g, r, fp) in enumerate(zip(got, rows, from_pool)):
            want = _reference(attn, seq[:n], fp & fp8)[r] if fp8 else plain[r]
            torch.testing.assert_close(g.double(), want, atol=ATOL_STORED, rtol=ATOL_STORED,
                                       msg=lambda m: f"request {b}, step {i + 1}, vs stored latents: {m}")
            torch.testing.assert_close(g.double(), plain[r], atol=ATOL_PLAIN, rtol=ATOL_PLAIN,
                                       msg=lambda m: f"request {b}, step {i + 1}, vs unquantized: {m}")
            errs.append(((g.double() - want).abs().max().item(), (g.double() - plain[r]).abs().max().item()))
    worst = [round(max(e[k] for e in errs), 4) for k in (0, 1)]
    scale = round(max(o.float().abs().max().item() for o in (o1, o2, o3)), 2)
    print(f"DeepseekV2AttentionMLA q_lora {q_lora}, {'fp8' if fp8 else 'bf16'} pool, {backend}: max |err| vs "
          f"stored latents, vs unquantized: {worst} (outputs up to {scale})")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FP8MLA_BACKEND", request.param)
    return request.param
