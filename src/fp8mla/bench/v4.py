"""``fp8mla bench decode --v4``: DeepSeek V4 decode (window + compressed rows + sinks) against the ceilings of the
same run.

Each request holds ``L`` cached tokens in the window pool and ``L // 4`` compressed rows (a CSA layer's ratio) in
the compressed pool, pages shuffled; its one decode token attends to its last ``--window`` tokens and to
``--compressed-topk`` distinct compressed rows picked at random (what the indexer hands over). The floor counts
what the kernel must read and compute: bytes = n x (window + topk) x bytes a token (584 for ``fp8_v4``), FLOPs =
2 x n x H x (window + topk) x (512 + 512), floor = max(bytes / read BW, FLOPs / bf16 matmul peak). Timed:
``backend="auto"``'s pick (the Gluon build on Hopper for bf16 queries, else the Triton kernel), checked against the
float64 reference on a few requests; with ``--compare flashmla``, FlashMLA's sparse decode from vLLM's ops beside it
on the formats its Hopper build reads (``fp8mla.bench.flashmla.v4_runner``: ``fp8_v4``), skipped by name elsewhere.
"""
from __future__ import annotations

import csv
import math
import os

import torch

from ..formats_v4 import get_v4_format

D = 512


def v4_cost(n: int, num_heads: int, keys: int, kv_format) -> tuple[int, int]:
    """``(bytes, flops)`` of ``n`` query tokens over ``keys`` gathered rows each: the rows (scales included) and
    the two products (q.k and p.v over 512 values)."""
    fmt = get_v4_format(kv_format)
    return n * keys * fmt.token_bytes, 2 * n * num_heads * keys * (D + D)


def invariant_attention(plan_args: dict, backend: str = "auto"):
    """``--batch-invariant``: ``V4SparseAttention(batch_invariant=True)`` planned for one grid point, timed beside
    the default (its row before the default's)."""
    from ..v4 import V4SparseAttention
    attn = V4SparseAttention(backend=backend, batch_invariant=True)
    attn.plan(**plan_args)
    return attn


def _segment_pool(B, L, page, fmt, device, g):
    """A pool holding ``L`` rows per request on shuffled pages, and each request's slots ``[B, L]``."""
    pages_per = -(-L // page)
    P = B * pages_per + 8
    pool = fmt.new_pool(P, page, device)
    perm = torch.randperm(P, device=device, generator=g)[: B * pages_per].reshape(B, pages_per)
    t = torch.arange(L, device=device)
    slots = (perm[:, t // page].long() * page + t % page)  # [B, L]
    from ..v4 import write_v4_pool
    write_v4_pool(fmt, pool, slots.reshape(-1), torch.randn(B * L, D, device=device, generator=g))
    return pool, slots


def _print_row(row: dict) -> None:
    print(f"{row['kernel']:20s} {row['kv']:8s} H{row['H']:<3d} B{row['B']:<3d} L{row['L']:<6d} "
          f"window{row['window']:<4d} topk{row['topk']:<5d} page{row['page']:<3d} splits {row['splits']:<3d} "
          f"{row['ms']:8.4f} ms "
          f"{row['gbps']:7.0f} GB/s {row['tflops']:6.1f} TFLOP/s {row['pct_floor']:5.1f}% floor  "
          f"err {row['rel_l2']:.2e}", flush=True)


def _flashmla_row(kv_format, window, w_idx, comp, c_idx, sinks, sm_scale, q, ref, m, reps):
    """(ms, rel_l2) of FlashMLA's sparse decode on the same inputs (``fp8mla.bench.flashmla.v4_runner``), or None
    with the reason printed (ops missing, a format its Hopper build does not read, a launch it refuses)."""
    from ..testing import compare
    from . import flashmla
    from .common import time_ms
    from .decode import _why
    ops = flashmla.load_ops()
    try:
        if kv_format not in flashmla.V4_FORMATS_ON_SM90:   # named before the ops are looked for
            raise ValueError(f"kv_format {kv_format!r}: FlashMLA's Hopper sparse decode reads "
                             f"{flashmla.V4_FORMATS_ON_SM90} (V4's 584-byte record) only")
        if isinstance(ops, str):
            raise RuntimeError(ops)
        out = torch.full_like(q, float("nan"))
        run = flashmla.v4_runner(ops, kv_format, window, w_idx, comp, c_idx, sinks, sm_scale, q, out)
        run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - record and go on
        print(f"  flashmla v4 {kv_format}: skipped: {_why(e)}", flush=True)
        return None
    return time_ms(run, reps=reps), compare(out[:m], ref).rel_l2


def main(args) -> int:
    from ..reference import v4_attention_reference
    from ..testing import compare
    from ..v4 import V4SparseAttention
    from .common import start_run, time_ms

    ceil = start_run("decode_v4", args.out)
    if ceil is None:
        return 2
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    W, K = args.window, args.compressed_topk
    sm_scale = 1.0 / math.sqrt(D)
    rows = []
    for H in args.heads:
        for page in args.pages:
            for name in args.v4_kv:
                fmt = get_v4_format(name)
                for B, L in shapes:
                    if L < W or L // 4 < K:
                        print(f"  skip B{B} L{L}: fewer than window {W} tokens or compressed topk {K} rows")
                        continue
                    window, w_slots = _segment_pool(B, L, page, fmt, device, g)
                    comp, c_slots = _segment_pool(B, L // 4, page, fmt, device, g)
                    w_idx = w_slots[:, L - W:].to(torch.int32).contiguous()
                    pick = torch.rand(B, L // 4, device=device, generator=g).argsort(dim=1)[:, :K]
                    c_idx = torch.gather(c_slots, 1, pick).to(torch.int32)
                    q = torch.randn(B, H, D, device=device, dtype=torch.bfloat16)
                    sinks = torch.randn(H, device=device)
                    out = torch.empty(B, H, D, device=device, dtype=torch.bfloat16)
                    lse = torch.empty(B, H, device=device)
                    attn = V4SparseAttention(backend="auto")
                    attn.plan(H, sm_scale, torch.bfloat16, name, window_topk=W, window_page_size=page,
                              compressed_topk=K, compressed_page_size=page)

                    def run():
                        return attn.run(q, window, w_idx, compressed_pool=comp, compressed_indices=c_idx,
                                        sinks=sinks, out=out, lse=lse)

                    out.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    m = min(B, args.err_requests)
                    ref, _ = v4_attention_reference(q[:m], window, w_idx[:m], sm_scale=sm_scale, kv_format=name,
                                                    window_page_size=page, compressed_pool=comp,
                                                    compressed_indices=c_idx[:m], compressed_page_size=page,
                                                    sinks=sinks)
                    err = compare(out[:m], ref).rel_l2
                    ms = time_ms(run, reps=args.reps)
                    nbytes, flops = v4_cost(B, H, W + K, fmt)
                    floor = ceil.floor_ms(nbytes, flops)
                    if getattr(args, "batch_invariant", False):   # the batch-invariant mode: its row first
                        inv = invariant_attention(dict(num_heads=H, sm_scale=sm_scale, q_data_type=torch.bfloat16,
                                                       kv_format=name, window_topk=W, window_page_size=page,
                                                       compressed_topk=K, compressed_page_size=page))
                        run_inv = lambda: inv.run(q, window, w_idx, compressed_pool=comp,  # noqa: E731
                                                  compressed_indices=c_idx, sinks=sinks, out=out, lse=lse)
                        out.fill_(float("nan"))
                        run_inv()
                        torch.cuda.synchronize()
                        inv_err = compare(out[:m], ref).rel_l2
                        inv_ms = time_ms(run_inv, reps=args.reps)
                        rows.append(dict(kernel=f"fp8mla v4 [{inv.backend},invariant]", kv=name, H=H, B=B, L=L,
                                         window=W, topk=K, page=page, splits=inv.splits_for(B), ms=inv_ms,
                                         gbps=nbytes / inv_ms / 1e6, tflops=flops / inv_ms / 1e9,
                                         pct_floor=100 * floor / inv_ms, floor_ms=floor, rel_l2=inv_err))
                        print(f"fp8mla v4 [{inv.backend},invariant] {name} H{H} B{B} L{L} splits "
                              f"{rows[-1]['splits']} {inv_ms:8.4f} ms {rows[-1]['gbps']:7.0f} GB/s "
                              f"{rows[-1]['pct_floor']:5.1f}% floor  err {inv_err:.2e}", flush=True)
                    label = f"fp8mla v4 [{attn.backend}]"
                    row = dict(kernel=label, kv=name, H=H, B=B, L=L, window=W, topk=K, page=page,
                               splits=attn.splits_for(B), ms=ms, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9,
                               pct_floor=100 * floor / ms, floor_ms=floor, rel_l2=err)
                    rows.append(row)
                    _print_row(row)
                    if "flashmla" in getattr(args, "compare", []):
                        fm = _flashmla_row(name, window, w_idx, comp, c_idx, sinks, sm_scale, q, ref, m,
                                           args.reps)
                        if fm is not None:
                            fm_ms, fm_err = fm
                            rows.append(dict(row, kernel="flashmla v4 (sm90)", splits=0, ms=fm_ms,
                                             gbps=nbytes / fm_ms / 1e6, tflops=flops / fm_ms / 1e9,
                                             pct_floor=100 * floor / fm_ms, rel_l2=fm_err))
                            _print_row(rows[-1])
                    window = comp = None   # (frees the memory: closures above read these names, so no del)
                    torch.cuda.empty_cache()
    path = os.path.join(args.out, "decode_v4.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kernel"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0
