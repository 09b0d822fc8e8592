"""The ``FP8MLA`` attention backend of vLLM: decode (MQA over the latent cache) through fp8mla.

vLLM imports this module only when ``FP8MLA`` is selected (``--attention-backend FP8MLA``); the plugin
(:mod:`fp8mla.integrations.vllm`) registers its path. What it replaces and what it keeps:

- decode (``forward_mqa``): BF16/FP16 queries ``(ql_nope [B, H, 512], q_pe [B, H, 64])`` against the paged
  latent cache ``[num_blocks, block_size, 576]`` as stored (FP8 e4m3 or 16-bit), through
  :class:`fp8mla.MLAPagedAttention`. Nothing converts the cache: the kernel dequantizes the rows it reads,
  with vLLM's per-layer ``_k_scale`` (real = stored x scale, fp8mla's convention) as a device tensor.
- the plan: one :class:`fp8mla.MLAPagedAttention` per metadata builder (all layers of a KV-cache group share a
  batch's page table), planned in the builder's ``_build_decode`` from vLLM's padded ``block_table`` and
  ``seq_lens`` as they are (:meth:`fp8mla.layout.PagedLayout.from_block_table`: no copy, O(batch) host work,
  no device-to-host sync) and run in every layer's ``forward_mqa``. On CUDA the wrapper keeps its plan in fixed
  buffers (``use_cuda_graph=True``), so vLLM can capture decode in a graph: plan outside, run inside.
- cache writes (``do_kv_cache_update``): vLLM's own ``concat_and_cache_mla`` on CUDA (it quantizes with the same
  scale); on other devices, fp8mla's saturating quantization rule in torch.
- prefill (``forward_mha``): vLLM's (the platform's MLA prefill backend on fresh 16-bit K/V, plus the context
  chunks vLLM gathers and dequantizes itself: tokens, never the pool).
"""
from __future__ import annotations

from .versions import check_version
from .vllm_releases import release_row

VLLM_VERSION = check_version("vllm")  # before any vLLM internals: another version gets the supported list
RELEASE = release_row(VLLM_VERSION)  # what differs between the supported releases (vllm_releases.ROWS)

from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402

import torch  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf  # noqa: E402
from vllm.v1.kv_cache_interface import is_quantized_kv_cache  # noqa: E402  (here in every supported release)

import fp8mla  # noqa: E402
from fp8mla.formats import get_format  # noqa: E402

from ._options import backend as _backend  # noqa: E402
from ._options import vllm_batch_invariant as _batch_invariant  # noqa: E402

__all__ = ["FP8MLABackend", "FP8MLAImpl", "FP8MLAMetadataBuilder", "FP8MLADecodeMetadata", "RELEASE", "STATS",
           "latent_width_error"]

# Under vLLM's "vllm" logger, so that the lines reach vLLM's handler and format (and VLLM_LOGGING_LEVEL).
logger = init_logger("vllm.fp8mla")

# kv_cache_dtype strings -> the pool's storage dtype (None: the model dtype). vLLM views an FP8 cache as
# current_platform.fp8_dtype() (e4m3) before forward_mqa, so e5m2 is not offered.
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
SUPPORTED_KV_CACHE_DTYPES = ["auto", "float16", "bfloat16", *_FP8_CACHE_DTYPES]


def latent_width_error(head_size: int, kv_lora_rank: int | None = None) -> str | None:
    """fp8mla's message when vLLM's MLA layers cannot carry a latent of ``head_size`` (kv_lora_rank + rope)
    values per token, else None. vLLM's ``MLACommonMetadata`` takes only the widths of
    ``MLACommonBackend.get_supported_head_sizes()`` (it refuses the others at the first request, deep in the
    worker); FP8MLA refuses them when it is selected, at start-up."""
    supported = MLACommonBackend.get_supported_head_sizes()
    if not supported or head_size in supported:
        return None
    parts = f" (kv_lora_rank {kv_lora_rank} + rope {head_size - kv_lora_rank})" if kv_lora_rank else ""
    return (f"FP8MLA: latent width {head_size}{parts} is not supported: vLLM {VLLM_VERSION}'s MLA layers carry "
            f"latent widths {', '.join(map(str, supported))} (DeepSeek-V2/V3 and Kimi-K2: kv_lora_rank 512 + rope "
            "64 = 576); fp8mla's own kernels take other widths, but not inside vLLM")


def _kv_format_name(kv_dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "fp8_e4m3 (1 byte per value, per-layer scale)",
            torch.bfloat16: "bf16", torch.float16: "fp16"}.get(kv_dtype, str(kv_dtype))


class _Stats:
    """Counters the engine tests read (and users may): how many decode calls went through fp8mla, on which
    pool dtypes and backends. Plain ints, no device work."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.decode_calls = 0
        self.decode_tokens = 0
        self.plans = 0
        self.pool_dtypes: set = set()
        self.backends: set = set()


STATS = _Stats()


@dataclass
class FP8MLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the planned fp8mla wrapper that every layer's ``forward_mqa`` runs."""

    attn: "fp8mla.MLAPagedAttention | None" = None


def _cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype in _FP8_CACHE_DTYPES:
        return torch.float8_e4m3fn
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("bfloat16", "float16"):
        return getattr(torch, kv_cache_dtype)
    raise ValueError(f"kv_cache_dtype: FP8MLA supports {SUPPORTED_KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


class FP8MLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata builder; decode metadata also carries a planned :class:`fp8mla.MLAPagedAttention`."""

    # Single-token decode batches have a fixed shape per batch size: the wrapper's fixed buffers let vLLM capture
    # them (FULL_DECODE_ONLY / FULL_AND_PIECEWISE). Multi-token (spec) decode rows go to prefill.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.SINGLE_ONLY

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layer = self.compilation_config.static_forward_context[layer_names[0]]
        self._sm_scale = float(layer.scale)
        self._q_dtype = self.model_config.dtype
        self._kv_dtype = _cache_storage_dtype(vllm_config.cache_config.cache_dtype, self._q_dtype)
        # DCP all-gathers the query heads before forward_mqa.
        self._num_heads = self.num_heads * self.dcp_world_size
        self._graphs = torch.device(device).type == "cuda"
        # decode rows per batch, captured (padded) batches included
        self._max_batch = max(1, vllm_config.scheduler_config.max_num_seqs,
                              getattr(self.compilation_config, "max_cudagraph_capture_size", None) or 0)
        self._attn = None  # built at the first plan, when the block table's width is known
        self._log_startup(device)

    def _log_startup(self, device):
        """One line per builder (per KV-cache group and rank) at start-up, through vLLM's logger: that FP8MLA is
        in use, the fp8mla kernel backend its plans will choose and the KV format."""
        from fp8mla.runtime import choose_backend
        requested = _backend()
        try:  # "auto" on Hopper takes gluon for the plans it supports, triton for the others
            chosen = choose_backend(requested, device, supports_gluon=lambda: (True, ""))
        except (RuntimeError, ValueError) as e:  # a named backend that cannot run here: the first plan raises
            chosen = f"none ({e})"
        if chosen == "gluon" and requested == "auto":
            chosen = "gluon (triton for plans gluon does not take)"
        logger.info("FP8MLA attention backend (fp8mla %s): kernel backend %s (FP8MLA_BACKEND=%s), KV cache %s, "
                    "queries %s, latent %d + rope %d, %d heads per rank, block size %d, device %s",
                    fp8mla.__version__, chosen, requested, _kv_format_name(self._kv_dtype),
                    str(self._q_dtype).replace("torch.", ""), self.mla_dims.kv_lora_rank,
                    self.mla_dims.qk_rope_head_dim, self._num_heads, self.page_size, torch.device(device))

    def _wrapper(self, block_table):
        if self._attn is None:
            opts = {}
            if self._graphs:  # fixed buffers for the widest batch of the full-width table (no copy per plan)
                opts = dict(max_batch_size=self._max_batch, max_qo_len=1,
                            max_kv_indices=self._max_batch * max(1, block_table.shape[1]))
            self._attn = fp8mla.MLAPagedAttention(None, use_cuda_graph=self._graphs, backend=_backend(),
                                                  batch_invariant=_batch_invariant(), **opts)
        return self._attn

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len=None, dcp_tot_seq_lens_device=None):
        # vLLM passes every argument by keyword; max_query_len only from 0.31 (RELEASE), and decode rows are
        # single tokens here whatever it says (query_len_support SINGLE_ONLY).
        _plan(self._wrapper(block_table_tensor), block_table_tensor, seq_lens_device, query_start_loc_cpu,
              self.page_size, self._num_heads, self.mla_dims.kv_lora_rank, self.mla_dims.qk_rope_head_dim,
              self._sm_scale, self._q_dtype, self._kv_dtype)
        STATS.plans += 1
        return FP8MLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                    dcp_tot_seq_lens=dcp_tot_seq_lens_device, attn=self._attn)


def _plan(attn, block_table, seq_lens, qo_indptr_cpu, page_size, num_heads, kv_lora_rank, rope_dim, sm_scale,
          q_dtype, kv_dtype):
    """Plans ``attn`` over vLLM's padded block table as is. ``qo_indptr`` is vLLM's host copy of the decode
    rows' query offsets (one per request), so planning reads nothing back from the device."""
    from fp8mla.layout import PagedLayout
    layout = PagedLayout.from_block_table(block_table, seq_lens, page_size,
                                          qo_indptr=qo_indptr_cpu.to(torch.int32))
    attn.plan_layout(layout, num_heads, kv_lora_rank, rope_dim, True, sm_scale, q_dtype, kv_dtype)


def _hopper() -> bool:
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        return False
    cap = current_platform.get_device_capability()
    return cap is not None and cap.major == 9


class FP8MLABackend(MLACommonBackend):
    """``FP8MLA``: vLLM's MLA scaffolding with fp8mla's decode over a BF16/FP16 or FP8 latent cache."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "FP8MLA"

    @staticmethod
    def get_impl_cls() -> type["FP8MLAImpl"]:
        return FP8MLAImpl

    @staticmethod
    def get_builder_cls() -> type["FP8MLAMetadataBuilder"]:
        return FP8MLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # fp8mla's kernels take any latent width, but vLLM's MLA metadata only these (latent_width_error)
        return MLACommonBackend.get_supported_head_sizes()

    @classmethod
    def validate_configuration(cls, head_size, *args, **kwargs) -> list[str]:
        """vLLM's checks (CUDA/ROCm validate a selected backend here), with fp8mla's message for the width."""
        reasons = super().validate_configuration(head_size, *args, **kwargs)
        why = latent_width_error(head_size)
        return [why if r == "head_size not supported" and why else r for r in reasons]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any page size: fp8mla reads pages of any size

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size >= 1

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """vLLM asks this only where ``--block-size`` was not given. On Hopper, pages of 64 tokens: the Gluon
        heads-on-M build (the fastest at 33-128 heads, in CUDA graphs too) reads whole 64-token pages, and with
        vLLM's default of 16 the wide build runs. Elsewhere vLLM's default."""
        if default_block_size % 64 and _hopper():
            return 64 * -(-default_block_size // 64)
        return default_block_size

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # Triton's bf16 tensor-core path: SM80 and newer, FP8 pools included (where vLLM's own Triton MLA
        # refuses FP8 below SM89, fp8mla converts in registers).
        return capability is None or capability.to_int() >= 80


class FP8MLAImpl(MLACommonImpl[MLACommonMetadata]):
    """Decode through fp8mla; prefill and everything else as vLLM's MLA common implementation."""

    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True  # fp8mla returns natural-log lse when asked (return_lse_base_on_e=True)
    supports_dcp: bool = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args):
        why = latent_width_error(head_size, mla_args.get("kv_lora_rank"))
        if why:  # at model construction, before the server reports healthy
            raise ValueError(why)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError("FP8MLA supports none of alibi_slopes, sliding_window, logits_soft_cap; got "
                                      f"alibi_slopes={alibi_slopes}, sliding_window={sliding_window}, "
                                      f"logits_soft_cap={logits_soft_cap}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"attn_type: FP8MLA supports decoder self-attention, got {attn_type!r}")
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: FP8MLA supports {SUPPORTED_KV_CACHE_DTYPES}, got "
                             f"{kv_cache_dtype!r}")
        # BF16/FP16 queries over the FP8 cache (the point of fp8mla): vLLM must not quantize the queries.
        self.supports_quant_query_input = False
        self._fp8 = is_quantized_kv_cache(kv_cache_dtype)
        self._fp8_format = get_format("fp8_e4m3")

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata, layer):
        decode = attn_metadata.decode
        assert decode is not None and decode.attn is not None, "FP8MLA: decode metadata was not planned"
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q.split([self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1)
        L = self.kv_lora_rank
        cache = kv_c_and_k_pe_cache
        scales = {}
        if self._fp8:
            # per-layer scale as a device tensor: no .item(), no sync, capturable
            scales = dict(ckv_scale=layer._k_scale.reshape(1), kpe_scale=layer._k_scale.reshape(1))
        out, lse = decode.attn.run(q_nope, q_pe, cache[..., :L], cache[..., L:], return_lse=True,
                                   return_lse_base_on_e=True, **scales)
        STATS.decode_calls += 1
        STATS.decode_tokens += q_nope.shape[0]
        STATS.pool_dtypes.add(cache.dtype)
        STATS.backends.add(decode.attn.backend)
        return out, (lse if self.need_to_return_lse_for_decode else None)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                           skip_scale=False) -> None:
        """``skip_scale`` (vLLM 0.33+, RELEASE) says the FP8 scale is 1.0: dividing by it changes nothing here."""
        if kv_cache.numel() == 0:
            return
        if kv_cache.device.type == "cuda":  # vLLM's fused kernel (quantizes with k_scale as fp8mla reads it)
            extra = (skip_scale,) if RELEASE.kv_update_passes_skip_scale else ()
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                                              *extra)
        rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
        flat = kv_cache.view(-1, rows.shape[-1])
        slots = slot_mapping.flatten().to(torch.long)
        keep = slots >= 0  # padding tokens carry slot -1
        rows, slots = rows[keep], slots[keep]
        if is_quantized_kv_cache(kv_cache_dtype):  # the cache is uint8 bytes; copy bytes (no fp8 index_copy)
            rows = self._fp8_format.quantize(rows, k_scale.reshape(()).float()).view(torch.uint8)
            flat = flat.view(torch.uint8)
        flat.index_copy_(0, slots, rows.to(flat.dtype))
