"""MLA attention configuration of the DeepSeek-V2/V3 family, and its YaRN rotary embedding.

Configs are read from Hugging Face ``config.json`` dicts: the fields of ``DeepseekV3Config`` that the attention
uses (``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``rope_theta``, ``rope_scaling``...). Both the checkpoints' ``rope_scaling`` and the
``rope_parameters`` that transformers >= 5 writes are understood. ``configs/*.json`` ship the attention parts of
the published models.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .._checks import as_int, check_positive_int

__all__ = ["MLAConfig", "load_config", "CONFIG_NAMES", "YarnRope", "yarn_get_mscale"]

_CONFIG_DIR = Path(__file__).with_name("configs")
# short names accepted by load_config / `fp8mla generate --config`
CONFIG_NAMES = {
    "tiny": "tiny.json",
    "dsv3": "deepseek_v3.json", "deepseek-v3": "deepseek_v3.json",
    "dsv2-lite": "deepseek_v2_lite.json", "deepseek-v2-lite": "deepseek_v2_lite.json",
    "kimi-k2": "kimi_k2.json",
}


@dataclass
class MLAConfig:
    """The attention hyper-parameters of one model (see ``DeepseekV3Config`` in transformers)."""

    hidden_size: int
    num_heads: int
    num_layers: int
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # DeepSeek checkpoints store the rope dims of q_b_proj/kv_a_proj as interleaved pairs (x0, x1), (x2, x3)...
    # transformers' ``rope_interleave`` (default True) rotates them as such; False means rotate-half layout.
    rope_interleave: bool = True
    attention_bias: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self):
        for k in ("hidden_size", "num_heads", "num_layers", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim"):
            setattr(self, k, check_positive_int(k, getattr(self, k)))
        if self.q_lora_rank is not None:
            if as_int(self.q_lora_rank) is None or as_int(self.q_lora_rank) <= 0:
                raise ValueError(f"q_lora_rank: expected a positive int or None, got {self.q_lora_rank!r}")
            self.q_lora_rank = as_int(self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number (rope rotates pairs), got "
                             f"{self.qk_rope_head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("yarn", "default", None):
                raise ValueError(f"rope_scaling: only YaRN (DeepSeek-V2/V3, Kimi-K2) is supported, got type {kind!r}")
            if kind in ("default", None):
                self.rope_scaling = None
            else:
                f = self.rope_scaling.get("factor")
                if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < math.inf:
                    raise ValueError(f"rope_scaling: YaRN needs a positive 'factor' (how far the context was "
                                     f"stretched), got {f!r} in {self.rope_scaling}")
                o = self.rope_scaling.get("original_max_position_embeddings")
                if isinstance(o, bool) or not isinstance(o, int) or o < 1:
                    raise ValueError(f"rope_scaling: YaRN needs a positive int 'original_max_position_embeddings', "
                                     f"got {o!r} in {self.rope_scaling}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale: ``1/sqrt(qk_head_dim)`` times ``mscale(factor, mscale_all_dim)**2`` under YaRN, as in
        DeepSeek-V3's ``softmax_scale`` (and transformers' ``yarn_apply_mscale``)."""
        s = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
            s *= m * m
        return s

    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "MLAConfig":
        """From a Hugging Face ``config.json`` dict (DeepSeek-V2/V3, Kimi-K2) or :meth:`to_dict` output."""
        if "num_heads" in d:  # our own to_dict()
            return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if k not in d]
        if missing:
            raise ValueError(f"config: missing {missing} (expected a DeepSeek-V2/V3 config.json)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type"))
        scaling = None
        if kind == "yarn":
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
            scaling["type"] = "yarn"
            scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
        elif kind not in (None, "default"):
            raise ValueError(f"config: rope type {kind!r} is not supported (expected 'yarn' or none)")
        interleave = d.get("rope_interleave")
        return cls(hidden_size=d["hidden_size"], num_heads=d["num_attention_heads"],
                   num_layers=d["num_hidden_layers"], q_lora_rank=d.get("q_lora_rank"),
                   kv_lora_rank=d.get("kv_lora_rank", 512), qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
                   qk_rope_head_dim=d.get("qk_rope_head_dim", 64), v_head_dim=d.get("v_head_dim", 128),
                   rope_theta=float(theta), rope_scaling=scaling,
                   max_position_embeddings=d.get("max_position_embeddings", 4096),
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_interleave=True if interleave is None else bool(interleave),
                   attention_bias=bool(d.get("attention_bias", False)), name=name)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **kw) -> "MLAConfig":
        return MLAConfig(**{**asdict(self), **kw})


def read_config_json(spec, names: dict) -> tuple[dict, str]:
    """``(the config dict, its name)`` of a short name in ``names`` (a file of ``models/configs``), a
    ``config.json`` path or a checkpoint directory holding one; a named error for anything else."""
    s = str(spec)
    if s in names:
        path, name = _CONFIG_DIR / names[s], s
    else:
        path = Path(s)
        if path.is_dir():
            path = path / "config.json"
        name = path.parent.name if path.name == "config.json" else path.stem
        if not path.is_file():
            raise ValueError(f"config: {spec!r} is neither a known name {sorted(names)} nor a config.json "
                             "file or checkpoint directory")
    try:
        with open(path) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config: {path} is not a valid JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"config: {path} holds a JSON {type(d).__name__}, expected an object (a config.json)")
    return d, name


def load_config(spec: str | os.PathLike | dict | MLAConfig) -> MLAConfig:
    """A config from a short name (``tiny``, ``dsv3``, ``dsv2-lite``, ``kimi-k2``), a ``config.json`` path, a
    checkpoint directory holding one, a dict, or an :class:`MLAConfig`."""
    if isinstance(spec, MLAConfig):
        return spec
    if isinstance(spec, dict):
        return MLAConfig.from_dict(spec)
    d, name = read_config_json(spec, CONFIG_NAMES)
    return MLAConfig.from_dict(d, name=name)


# -- YaRN rotary embedding ---------------------------------------------------------------------------------------
def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnRope:
    """DeepSeek-V3's rotary embedding: YaRN inverse frequencies (NTK-by-parts ramp between ``beta_fast`` and
    ``beta_slow``, truncated to whole dims) and cos/sin multiplied by ``mscale / mscale_all_dim``
    (``attention_factor``); plain RoPE without ``rope_scaling``. Angles in fp32, as transformers does."""

    def __init__(self, cfg: MLAConfig, device="cpu"):
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        rs = cfg.rope_scaling
        self.interleave = cfg.rope_interleave
        if rs is None:
            inv_freq, self.attention_factor = 1.0 / pos_freqs, 1.0
        else:
            factor = float(rs["factor"])
            orig = rs["original_max_position_embeddings"]
            beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

            def corr_dim(rot):  # the dim whose wavelength makes `rot` turns over the original context
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(corr_dim(beta_fast)), 0)
            high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001  # the ramp would divide by zero
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            extra = 1.0 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
            inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
            af = rs.get("attention_factor")
            if af is None:
                m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
                af = (yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all)) if (m and m_all) \
                    else yarn_get_mscale(factor)
            self.attention_factor = float(af)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` fp32 ``[T, dim // 2]`` for int positions ``[T]``."""
        f = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        return f.cos() * self.attention_factor, f.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
              interleave: bool | None = None) -> torch.Tensor:
        """Rotate ``x [T, ..., dim]`` (cos/sin ``[T, dim // 2]``); the result is in rotate-half layout either way
        (as transformers' ``apply_rotary_pos_emb_interleave``), which leaves every q.k product unchanged.
        ``interleave``: the pair layout of ``x`` (default: the config's ``rope_interleave``; the DSA indexers
        use their own)."""
        if self.interleave if interleave is None else interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        c, s = cos.view(shape), sin.view(shape)
        x1, x2 = x1.float(), x2.float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
