"""fp8mla's MLA layer against transformers' DeepseekV3Attention (eager, fp32), same random weights, tiny widths.

A 2-layer attention stack (pre-RMSNorm + residual) runs a continuous-batching schedule: a prefill of sequences
of different lengths, then 16 decode steps in which sequences join (prefill mixed with decode, and one prefill
split in two chunks so the cached prefix is gathered and LSE-merged) and leave (their pages are reused). The
reference is the transformers stack over each sequence's whole token list (causal, so position t's output is
the one a step that adds token t must produce).

Errors are those of what the attention layers add to the residual stream (the residual itself is exact on both
sides), rel L2 per step, measured over both configs (torch 2.13 CPU, transformers 5.x):
  bf16 cache       2.7e-3 .. 4.3e-3  bound 1e-2  (bf16 queries, latents and outputs)
  fp8_e4m3         1.3e-2 .. 4.4e-2  bound 6e-2  (e4m3 keeps 3 mantissa bits: ~3.6% rms per stored value)
  fp8_e4m3_group   1.3e-2 .. 4.3e-2  bound 6e-2  (group scales move the range, not the mantissa)
  fp8_e5m2         2.7e-2 .. 9.1e-2  bound 1.2e-1 (2 mantissa bits)
Step 0 (prefill only) is at the bf16 level for every format: it attends over the fresh 16-bit latents.
No drift: the worst of the last 4 decode steps stays within 1.25x the worst of the first 4 (measured <= 1.13x).
"""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hfm = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from fp8mla import available_backends  # noqa: E402
from fp8mla.models import DeepseekMLAModel, load_config  # noqa: E402
from fp8mla.testing import compare  # noqa: E402

BOUND = {"bf16": 1e-2, "fp8_e4m3": 6e-2, "fp8_e4m3_group": 6e-2, "fp8_e5m2": 1.2e-1}
DRIFT = 1.25


def tiny(variant: str):
    cfg = load_config("tiny")
    if variant == "v2":  # DeepSeek-V2-Lite's shape: no q LoRA; rotate-half rope; cos/sin mscale != 1
        rs = dict(cfg.rope_scaling, mscale=1.0, mscale_all_dim=0.707)
        cfg = cfg.replace(q_lora_rank=None, rope_interleave=False, rope_scaling=rs)
    return cfg


def hf_config(cfg, num_layers: int):
    # rope_theta + rope_scaling: the form of the published config.json files, read by transformers 4.x and 5.x
    c = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, num_hidden_layers=num_layers,
        max_position_embeddings=cfg.max_position_embeddings, rope_interleave=cfg.rope_interleave,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=dict(cfg.rope_scaling),
        vocab_size=64, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1)
    c._attn_implementation = "eager"
    return c


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights that make attention non-trivial: N(0, 1/fan_in) matrices, norms 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * r if p.dim() == 1 else r / math.sqrt(p.shape[-1]))


class HFStack:
    """transformers' attention layers composed as fp8mla's stack: x + attn(input_layernorm(x))."""

    def __init__(self, hf_cfg, norms, attns):
        self.rotary = hfm.DeepseekV3RotaryEmbedding(hf_cfg)
        self.norms, self.attns = norms, attns

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [L, D] one whole sequence
        L = x.shape[0]
        h = x[None]
        cos_sin = self.rotary(h, torch.arange(L)[None])
        mask = torch.full((L, L), -math.inf).triu(1)[None, None]
        for norm, attn in zip(self.norms, self.attns):
            h = h + attn(norm(h), cos_sin, mask)[0]
        return h[0]


def build_pair(cfg, num_layers: int = 2, seed: int = 0, backend: str = "torch"):
    hc = hf_config(cfg, num_layers)
    norms = [hfm.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) for _ in range(num_layers)]
    attns = [hfm.DeepseekV3Attention(hc, i).eval() for i in range(num_layers)]
    for i, (n, a) in enumerate(zip(norms, attns)):
        randomize(n, seed * 100 + 2 * i)
        randomize(a, seed * 100 + 2 * i + 1)
    ours = DeepseekMLAModel(cfg, num_layers, dtype=torch.float32, backend=backend)
    for blk, n, a in zip(ours.layers, norms, attns):
        sd = a.state_dict()
        blk.self_attn.load_weights(lambda name: sd[name])
        blk.input_layernorm.weight.data.copy_(n.weight)
    return ours, HFStack(hc, norms, attns)


# Continuous batching: step -> (joining sequences with their first chunk, sequences leaving before the step).
# Step 0 is the first prefill (B has a single token: a prefill of length 1); sequence F's prompt comes in two
# chunks (9 then 6 tokens), the second one attending its cached prefix.
PROMPTS = {"A": 13, "B": 1, "C": 30, "D": 7, "E": 11, "F": 15, "G": 5}
JOIN = {0: ["A", "B", "C", "D"], 3: ["E"], 7: ["F"], 12: ["G"]}
CHUNKS = {"F": [9, 6]}
LEAVE = {5: ["A"], 10: ["C"], 12: ["B"]}
DECODE_STEPS = 16


def run_schedule(model, kv_format: str, tokens: dict, page_size: int = 4):
    """Runs the schedule; yields (step, rows_by_seq {name: (row0, row1, pos0)}, x [T, D], out [T, D], paths)."""
    cache = model.make_cache(num_pages=96, page_size=page_size, kv_format=kv_format)
    live, todo, ids = {}, {}, {}
    for step in range(DECODE_STEPS + 1):
        for s in LEAVE.get(step, []):
            cache.free(ids[s])
            del live[s]
        for s in JOIN.get(step, []):
            ids[s] = cache.add_sequence()
            todo[s] = list(CHUNKS.get(s, [PROMPTS[s]]))
            live[s] = 0
        names, counts = [], []
        for s in live:
            n = todo[s].pop(0) if todo.get(s) else 1
            names.append(s)
            counts.append(n)
        x = torch.cat([tokens[s][live[s]: live[s] + n] for s, n in zip(names, counts)])
        st = model.begin_step(cache, [ids[s] for s in names], counts)
        out = model(x, st)
        rows, r = {}, 0
        for s, n in zip(names, counts):
            rows[s] = (r, r + n, live[s])
            live[s] += n
            r += n
        paths = {"prefill"} if st.ragged is not None else set()
        paths |= {"decode"} if st.paged is not None else set()
        paths |= {"prefix"} if st.ragged_prefix is not None else set()
        paths |= {w.backend for w in (st.paged, st.ragged) if w is not None}
        yield step, rows, x, out, paths


def make_tokens(cfg, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {s: torch.randn(n + DECODE_STEPS, cfg.hidden_size, generator=g) for s, n in PROMPTS.items()}


TRITON = pytest.mark.skipif("triton" not in available_backends(), reason="triton cannot run here (no GPU, and "
                            "TRITON_INTERPRET is not set)")


@pytest.mark.parametrize("variant, kv_format, backend", [
    *[(v, f, "torch") for v in ("v3", "v2") for f in BOUND],
    # the Triton kernels (decode, ragged, gather, merge) in the same model; the interpreter on a CPU (~9 s)
    pytest.param("v3", "fp8_e4m3", "triton", marks=TRITON),
])
def test_matches_transformers_continuous_batching(variant, kv_format, backend):
    torch.manual_seed(0)
    cfg = tiny(variant)
    ours, hf = build_pair(cfg, backend=backend)
    tokens = make_tokens(cfg)
    ref = {s: hf(t) for s, t in tokens.items()}
    errs, seen = [], set()
    for step, rows, x, out, paths in run_schedule(ours, kv_format, tokens):
        seen.add(frozenset(paths))
        want = torch.cat([ref[s][p0: p0 + (r1 - r0)] for s, (r0, r1, p0) in rows.items()])
        # The residual stream is exact on both sides: compare what the attention layers added to it.
        c = compare(out - x, want - x)
        assert c.nan_mismatch == 0 and c.rel_l2 <= BOUND[kv_format], f"step {step} ({kv_format}): {c}"
        errs.append(c.rel_l2)
    # the schedule exercised a mixed prefill+decode step and a chunk attending its cached prefix
    assert any({"prefill", "decode"} <= p for p in seen) and any("prefix" in p for p in seen), seen
    assert {b for p in seen for b in p if b in ("torch", "triton")} == {backend}
    assert max(errs[-4:]) <= DRIFT * max(errs[1:5]), f"{kv_format}: error grows over the decode steps: {errs}"


def test_decode_and_prefill_paths_agree():
    """The same tokens through prefill only (ragged on fresh K/V) and through prefill + absorbed decode."""
    cfg = tiny("v3")
    ours, _ = build_pair(cfg, num_layers=1)
    x = torch.randn(9, cfg.hidden_size)
    a = ours.make_cache(16, 4, "bf16")
    a.add_sequence(0)
    full = ours(x, ours.begin_step(a, [0], [9]))
    b = ours.make_cache(16, 4, "bf16")
    b.add_sequence(0)
    outs = [ours(x[:5], ours.begin_step(b, [0], [5]))]
    outs += [ours(x[t: t + 1], ours.begin_step(b, [0], [1])) for t in range(5, 9)]
    c = compare(torch.cat(outs), full)
    assert c.rel_l2 < 1e-2, str(c)


def test_save_pretrained_round_trip(tmp_path):
    """A tiny random transformers DeepseekV3ForCausalLM saved with save_pretrained loads into fp8mla with the same
    weights, and both run the same attention stack."""
    cfg = tiny("v3")
    hc = hf_config(cfg, 2)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hc).eval()
    randomize(model, 5)
    model.save_pretrained(tmp_path)
    ours = DeepseekMLAModel.from_pretrained(tmp_path, dtype=torch.float32, backend="torch")
    assert ours.cfg.sm_scale == pytest.approx(model.model.layers[0].self_attn.scaling)
    hf_sd = model.state_dict()
    for name, p in ours.state_dict().items():
        assert torch.equal(p, hf_sd["model." + name]), name
    layers = model.model.layers
    hf = HFStack(hc, [blk.input_layernorm for blk in layers], [blk.self_attn for blk in layers])
    tokens = {"a": torch.randn(8, cfg.hidden_size), "b": torch.randn(5, cfg.hidden_size)}
    cache = ours.make_cache(16, 4, "bf16")
    for s in (0, 1):
        cache.add_sequence(s)
    got = [ours(torch.cat([tokens["a"][:6], tokens["b"][:3]]), ours.begin_step(cache, [0, 1], [6, 3]))]
    for t in range(2):
        x = torch.cat([tokens["a"][6 + t: 7 + t], tokens["b"][3 + t: 4 + t]])
        got.append(ours(x, ours.begin_step(cache, [0, 1], [1, 1])))
    ra, rb = hf(tokens["a"]), hf(tokens["b"])
    want = [torch.cat([ra[:6], rb[:3]])] + [torch.cat([ra[6 + t: 7 + t], rb[3 + t: 4 + t]]) for t in range(2)]
    for g, w in zip(got, want):
        c = compare(g, w)
        assert c.rel_l2 < 1e-2, str(c)


def test_load_errors_name_the_tensor(tmp_path):
    cfg = tiny("v3")
    ours = DeepseekMLAModel(cfg, 1, dtype=torch.float32)
    bad = {n: torch.zeros(s.shape) for n, s in ours.layers[0].self_attn.named_parameters()}
    bad["kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="kv_b_proj.weight"):
        ours.layers[0].self_attn.load_weights(lambda n: bad[n])
    with pytest.raises(ValueError, match="config.json"):
        DeepseekMLAModel.from_pretrained(tmp_path)
