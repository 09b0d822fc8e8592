"""Load the attention weights of a local Hugging Face checkpoint (``config.json`` + ``*.safetensors``).

Names are transformers' (``model.layers.{i}.self_attn.kv_b_proj.weight``, ``model.layers.{i}.input_layernorm
.weight``); a checkpoint of the bare ``DeepseekV3Model`` (no ``model.`` prefix) loads too. Tensors are read
lazily: under tensor parallelism each rank reads only its heads' rows/columns. Block-scaled FP8 weights (the
published DeepSeek-V3 / Kimi-K2 checkpoints: ``weight`` in e4m3 plus ``weight_scale_inv``, one fp32 scale per
128x128 block) are dequantized on load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .._checks import as_int
from .config import MLAConfig

__all__ = ["load_checkpoint", "CheckpointReader"]

FP8_BLOCK = 128  # DeepSeek's weight_scale_inv block (quantization_config.weight_block_size)


class _Lazy:
    """A safetensors slice with ``.shape`` and ``[a:b]`` / ``[:, a:b]`` indexing (reads only what it returns)."""

    def __init__(self, sl):
        self._sl = sl
        self.shape = tuple(sl.get_shape())

    def __getitem__(self, idx):
        return self._sl[idx]


class CheckpointReader:
    """Maps tensor names to the safetensors files of a checkpoint directory and reads them."""

    def __init__(self, path):
        try:
            from safetensors import safe_open
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("checkpoint: loading safetensors needs `pip install safetensors` "
                              "(or fp8mla[models])") from e
        self._open = safe_open
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise ValueError(f"checkpoint: {str(path)!r} is not a directory")
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: self.dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.files = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    self.files.update({k: f for k in h.keys()})
        if not self.files:
            raise ValueError(f"checkpoint: no *.safetensors in {str(self.dir)!r}")
        self._handles = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        if name not in self.files:
            raise KeyError(f"checkpoint: no tensor {name!r} in {str(self.dir)!r}")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._open(str(f), "pt")
        return self._handles[f]

    def get(self, name: str):
        """A lazy slice of ``name``, or the dequantized tensor for a block-scaled FP8 weight."""
        h = self._handle(name)
        sl = h.get_slice(name)
        if sl.get_dtype() in ("F8_E4M3", "F8_E5M2") and name + "_scale_inv" in self.files:
            w = h.get_tensor(name).float()
            s = self._handle(name + "_scale_inv").get_tensor(name + "_scale_inv").float()
            s = s.repeat_interleave(FP8_BLOCK, 0)[: w.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : w.shape[1]]
            return w * s
        return _Lazy(sl)

    def close(self):
        self._handles.clear()


def load_checkpoint(cls, path, num_layers=None, **kw):
    """``cls(config from path/config.json, num_layers, **kw)`` with the attention weights of the checkpoint."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"checkpoint: {str(path)!r} has no config.json")
    # DSAModel reads a DSAConfig (the indexer's fields too); the dense models an MLAConfig.
    cfg = getattr(cls, "config_class", MLAConfig).from_dict(json.loads(cfg_file.read_text()), name=path.name)
    reader = CheckpointReader(path)
    n = cfg.num_layers if num_layers is None else num_layers
    if as_int(n) is not None and as_int(n) > cfg.num_layers:
        raise ValueError(f"num_layers: the checkpoint has {cfg.num_layers} layers, asked for {n}")
    prefix = "model." if "model.layers.0.self_attn.kv_b_proj.weight" in reader else ""
    if prefix + "layers.0.self_attn.kv_b_proj.weight" not in reader:
        raise ValueError(f"checkpoint: {str(path)!r} has no layers.0.self_attn.kv_b_proj.weight (not a "
                         "DeepSeek-V2/V3 MLA checkpoint?)")
    model = cls(cfg, num_layers, **kw)
    try:
        with torch.no_grad():
            for i, blk in enumerate(model.layers):
                base = f"{prefix}layers.{i}."
                blk.self_attn.load_weights(lambda name: reader.get(base + "self_attn." + name))
                w = torch.as_tensor(reader.get(base + "input_layernorm.weight")[:])
                blk.input_layernorm.weight.copy_(w.to(blk.input_layernorm.weight.dtype))
    finally:
        reader.close()
    return model
