"""Helpers shared by tests, checks, benchmarks and the CLI: random paged batches built to expose indexing bugs,
and one comparison helper.

``make_paged_batch`` fills every page the batch does not use, and every slot past a request's last token, with
NaN; hands out page ids in shuffled order; and draws fresh random values. A kernel that reads a page outside
``kv_indices`` or a slot past ``kv_len`` then produces NaN, which :func:`compare` always rejects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import get_format
from .reference import mla_reference


@dataclass
class PagedBatch:
    plan_args: dict   # keyword arguments of MLAPagedAttention.plan
    run_args: dict    # keyword arguments of MLAPagedAttention.run (q_nope, q_pe, caches, scales)
    pool: torch.Tensor  # [P, page, Dc + Dk] storage; ckv_cache/kpe_cache are views of it

    def reference(self):
        """float64 ``(out, lse base 2)`` on the dequantized KV."""
        a, r = self.plan_args, self.run_args
        return mla_reference(r["q_nope"], r["q_pe"], r["ckv_cache"], r["kpe_cache"], a["qo_indptr"],
                             a["kv_indptr"], a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"],
                             causal=a["causal"], ckv_scale=1.0 if r["ckv_scale"] is None else r["ckv_scale"],
                             kpe_scale=r["kpe_scale"],
                             ckv_scale_arr=r["ckv_scale_arr"])


def make_paged_batch(kv_lens, qo_lens, num_heads: int, page_size: int, kv_format="fp8_e4m3", *,
                     head_dim_ckv: int = 512, head_dim_kpe: int = 64, q_dtype=torch.bfloat16, causal=True,
                     device="cpu", seed: int | None = None, ckv_scale: float = 1.0, kpe_scale: float = 1.0,
                     spare_pages: int = 3, value_scale: float = 1.0, sm_scale: float | None = None,
                     generator: torch.Generator | None = None, extra_pages: int = 0) -> PagedBatch:
    """A random batch over a NaN-poisoned pool with shuffled page ids.

    Values are ``value_scale * N(0, 1)``; FP8 formats store them quantized with ``ckv_scale``/``kpe_scale``
    (group format: per-token group scales). ``sm_scale`` defaults to ``1 / sqrt(192)``. ``extra_pages``: NaN
    pages listed in each request's ``kv_indices`` after the ones its ``kv_len`` needs (legal: kv_len may be less
    than pages x page_size); a kernel that counts pages from ``kv_indptr`` instead of ``kv_len`` reads them.
    """
    fmt = get_format(kv_format, arg="kv_format")
    g = generator
    if g is None:
        g = torch.Generator()
        if seed is not None:
            g.manual_seed(seed)
        else:  # a fresh seed for this generator only (torch.seed() would reseed the global RNG)
            g.seed()
    B = len(kv_lens)
    assert len(qo_lens) == B
    pages_per = [-(-L // page_size) for L in kv_lens]
    # Requests with kv_len 0 still own a page sometimes (a freshly reserved one): the kernel must ignore it.
    pages_per = [n if n else int(torch.randint(0, 2, (1,), generator=g)) for n in pages_per]
    pages_per = [n + extra_pages for n in pages_per]
    P = sum(pages_per) + spare_pages
    perm = torch.randperm(P, generator=g)
    width = head_dim_ckv + head_dim_kpe
    pool = torch.full((P, page_size, width), float("nan"), dtype=torch.float32)
    kv_indices, kv_indptr, start = [], [0], 0
    for b in range(B):
        ids = perm[start: start + pages_per[b]].tolist()
        start += pages_per[b]
        kv_indices += ids
        kv_indptr.append(len(kv_indices))
        for t in range(kv_lens[b]):
            pool[ids[t // page_size], t % page_size] = torch.randn(width, generator=g) * value_scale
    scale_arr = None
    used = ~torch.isnan(pool[..., 0])
    if fmt.scale_kind == "group":
        scale_arr = torch.full((P, page_size, fmt.num_groups(head_dim_ckv)), float("nan"))
        gs = fmt.group_scales(pool[used][:, :head_dim_ckv])
        scale_arr[used] = gs
        stored = torch.full_like(pool, float("nan")).to(fmt.storage_dtype)
        stored[used] = torch.cat([fmt.quantize_groups(pool[used][:, :head_dim_ckv], gs),
                                  fmt.quantize(pool[used][:, head_dim_ckv:], kpe_scale)], dim=-1)
        ckv_scale_used, kpe_scale_used = 1.0, kpe_scale
    elif fmt.is_fp8:
        stored = torch.cat([fmt.quantize(pool[..., :head_dim_ckv], ckv_scale),
                            fmt.quantize(pool[..., head_dim_ckv:], kpe_scale)], dim=-1)
        ckv_scale_used, kpe_scale_used = ckv_scale, kpe_scale
    else:
        stored = fmt.quantize(pool)
        ckv_scale_used = kpe_scale_used = 1.0
    stored = stored.to(device)
    n = sum(qo_lens)
    i32 = dict(dtype=torch.int32, device=device)
    plan_args = dict(
        qo_indptr=torch.tensor([0] + [sum(qo_lens[: b + 1]) for b in range(B)], **i32),
        kv_indptr=torch.tensor(kv_indptr, **i32), kv_indices=torch.tensor(kv_indices, **i32),
        kv_len_arr=torch.tensor(list(kv_lens), **i32), num_heads=num_heads, head_dim_ckv=head_dim_ckv,
        head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(192), q_data_type=q_dtype,
        kv_data_type=fmt.name)
    run_args = dict(
        q_nope=torch.randn(n, num_heads, head_dim_ckv, generator=g).to(device=device, dtype=q_dtype),
        q_pe=torch.randn(n, num_heads, head_dim_kpe, generator=g).to(device=device, dtype=q_dtype),
        ckv_cache=stored[..., :head_dim_ckv], kpe_cache=stored[..., head_dim_ckv:],
        ckv_scale=None if scale_arr is not None else ckv_scale_used, kpe_scale=kpe_scale_used,
        ckv_scale_arr=None if scale_arr is None else scale_arr.to(device))
    return PagedBatch(plan_args, run_args, stored)


@dataclass
class Comparison:
    rel_l2: float
    max_abs: float
    cos_diff: float
    worst: tuple
    nan_mismatch: int

    def ok(self, rel_l2: float) -> bool:
        return self.nan_mismatch == 0 and self.rel_l2 <= rel_l2

    def __str__(self):
        return (f"rel_l2={self.rel_l2:.3e} max_abs={self.max_abs:.3e} cos_diff={self.cos_diff:.3e} "
                f"worst at {self.worst} nan_mismatch={self.nan_mismatch}")


def compare(out: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """Relative L2, max abs error, cosine difference and the worst index; NaN/inf positions must match."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        raise ValueError(f"compare: shapes differ, out {tuple(o.shape)} vs ref {tuple(r.shape)}")
    bad = int((torch.isnan(o) != torch.isnan(r)).sum()) + int(((o == math.inf) != (r == math.inf)).sum()) \
        + int(((o == -math.inf) != (r == -math.inf)).sum())
    fin = torch.isfinite(r) & torch.isfinite(o)
    d = torch.where(fin, o - r, 0.0)
    rr = torch.where(fin, r, 0.0)
    rel = float(d.norm() / rr.norm()) if rr.norm() > 0 else float(d.norm())
    oo = torch.where(fin, o, 0.0)
    denom = float(oo.norm() * rr.norm())
    cos = 1.0 - float((oo * rr).sum()) / denom if denom > 0 else 0.0
    worst = tuple(int(i) for i in torch.unravel_index(d.abs().argmax(), d.shape)) if d.numel() else ()
    return Comparison(rel, float(d.abs().max()) if d.numel() else 0.0, cos, worst, bad)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel_l2: float, what: str = "out") -> Comparison:
    c = compare(out, ref)
    assert c.ok(rel_l2), f"{what}: {c} (limit rel_l2 {rel_l2:.1e})"
    return c


def capture_then_replay(run, out: torch.Tensor):
    """The CUDA-graph check of a planned attention (GPU only): ``run()`` once with plain launches (compiles),
    captured in a CUDA graph, ``out`` poisoned with NaN, the graph replayed and synchronized. Returns the graph, to
    replay again after a re-plan into the same buffers."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    return graph


@dataclass
class SparseBatch:
    plan_args: dict   # keyword arguments of MLASparseAttention.plan
    run_args: dict    # keyword arguments of MLASparseAttention.run (q_nope, q_pe, kv_cache, indices, scales)

    def reference(self):
        """float64 ``(out, lse base 2)`` on the dequantized KV."""
        from .reference import sparse_mla_reference
        a, r = self.plan_args, self.run_args
        return sparse_mla_reference(r["q_nope"], r["q_pe"], r["kv_cache"], r["indices"], sm_scale=a["sm_scale"],
                                    kv_format=a["kv_data_type"], page_size=a["page_size"],
                                    ckv_scale=r.get("ckv_scale") or 1.0, kpe_scale=r.get("kpe_scale") or 1.0,
                                    ckv_scale_arr=r.get("ckv_scale_arr"))


def make_sparse_batch(kv_lens, qo_lens, num_heads: int, topk: int, page_size: int, kv_format="fp8_e4m3", *,
                      selected=None, pad: str = "scattered", q_dtype=torch.bfloat16, device="cpu",
                      seed: int | None = None, ckv_scale: float = 1.0, kpe_scale: float = 1.0,
                      sm_scale: float | None = None) -> SparseBatch:
    """A random sparse batch: request ``b`` holds ``kv_lens[b]`` tokens in shuffled pages of a pool whose unused
    slots are NaN (records: all-ones bytes, NaN in every field); each of its ``qo_lens[b]`` query tokens selects
    ``selected(b, i)`` of them (default: a random count in [0, min(kv_len, topk)]), in random order, placed at
    random positions of its index row (``pad="scattered"``) or first (``"trailing"``: -1 after them).
    """
    fmt = get_format(kv_format, arg="kv_format", sparse_ok=True)
    record = fmt.scale_kind == "record"
    g = torch.Generator()
    if seed is not None:
        g.manual_seed(seed)
    else:
        g.seed()
    dense = make_paged_batch(kv_lens, qo_lens, num_heads, page_size, "bf16" if record else fmt, q_dtype=q_dtype,
                             device="cpu", generator=g, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    pa, ra = dense.plan_args, dense.run_args
    pool = dense.pool
    if record:
        used = ~torch.isnan(pool[..., 0].float())
        rec = torch.full((*pool.shape[:2], 656), 0xFF, dtype=torch.uint8)
        rec[used] = fmt.pack(pool[used][:, :512], pool[used][:, 512:])
        pool = rec
    pages, ind = pa["kv_indices"].tolist(), pa["kv_indptr"].tolist()
    rows = []
    for b, L in enumerate(kv_lens):
        slots = [pages[ind[b] + t // page_size] * page_size + t % page_size for t in range(L)]
        for i in range(qo_lens[b]):
            k = selected(b, i) if selected is not None else int(torch.randint(0, min(L, topk) + 1, (1,),
                                                                             generator=g))
            pick = [slots[j] for j in torch.randperm(L, generator=g)[:k].tolist()]
            row = [-1] * topk
            where = torch.randperm(topk, generator=g)[:k].tolist() if pad == "scattered" else range(k)
            for j, s in zip(where, pick):
                row[j] = s
            rows.append(row)
    indices = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), topk)
    plan_args = dict(num_heads=num_heads, topk=topk, page_size=page_size,
                     sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(576), q_data_type=q_dtype,
                     kv_data_type=fmt.name, num_pages=pool.shape[0], device=device)
    run_args = dict(q_nope=ra["q_nope"].to(device), q_pe=ra["q_pe"].to(device), kv_cache=pool.to(device),
                    indices=indices.to(device))
    if fmt.scale_kind == "group":
        run_args.update(ckv_scale_arr=ra["ckv_scale_arr"].to(device), kpe_scale=kpe_scale)
    elif fmt.scale_kind == "tensor":
        run_args.update(ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    return SparseBatch(plan_args, run_args)
