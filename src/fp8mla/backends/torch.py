"""The "torch" backend: gather the referenced tokens, dequantize them, fp32 math. Any device.

It reads only the tokens the batch references (never the whole pool) and writes an fp32 copy of those tokens.
Requests are run in buckets of similar lengths (powers of two of kv_len and qo_len), each padded only to its
own longest request, so time and memory follow the batch's tokens, not B x the longest request.
It reads the lengths on the host (a sync when they live only on the device): it is the fallback and the
reference-like path, not the fast one. The batch-invariant mode (``InvariantTorchPlan``) runs each request alone
instead, in the chunks the triton backend cuts it in.
"""
from __future__ import annotations

import math

import torch

from .._softmax import softmax_rows
from ..formats import expand_group_scales
from .._checks import check_kv_lengths, check_page_ids
from ..kernels.split import chunk_bounds, merge_chunks
from ..runtime import LOG2E
from ._invariant import INVARIANT_CHUNK

__all__ = ["build", "TorchPlan"]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())



def _start_run(plan, ckv_cache, out, lse) -> None:
    """What every torch plan's run() does first: refuse a pool smaller than the pages the plan references, and write
    the rows that see no token (out 0, lse -inf)."""
    if plan.max_page >= ckv_cache.shape[0]:
        raise ValueError(f"kv_indices: the plan references page {plan.max_page} but ckv_cache has "
                         f"{ckv_cache.shape[0]} pages")
    if plan.empty_rows.numel():
        out[plan.empty_rows] = 0
        lse[plan.empty_rows] = -math.inf

class _Bucket:
    """Requests of similar lengths, padded to the bucket's longest: token t of row r at ``slots[r, t]``."""

    def __init__(self, reqs, qo_start, qo_lens, kv_lens, layout, causal, device):
        R = len(reqs)
        L = max(kv_lens[b] for b in reqs)
        Q = max(qo_lens[b] for b in reqs)
        lens = torch.tensor([kv_lens[b] for b in reqs], dtype=torch.int64)
        qlens = torch.tensor([qo_lens[b] for b in reqs], dtype=torch.int64)
        kvp = layout.kv_indptr.to("cpu", torch.int64)[torch.tensor(reqs)]
        pos = torch.arange(L)
        page_col = torch.div(pos, layout.page_size, rounding_mode="floor")
        kv_valid = pos[None, :] < lens[:, None]                                     # [R, L]
        index = torch.where(kv_valid, kvp[:, None] + page_col[None, :], 0)           # into kv_indices
        q0 = torch.tensor([qo_start[b] for b in reqs], dtype=torch.int64)
        qpos = torch.arange(Q)
        q_valid = qpos[None, :] < qlens[:, None]                                    # [R, Q]
        visible = kv_valid[:, None, :].expand(R, Q, L)
        if causal:
            last = lens[:, None] - qlens[:, None] + qpos[None, :]                     # last visible position
            visible = visible & (pos[None, None, :] <= last[:, :, None])
        # Padding (positions past a request's kv_len) is zeroed after the gather. Where every query row sees every
        # real key of its request (decode rows: one query each, causal or not; non-causal rows), the padding is
        # then the only masked key and holds zeros, so softmax_rows' scan for non-finite masked values is skipped.
        # A causal row of several queries keeps the scan: its earlier queries do not see its later keys.
        self.padded = min(kv_lens[b] for b in reqs) < L
        self.sees_all = not causal or Q == 1
        self.index, self.offset = index.to(device), (pos % layout.page_size).to(device)
        self.kv_valid, self.q_valid = kv_valid.to(device), q_valid.to(device)
        self.qidx = torch.where(q_valid, q0[:, None] + qpos[None, :], 0).to(device)
        self.visible = visible.to(device)


def _host_lengths(layout):
    """(qo_lens, kv_lens, max page id) on the host. A device-only table: this backend reads it on the host anyway,
    so it checks it like a host one."""
    qo_lens = layout.qo_lens if layout.qo_lens is not None else (
        (layout.qo_indptr[1:] - layout.qo_indptr[:-1]).tolist())
    kv_lens, max_page = layout.kv_lens, layout.max_page_id
    if kv_lens is None or max_page is None:
        h = [t.cpu() for t in (layout.kv_indptr, layout.kv_indices, layout.kv_len)]
        active = torch.tensor(qo_lens) > 0
        kv_lens = check_kv_lengths(h[0], h[1].numel(), h[2], layout.page_size, active)
        max_page = check_page_ids(h[0], h[1], h[2], layout.page_size, active)
    return qo_lens, kv_lens, max_page


def _joint_rows(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> torch.Tensor | None:
    """``[pages * page, Dc + Dk]`` over both caches when they are two views of one pool in which each token's kpe
    directly follows its ckv (vLLM's and SGLang's latent cache ``[..., :Dc]`` / ``[..., Dc:]``), else None. One
    gather, one conversion and one score product then serve both parts."""
    c, k = ckv_cache, kpe_cache
    if (c.dtype != k.dtype or c.device != k.device or c.shape[:2] != k.shape[:2] or c.stride() != k.stride()
            or c.stride(-1) != 1 or c.stride(0) != c.shape[1] * c.stride(1)
            or c.stride(1) < c.shape[-1] + k.shape[-1]
            or c.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or k.data_ptr() != c.data_ptr() + c.shape[-1] * c.element_size()):
        return None
    return c.as_strided((c.shape[0] * c.shape[1], c.shape[-1] + k.shape[-1]), (c.stride(1), 1))


class TorchPlan:
    def __init__(self, layout, spec):
        self.spec = spec
        qo_lens, kv_lens, self.max_page = _host_lengths(layout)
        qo_start = [0]
        for q in qo_lens:
            qo_start.append(qo_start[-1] + q)
        self.num_qo = qo_start[-1]
        groups: dict = {}
        for b, (q, L) in enumerate(zip(qo_lens, kv_lens)):
            if q:
                groups.setdefault((_pow2(L), _pow2(q)), []).append(b)
        self.layout = layout
        self._bucket_args = ([reqs for reqs in groups.values() if max(kv_lens[b] for b in reqs) > 0],
                             qo_start, qo_lens, kv_lens)
        self._buckets = None
        # Requests with queries but no token at all: out 0, lse -inf.
        empty = [b for reqs in groups.values() if max(kv_lens[b] for b in reqs) == 0 for b in reqs]
        rows = [t for b in empty for t in range(qo_start[b], qo_start[b + 1])]
        self.empty_rows = torch.tensor(rows, dtype=torch.int64, device=spec.device)

    @property
    def buckets(self) -> list:
        """The buckets' gather indices, built on first use: they are O(tokens) host work, so plan() stays
        O(batch) and a plan that is never run costs none of it."""
        if self._buckets is None:
            groups, qo_start, qo_lens, kv_lens = self._bucket_args
            self._buckets = [_Bucket(reqs, qo_start, qo_lens, kv_lens, self.layout, self.spec.causal,
                                     self.spec.device) for reqs in groups]
        return self._buckets

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e: bool) -> None:
        _start_run(self, ckv_cache, out, lse)
        if not self.buckets:
            return
        page_size = self.layout.page_size
        ckv_flat, kpe_flat = ckv_cache.flatten(0, 1), kpe_cache.flatten(0, 1)
        sa_flat = None if ckv_scale_arr is None else ckv_scale_arr.flatten(0, 1)
        ckv_s, kpe_s = scales.to(device=out.device, dtype=torch.float32).unbind(0)
        pages = self.layout.kv_indices.long()
        Dc = ckv_cache.shape[-1]
        joint = _joint_rows(ckv_cache, kpe_cache) if sa_flat is None else None
        for bk in self.buckets:
            R, L = bk.kv_valid.shape
            slots = (pages[bk.index] * page_size + bk.offset).reshape(-1)
            valid = bk.kv_valid.reshape(-1, 1)
            # Per-tensor scales go on the (small) queries and output rather than on every gathered value.
            out_scale = None
            if sa_flat is not None:
                qn_scale = self.spec.sm_scale
            else:
                qn_scale, out_scale = ckv_s * self.spec.sm_scale, ckv_s
            qn = q_nope[bk.qidx].float() * qn_scale                          # [R, Q, H, Dc]
            qp = q_pe[bk.qidx].float() * (kpe_s * self.spec.sm_scale)
            Q, H = qn.shape[1:3]
            # Gather first, convert second: only these tokens are converted, never the pool.
            if joint is not None:  # both parts in one gather and one score product
                kv = joint.index_select(0, slots).float()
                if bk.padded:  # padding slots may point at pages full of NaN: zero them (no 0-weight x NaN)
                    kv.masked_fill_(~valid, 0.0)
                kv = kv.view(R, L, -1)
                ckv = kv[..., :Dc]
                s = torch.matmul(torch.cat([qn, qp], dim=-1).view(R, Q * H, -1), kv.transpose(1, 2))
            else:
                ckv = ckv_flat.index_select(0, slots).float()
                kpe = kpe_flat.index_select(0, slots).float()
                if sa_flat is not None:
                    ckv = ckv * expand_group_scales(sa_flat.index_select(0, slots).float(), ckv.shape[-1])
                if bk.padded:
                    ckv.masked_fill_(~valid, 0.0)
                    kpe.masked_fill_(~valid, 0.0)
                ckv, kpe = ckv.view(R, L, -1), kpe.view(R, L, -1)
                s = (torch.matmul(qn.view(R, Q * H, -1), ckv.transpose(1, 2))
                     + torch.matmul(qp.view(R, Q * H, -1), kpe.transpose(1, 2)))
            s = s.view(R, Q, H, L)
            # every key visible to every row (decode rows of one length): no mask to apply
            visible = None if bk.sees_all and not bk.padded else bk.visible[:, :, None, :]
            o, ls = softmax_rows(s, ckv[:, None], visible, masked_values_finite=bk.sees_all)
            if out_scale is not None:
                o = o * out_scale
            rows = bk.qidx[bk.q_valid]
            out[rows] = o[bk.q_valid].to(out.dtype)
            lse[rows] = ls[bk.q_valid] if base_e else ls[bk.q_valid] * LOG2E


class InvariantTorchPlan(TorchPlan):
    """The batch-invariant mode: each request alone, its KV cut in chunks by ``kernels.split.chunk_bounds`` (its own
    length and the chunk size), each chunk's (o, lse) merged in chunk order (``kernels.split.merge_chunks``). Every
    torch op sees shapes that follow the request only (a batched or padded matmul may block its reduction by the
    batch's shape)."""

    def __init__(self, layout, spec, chunk: int):
        self.spec, self.layout, self.chunk = spec, layout, chunk
        qo_lens, kv_lens, self.max_page = _host_lengths(layout)
        self._lens, self._requests = (qo_lens, kv_lens), None
        q0, empty = 0, []
        for q, L in zip(qo_lens, kv_lens):
            if q and not L:
                empty += range(q0, q0 + q)
            q0 += q
        self.empty_rows = torch.tensor(empty, dtype=torch.int64, device=spec.device)

    @property
    def requests(self) -> list:
        """Per request with tokens: (rows [q], its tokens' slots [L] in the flat pool, q, L, chunk bounds). Built
        on first use (O(tokens) host work, as the default plan's buckets)."""
        if self._requests is None:
            layout, dev = self.layout, self.spec.device
            kvp = layout.kv_indptr.to("cpu", torch.int64).tolist()
            pages = layout.kv_indices.to("cpu", torch.int64)
            reqs, q0 = [], 0
            for b, (q, L) in enumerate(zip(*self._lens)):
                if q and L:
                    pos = torch.arange(L)
                    slots = pages[kvp[b] + pos // layout.page_size] * layout.page_size + pos % layout.page_size
                    reqs.append((torch.arange(q0, q0 + q, device=dev), slots.to(dev), q, L,
                                 chunk_bounds(L, self.chunk)))
                q0 += q
            self._requests = reqs
        return self._requests

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, scales, ckv_scale_arr, out, lse, base_e: bool) -> None:
        _start_run(self, ckv_cache, out, lse)
        ckv_flat, kpe_flat = ckv_cache.flatten(0, 1), kpe_cache.flatten(0, 1)
        sa_flat = None if ckv_scale_arr is None else ckv_scale_arr.flatten(0, 1)
        ckv_s, kpe_s = scales.to(device=out.device, dtype=torch.float32).unbind(0)
        for rows, slots, q, L, bounds in self.requests:
            qn, qp = q_nope[rows].float(), q_pe[rows].float()                       # [q, H, D]
            # query i sees positions <= L - q + i (causal) or all L
            last = (L - q + torch.arange(q, device=out.device)) if self.spec.causal else \
                torch.full((q,), L - 1, device=out.device)
            parts = []
            for s0, s1 in bounds:
                sl = slots[s0:s1]
                ckv = ckv_flat.index_select(0, sl).float()
                kpe = kpe_flat.index_select(0, sl).float() * kpe_s
                if sa_flat is not None:
                    ckv = ckv * expand_group_scales(sa_flat.index_select(0, sl).float(), ckv.shape[-1])
                else:
                    ckv = ckv * ckv_s
                s = (torch.einsum("qhd,ld->qhl", qn, ckv) + torch.einsum("qhd,ld->qhl", qp, kpe)) \
                    * self.spec.sm_scale
                pos = torch.arange(s0, s1, device=out.device)
                visible = (pos[None, :] <= last[:, None])[:, None, :]              # [q, 1, c]
                parts.append(softmax_rows(s, ckv, visible))
            o, ls = merge_chunks(parts)
            out[rows] = o.to(out.dtype)
            lse[rows] = ls if base_e else ls * LOG2E


def build(layout, spec, options: dict, state=None) -> TorchPlan:
    if options.get("batch_invariant"):
        return InvariantTorchPlan(layout, spec, options.get("invariant_chunk") or INVARIANT_CHUNK)
    return TorchPlan(layout, spec)
