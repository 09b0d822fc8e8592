"""``fp8mla bench write``: quantize-on-write and gather-then-cast against the bandwidth ceilings measured in the
same run.

- quant_append: 64K new tokens (bf16 c_kv/k_pe) into shuffled slots of an FP8 / FP8-group / BF16 pool.
  Bytes = tokens x (input bytes + stored bytes + scales + slot id). Target: >= 80% of read+write BW.
- gather_dequant: B requests x L tokens from shuffled pages of an FP8 pool into a bf16 workspace.
  Bytes = tokens x (stored bytes + scales + 1152 written). Target: >= 80% of read+write BW.
The read+write ceiling is a ``copy_`` of 2 GB (bytes read + written); the read ceiling is ``torch.sum``. The
torch code paths (``PagedMLACache.write`` without Triton, the torch gather) and a whole-pool ``.to(bf16)``
(what the gather replaces) are timed beside them. CSV to ``--out``/write.csv.
"""
from __future__ import annotations

import csv
import os
import statistics

import torch

from ..cache import PagedMLACache
from ..formats import get_format
from ..gather import gather_dequant, token_slots
from .common import _events_ms, start_run, time_ms

DC, DK = 512, 64


def add_arguments(p):
    p.add_argument("--what", nargs="+", choices=["append", "gather"], default=["append", "gather"])
    p.add_argument("--tokens", type=int, default=65536, help="append: new tokens")
    p.add_argument("--kv", nargs="+", default=["fp8_e4m3", "fp8_e4m3_group", "bf16"], help="pool formats")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--pool-tokens", type=int, default=131072, help="slots in the pool (one layer)")
    p.add_argument("--gather", default="32x4096", help="gather: BxL requests x tokens")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default="bench_out", help="directory for write.csv")


def copy_gbps(device, gb: float = 2.0, reps: int = 20) -> float:
    """Read+write bandwidth: bytes read plus bytes written by a ``copy_`` of ``gb`` GB."""
    n = int(gb * 1e9) // 2
    src = torch.randn(n // 4096, 4096, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(_events_ms(lambda: dst.copy_(src), reps))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def _row(kind, name, fmt, T, nbytes, ms, copy_bw, read_bw):
    gbps = nbytes / ms / 1e6
    return dict(op=kind, kernel=name, kv=fmt, tokens=T, ms=ms, gbps=gbps, pct_copy_bw=100 * gbps / copy_bw,
                pct_read_bw=100 * gbps / read_bw)


def _print(r):
    print(f"{r['op']:8s} {r['kernel']:22s} {r['kv']:15s} T={r['tokens']:<7d} {r['ms']:8.4f} ms "
          f"{r['gbps']:7.0f} GB/s  {r['pct_copy_bw']:5.1f}% of copy BW", flush=True)


def _append_rows(args, copy_bw, read_bw, device):
    from ..kernels.quant_append import quant_append
    T, page = args.tokens, args.page
    rows = []
    for fmt_name in args.kv:
        fmt = get_format(fmt_name)
        pages = -(-max(args.pool_tokens, T) // page)
        cache = PagedMLACache(1, pages, page, fmt_name, device=device,  # scales only where the format takes them
                              ckv_scale=0.5 if fmt.scale_kind == "tensor" else 1.0,
                              kpe_scale=0.5 if fmt.is_fp8 else 1.0)
        g = torch.Generator(device=device).manual_seed(0)
        slots = torch.randperm(pages * page, device=device, generator=g)[:T]
        c_kv = torch.randn(T, DC, device=device, generator=g).to(torch.bfloat16)
        k_pe = torch.randn(T, DK, device=device, generator=g).to(torch.bfloat16)
        rows_ = cache.pool[0].view(pages * page, -1)
        scales = None if cache.scale_arr is None else cache.scale_arr[0].view(pages * page, -1)
        nbytes = T * ((DC + DK) * 2 + fmt.bytes_per_token(DC, DK) + 8)
        runners = {
            "quant_append": lambda: quant_append(rows_, scales, slots, c_kv, k_pe, fmt, cache.ckv_scale,
                                                 cache.kpe_scale),
            "torch write": lambda: cache.write(0, slots, c_kv, k_pe, use_triton=False),
        }
        for name, fn in runners.items():
            try:
                ms = time_ms(fn, reps=args.reps, cuda_graph=name == "quant_append")
            except Exception as e:  # noqa: BLE001 - record and go on
                print(f"  append {name} {fmt_name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(_row("append", name, fmt_name, T, nbytes, ms, copy_bw, read_bw))
            _print(rows[-1])
        cache = None   # (frees the memory: closures above read these names, so no del)
        torch.cuda.empty_cache()
    return rows


def _gather_rows(args, copy_bw, read_bw, device):
    from ..kernels.gather_dequant import gather_dequant_rows
    B, L = (int(x) for x in args.gather.split("x"))
    page = args.page
    rows = []
    for fmt_name in args.kv:
        fmt = get_format(fmt_name)
        pages_per = -(-L // page)
        P = max(B * pages_per, -(-args.pool_tokens // page)) + 4
        g = torch.Generator(device=device).manual_seed(1)
        pool = torch.randn(P, page, DC + DK, device=device, generator=g).to(fmt.storage_dtype)
        ckv, kpe = pool[..., :DC], pool[..., DC:]
        gs = (torch.rand(P, page, DC // 128, device=device, generator=g) + 0.5) if fmt.scale_kind == "group" \
            else None
        i32 = dict(dtype=torch.int32, device=device)
        kv_indices = torch.randperm(P, device=device, generator=g)[: B * pages_per].to(torch.int32)
        kv_indptr = torch.arange(B + 1, **i32) * pages_per
        kv_len = torch.full((B,), L, **i32)
        T = B * L
        slots, _ = token_slots(kv_indptr, kv_indices, kv_len, page, T)
        out_c = torch.empty(T, DC, device=device, dtype=torch.bfloat16)
        out_k = torch.empty(T, DK, device=device, dtype=torch.bfloat16)
        cs = 0.5 if fmt.scale_kind == "tensor" else 1.0
        ks = 0.5 if fmt.is_fp8 else 1.0
        nbytes = T * (fmt.bytes_per_token(DC, DK) + (DC + DK) * 2)
        runners = {
            "gather_dequant": lambda: gather_dequant_rows(ckv, kpe, slots, out_c, out_k, ckv_scale=cs,
                                                          kpe_scale=ks, ckv_scale_arr=gs),
            "torch gather": lambda: gather_dequant(ckv, kpe, kv_indptr, kv_indices, kv_len, ckv_scale=cs,
                                                   kpe_scale=ks, ckv_scale_arr=gs, out_ckv=out_c, out_kpe=out_k,
                                                   backend="torch"),
        }
        for name, fn in runners.items():
            try:
                ms = time_ms(fn, reps=args.reps, cuda_graph=name == "gather_dequant")
            except Exception as e:  # noqa: BLE001
                print(f"  gather {name} {fmt_name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(_row("gather", name, fmt_name, T, nbytes, ms, copy_bw, read_bw))
            _print(rows[-1])
        # what gather-then-cast replaces: converting the whole pool (P x page tokens), for scale
        ms = time_ms(lambda: pool.to(torch.bfloat16), reps=10, cuda_graph=False)
        r = _row("gather", "pool.to(bf16) [whole]", fmt_name, P * page,
                 P * page * (fmt.bytes_per_token(DC, DK) + (DC + DK) * 2), ms, copy_bw, read_bw)
        rows.append(r)
        _print(r)
        pool = ckv = kpe = None   # (frees the memory: closures above read these names, so no del)
        torch.cuda.empty_cache()
    return rows


def main(args) -> int:
    ceil = start_run("write", args.out)
    if ceil is None:
        return 2
    device = "cuda"
    cbw = copy_gbps(device)
    print(f"ceiling: read+write {cbw:.0f} GB/s (copy_ of 2 GB)")
    rows = []
    if "append" in args.what:
        rows += _append_rows(args, cbw, ceil.read_gbps, device)
    if "gather" in args.what:
        rows += _gather_rows(args, cbw, ceil.read_gbps, device)
    path = os.path.join(args.out, "write.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0 if rows else 1
