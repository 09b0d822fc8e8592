"""fp8mla's DeepSeek-V4 attention block against transformers' ``DeepseekV4Attention`` (eager, CPU), same random
weights, the tiny config (models/configs/tiny_v4.json: one layer of each type, a 16-token window, CSA rows of 4
tokens, HCA rows of 8, indexer topk 4) and one run at V4's real window and HCA rate (128).

transformers runs each sequence through its own ``DynamicCache`` in the same chunks as fp8mla's steps (prefills,
a prefill in three chunks, decode tokens past the window and past several compressed rows), so its decode rows
come from its own decode path. fp8mla runs the sequences batched over NaN-poisoned pools with shuffled pages.
Every layer gets the same input (a layer's output is compared alone, on equal inputs):

- (a) the attention block's output, the CSA layer given transformers' own selection: max abs error over the
  reference's max abs (``rel_max``) per layer type and mode (prefill, chunk, decode) against the budgets below;
- (b) the indexer's selection: the same set of rows as transformers' on every query whose k-th and (k+1)-th
  scores differ by more than 1e-4 of its largest; queries seeing at most topk rows must match always.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

import inspect  # noqa: E402
if "cache" not in inspect.signature(create_sliding_window_causal_mask).parameters:
    # the comparison drives DeepseekV4Attention as transformers 5.25 (CI's) calls it; other releases change the
    # mask and cache calls (the GPU machine's takes no ``cache``)
    pytest.skip(f"transformers {transformers.__version__}: the V4 comparison follows transformers 5.25's calls",
                allow_module_level=True)

from fp8mla.models.deepseek_v4 import V4Model  # noqa: E402
from fp8mla.models.v4_attend import attend_rows  # noqa: E402
from fp8mla.models.v4_config import CSA, HCA, SLIDING, load_v4_config  # noqa: E402
from fp8mla import available_backends  # noqa: E402
from fp8mla.testing import compare  # noqa: E402

# (rel_max, rel_l2) budgets per row format: float32 / float64 rows are exact up to summation order; bf16 rows and
# queries; fp8_v4: e4m3 NoPE values (3 mantissa bits) with power-of-two scales per 64 values and bf16 RoPE values;
# fp8_v41: all 512 values in e4m3, scales per 32
BUDGET = {"float64": (1e-6, 1e-6), "float32": (2e-5, 1e-5), "bf16": (1.5e-2, 1e-2), "fp8_v4": (1.2e-1, 1e-1),
          "fp8_v41": (1.2e-1, 1e-1)}
KERNEL_BUDGET = 1e-2  # the attention against float64 on the same dequantized rows (rel L2 of out, abs of lse)
GAP = 1e-4


TRITON = pytest.mark.skipif("triton" not in available_backends(), reason="triton cannot run here (no GPU, and "
                            "TRITON_INTERPRET is not set)")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_config(cfg):
    scaling = {k: v for k, v in (cfg.compress_rope_scaling or {}).items() if k != "type"}
    c = transformers.DeepseekV4Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        num_hidden_layers=cfg.num_layers, layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
        compress_rates=dict(cfg.compress_rates), index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "yarn", **scaling} if scaling else None, rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
    c._attn_implementation = "eager"
    return c


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """N(0, 1/fan_in) matrices, norm weights 1 + N(0, 0.1^2), position biases N(0, 0.5^2), sinks N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if name.endswith("position_bias"):
            p.copy_(0.5 * r)
        elif p.dim() == 2:
            p.copy_(r / math.sqrt(p.shape[1]))
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * r)
        else:
            p.copy_(r)


class HFLayers:
    """transformers' three attention blocks, each run on the same input, one sequence at a time through a
    DynamicCache; records each block's output and the CSA indexer's selection."""

    def __init__(self, cfg, seed: int, dtype):
        self.hc = hc = hf_config(cfg)
        self.rotary = v4.DeepseekV4RotaryEmbedding(hc).to(dtype)
        self.attns = [v4.DeepseekV4Attention(hc, i).to(dtype).eval() for i in range(cfg.num_layers)]
        for i, a in enumerate(self.attns):
            randomize(a, seed * 100 + i)
        self.selected = None
        for a in self.attns:
            if a.compressor is not None and a.compressor.__class__.__name__.endswith("CSACompressor"):
                a.compressor.indexer.register_forward_hook(lambda mod, args, out: setattr(self, "selected", out))

    def new_cache(self):
        return DynamicCache(config=self.hc)

    @torch.no_grad()
    def chunk(self, cache, x: torch.Tensor, pos0: int):
        """``x [n, hidden]`` at positions pos0.. -> per layer (output [n, hidden], CSA selection [n, k] or None)."""
        h = x[None]
        pos = torch.arange(pos0, pos0 + x.shape[0])[None]
        pe = {k: self.rotary(h, pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.hc, inputs_embeds=h, attention_mask=None, cache=cache,
                                                 position_ids=pos)
        out = []
        for a in self.attns:
            self.selected = None
            o, _ = a(h, pe, pos, mask, cache=cache)
            out.append((o[0], None if self.selected is None else self.selected[0]))
        assert cache.get_seq_length() == pos0 + x.shape[0]
        return out


def load_ours(cfg, hf: HFLayers, dtype, backend: str = "torch") -> V4Model:
    ours = V4Model(cfg, dtype=dtype, backend=backend)
    for blk, a in zip(ours.layers, hf.attns):
        blk.self_attn.load_state_dict(a.state_dict(), strict=True)
    return ours


# step -> sequences joining (with their prompt chunks); without chunks left a sequence decodes one token a step.
# "a": a prefill past the window and several rows; "b": one prompt in three chunks (the first inside one CSA
# window, the others crossing HCA rows); "c": one token, then decodes across its first rows.
JOIN = {0: {"a": [37], "b": [3, 22, 9], "c": [1]}}
STEPS = 14


def mode_of(pos0: int, n: int, first: bool) -> str:
    return "decode" if n == 1 and pos0 > 0 else ("prefill" if first else "chunk")


def selection_check(ours, scores, theirs, pos0, rate, topk):
    """(queries with a real choice, of them compared, queries whose sets differ)."""
    choice = compared = differ = 0
    for i in range(ours.shape[0]):
        visible = (pos0 + i + 1) // rate
        real = visible > topk
        if real:
            choice += 1
            top = scores[i, :visible].topk(topk + 1).values
            if top[topk - 1] - top[topk] <= GAP * top.abs().max():
                continue
            compared += 1
        a = {int(r) for r in ours[i] if r >= 0}
        b = {int(r) for r in theirs[i] if r >= 0}
        if a != b:
            differ += 1
            assert real, f"position {pos0 + i}: selected {sorted(a)}, expected all visible rows {sorted(b)}"
    return choice, compared, differ


def checked_attend(attn, into: list):
    """``attn.attend`` that also runs the float64 torch code on the same queries (rounded as the kernel gets them)
    over the same rows, dequantized, and appends the kernel's rel L2 to ``into``: the attention's own error, apart
    from the rows' quantization."""
    attend = type(attn).attend

    def wrapped(q, segments, step):
        out, lse = attend(attn, q, segments, step)
        if step.cache.format is not None:
            reads = [(lambda sl, st=st: step.cache.read_rows(st, attn.layer_idx, sl), idx) for st, idx in segments]
            ref, ref_lse = attend_rows(q.to(step.attn_dtype).double(), reads, attn.sinks, attn.cfg.sm_scale,
                                       compute_dtype=torch.float64)
            c = compare(out, ref)
            assert c.nan_mismatch == 0, c
            into.append(max(c.rel_l2, (lse - ref_lse).abs().max().item()))
        return out, lse
    return wrapped


def run(kv_format: str, *, dtype=torch.float32, cfg=None, join=JOIN, steps=STEPS, seed=0, page_size=4,
        backend: str = "torch", kernel_errs: list | None = None):
    torch.manual_seed(seed)
    cfg = cfg or load_v4_config("tiny-v4")
    hf = HFLayers(cfg, seed, dtype)
    ours = load_ours(cfg, hf, dtype, backend)
    for blk in ours.layers:
        blk.self_attn.attend = checked_attend(blk.self_attn, [] if kernel_errs is None else kernel_errs)
    cache = ours.make_cache(num_pages=256, page_size=page_size, kv_format=kv_format)
    with torch.no_grad():  # all-ones bytes are NaN in every format: an unselected or unwritten row read is seen
        for pool in (p for pools in cache.pools.values() for p in pools):
            pool.view(torch.uint8).fill_(0xFF)
        cache.index_pool.fill_(math.nan)
    for s in cache.streams.values():
        random.Random(seed).shuffle(s.free)
    g = torch.Generator().manual_seed(seed + 1)
    total = {s: sum(c) + steps for j in join.values() for s, c in j.items()}
    tokens = {s: torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64).to(dtype)
              for s, n in total.items()}
    live, todo, ids, hf_cache, first = {}, {}, {}, {}, {}
    errs = {}   # (layer type, mode) -> (worst rel_max, worst rel L2)
    sel = [0, 0, 0]
    for step in range(steps):
        for s, chunks in join.get(step, {}).items():
            ids[s], todo[s], live[s], hf_cache[s], first[s] = cache.add_sequence(), list(chunks), 0, \
                hf.new_cache(), True
        names = list(live)
        counts = [todo[s].pop(0) if todo[s] else 1 for s in names]
        ref = {s: hf.chunk(hf_cache[s], tokens[s][live[s]: live[s] + n], live[s]) for s, n in zip(names, counts)}
        x = torch.cat([tokens[s][live[s]: live[s] + n] for s, n in zip(names, counts)])
        st = ours.begin_step(cache, [ids[s] for s in names], counts)
        for li, blk in enumerate(ours.layers):
            attn = blk.self_attn
            want = torch.cat([ref[s][li][0] for s in names])
            csa_rows = None
            if attn.layer_type == CSA:
                k = max(ref[s][li][1].shape[1] for s in names)
                csa_rows = torch.full((x.shape[0], max(k, 1)), -1, dtype=torch.int64)
                for (r0, r1, _), s in zip(st.seqs, names):
                    theirs = ref[s][li][1]
                    csa_rows[r0:r1, : theirs.shape[1]] = theirs
                q_resid = attn.q_a_norm(attn.q_a_proj(x))
            got = attn(x, st, csa_rows=csa_rows)
            for (r0, r1, p0), s, n in zip(st.seqs, names, counts):
                c = compare(got[r0:r1], want[r0:r1])
                assert c.nan_mismatch == 0, f"step {step} layer {li}: {c}"
                e = (c.max_abs / want[r0:r1].abs().max().item(), c.rel_l2)
                key = (attn.layer_type, mode_of(p0, n, first[s]))
                errs[key] = tuple(map(max, errs.get(key, (0.0, 0.0)), e))
            if attn.layer_type == CSA:  # the indexer's own choice, on the rows the compressor wrote
                mine, scores = attn.select(x, q_resid, st, return_scores=True)
                for (r0, r1, p0), sc, s in zip(st.seqs, scores, names):
                    part = selection_check(mine[r0:r1], sc, ref[s][li][1], p0, cfg.compress_rates[CSA],
                                           cfg.index_topk)
                    sel = [u + v for u, v in zip(sel, part)]
        st.commit()
        for s, n in zip(names, counts):
            live[s] += n
            first[s] = False
    return errs, sel


def within(errs: dict, budget) -> bool:
    return all(e <= b for v in errs.values() for e, b in zip(v, budget))


@pytest.mark.parametrize("kv_format", ["float32", "bf16", "fp8_v4", "fp8_v41"])
def test_layers_match_transformers(kv_format):
    kernel = []
    page_size = {"float32": 3, "fp8_v4": 5}.get(kv_format, 4)  # odd sizes too (fp8_v4: padded pages)
    errs, (choice, compared, differ) = run(kv_format, kernel_errs=kernel, page_size=page_size)
    assert kv_format == "float32" or (len(kernel) == 3 * STEPS and max(kernel) <= KERNEL_BUDGET), max(kernel)
    modes = {(t, m) for t in (SLIDING, CSA, HCA) for m in ("prefill", "chunk", "decode")}
    assert set(errs) == modes, sorted(errs)
    assert within(errs, BUDGET[kv_format]), errs
    assert choice >= 40 and compared >= 0.9 * choice and differ == 0, (choice, compared, differ)


def test_layers_match_transformers_float64():
    errs, (choice, compared, differ) = run("float64", dtype=torch.float64, steps=6)
    assert within(errs, BUDGET["float64"]), errs
    assert differ == 0


def test_real_window_and_hca_rate():
    """V4's own window (128) and HCA rate (128): a 300-token prefill in two chunks, then decode tokens."""
    cfg = load_v4_config("tiny-v4").replace(sliding_window=128, compress_rates={CSA: 4, HCA: 128},
                                            index_topk=16)
    errs, (choice, compared, differ) = run("bf16", cfg=cfg, join={0: {"a": [170, 130]}}, steps=5, page_size=64)
    assert within(errs, BUDGET["bf16"]), errs
    assert choice >= 100 and differ == 0, (choice, compared, differ)


def test_config_from_transformers():
    """transformers' own config.json of the tiny model (its nested rope_parameters) reads back as the same config;
    the rope angles of both rope kinds are transformers' own."""
    cfg = load_v4_config("tiny-v4")
    hc = hf_config(cfg)
    got = type(cfg).from_dict(hc.to_dict())
    scaling = dict(got.compress_rope_scaling)
    assert scaling.pop("attention_factor") == 1.0  # transformers writes the V4 default out
    got = got.replace(compress_rope_scaling=scaling)
    assert got.replace(name="custom") == cfg.replace(name="custom")
    from fp8mla.models.config import YarnRope
    rotary = v4.DeepseekV4RotaryEmbedding(hc)
    pos = torch.arange(0, 3000, 7)
    for kind, layer_type in (("main", SLIDING), ("compress", CSA)):
        cos, sin = YarnRope(cfg.rope_spec(layer_type)).cos_sin(pos)
        want_cos, want_sin = rotary(torch.zeros(1), pos[None], layer_type=kind)
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


def test_save_pretrained_round_trip(tmp_path):
    """A tiny random transformers DeepseekV4ForCausalLM saved with save_pretrained (DeepSeek's own names) loads into
    fp8mla: every attention weight and input norm, the config."""
    cfg = load_v4_config("tiny-v4")
    torch.manual_seed(0)
    hf_model = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    randomize(hf_model, 5)
    hf_model.save_pretrained(tmp_path)
    ours = V4Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.cfg.layer_types == cfg.layer_types and ours.cfg.compress_rates == cfg.compress_rates
    hf_sd = hf_model.state_dict()
    names = ours.state_dict()
    assert any(".indexer.scorer.weights_proj." in n for n in names)
    for name, p in names.items():
        assert torch.equal(p, hf_sd["model." + name]), name


@TRITON
def test_layers_match_transformers_triton_kernel():
    """The Triton V4 kernel and quantize-on-write in the same layers (the interpreter on a CPU: a short schedule):
    a chunked prompt past the window and a one-token start, then decode tokens."""
    kernel = []
    errs, (choice, compared, differ) = run("fp8_v4", backend="triton", join={0: {"b": [3, 22, 9], "c": [1]}},
                                           steps=4, kernel_errs=kernel)
    assert within(errs, BUDGET["fp8_v4"]) and max(kernel) <= KERNEL_BUDGET, (errs, max(kernel))
    assert choice >= 10 and differ == 0
