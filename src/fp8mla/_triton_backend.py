"""The "triton" backend of MLAPagedAttention: split-KV scheduling in plan(), launches in run().

Scheduling: every request's tokens are cut into chunks of at most ``chunk`` tokens (a multiple of BLOCK_N), so
that (work items x row tiles) is about ``ctas_per_sm`` waves of the GPU's SMs; no chunk is shorter than
``min_chunk`` tokens, because each split costs one fp32 partial (the size of ~57 FP8 tokens at H=16) and a
merge. A request with one chunk is written directly; the others go through the merge kernel.

With ``use_cuda_graph=True`` every device tensor run() touches lives in buffers allocated once (capacities
from the constructor's ``max_batch_size``, ``max_qo_len``, ``max_kv_indices`` and the first plan's heads and
dims), the grids are sized by those capacities, and the kernels read the real counts from device memory: a
captured run() replays correctly after a re-plan with other lengths.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .kernels.decode import KV_BF16, KV_FP16_MATH, KV_GROUP, mla_decode

DEFAULTS = dict(block_n=None, num_stages=2, ctas_per_sm=2, min_chunk=256, evict_first=True, max_batch_size=256,
                max_qo_len=1, max_kv_indices=1 << 20)
EXTEND_MIN_QO = 9  # plans with longer query blocks run the extend (paged prefill) kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small machine, so tests see several splits per request


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_config(num_heads: int, max_qo_len: int, kv_mode: int, opts: dict) -> dict:
    """BLOCK_M / BLOCK_N / warps / stages for a plan (overridable through the constructor's keywords)."""
    rows = num_heads * max_qo_len
    block_m = opts.get("block_m") or min(64, max(16, _pow2(rows)))
    # The group format's fp32 dequantization tiles overflow shared memory at BLOCK_N 64 (259 KB on the H200).
    block_n = opts.get("block_n") or (32 if kv_mode == KV_GROUP else 64)
    return dict(block_m=block_m, block_n=block_n,
                evict_first=opts.get("evict_first", DEFAULTS["evict_first"]), index64=opts.get("index64"),
                cvt_asm=bool(opts.get("cvt_asm", False)),
                num_warps=opts.get("num_warps") or (4 if block_m <= 16 else 8),
                num_stages=opts.get("num_stages", DEFAULTS["num_stages"]))


def schedule(kv_lens: list[int], qo_lens: list[int], row_tiles: int, num_sms: int, block_n: int,
             ctas_per_sm: int, min_chunk: int):
    """Work items ``(request, kv_start, kv_end, partial index or -1)`` and ``split_indptr [B + 1]``."""
    total = sum(L for L, q in zip(kv_lens, qo_lens) if q)
    items_target = max(1, (num_sms * ctas_per_sm) // max(1, row_tiles))
    chunk = max(min_chunk, -(-total // items_target))
    chunk = -(-chunk // block_n) * block_n
    items, split_indptr, parts = [], [0], 0
    for b, (L, q) in enumerate(zip(kv_lens, qo_lens)):
        if q == 0:
            split_indptr.append(len(items))
            continue
        n = max(1, -(-L // chunk))
        per = -(-(-(-L // n)) // block_n) * block_n if L else 0
        starts = list(range(0, L, per)) if L else [0]
        for s in starts:
            items.append([b, s, min(L, s + per) if L else 0, parts if len(starts) > 1 else -1])
            parts += len(starts) > 1
        split_indptr.append(len(items))
    return items, split_indptr, parts


@dataclass
class TritonPlan:
    kv_mode: int
    cfg: dict
    fp32_dot: bool
    max_rows: int
    grid_items: int
    grid_batch: int
    tensors: dict       # device tensors the kernels read
    scales: torch.Tensor
    scales_host: list
    extend_qo: int = 0  # > 0: run the extend kernel with this max_qo_len instead of the decode kernel

    @staticmethod
    def build(attn, plan, qo_indptr, kv_indptr, kv_indices, kv_len_arr, qo_lens, kv_lens) -> "TritonPlan":
        opts = {**DEFAULTS, **attn._kernel_options}
        fmt, device, H = plan.kv_format, plan.device, plan.num_heads
        if fmt.scale_kind == "group":
            kv_mode = KV_GROUP
        elif fmt.storage_dtype == torch.bfloat16:
            kv_mode = KV_BF16
        else:
            kv_mode = KV_FP16_MATH
        for name, d in (("head_dim_ckv", plan.head_dim_ckv), ("head_dim_kpe", plan.head_dim_kpe)):
            if d != _pow2(d) or d < 16:
                raise ValueError(f"{name}: the triton backend needs a power of two >= 16, got {d}; "
                                 "use backend='torch'")
        graph = attn._use_cuda_graph
        max_qo = opts["max_qo_len"] if graph else max([1] + qo_lens)
        if graph and max(qo_lens, default=0) > max_qo:
            raise ValueError(f"qo_indptr: a request has {max(qo_lens)} query tokens, above max_qo_len={max_qo} "
                             "given to the constructor for CUDA graphs")
        # The extend kernel rounds dequantized K/V to the query dtype: fine for FP8 and same-dtype pools, but the
        # group format and an fp16 pool under bf16 queries lose bits there (lse error ~2e-2 on the H200); those
        # plans stay on the decode kernel, which handles any query length (taller row tiles, exact numerics).
        extend_ok = fmt.scale_kind != "group" and not (fmt.storage_dtype == torch.float16
                                                        and plan.q_dtype == torch.bfloat16)
        extend_qo = (max(qo_lens, default=0) if extend_ok and not graph and max(qo_lens, default=0) >= EXTEND_MIN_QO
                     else 0)
        cfg = kernel_config(H, max_qo, kv_mode, opts)
        max_rows = 0 if extend_qo else H * max_qo  # the extend kernel needs no split schedule nor partials
        row_tiles = -(-max_rows // cfg["block_m"])
        items, split_indptr, parts = ([], [0] * (len(kv_lens) + 1), 0) if extend_qo else schedule(
            kv_lens, qo_lens, row_tiles, _num_sms(device), cfg["block_n"], opts["ctas_per_sm"], opts["min_chunk"])
        B = len(kv_lens)
        cols = list(zip(*items)) if items else [[], [], [], []]
        host = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len_arr,
                    item_req=cols[0], item_start=cols[1], item_end=cols[2], item_part=cols[3],
                    split_indptr=split_indptr, num_items=[len(items)], batch_size=[B])
        host = {k: (v.to(torch.int32) if isinstance(v, torch.Tensor) else torch.tensor(list(v), dtype=torch.int32))
                for k, v in host.items()}
        Dc = plan.head_dim_ckv
        if graph:
            st = attn._triton_state
            if st is None:
                st = attn._triton_state = _GraphBuffers(opts, H, Dc, device, row_tiles)
            st.check(H, Dc, max_rows, B, len(items), parts, kv_indices.numel())
            tensors = st.load(host)
            grid_items, grid_batch, scales, scales_host = st.max_items, st.max_batch, st.scales, st.scales_host
        else:
            tensors = {k: v.to(device, non_blocking=True) for k, v in host.items()}
            tensors["part_o"] = torch.empty(max(parts, 1), max_rows, Dc, dtype=torch.float32, device=device)
            tensors["part_lse"] = torch.empty(max(parts, 1), max_rows, dtype=torch.float32, device=device)
            grid_items, grid_batch = max(1, len(items)), max(1, B)
            scales, scales_host = torch.ones(2, dtype=torch.float32, device=device), [1.0, 1.0]
        return TritonPlan(kv_mode, cfg, _interpreting(), max_rows, grid_items, grid_batch, tensors, scales,
                          scales_host, extend_qo)


class _GraphBuffers:
    """Fixed device buffers for CUDA-graph capture; plan() copies into them, never reallocates."""

    def __init__(self, opts, H, Dc, device, row_tiles):
        self.H, self.Dc = H, Dc
        self.max_batch = opts["max_batch_size"]
        self.max_rows = H * opts["max_qo_len"]
        self.max_items = max(1, (_num_sms(device) * opts["ctas_per_sm"]) // max(1, row_tiles)) + self.max_batch
        self.max_kv_indices = opts["max_kv_indices"]
        i32 = dict(dtype=torch.int32, device=device)
        mb, mi = self.max_batch, self.max_items
        self.buf = dict(qo_indptr=torch.zeros(mb + 1, **i32), kv_indptr=torch.zeros(mb + 1, **i32),
                        kv_indices=torch.zeros(self.max_kv_indices, **i32), kv_len=torch.zeros(mb, **i32),
                        item_req=torch.zeros(mi, **i32), item_start=torch.zeros(mi, **i32),
                        item_end=torch.zeros(mi, **i32), item_part=torch.zeros(mi, **i32),
                        split_indptr=torch.zeros(mb + 1, **i32), num_items=torch.zeros(1, **i32),
                        batch_size=torch.zeros(1, **i32),
                        part_o=torch.empty(mi, self.max_rows, Dc, dtype=torch.float32, device=device),
                        part_lse=torch.empty(mi, self.max_rows, dtype=torch.float32, device=device))
        self.scales = torch.ones(2, dtype=torch.float32, device=device)
        self.scales_host = [1.0, 1.0]  # what self.scales holds, shared by every plan on these buffers

    def check(self, H, Dc, max_rows, B, n_items, parts, n_indices):
        for what, got, cap in (("num_heads", H, self.H), ("head_dim_ckv", Dc, self.Dc),
                               ("batch size", B, self.max_batch), ("work items", n_items, self.max_items),
                               ("kv_indices entries", n_indices, self.max_kv_indices),
                               ("query rows", max_rows, self.max_rows)):
            if (got != cap) if what in ("num_heads", "head_dim_ckv") else (got > cap):
                raise ValueError(f"plan: {what} {got} does not fit the CUDA-graph buffers ({cap}); construct "
                                 "MLAPagedAttention with larger max_batch_size / max_qo_len / max_kv_indices")

    def load(self, host: dict) -> dict:
        for k, v in host.items():
            self.buf[k][: v.numel()].copy_(v, non_blocking=True)
        return self.buf


def run_triton(p, q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, kpe_scale, ckv_scale_arr, out, lse,
               base_e: bool) -> None:
    tp: TritonPlan = p.impl
    for i, v in enumerate((ckv_scale, kpe_scale)):
        if isinstance(v, torch.Tensor):
            tp.scales[i].copy_(v)
            tp.scales_host[i] = None
        elif tp.scales_host[i] != v:  # a float: refill only when it changed (keeps replays cheap)
            tp.scales[i].fill_(v)
            tp.scales_host[i] = v
    t = tp.tensors
    c = tp.cfg
    if tp.extend_qo:
        from .kernels.extend import mla_extend
        mla_extend(q_nope, q_pe, ckv_cache, kpe_cache, t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"],
                   out, lse, sm_scale=p.sm_scale, causal=p.causal, scales=tp.scales, ckv_scale_arr=ckv_scale_arr,
                   max_qo_len=tp.extend_qo, fp32_dot=tp.fp32_dot)
        if base_e:
            lse.mul_(0.6931471805599453)
        return
    mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale_arr, tp.scales, out, lse, t["part_o"], t["part_lse"],
               t["qo_indptr"], t["kv_indptr"], t["kv_indices"], t["kv_len"], t["item_req"], t["item_start"],
               t["item_end"], t["item_part"], t["num_items"], t["split_indptr"], t["batch_size"],
               grid_items=tp.grid_items, grid_batch=tp.grid_batch, num_heads=p.num_heads, max_rows=tp.max_rows,
               sm_scale=p.sm_scale, causal=p.causal, kv_mode=tp.kv_mode, block_m=c["block_m"],
               block_n=c["block_n"], num_warps=c["num_warps"], num_stages=c["num_stages"], fp32_dot=tp.fp32_dot,
               evict_first=c["evict_first"], index64=c["index64"], cvt_asm=c["cvt_asm"], q_split=tp.kv_mode == KV_GROUP or (tp.kv_mode == KV_BF16 and p.q_dtype == torch.float16))
    if base_e:
        lse.mul_(0.6931471805599453)  # log2 -> ln
