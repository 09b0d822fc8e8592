"""FlashMLA's decode kernels beside fp8mla in one process (``fp8mla bench decode --compare flashmla``, also with
``--sparse``): the compiled ops vLLM's wheel ships (``vllm._flashmla_C``, ``vllm._flashmla_extension_C``; on a
machine without vLLM, ``../shared/tools/flashmla-ops`` puts them in ``.fmla/``: run with ``PYTHONPATH=.fmla``).
Optional: where the ops do not import, :func:`load_ops` says why and the rows are skipped by name.

Rows (Hopper builds of the ops, pages of 64 tokens):
- ``flashmla bf16``: dense decode over a BF16 copy of the pool (the same values), BF16 queries.
- ``flashmla fp8-q``: vLLM's FLASHMLA path over the FP8 pool: Q quantized to e4m3 per tensor (``descale_q``), so
  its error is that of FP8 queries.
- ``flashmla sparse``: sparse decode over the same 656-byte records; heads zero-padded to 64 (the sm_90 build
  takes 64 or 128), as vLLM's FLASHMLA_SPARSE does.
- ``flashmla v4`` (``--v4``): the same sparse decode over DeepSeek V4 pools (``v4_runner``): the window as
  ``k_cache`` + ``indices``, the compressed rows as ``extra_k_cache`` + ``extra_indices``, ``attn_sink``. vLLM
  0.34's build of the ops has its sm_90 sparse decode for the V3.2 (656-byte) and V4 (584-byte, ``fp8_v4``)
  records only, 64 or 128 heads (V4.1's 528-byte record runs on SM100 there): other formats are refused by name.
Each runner writes ``[B, H, 512]`` into ``out`` (a view), so the bench's error check reads it like fp8mla's.
"""
from __future__ import annotations

import importlib

import torch

DC, DK = 512, 64
PAGE = 64


def load_ops():
    """``(ops, ext)``: ``torch.ops._flashmla_C`` and ``torch.ops._flashmla_extension_C``, or a str saying why not."""
    try:
        importlib.import_module("vllm._flashmla_C")   # (importing them registers the ops)
        importlib.import_module("vllm._flashmla_extension_C")
    except Exception as e:  # noqa: BLE001 - any import failure: the rows are skipped, by name
        return (f"FlashMLA's ops do not import ({type(e).__name__}: {e}); install vLLM, or fetch them with "
                "../shared/tools/flashmla-ops and run with PYTHONPATH=.fmla")
    return torch.ops._flashmla_C, torch.ops._flashmla_extension_C


def _q576(q_nope, q_pe, heads: int):
    """``[B, 1, heads, 576]`` bf16: the concatenated query (zero heads appended up to ``heads``)."""
    q = torch.cat([q_nope, q_pe], dim=-1).to(torch.bfloat16)
    if heads > q.shape[1]:
        q = torch.cat([q, q.new_zeros(q.shape[0], heads - q.shape[1], q.shape[2])], dim=1)
    return q.unsqueeze(1).contiguous()


class _Runner:
    """One FlashMLA call with its schedule made by a first call (outside any timed graph); ``out`` [B, H, 512]
    receives the result, from an out buffer of FlashMLA's own shape."""

    def __init__(self, call, out: torch.Tensor, heads: int):
        self.call, self.out, self.heads = call, out, heads
        B, H, _ = out.shape
        self.buf = torch.empty(B, 1, heads, DC, dtype=out.dtype, device=out.device)
        self.meta = (None, None)
        res = call(self.buf, *self.meta)       # the first call makes the tile schedule
        self.meta = (res[2], res[3]) if len(res) > 3 else self.meta

    def __call__(self):
        self.call(self.buf, *self.meta)
        self.out.copy_(self.buf[:, 0, : self.out.shape[1]])


def dense_runners(ops, plan_args, H, pool, fmt, q_nope, q_pe, out) -> dict:
    """``{name: runner}`` for the dense rows over this bench point's pool (``[P, 64, 576]``, FP8 or BF16)."""
    a = plan_args
    if a["page_size"] != PAGE:
        raise ValueError(f"page_size {a['page_size']}: FlashMLA's decode takes pages of {PAGE}")
    fm, ext = ops
    B = a["kv_len_arr"].numel()
    seqlens = a["kv_len_arr"].to(torch.int32)
    table = a["kv_indices"].view(B, -1).to(torch.int32)
    q = _q576(q_nope, q_pe, H)
    scale = float(a["sm_scale"])
    P = pool.shape[0]
    k16 = pool.to(torch.bfloat16).view(P, PAGE, 1, DC + DK)
    runners = {"flashmla bf16": _Runner(
        lambda o, meta, splits: fm.dense_decode_fwd(q, k16, DC, seqlens, table, scale, True, meta, splits, o),
        out, H)}
    if fmt.is_fp8 and fmt.storage_dtype == torch.float8_e4m3fn and fmt.scale_kind == "tensor":
        descale_q = (q.abs().amax().float() / 448.0).clamp(min=1e-12).reshape(1)
        q8 = (q.float() / descale_q).to(torch.float8_e4m3fn)
        k8 = pool.view(P, PAGE, 1, DC + DK)
        one = torch.ones(1, dtype=torch.float32, device=pool.device)
        meta, splits = ext.get_mla_decoding_metadata_dense_fp8(seqlens, H, 1)

        def fp8_q():
            o = ext.fwd_kvcache_mla_fp8(q8, k8, DC, seqlens, table, scale, True, meta, splits, descale_q, one)[0]
            out.copy_(o.view(B, H, DC))
        runners["flashmla fp8-q"] = fp8_q
    return runners


def sparse_runner(ops, H, kv, indices, sm_scale, q_nope, q_pe, out):
    """The sparse row: ``kv`` the 656-byte records ``[P, 64, 656]`` uint8, ``indices`` ``[B, topk]`` flat slots
    (page id x 64 + offset, -1 padded)."""
    if kv.shape[1] != PAGE or kv.shape[-1] != 656:
        raise ValueError(f"kv: FlashMLA's sparse decode takes [P, {PAGE}, 656] records, got {tuple(kv.shape)}")
    fm, _ = ops
    heads = 64 if H <= 64 else 128
    q = _q576(q_nope, q_pe, heads)
    k = kv.view(kv.shape[0], PAGE, 1, kv.shape[-1])
    idx = indices.to(torch.int32).unsqueeze(1).contiguous()
    return _Runner(lambda o, meta, splits: fm.sparse_decode_fwd(q, k, idx, None, None, meta, splits, None, None,
                                                                 None, DC, float(sm_scale), o, False), out, heads)


# The V4 pool formats the ops' sm_90 sparse decode reads (vLLM 0.34: kernels instantiated for the V3.2 and V4
# records; V4.1 and its fp4 extra cache only on SM100)
V4_FORMATS_ON_SM90 = ("fp8_v4",)


def v4_runner(ops, kv_format: str, window_pool, w_idx, comp_pool, c_idx, sinks, sm_scale, q, out):
    """The ``flashmla v4`` row: ``q`` ``[B, H, 512]`` bf16 (heads zero-padded to 64 or 128, sinks with them),
    ``window_pool`` / ``comp_pool`` ``fp8_v4`` pools in fp8mla's shape ``[P, page, 584]`` (padded pages: FlashMLA's
    and vLLM's own view), ``w_idx`` / ``c_idx`` ``[B, topk]`` int32 global slots (-1 padded); ``out`` ``[B, H,
    512]`` receives the result."""
    if kv_format not in V4_FORMATS_ON_SM90:
        raise ValueError(f"kv_format {kv_format!r}: FlashMLA's Hopper sparse decode reads {V4_FORMATS_ON_SM90} "
                         "(V4's 584-byte record) only")
    fm, _ = ops
    B, H, D = q.shape
    heads = 64 if H <= 64 else 128
    qp = q.new_zeros(B, 1, heads, D)
    qp[:, 0, :H] = q
    sink = None
    if sinks is not None:
        sink = sinks.new_zeros(heads)
        sink[:H] = sinks

    def cache(pool):   # [P, page, 1, 584], pages at their padded stride, as FlashMLA's quantizer lays them out
        return pool.view(torch.uint8).unsqueeze(2)

    k, ek = cache(window_pool), cache(comp_pool) if comp_pool is not None else None
    wi = w_idx.to(torch.int32).unsqueeze(1).contiguous()
    ci = c_idx.to(torch.int32).unsqueeze(1).contiguous() if c_idx is not None else None
    return _Runner(lambda o, meta, splits: fm.sparse_decode_fwd(qp, k, wi, None, sink, meta, splits, ek, ci, None,
                                                                 D, float(sm_scale), o, False), out, heads)
