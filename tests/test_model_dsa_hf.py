"""fp8mla's DSA layer against transformers' ``GlmMoeDsaAttention`` / ``DeepseekV32Attention`` (eager, fp32, CPU),
same random weights, tiny widths (tests/../configs/tiny_dsa.json: 3 layers, GLM's middle one "shared", topk 8).

transformers runs each sequence through its own ``DynamicCache`` in the same chunks as fp8mla's steps (a
prefill, a prefill in two chunks, decode tokens), so its decode rows come from its own decode path. fp8mla runs
the sequences batched, over a NaN-poisoned pool with shuffled pages. Each fp8mla layer gets transformers' input
of that layer (its residual stream), so that every layer is compared on equal inputs:

- (a) the attention output given transformers' own selection (its position indices mapped to our slots, its
  future positions handed over as -1), through fp8mla.MLASparseAttention: rel L2 per step and layer, measured
  (torch 2.13 CPU, transformers 5.24, both models): bf16 cache 2.2e-3 .. 3.4e-3 (bound 1e-2: bf16 queries and
  latents); fp8_e4m3 2.1e-2 .. 3.6e-2 and fp8_ds_mla 1.7e-2 .. 3.2e-2 (bound 6e-2: e4m3's 3 mantissa bits, as
  the dense layer's test); the Triton kernel (interpreter, short schedule) 2.1e-2 .. 3.2e-2 on fp8_ds_mla;
- (b) the selection itself: the same set of positions as transformers' on every row whose k-th and (k+1)-th
  scores are apart by more than 1e-4 of the row's largest score (rows with at most topk visible tokens: all of
  them, always compared). At least 90% of the rows with a real choice must be compared; with the indexer's rope
  variant flipped (GLM-5 interleaved <-> V3.2 half-split) most of them differ, so the check sees the variant.

Why per layer on transformers' inputs: through the whole stack, the 16-bit attention of layer l moves layer
l + 1's index scores by ~1e-3, enough to swap a near-tied token at the top-k boundary; a step with such a swap
then differs from transformers by 8e-2 .. 3e-1 rel L2 (measured on this schedule) -- the discrete selection's
own sensitivity, not an error of either side.

Nothing of transformers' needs patching on the CPU: its eager DSA path is plain torch.
"""
from __future__ import annotations

import inspect
import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
glm = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers.cache_utils import DynamicCache  # noqa: E402

from fp8mla import available_backends  # noqa: E402
from fp8mla.models.dsa import DSAModel  # noqa: E402
from fp8mla.models.dsa_config import load_dsa_config  # noqa: E402
from fp8mla.testing import compare  # noqa: E402

BOUND = {"bf16": 1e-2, "fp8_e4m3": 6e-2, "fp8_ds_mla": 6e-2}
GAP = 1e-4          # relative k-th / (k+1)-th score gap above which the selection must match
MIN_COMPARED = 0.9  # of the rows with more than topk visible tokens


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread is 10-20x faster than two on a loaded 2-core machine (CI)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(model: str, **kw):
    cfg = load_dsa_config("tiny-dsa")
    if model == "v32":  # DeepSeek-V3.2: half-split indexer rope, every layer its own indexer
        cfg = cfg.replace(model_type="deepseek_v32", indexer_rope_interleave=False, indexer_types=["full"] * 3)
    return cfg.replace(**kw) if kw else cfg


def hf_config(cfg):
    kw = dict(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
              q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, num_hidden_layers=cfg.num_layers,
              max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
              rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                               **{k: v for k, v in cfg.rope_scaling.items() if k != "type"}},
              index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim, index_n_heads=cfg.index_n_heads,
              vocab_size=64, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
              num_experts_per_tok=2, n_group=1, topk_group=1)
    if cfg.model_type == "glm_moe_dsa":
        c = transformers.GlmMoeDsaConfig(**kw, indexer_types=list(cfg.indexer_types))
    else:
        c = transformers.DeepseekV32Config(**kw)
    c._attn_implementation = "eager"
    return c


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """N(0, 1/fan_in) matrices, norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g)
        p.copy_((0.1 * r if name.endswith("bias") else 1.0 + 0.1 * r) if p.dim() == 1 else r / math.sqrt(p.shape[-1]))


class HFStack:
    """transformers' attention layers as fp8mla's stack (x + attn(input_layernorm(x))), one sequence at a time
    through a DynamicCache; records each layer's input, attention output and selected positions."""

    def __init__(self, cfg, seed: int = 0):
        self.hc = hc = hf_config(cfg)
        m = glm if cfg.model_type == "glm_moe_dsa" else v32
        prefix = "GlmMoeDsa" if cfg.model_type == "glm_moe_dsa" else "DeepseekV32"
        self.glm = m is glm
        self.rotary = getattr(m, prefix + "RotaryEmbedding")(hc)
        self.norms = [getattr(m, prefix + "RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)
                      for _ in range(cfg.num_layers)]
        self.attns = [getattr(m, prefix + "Attention")(hc, i).eval() for i in range(cfg.num_layers)]
        for i, (n, a) in enumerate(zip(self.norms, self.attns)):
            randomize(n, seed * 100 + 2 * i)
            randomize(a, seed * 100 + 2 * i + 1)
        self.captured = None
        for a in self.attns:  # DeepseekV32Attention does not return its selection: the indexer's output is it
            if a.indexer is not None:
                a.indexer.register_forward_hook(lambda mod, args, out: setattr(self, "captured", out))

    def new_cache(self):
        return DynamicCache(config=self.hc)

    @torch.no_grad()
    def chunk(self, cache, x: torch.Tensor, pos0: int):
        """``x [n, D]`` at positions pos0.. -> per layer (input [n, D], attention out [n, D], positions [n, k])."""
        n = x.shape[0]
        h = x[None]
        pos = torch.arange(pos0, pos0 + n)
        cos_sin = self.rotary(h, pos[None])
        keys = torch.arange(pos0 + n)
        mask = torch.where(keys[None, :] <= pos[:, None], 0.0, -math.inf)[None, None]
        layers, prev = [], None
        for norm, attn in zip(self.norms, self.attns):
            kw = {cache_keyword(attn): cache}
            if self.glm:
                o, _, prev = attn(norm(h), cos_sin, mask, prev_topk_indices=prev, **kw)
            else:
                o, _ = attn(norm(h), cos_sin, mask, **kw)
                prev = self.captured
            layers.append((h[0], o[0], prev[0].long()))
            h = h + o
        # a cache keyword the layer does not know lands in its **kwargs unread: each chunk would then attend to
        # itself alone (and the indexer's top-k, over the full-length mask, point past the keys)
        assert cache.get_seq_length() == pos0 + n, (cache.get_seq_length(), pos0 + n)
        return layers


def cache_keyword(attn: torch.nn.Module) -> str:
    """The attention's cache argument by its signature: ``cache`` in transformers 5.24 (which maps the old name to it
    through a deprecation shim), ``past_key_values`` in older releases such as 5.17 (which know only that one)."""
    params = inspect.signature(type(attn).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise AssertionError(f"{type(attn).__name__}.forward takes neither cache nor past_key_values: {list(params)}")


def load_ours(cfg, hf: HFStack, backend: str = "torch") -> DSAModel:
    ours = DSAModel(cfg, dtype=torch.float32, backend=backend)
    for blk, n, a in zip(ours.layers, hf.norms, hf.attns):
        sd = a.state_dict()
        blk.self_attn.load_weights(lambda name: sd[name])
        blk.input_layernorm.weight.data.copy_(n.weight)
    return ours


# step -> sequences joining (with their chunks); a sequence without chunks left decodes one token a step.
# "b" starts with one token and crosses topk (8) while decoding; "c"'s prompt comes in two chunks.
JOIN = {0: {"a": [13], "b": [1], "c": [9, 14]}, 3: {"d": [5]}, 5: {"e": [20]}}
LEAVE = {6: ["a"]}
STEPS = 10


def selection_agreement(sel_slots, hf_pos, scores, seq_slots, pos0, topk):
    """Rows of one sequence's chunk: (rows with a real choice, of them compared, rows whose sets differ)."""
    slot_to_pos = {int(s): i for i, s in enumerate(seq_slots)}
    choice = compared = differ = 0
    for i in range(sel_slots.shape[0]):
        p = pos0 + i
        visible = scores[i, : p + 1]
        if p + 1 > topk:
            choice += 1
            top = visible.topk(topk + 1).values
            if top[topk - 1] - top[topk] <= GAP * top.abs().max():
                continue
        compared += p + 1 > topk
        ours = {slot_to_pos[int(s)] for s in sel_slots[i] if s >= 0}
        theirs = {int(q) for q in hf_pos[i] if q <= p}
        if ours != theirs:
            differ += 1
            if p + 1 <= topk:  # with every visible token selected there is no choice to get wrong
                raise AssertionError(f"position {p}: selected {sorted(ours)}, expected all of {sorted(theirs)}")
    return choice, compared, differ


def keep_scores(attn, into: list):
    """``attn.select`` that also appends its per-sequence score matrices to ``into``."""
    select = type(attn).select

    def wrapped(*args, **kw):
        sel, scores = select(attn, *args, return_scores=True, **kw)
        into.extend(scores)
        return sel
    return wrapped


def run(model: str, kv_format: str, *, flip_rope: bool = False, seed: int = 0, backend: str = "torch",
        join=JOIN, leave=LEAVE, steps: int = STEPS):
    torch.manual_seed(seed)
    cfg = tiny(model)
    hf = HFStack(cfg, seed)
    if flip_rope:
        cfg = cfg.replace(indexer_rope_interleave=not cfg.indexer_rope_interleave)
    ours = load_ours(cfg, hf, backend)
    cache = ours.make_cache(num_pages=64, page_size=4, kv_format=kv_format)
    with torch.no_grad():  # all-ones bytes are NaN in bf16 and e4m3: an unselected or unwritten slot read is seen
        cache.pool.view(torch.uint8).fill_(0xFF)
        cache.index_pool.fill_(math.nan)
    random.Random(seed).shuffle(cache._free)  # pages handed out in shuffled order
    g = torch.Generator().manual_seed(seed + 1)
    tokens = {s: torch.randn(40, cfg.hidden_size, generator=g) for j in join.values() for s in j}
    live, todo, ids, hf_cache = {}, {}, {}, {}
    errs, stats = [], [0, 0, 0]
    for step in range(steps):
        for s in leave.get(step, []):
            cache.free(ids.pop(s))
            del live[s]
        for s, chunks in join.get(step, {}).items():
            ids[s], todo[s], live[s], hf_cache[s] = cache.add_sequence(), list(chunks), 0, hf.new_cache()
        names = list(live)
        counts = [todo[s].pop(0) if todo[s] else 1 for s in names]
        ref = {s: hf.chunk(hf_cache[s], tokens[s][live[s]: live[s] + n], live[s]) for s, n in zip(names, counts)}
        st = ours.begin_step(cache, [ids[s] for s in names], counts)
        assert st.sparse.backend == backend
        for li, blk in enumerate(ours.layers):
            attn = blk.self_attn
            x = torch.cat([ref[s][li][0] for s in names])
            want = torch.cat([ref[s][li][1] for s in names])
            hf_slots = torch.full((x.shape[0], st.index_width), -1, dtype=torch.int32)
            for (r0, r1, p0, slots), s in zip(st.seqs, names):
                pos = ref[s][li][2]
                horizon = p0 + torch.arange(r1 - r0)[:, None]
                hf_slots[r0:r1, : pos.shape[1]] = torch.where(pos <= horizon, slots[pos.clamp_max(slots.numel() - 1)],
                                                              -1).to(torch.int32)
            scores = []
            if attn.indexer is not None:  # keep the indexer's scores of this layer for the gap rule
                attn.select = keep_scores(attn, scores)
            got = attn(blk.input_layernorm(x), st, indices=hf_slots)
            attn.__dict__.pop("select", None)
            c = compare(got, want)
            assert c.nan_mismatch == 0 and c.rel_l2 <= BOUND[kv_format], f"step {step} layer {li}: {c}"
            errs.append(c.rel_l2)
            if attn.indexer is not None:
                for (r0, r1, p0, slots), sc, s in zip(st.seqs, scores, names):
                    part = selection_agreement(st.selections[li][r0:r1], ref[s][li][2], sc, slots, p0,
                                               cfg.index_topk)
                    stats = [u + v for u, v in zip(stats, part)]
            else:  # a shared layer attends to the selection of the full layer before it
                assert torch.equal(st.selections[li], st.selections[li - 1])
        st.committed = True
        for s, n in zip(names, counts):
            live[s] += n
    return errs, stats


TRITON = pytest.mark.skipif("triton" not in available_backends(), reason="triton cannot run here (no GPU, and "
                            "TRITON_INTERPRET is not set)")


@pytest.mark.parametrize("kv_format", list(BOUND))
@pytest.mark.parametrize("model", ["glm", "v32"])
def test_layers_match_transformers(model, kv_format):
    errs, (choice, compared, differ) = run(model, kv_format)
    assert choice >= 50, f"too few rows with a real top-k choice ({choice}): the test would not see the indexer"
    assert compared >= MIN_COMPARED * choice, f"only {compared} of {choice} rows have a clear top-k boundary"
    assert differ == 0, f"{differ} of {compared} compared rows select other positions than transformers"


@TRITON
def test_layers_match_transformers_triton_kernel():
    """The Triton sparse kernel in the same layers (the interpreter on a CPU: a short schedule, ~15 s): a prefill,
    a chunk over its cached prefix, decode tokens; attention outputs within the bound (the selection does not
    depend on the attention backend)."""
    errs, (choice, compared, differ) = run("glm", "fp8_ds_mla", backend="triton", join={0: {"b": [1], "c": [9, 3]}},
                                           leave={}, steps=4)
    assert len(errs) == 12 and differ == 0


@pytest.mark.parametrize("model", ["glm", "v32"])
def test_wrong_indexer_rope_variant_is_seen(model):
    """The other model's indexer rope (interleaved <-> half-split) changes most clear-cut selections."""
    _, (choice, compared, differ) = run(model, "bf16", flip_rope=True)
    assert compared >= MIN_COMPARED * choice and differ >= 0.3 * compared, (choice, compared, differ)


@pytest.mark.parametrize("model", ["glm", "v32"])
def test_save_pretrained_round_trip(model, tmp_path):
    """A tiny random transformers GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM saved with save_pretrained loads
    into fp8mla by name: every attention and indexer weight, the config's indexer fields."""
    cfg = tiny(model)
    hc = hf_config(cfg)
    cls = transformers.GlmMoeDsaForCausalLM if model == "glm" else transformers.DeepseekV32ForCausalLM
    torch.manual_seed(0)
    hf_model = cls(hc).eval()
    randomize(hf_model, 5)
    hf_model.save_pretrained(tmp_path)
    ours = DSAModel.from_pretrained(tmp_path, dtype=torch.float32, backend="torch")
    assert (ours.cfg.model_type, ours.cfg.indexer_types, ours.cfg.indexer_rope_interleave, ours.cfg.index_topk) == \
        (cfg.model_type, cfg.indexer_types, cfg.indexer_rope_interleave, cfg.index_topk)
    assert ours.cfg.sm_scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling)
    hf_sd = hf_model.state_dict()
    names = ours.state_dict()
    assert any(".indexer.weights_proj." in n for n in names)
    for name, p in names.items():
        assert torch.equal(p, hf_sd["model." + name]), name
