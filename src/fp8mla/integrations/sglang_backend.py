"""The ``fp8mla`` attention backend of SGLang (0.5.23): MLA over SGLang's latent pool without casting it.

SGLang's FlashInfer MLA backend calls ``get_key_buffer(layer).to(q.dtype)`` on every layer of every step:
with an FP8 pool that converts the whole pool (the GLM-5 / DeepSeek-R1 profiles in fp8mla's docs). Here the
pool is read as stored:

- the pool: ``[size + page, 1, 576]`` per layer, stored as uint8 with an fp8 view (``get_key_buffer`` returns
  the view: no copy) or in the model dtype; viewed as pages ``[(size + page) / page, page, 576]`` (SGLang
  allocates whole pages, so token slot = page * page_size + offset).
- the page table: page size 1 (SGLang's default: token slots) or larger, built per batch from
  ``req_to_token`` as one :class:`fp8mla.layout.PagedLayout` (O(batch) host work from SGLang's host lengths,
  device gathers, no device-to-host sync). On CUDA the token stream comes from SGLang's own
  ``kv_index_translator.pack_read_stream`` (unified/translated pools included); elsewhere from ``req_to_token``
  directly (plain pools).
- ``forward_decode``: :class:`fp8mla.MLAPagedAttention` over the pool, BF16/FP16 queries, per-tensor scale
  ``layer.k_scale_float`` (SGLang stores ``k / k_scale``: real = stored x scale, fp8mla's convention).
- ``forward_extend``: with fresh latents (``k`` given, the DeepSeek model's path), ragged causal attention over
  the fresh 16-bit latents (:class:`fp8mla.MLARaggedPrefill`) plus paged non-causal attention over the cached
  prefix read in place, merged by log-sum-exp; without them (``k is None``: the tokens were written already),
  causal paged attention over each request's whole sequence in the pool. On CUDA the ragged kernel does not
  take the absorbed 576/512 widths, so there the fresh tokens are written first and read back by the paged
  extend kernel (the second form).
- writes: ``k / k_scale`` saturated to the pool's dtype by fp8mla's rule, then SGLang's ``set_mla_kv_buffer``.
- CUDA graphs (decode): ``init_cuda_graph_state`` makes a wrapper with fixed buffers; the batch is planned in
  ``init_forward_metadata_out_graph`` (outside the graph) and run inside it.
"""
from __future__ import annotations

from .versions import check_version

SGLANG_VERSION = check_version("sglang")  # before any SGLang internals

from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from fp8mla.attention import MLAPagedAttention  # noqa: E402
from fp8mla.formats import get_format  # noqa: E402
from fp8mla.layout import PagedLayout  # noqa: E402
from fp8mla.ragged import MLARaggedPrefill, merge_state  # noqa: E402

from ._options import backend as _backend, ragged_backend as _ragged_backend, sglang_deterministic  # noqa: E402

__all__ = ["FP8MLAAttnBackend", "STATS"]


class _Stats:
    """Counters the engine tests read: calls per path, pool dtypes seen, fp8mla backends used."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.decode_calls = 0
        self.extend_calls = 0
        self.extend_ragged_calls = 0
        self.writes = 0
        self.pool_dtypes: set = set()
        self.backends: set = set()


STATS = _Stats()


@dataclass
class _Metadata:
    mode: str                                 # "decode" | "extend"
    attn: MLAPagedAttention | None = None     # decode: all tokens; extend without fresh latents: causal, all
    prefix: MLAPagedAttention | None = None   # extend with fresh latents: non-causal over the cached prefix
    ragged: MLARaggedPrefill | None = None    # extend with fresh latents: causal over the fresh ones
    has_prefix: bool = False


class FP8MLAAttnBackend(AttentionBackend):
    """SGLang attention backend for MLA models over a BF16/FP16 or FP8 latent pool, through fp8mla."""

    def __init__(self, model_runner):
        super().__init__()
        cfg = model_runner.model_config
        par = get_parallel()
        if getattr(par, "attn_dcp_size", 1) > 1:
            raise NotImplementedError("fp8mla: decode context parallelism (--dcp-size > 1) is not supported")
        self.device = torch.device(model_runner.device)
        self.page_size = int(model_runner.page_size or 1)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = model_runner.kv_index_translator
        self.num_heads = cfg.num_attention_heads // par.attn_tp_size
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.sm_scale = float(cfg.scaling)
        self.data_type = model_runner.dtype
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        if self.kv_cache_dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
            raise ValueError(f"--kv-cache-dtype: fp8mla reads fp8_e4m3, bfloat16 or float16 latent pools, got "
                             f"{self.kv_cache_dtype}")
        self._fmt = get_format(self.kv_cache_dtype)
        rows = self.token_to_kv_pool.size + self.page_size
        if rows % self.page_size:
            raise ValueError(f"fp8mla: the KV pool has {rows} rows, not a whole number of pages of "
                             f"{self.page_size}")
        self._backend = _backend()  # FP8MLA_BACKEND (default auto)
        # --enable-deterministic-inference: every paged plan batch-invariant (docs/batch_invariance.md)
        self._invariant = sglang_deterministic(getattr(model_runner, "server_args", None))
        self._decode = MLAPagedAttention(backend=self._backend, batch_invariant=self._invariant)
        self._extend = MLAPagedAttention(backend=self._backend, batch_invariant=self._invariant)
        self._prefix = MLAPagedAttention(backend=self._backend, batch_invariant=self._invariant)
        self._ragged = MLARaggedPrefill(backend=_ragged_backend())
        self._graph_decode: dict[int, MLAPagedAttention] = {}
        self._graph_opts: dict | None = None
        self.forward_metadata = None

    # -- page tables ------------------------------------------------------------------------------------------
    def _layout(self, forward_batch, kv_lens_cpu: torch.Tensor, qo_lens_cpu: torch.Tensor) -> PagedLayout:
        """The batch's page table over the first ``kv_lens_cpu[b]`` tokens of each request (host lengths: the
        only host reads are these O(batch) lists)."""
        P, dev = self.page_size, self.device
        B = kv_lens_cpu.numel()
        kv_lens_cpu = kv_lens_cpu.to(torch.int64)
        qo_indptr = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(qo_lens_cpu.to(torch.int64), 0, out=qo_indptr[1:])
        pages = (kv_lens_cpu + P - 1) // P
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        n_pages = int(kv_indptr[-1])
        req_rows = forward_batch.req_pool_indices[:B]
        if dev.type == "cuda" or self.kv_index_translator.needs_read_translate:
            kv_pages = self._pages_from_stream(forward_batch, kv_lens_cpu, pages, n_pages)
        else:
            # a plain pool: req_to_token holds the physical token slots; read each page's first slot
            req = torch.repeat_interleave(torch.arange(B), pages, output_size=n_pages)
            first_pos = (torch.arange(n_pages) - kv_indptr[:-1].long()[req]) * P
            kv_pages = self.req_to_token[req_rows.long()[req.to(dev)], first_pos.to(dev)] // P
        return PagedLayout.from_csr(qo_indptr, kv_indptr, kv_pages.to(torch.int32), kv_lens_cpu.to(torch.int32), P,
                                    device=dev)

    def _pages_from_stream(self, forward_batch, kv_lens_cpu, pages, n_pages):
        """Page ids through SGLang's own read stream (token ids, translated where the pool needs it)."""
        B, P, dev = kv_lens_cpu.numel(), self.page_size, self.device
        T = int(kv_lens_cpu.sum())
        lens_dev = kv_lens_cpu.to(dev, non_blocking=True)
        tok_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        torch.cumsum(lens_dev, 0, out=tok_indptr[1:])
        tokens = torch.empty(max(T, 1), dtype=torch.int32, device=dev)
        tr = self.kv_index_translator
        done = tr.pack_read_stream(forward_batch.kv_loc_plan, req_pool_indices=forward_batch.req_pool_indices,
                                   seq_lens=lens_dev, indptr=tok_indptr, out=tokens)
        if not done and T and tr.needs_read_translate:
            tokens[:T].copy_(tr.translate_dcp_read_ids(tokens[:T]))
        if P == 1:
            return tokens[:n_pages]
        tok_start = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(kv_lens_cpu, 0, out=tok_start[1:])
        page_start = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(pages, 0, out=page_start[1:])
        req = torch.repeat_interleave(torch.arange(B), pages, output_size=n_pages)
        idx = tok_start[req] + (torch.arange(n_pages) - page_start[req]) * P
        return tokens[idx.to(dev)] // P

    def _plan(self, attn, layout, causal):
        attn.plan_layout(layout, self.num_heads, self.kv_lora_rank, self.rope_dim, causal, self.sm_scale,
                         self.data_type, self.kv_cache_dtype)

    # -- metadata -----------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():  # no tokens on this rank (DP attention): AttentionBackend.forward returns empty outputs
            self.forward_metadata = _Metadata("idle")
            return
        seq_cpu = forward_batch.seq_lens_cpu
        if seq_cpu is None:
            raise ValueError("forward_batch.seq_lens_cpu: fp8mla plans from SGLang's host lengths, got None")
        B = forward_batch.batch_size
        seq_cpu = seq_cpu[:B].to(torch.int64)
        if mode.is_decode():
            self._plan(self._decode, self._layout(forward_batch, seq_cpu, torch.ones(B, dtype=torch.int64)), True)
            self.forward_metadata = _Metadata("decode", attn=self._decode)
            return
        if mode.is_target_verify() or not mode.is_extend():
            raise NotImplementedError(f"fp8mla: forward mode {mode} (speculative decoding) is not supported")
        ext = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
        pre = torch.tensor(forward_batch.extend_prefix_lens_cpu, dtype=torch.int64)
        # without fresh latents: every request's whole sequence from the pool, causal
        self._plan(self._extend, self._layout(forward_batch, seq_cpu, ext), True)
        # with fresh latents: the fresh tokens ragged (causal) + the cached prefix paged (every query sees all)
        indptr = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(ext, 0, out=indptr[1:])
        D = self.kv_lora_rank + self.rope_dim
        self._ragged.plan(indptr, indptr, self.num_heads, 1, D, self.kv_lora_rank, causal=True,
                          sm_scale=self.sm_scale, q_data_type=self.data_type, kv_data_type=self.data_type)
        has_prefix = bool((pre > 0).any())
        if has_prefix:
            self._plan(self._prefix, self._layout(forward_batch, pre, ext), False)
        self.forward_metadata = _Metadata("extend", attn=self._extend, prefix=self._prefix, ragged=self._ragged,
                                          has_prefix=has_prefix)

    # CUDA graphs (decode): fixed buffers, planned outside the graph, run inside.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None):
        max_pages = -(-self.req_to_token.shape[1] // self.page_size)
        self._graph_opts = dict(max_batch_size=max_bs, max_qo_len=1, max_kv_indices=max(1, max_bs * max_pages))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError("fp8mla: CUDA graphs are captured for decode batches only")
        B = forward_batch.batch_size
        attn = self._graph_decode.get(B)
        if attn is None:
            attn = self._graph_decode[B] = MLAPagedAttention(None, True, backend=self._backend,
                                                              batch_invariant=self._invariant,
                                                              **(self._graph_opts or {}))
        seq_cpu = forward_batch.seq_lens_cpu
        if seq_cpu is None:  # SGLang's capture path may not carry host lengths: one copy, at capture time only
            seq_cpu = forward_batch.seq_lens.cpu()
        seq_cpu = seq_cpu[:B].to(torch.int64)
        self._plan(attn, self._layout(forward_batch, seq_cpu, torch.ones(B, dtype=torch.int64)), True)
        self.forward_metadata = _Metadata("decode", attn=attn)

    def init_forward_metadata_in_graph(self, forward_batch):
        pass  # the plan lives in the wrapper's fixed buffers, filled by init_forward_metadata_out_graph

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # -- forward --------------------------------------------------------------------------------------------------
    def _pool(self, layer):
        """(ckv, kpe) page views of the layer's pool as stored, and the per-tensor scales to read it with."""
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)  # fp8 view of the uint8 storage: no copy
        P = self.page_size
        pages = kv.view(kv.shape[0] // P, P, kv.shape[-1])
        scales = {}
        if self._fmt.is_fp8:
            s = float(layer.k_scale_float) if getattr(layer, "k_scale_float", None) is not None else 1.0
            scales = dict(ckv_scale=s, kpe_scale=s)
        STATS.pool_dtypes.add(pages.dtype)
        return pages[..., : self.kv_lora_rank], pages[..., self.kv_lora_rank:], scales

    def _split_q(self, q, q_rope, layer):
        H, Dc = layer.tp_q_head_num, layer.v_head_dim
        if q_rope is not None:
            return q.view(-1, H, Dc), q_rope.view(-1, H, layer.head_dim - Dc)
        qall = q.view(-1, H, layer.head_dim)
        return qall[..., :Dc], qall[..., Dc:]

    def _split_k(self, k, v, k_rope, layer):
        """Fresh latents as (c_kv [n, 1, 512], k_pe [n, 1, 64]) in the model dtype."""
        Dc = layer.v_head_dim
        if k_rope is not None:
            return k.view(-1, 1, Dc), k_rope.view(-1, 1, layer.head_dim - Dc)
        k = k.view(-1, 1, layer.head_dim)
        return k[..., :Dc], k[..., Dc:]

    def _write(self, layer, forward_batch, ckv, kpe):
        """k / k_scale, saturated to the pool's dtype (fp8mla's quantization rule), through SGLang's writer."""
        if self._fmt.is_fp8:
            s = float(layer.k_scale_float) if getattr(layer, "k_scale_float", None) is not None else 1.0
            ckv, kpe = self._fmt.quantize(ckv, s), self._fmt.quantize(kpe, s)
        self.token_to_kv_pool.set_mla_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), ckv, kpe)
        STATS.writes += 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       **kwargs):
        md = self.forward_metadata
        if k is not None and save_kv_cache:
            self._write(layer, forward_batch, *self._split_k(k, v, k_rope, layer))
        q_nope, q_pe = self._split_q(q, q_rope, layer)
        ckv, kpe, scales = self._pool(layer)
        out = md.attn.run(q_nope, q_pe, ckv, kpe, **scales)
        STATS.decode_calls += 1
        STATS.backends.add(md.attn.backend)
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       **kwargs):
        md = self.forward_metadata
        q_nope, q_pe = self._split_q(q, q_rope, layer)
        H, Dc = layer.tp_q_head_num, layer.v_head_dim
        fresh = None
        if k is not None:
            fresh = self._split_k(k, v, k_rope, layer)
            if save_kv_cache:
                self._write(layer, forward_batch, *fresh)
        ckv, kpe, scales = self._pool(layer)
        STATS.extend_calls += 1
        if fresh is not None and self.device.type == "cuda" and md.ragged.backend != "triton":
            fresh = None  # no GPU kernel for 576-wide ragged attention: read the just-written tokens back instead
        if fresh is None:  # the new tokens are in the pool already: causal over every request's sequence
            out = md.attn.run(q_nope, q_pe, ckv, kpe, **scales)
            STATS.backends.add(md.attn.backend)
            return out.view(-1, H * Dc)
        # fresh 16-bit latents, ragged and causal: q = [q_nope | q_pe] against k = [c_kv | k_pe], v = c_kv
        c_kv, k_pe = (t.to(self.data_type) for t in fresh)
        qr = torch.cat([q_nope, q_pe], dim=-1)
        kr = torch.cat([c_kv, k_pe], dim=-1)
        out, lse = md.ragged.run(qr, kr, c_kv, return_lse=True)
        STATS.extend_ragged_calls += 1
        if md.has_prefix:  # the cached prefix, read in place, merged by log-sum-exp (base 2 on both sides)
            o_p, lse_p = md.prefix.run(q_nope, q_pe, ckv, kpe, return_lse=True, **scales)
            STATS.backends.add(md.prefix.backend)
            out, lse = merge_state(o_p, lse_p, out, lse)
        return out.reshape(-1, H * Dc)
