"""The MLA attention layer of DeepSeek-V2/V3 and Kimi-K2 over a paged (FP8) latent cache.

One step of a batch (any mix of new sequences, prefill chunks and decode tokens)::

    model = DeepseekMLAModel.random(load_config("tiny"))          # or .from_pretrained(checkpoint_dir)
    cache = model.make_cache(num_pages=64, page_size=16, kv_format="fp8_e4m3")
    cache.add_sequence(0); cache.add_sequence(1)
    step = model.begin_step(cache, seq_ids=[0, 1], num_tokens=[7, 5])   # reserves slots, plans once
    out = model(hidden, step)                                            # hidden [12, hidden_size]

Per layer, with ``c`` = RMSNorm(latent) and ``k_pe`` = rope(rope part) of ``kv_a_proj_with_mqa(x)``:

- every new token's ``(c, k_pe)`` is written to the cache once, quantized on write;
- **prefill** tokens (a chunk of a sequence, or its first tokens) attend over K/V up-projected from the fresh
  16-bit latents (:class:`~fp8mla.ragged.MLARaggedPrefill`, causal); tokens of the sequence already in the
  cache are read with :func:`~fp8mla.gather.gather_dequant` (only that sequence's tokens, never the pool),
  up-projected, attended without mask, and the two states are merged by their LSE (:func:`merge_state`);
- **decode** tokens (one new token of a sequence with a cached prefix) use weight absorption: ``W_UK`` is folded
  into the query (``q_nope @ W_UK -> [H, kv_lora_rank]``), :class:`~fp8mla.attention.MLAPagedAttention` reads
  the FP8 pool directly, and ``W_UV`` maps the latent output to the value heads.

Parameter names are transformers' ``DeepseekV3Attention`` ones, so checkpoints load by name.

Numerics (tests/test_model_hf.py, against transformers in fp32): attention runs on bf16 queries and latents
(rel L2 of the layers' output <= 4.3e-3 with a bf16 cache). An FP8 cache adds its quantization: e4m3 keeps 3
mantissa bits, so decode steps read latents with ~3.6% rms error each and the output is within 4.4e-2 (e5m2:
9.1e-2), with no growth over steps. Prefill over fresh latents is at the bf16 level whatever the format.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import as_int
from ..cache import PagedMLACache
from ..gather import gather_dequant
from ..ragged import merge_state
from .config import MLAConfig, YarnRope, load_config
# The step record and its planning (re-exported: models and callers import them from here too).
from .mla_step import (MLAStep, attention_dtype, begin_step, check_step_args, forked_since, plan_decode,
                       refuse_stale_step)
from .parallel import TensorParallel

__all__ = ["DeepseekMLA", "DeepseekMLAModel", "MLAStep", "RMSNorm", "begin_step", "check_step_args", "forked_since",
           "plan_decode", "refuse_stale_step"]

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's code and transformers ignore rms_norm_eps
# Parameters split over tensor-parallel ranks: name -> (dim split, width of one head along it, from cfg).
_SHARDED = {
    "q_b_proj.weight": (0, lambda c: c.qk_head_dim),
    "q_proj.weight": (0, lambda c: c.qk_head_dim),
    "kv_b_proj.weight": (0, lambda c: c.qk_nope_head_dim + c.v_head_dim),
    "o_proj.weight": (1, lambda c: c.v_head_dim),
}


class RMSNorm(nn.Module):
    """transformers' ``DeepseekV3RMSNorm``: normalize in fp32, cast back, then scale (same rounding order)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DeepseekMLA(nn.Module):
    """One MLA attention layer (``DeepseekV3Attention``), its heads optionally split over ``tp_group``.

    Args:
        cfg: the model's :class:`~fp8mla.models.config.MLAConfig`.
        layer_idx: the layer of the paged cache this layer reads and writes.
        dtype, device: of the weights (an fp32 model still runs attention in bf16).
        tp_group: a torch.distributed process group to split the heads over (see :mod:`.parallel`).
    """

    def __init__(self, cfg: MLAConfig, layer_idx: int, *, dtype=torch.bfloat16, device="cpu", tp_group=None):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.tp = TensorParallel(tp_group)
        self.head_start, head_end = self.tp.head_range(cfg.num_heads)
        self.num_local_heads = H = head_end - self.head_start
        kw = dict(dtype=dtype, device=device)
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, H * cfg.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias,
                                            **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **kw)
        # Its bias (if any) is added once, after the all-reduce of the partial sums.
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=bias, **kw)

    # -- weights ----------------------------------------------------------------------------------------------
    def _shard(self, name: str, full):
        """This rank's part of a full (unsplit) tensor, or of a lazy safetensors slice."""
        if name not in _SHARDED:
            return full[:]
        dim, width = _SHARDED[name]
        a, b = self.head_start * width(self.cfg), (self.head_start + self.num_local_heads) * width(self.cfg)
        return full[a:b] if dim == 0 else full[:, a:b]

    def full_shape(self, name: str) -> tuple:
        shape = list(dict(self.named_parameters())[name].shape)
        if name in _SHARDED:
            dim, _ = _SHARDED[name]
            shape[dim] *= self.tp.size
        return tuple(shape)

    @torch.no_grad()
    def load_weights(self, get) -> None:
        """Copy every parameter from ``get(name)``: a full (unsplit) tensor, or an object with ``.shape`` and
        slicing (a lazy safetensors slice), under the transformers names (``q_a_proj.weight``...)."""
        for name, p in self.named_parameters():
            full = get(name)
            shape = tuple(full.shape)
            if shape != self.full_shape(name):
                raise ValueError(f"weights: {name} has shape {list(shape)}, the config expects "
                                 f"{list(self.full_shape(name))}")
            p.copy_(torch.as_tensor(self._shard(name, full)).to(p.dtype))

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> None:
        """Random weights, N(0, 1/fan_in) for projections and 1 + N(0, 0.1^2) for norms, drawn per head for the
        split parameters so that every tensor-parallel split gets exactly the single-process weights."""
        for name, p in self.named_parameters():
            key = [seed, self.layer_idx, sum(map(ord, name)) * 131 + len(name)]
            std = 0.1 if p.dim() == 1 else 1.0 / math.sqrt(self.full_shape(name)[-1])
            if name in _SHARDED:
                dim, width = _SHARDED[name]
                w = width(self.cfg)
                shape = (w, p.shape[1]) if dim == 0 else (p.shape[0], w)
                heads = range(self.head_start, self.head_start + self.num_local_heads)
                parts = [_randn(shape, key + [h]) for h in heads]
                p.copy_(torch.cat(parts, dim=dim) * std)
            else:
                p.copy_(_randn(tuple(p.shape), key) * std + (1.0 if name.endswith("layernorm.weight") else 0.0))

    def _w_uk_uv(self):
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.num_local_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]   # [H, nope, Dc], [H, v, Dc]

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: MLAStep) -> torch.Tensor:
        """``x [T, hidden_size]`` (the step's new tokens, in order) -> ``[T, hidden_size]``."""
        c = self.cfg
        T, H = step.num_rows, self.num_local_heads
        if not step.reserved or forked_since(step):
            step.check_runnable()  # (raises: a cancelled step, or one that would write a fork's pages)
        if x.dim() != 2 or x.shape != (T, c.hidden_size):
            raise ValueError(f"x: expected shape [{T}, {c.hidden_size}] (the step's new tokens), got {list(x.shape)}")
        if step.fused:
            return self._decode_step(x, step)
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        q_pe = rope_step(step, q_pe)
        k_pe = rope_step(step, k_pe)
        write_latents(step, self.layer_idx, ckv, k_pe)  # quantize-on-write, before decode reads it

        if step.decode_rows is None:
            o = self._prefill(q_nope, q_pe, ckv, k_pe, step)
        elif step.prefill_rows is None:
            o = self._decode(q_nope, q_pe, step)
        else:
            o = x.new_empty(T, H, c.v_head_dim)
            pr, dr = step.prefill_rows, step.decode_rows
            o[pr] = self._prefill(q_nope[pr], q_pe[pr], ckv[pr], k_pe[pr], step)
            o[dr] = self._decode(q_nope[dr], q_pe[dr], step)
        return self._out(o, T)

    def _out(self, o: torch.Tensor, T: int) -> torch.Tensor:
        c = self.cfg
        out = self.tp.all_reduce(F.linear(o.reshape(T, self.num_local_heads * c.v_head_dim), self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias

    def _decode_step(self, x: torch.Tensor, step: MLAStep) -> torch.Tensor:
        """A decode-only step with the fused kernels: no host sync, nothing sized by data (CUDA-graph safe).
        Launches per layer: q_a, norm, q_b, kv_a, norm+rope+write, q rope, absorb, attention (+ merge), W_UV,
        o_proj (+ all-reduce)."""
        from . import fused
        c, cache = self.cfg, step.cache
        T, H = step.num_rows, self.num_local_heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(fused.rms_norm(self.q_a_proj(x), self.q_a_layernorm.weight, LATENT_NORM_EPS))
        q = q.view(T, H, c.qk_head_dim)
        kv = self.kv_a_proj_with_mqa(x)
        if fused.supports_kv_format(cache.format):
            rows = cache.pool[self.layer_idx].view(cache.num_pages * cache.page_size, -1)
            fused.kv_norm_rope_write(kv, self.kv_a_layernorm.weight, LATENT_NORM_EPS, step.cos, step.sin,
                                     step.slots, rows, cache.format, cache.ckv_scale, cache.kpe_scale,
                                     interleave=c.rope_interleave, head_dim_ckv=c.kv_lora_rank)
        else:  # group scales: the torch norm and rope, then the quantize-on-write kernel
            ckv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            write_latents(step, self.layer_idx, self.kv_a_layernorm(ckv), rope_step(step, k_pe))
        q_pe = fused.q_rope(q, c.qk_nope_head_dim, step.cos, step.sin, step.attn_dtype, interleave=c.rope_interleave)
        o = self._decode(q[..., : c.qk_nope_head_dim], q_pe, step)
        return self._out(o, T)

    def _up_project(self, ckv: torch.Tensor, k_pe: torch.Tensor, adt: torch.dtype):
        """Per-head ``k [n, H, nope + rope]`` and ``v [n, H, v]`` of latents, in the attention dtype."""
        c, n, H = self.cfg, ckv.shape[0], self.num_local_heads
        kv = self.kv_b_proj(ckv.to(self.kv_b_proj.weight.dtype)).view(n, H, -1).to(adt)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.to(adt)[:, None, :].expand(n, H, c.qk_rope_head_dim)], dim=-1)
        return k, v

    def _prefill(self, q_nope, q_pe, ckv, k_pe, step: MLAStep) -> torch.Tensor:
        adt = step.attn_dtype
        q = torch.cat([q_nope, q_pe], dim=-1).to(adt)
        k, v = self._up_project(ckv, k_pe, adt)
        o, lse = step.ragged.run(q, k, v, return_lse=True)
        if step.ragged_prefix is not None:
            cache, layer = step.cache, self.layer_idx
            # Gather-then-cast: only the prefixes' own tokens are read and dequantized, never the pool.
            p_ckv, p_kpe, _ = gather_dequant(cache.ckv_cache(layer), cache.kpe_cache(layer), **step.prefix_gather,
                                             ckv_scale=cache.ckv_scale, kpe_scale=cache.kpe_scale,
                                             ckv_scale_arr=cache.ckv_scale_arr(layer), dtype=adt,
                                             backend=step.backend)
            pk, pv = self._up_project(p_ckv, p_kpe, adt)
            o_p, lse_p = step.ragged_prefix.run(q, pk, pv, return_lse=True)
            o, lse = merge_state(o, lse, o_p, lse_p, backend=step.backend)
        return o.to(q_nope.dtype)

    def _decode(self, q_nope, q_pe, step: MLAStep) -> torch.Tensor:
        adt = step.attn_dtype
        w_uk, w_uv = self._w_uk_uv()
        # Absorption: q_nope . (W_UK c) == (W_UK^T q_nope) . c, so the query moves into the latent space and the
        # kernel scores it against the cached latents directly.
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk).to(adt)
        o_lat = step.paged.run(q_lat, q_pe.to(adt).contiguous(), **step.cache.run_inputs(self.layer_idx))
        return torch.einsum("nhc,hvc->nhv", o_lat.to(w_uv.dtype), w_uv)


def rope_step(step: MLAStep, x: torch.Tensor) -> torch.Tensor:
    """``x``'s rope dims rotated by the step's positions (its cos / sin: one row per new token)."""
    return step.rope.apply(x, step.cos, step.sin)


def write_latents(step: MLAStep, layer: int, ckv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Quantize-on-write of the step's tokens. On a GPU the kernel is called directly: the slots came from the
    allocator (no range check, which would cost a device-to-host sync per layer and break graph capture)."""
    cache = step.cache
    if cache.device.type != "cuda":
        cache.write(layer, step.slots, ckv, k_pe)
        return
    from ..kernels.quant_append import quant_append
    total = cache.num_pages * cache.page_size
    scales = None if cache.scale_arr is None else cache.scale_arr[layer].view(total, -1)
    quant_append(cache.pool[layer].view(total, -1), scales, step.slots, ckv, k_pe, cache.format, cache.ckv_scale,
                 cache.kpe_scale)


def _randn(shape: tuple, key: list) -> torch.Tensor:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k)) % (2**63 - 1)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class DeepseekMLABlock(nn.Module):
    """``x + self_attn(input_layernorm(x))``: a decoder layer without its MLP."""

    def __init__(self, cfg: MLAConfig, layer_idx: int, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=kw.get("dtype"),
                                       device=kw.get("device"))
        self.self_attn = DeepseekMLA(cfg, layer_idx, **kw)

    def forward(self, x: torch.Tensor, step: MLAStep) -> torch.Tensor:
        if step.fused:  # one kernel instead of seven (same rounding)
            from .fused import rms_norm
            return x + self.self_attn(rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps), step)
        return x + self.self_attn(self.input_layernorm(x), step)


class DeepseekMLAModel(nn.Module):
    """A stack of MLA layers with pre-norm residuals (attention only: no embedding, MLP or head).

    Args:
        cfg: config or anything :func:`~fp8mla.models.config.load_config` takes (``"tiny"``, ``"dsv3"``...).
        num_layers: layers to build (default: the config's).
        dtype, device: of the weights. tp_group: split the heads over this process group.
        backend: attention backend for every plan (``"auto"``, ``"torch"``, ``"triton"``).
    """

    def __init__(self, cfg, num_layers: int | None = None, *, dtype=torch.bfloat16, device="cpu", tp_group=None,
                 backend: str = "auto", fused: bool | None = None):
        super().__init__()
        self.cfg = cfg = load_config(cfg)
        n = cfg.num_layers if num_layers is None else as_int(num_layers)
        if n is None or n < 1:
            raise ValueError(f"num_layers: expected a positive int, got {num_layers!r}")
        self.layers = nn.ModuleList(DeepseekMLABlock(cfg, i, dtype=dtype, device=device, tp_group=tp_group)
                                    for i in range(n))
        self.backend, self.dtype, self.device = backend, dtype, torch.device(device)
        self.rope = YarnRope(cfg, device=device)
        if fused is None:  # the fused decode kernels: on a GPU with triton (tests force them under the interpreter)
            import importlib.util
            fused = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.fused = bool(fused)

    @property
    def num_local_heads(self) -> int:
        return self.layers[0].self_attn.num_local_heads

    @classmethod
    def random(cls, cfg, num_layers=None, *, seed: int = 0, **kw) -> "DeepseekMLAModel":
        """A model with random weights (reproducible from ``seed``, identical under any tensor-parallel split)."""
        m = cls(cfg, num_layers, **kw)
        for i, blk in enumerate(m.layers):
            blk.self_attn.init_random(seed)
            with torch.no_grad():
                blk.input_layernorm.weight.copy_(1.0 + 0.1 * _randn((m.cfg.hidden_size,), [seed, i, 7]))
        return m

    @classmethod
    def from_pretrained(cls, path, num_layers=None, **kw) -> "DeepseekMLAModel":
        """Attention weights of a local Hugging Face checkpoint directory (``config.json`` + safetensors)."""
        from .checkpoint import load_checkpoint
        return load_checkpoint(cls, path, num_layers, **kw)

    def make_cache(self, num_pages: int, page_size: int, kv_format="fp8_e4m3", **kw) -> PagedMLACache:
        """A paged cache for this model's layers on its device (one per rank under tensor parallelism)."""
        return PagedMLACache(len(self.layers), num_pages, page_size, kv_format, head_dim_ckv=self.cfg.kv_lora_rank,
                             head_dim_kpe=self.cfg.qk_rope_head_dim, device=self.device, **kw)

    def begin_step(self, cache: PagedMLACache, seq_ids, num_tokens) -> MLAStep:
        """Reserve the new tokens' slots and plan the step (see :func:`begin_step`)."""
        if cache.num_layers < len(self.layers):
            raise ValueError(f"cache: {cache.num_layers} layers, the model has {len(self.layers)}")
        return begin_step(cache, seq_ids, num_tokens, cfg=self.cfg, rope=self.rope,
                          num_heads=self.num_local_heads, attn_dtype=attention_dtype(self.dtype), backend=self.backend,
                          fused=self.fused)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, step: MLAStep) -> torch.Tensor:
        """The residual stream after every layer's ``x + attn(norm(x))``, ``[T, hidden_size]``. A failure gives the
        step's reservation back to the cache (see :meth:`MLAStep.cancel`); a cancelled step is refused (see
        :meth:`MLAStep.check_runnable`)."""
        step.check_runnable()  # before the try: a refused step has nothing to give back
        try:
            for blk in self.layers:
                x = blk(x, step)
        except BaseException:
            step.cancel()
            raise
        step.committed = True
        return x
