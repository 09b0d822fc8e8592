"""Configuration of the DeepSeek Sparse Attention (DSA) models: GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2
(``deepseek_v32``).

Both are DeepSeek-V3's MLA (:class:`~fp8mla.models.config.MLAConfig`) plus a lightning indexer that picks, per
query token, the ``index_topk`` cached tokens the attention reads. The indexer's fields, as in their
``config.json`` and transformers' ``GlmMoeDsaConfig`` / ``DeepseekV32Config``:

- ``index_n_heads``, ``index_head_dim``, ``index_topk`` (2048 in both released models);
- ``indexer_rope_interleave``: how the indexer ropes the first ``qk_rope_head_dim`` dims of its heads. GLM-5:
  interleaved pairs, as the main attention; DeepSeek-V3.2: half-split (rotate-half) -- DeepSeek's inference code
  had this wrong until 2025-11 and transformers' ``DeepseekV32Indexer`` calls ``apply_rotary_pos_emb`` (not the
  interleaved one). Defaults follow the ``model_type`` when the file does not say.
- ``indexer_types``: per layer ``"full"`` (runs its indexer) or ``"shared"`` (reuses the selection of the last
  full layer before it; GLM-5.x). Derived from ``index_topk_freq`` / ``index_skip_topk_offset`` (or the
  ``index_topk_pattern`` string) exactly as ``GlmMoeDsaConfig`` does when the list is absent; DeepSeek-V3.2:
  all full.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .._checks import check_positive_int
from .config import MLAConfig, read_config_json

__all__ = ["DSAConfig", "load_dsa_config", "DSA_CONFIG_NAMES"]

DSA_CONFIG_NAMES = {
    "tiny-dsa": "tiny_dsa.json",
    "glm5": "glm5.json", "glm-5": "glm5.json",
    "dsv32": "deepseek_v32.json", "deepseek-v3.2": "deepseek_v32.json",
}
MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


def _indexer_types(d: dict, num_layers: int) -> list:
    """``GlmMoeDsaConfig.__post_init__``'s rule when ``indexer_types`` is absent."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]


@dataclass
class DSAConfig(MLAConfig):
    """:class:`MLAConfig` plus the lightning indexer (see the module docstring)."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleave: bool = False
    indexer_types: list = field(default_factory=list)
    model_type: str = "deepseek_v32"

    def __post_init__(self):
        super().__post_init__()
        for k in ("index_n_heads", "index_head_dim", "index_topk"):
            setattr(self, k, check_positive_int(k, getattr(self, k)))
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank: the DSA indexer reads the query LoRA latent (q_a_layernorm output), "
                             "expected an int, got None")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim: expected at least qk_rope_head_dim ({self.qk_rope_head_dim}) "
                             f"(its first dims are roped), got {self.index_head_dim}")
        if not self.indexer_types:
            self.indexer_types = ["full"] * self.num_layers
        self.indexer_types = list(self.indexer_types)
        if len(self.indexer_types) != self.num_layers or set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"indexer_types: expected {self.num_layers} entries of 'full' / 'shared', got "
                             f"{self.indexer_types}")
        if self.indexer_types[0] != "full":
            raise ValueError("indexer_types: layer 0 must be 'full' (a shared layer reuses an earlier layer's "
                             f"selection), got {self.indexer_types[:4]}...")

    @property
    def index_softmax_scale(self) -> float:
        return self.index_head_dim ** -0.5

    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "DSAConfig":
        """From a ``glm_moe_dsa`` / ``deepseek_v32`` ``config.json`` dict, or :meth:`to_dict` output."""
        if "num_heads" in d:  # our own to_dict()
            return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        mt = d.get("model_type", "deepseek_v32")
        if mt not in MODEL_TYPES:
            raise ValueError(f"config: model_type {mt!r} is not a DSA model (expected one of {MODEL_TYPES})")
        missing = [k for k in ("index_topk", "index_n_heads", "index_head_dim") if k not in d]
        if missing:
            raise ValueError(f"config: missing {missing} (expected a {mt} config.json with its indexer fields)")
        base = asdict(MLAConfig.from_dict(d, name=name))
        n = base["num_layers"]
        if mt == "glm_moe_dsa":
            types = d.get("indexer_types") or _indexer_types(d, n)
        else:  # transformers' DeepseekV32Attention always builds its indexer
            types = ["full"] * n
        interleave = d.get("indexer_rope_interleave")
        return cls(**base, index_n_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"],
                   index_topk=d["index_topk"], indexer_types=list(types), model_type=mt,
                   indexer_rope_interleave=(mt == "glm_moe_dsa") if interleave is None else bool(interleave))

    def replace(self, **kw) -> "DSAConfig":
        d = {**asdict(self), **kw}
        if "num_layers" in kw and "indexer_types" not in kw:
            d["indexer_types"] = (self.indexer_types + ["full"] * kw["num_layers"])[: kw["num_layers"]]
        return DSAConfig(**d)


def load_dsa_config(spec) -> DSAConfig:
    """A DSA config from a short name (``tiny-dsa``, ``glm5``, ``dsv32``), a ``config.json`` path, a checkpoint
    directory holding one, a dict, or a :class:`DSAConfig`."""
    if isinstance(spec, DSAConfig):
        return spec
    if isinstance(spec, dict):
        return DSAConfig.from_dict(spec)
    d, name = read_config_json(spec, DSA_CONFIG_NAMES)
    return DSAConfig.from_dict(d, name=name)
