"""Attention configuration of DeepSeek-V4 (``model_type="deepseek_v4"``), read from Hugging Face ``config.json``.

The fields are those of transformers' ``DeepseekV4Config`` that the attention block uses:

- ``num_attention_heads``, ``head_dim`` (512: one shared K=V head), ``qk_rope_head_dim`` (64, the trailing dims
  of each head; older files say ``partial_rotary_factor`` instead), ``q_lora_rank``;
- ``o_groups``, ``o_lora_rank``: the grouped low-rank output projection;
- ``sliding_window`` (128): the window every layer attends to;
- ``layer_types``: per layer ``sliding_attention``, ``compressed_sparse_attention`` (CSA) or
  ``heavily_compressed_attention`` (HCA); older files give ``compress_ratios`` (0 / 4 / 128 per layer) instead,
  and ``compress_rate_csa`` / ``compress_rate_hca`` for ``compress_rates``;
- ``index_n_heads``, ``index_head_dim``, ``index_topk``: the CSA layers' lightning indexer;
- ``rope_theta`` (sliding layers' plain RoPE) and ``compress_rope_theta`` with the checkpoint's YaRN
  ``rope_scaling`` (CSA and HCA layers, their compressors and indexers). As transformers does, that YaRN does not
  scale cos / sin (``attention_factor`` 1.0) unless the file says otherwise.

Transformers' defaults (V4-Flash's numbers) fill what a file leaves out, and its rule gives ``layer_types`` when
neither list is there: two HCA layers, then CSA and HCA alternating.
"""
from __future__ import annotations

import os
import types
from dataclasses import asdict, dataclass, field

from .config import read_config_json

__all__ = ["V4Config", "load_v4_config", "V4_CONFIG_NAMES", "LAYER_TYPES", "SLIDING", "CSA", "HCA", "NATIVE_NAMES"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
V4_CONFIG_NAMES = {"tiny-v4": "tiny_v4.json"}


def _default_layer_types(n: int) -> list:
    """transformers' rule without ``layer_types`` / ``compress_ratios``: 2 x HCA, then CSA / HCA alternating."""
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


@dataclass
class V4Config:
    """The attention hyper-parameters of one DeepSeek-V4 model (see the module docstring)."""

    hidden_size: int
    num_heads: int
    num_layers: int
    layer_types: list = field(default_factory=list)
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_rates: dict = field(default_factory=lambda: {CSA: 4, HCA: 128})
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None  # YaRN of the compressed layers: factor, original_max_position_embeddings
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for k in ("hidden_size", "num_heads", "num_layers", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{k}: expected a positive int, got {v!r}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim: expected an even number <= head_dim ({self.head_dim}) and "
                             f"index_head_dim ({self.index_head_dim}), got {self.qk_rope_head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups: expected a divisor of num_heads * head_dim ({self.num_heads} x "
                             f"{self.head_dim}), got {self.o_groups}")
        if not self.layer_types:
            self.layer_types = _default_layer_types(self.num_layers)
        self.layer_types = list(self.layer_types)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if len(self.layer_types) != self.num_layers or bad:
            raise ValueError(f"layer_types: expected {self.num_layers} entries of {LAYER_TYPES}, got "
                             f"{self.layer_types}")
        self.compress_rates = {**{CSA: 4, HCA: 128}, **dict(self.compress_rates)}
        for t in (CSA, HCA):
            r = self.compress_rates[t]
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(f"compress_rates[{t!r}]: expected a positive int, got {r!r}")
        if self.compress_rope_scaling is not None:
            kind = self.compress_rope_scaling.get("type", self.compress_rope_scaling.get("rope_type"))
            if kind in (None, "default"):
                self.compress_rope_scaling = None
            elif kind != "yarn":
                raise ValueError(f"rope_scaling: only YaRN is supported for the compressed layers, got {kind!r}")

    @property
    def sm_scale(self) -> float:
        """``head_dim ** -0.5``, transformers' ``DeepseekV4Attention.scaling`` (no YaRN mscale)."""
        return self.head_dim ** -0.5

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed row of ``layer`` (0 for a sliding layer)."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else self.compress_rates[t]

    def rope_spec(self, layer_type: str):
        """What :class:`~fp8mla.models.config.YarnRope` reads, for the rope of ``layer_type``: plain RoPE with
        ``rope_theta`` on sliding layers, ``compress_rope_theta`` with the YaRN scaling on CSA / HCA layers."""
        sliding = layer_type == SLIDING
        scaling = None
        if not sliding and self.compress_rope_scaling is not None:
            scaling = {"attention_factor": 1.0, **self.compress_rope_scaling}
            scaling.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return types.SimpleNamespace(qk_rope_head_dim=self.qk_rope_head_dim, rope_interleave=True,
                                     rope_theta=self.rope_theta if sliding else self.compress_rope_theta,
                                     rope_scaling=scaling)

    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "V4Config":
        """From a ``deepseek_v4`` ``config.json`` dict (transformers' or the checkpoints' legacy names), or
        :meth:`to_dict` output."""
        if "num_heads" in d:  # our own to_dict()
            return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        mt = d.get("model_type", "deepseek_v4")
        if mt != "deepseek_v4":
            raise ValueError(f"config: model_type {mt!r} is not DeepSeek-V4 (expected 'deepseek_v4')")
        hf = _hf_defaults()
        g = lambda k: d.get(k, hf[k])  # noqa: E731
        n = g("num_hidden_layers")
        head_dim = g("head_dim")
        rope_dim = d.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * (d.get("partial_rotary_factor") or 64 / 512))
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        for t, k in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
            if d.get(k) is not None:
                rates[t] = d[k]
        types_ = d.get("layer_types")
        if types_ is None and d.get("compress_ratios") is not None:
            try:
                types_ = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
            except KeyError as e:
                raise ValueError(f"config: compress_ratios entries must be 0, 4 or 128, got {e.args[0]!r}") from None
        types_ = list(types_ or _default_layer_types(n))[:n]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        main, compress = rope.get("main"), rope.get("compress")
        if isinstance(compress, dict):  # transformers' nested form
            scaling = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")}
            compress_theta = compress.get("rope_theta", g("compress_rope_theta"))
            theta = (main or {}).get("rope_theta", g("rope_theta"))
        else:
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
            compress_theta, theta = g("compress_rope_theta"), d.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = scaling.get("rope_type", scaling.get("type"))
        scaling = {**scaling, "type": kind} if kind not in (None, "default") else None
        if scaling is not None:
            scaling.pop("rope_type", None)
        return cls(hidden_size=g("hidden_size"), num_heads=g("num_attention_heads"), num_layers=n,
                   layer_types=types_, head_dim=head_dim, qk_rope_head_dim=rope_dim, q_lora_rank=g("q_lora_rank"),
                   o_groups=g("o_groups"), o_lora_rank=g("o_lora_rank"), sliding_window=g("sliding_window"),
                   compress_rates=rates, index_n_heads=g("index_n_heads"), index_head_dim=g("index_head_dim"),
                   index_topk=g("index_topk"), rope_theta=float(theta), compress_rope_theta=float(compress_theta),
                   compress_rope_scaling=scaling, max_position_embeddings=g("max_position_embeddings"),
                   rms_norm_eps=g("rms_norm_eps"), name=name)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **kw) -> "V4Config":
        d = {**asdict(self), **kw}
        if "num_layers" in kw and "layer_types" not in kw:
            d["layer_types"] = (self.layer_types + [SLIDING] * kw["num_layers"])[: kw["num_layers"]]
        return V4Config(**d)


def _hf_defaults() -> dict:
    """``DeepseekV4Config``'s defaults for the attention fields (transformers 5.25; V4-Flash's numbers)."""
    return dict(hidden_size=4096, num_attention_heads=64, num_hidden_layers=43, head_dim=512, q_lora_rank=1024,
                o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128,
                index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1048576,
                rms_norm_eps=1e-6)


def load_v4_config(spec: str | os.PathLike | dict | V4Config) -> V4Config:
    """A V4 config from a short name (``tiny-v4``), a ``config.json`` path, a checkpoint directory holding one, a
    dict, or a :class:`V4Config`."""
    if isinstance(spec, V4Config):
        return spec
    if isinstance(spec, dict):
        return V4Config.from_dict(spec)
    d, name = read_config_json(spec, V4_CONFIG_NAMES)
    return V4Config.from_dict(d, name=name)


# Checkpoint names of the attention parameters: DeepSeek's own (the published checkpoints, and what transformers'
# save_pretrained writes back), under ``layers.{i}.attn.``, for fp8mla's (= transformers') names under
# ``layers.{i}.self_attn.``. transformers' conversion_mapping.py ("deepseek_v4") is the inverse of this table.
NATIVE_NAMES = {
    "q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight", "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight", "kv_norm.weight": "norm.weight", "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight", "sinks": "attn_sink",
    "compressor.kv_proj.weight": "compressor.wkv.weight", "compressor.gate_proj.weight": "compressor.wgate.weight",
    "compressor.position_bias": "compressor.ape", "compressor.kv_norm.weight": "compressor.norm.weight",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}
