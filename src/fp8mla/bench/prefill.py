"""``fp8mla bench prefill``: paged extend (MLA over the FP8 pool) and ragged prefill against the bf16 matmul
ceiling measured in the same run.

- extend: H=128, qo_len 1024 new tokens at the end of kv_len 8192 (causal), page 64, FP8 e4m3 and BF16 pools;
  FLOPs = 2 H (576 + 512) x (tokens each query sees). Target: >= 50% of the bf16 matmul peak.
- ragged: H=128, one 4096-token causal prefill, head_dim_qk 192 / vo 128, bf16;
  FLOPs = 2 H (192 + 128) x (keys each query sees). Target: >= 45% of the bf16 matmul peak.
Each point: median of CUDA-graph replays with the L2 flushed, ms, TFLOP/s, % of the matmul ceiling, % of the
floor (max of bytes / read BW and FLOPs / matmul peak), and the relative L2 error of the last queries against
a float64 reference. ``--sweep`` times tile variants. CSV to ``--out``/prefill.csv.
"""
from __future__ import annotations

import csv
import math
import os

import torch

from ..formats import get_format
from ..reference import mla_reference
from ..testing import compare
from .common import start_run, time_ms

DC, DK = 512, 64
EXTEND_VARIANTS = {
    "default": {},
    "n16": dict(block_n=16), "n64": dict(block_n=64),
    "w4": dict(num_warps=4), "s1": dict(num_stages=1), "s3": dict(num_stages=3),
    "h32": dict(block_h=32, block_q=2), "h64q2": dict(block_h=64, block_q=2),
    "n16s3": dict(block_n=16, num_stages=3),
    "n64s2": dict(block_n=64, num_stages=2), "h16q4": dict(block_h=16, block_q=4),
}
_SPEC_KEYS = {"h": "block_h", "q": "block_q", "n": "block_n", "w": "num_warps", "s": "num_stages"}


def parse_variant(spec: str, table: dict) -> dict:
    """A variant by name from ``table`` or spelled out as tile letters and numbers, e.g. ``h64q1n32w8s2``
    (block_h, block_q, block_n, num_warps, num_stages; any subset, in any order; the rest default)."""
    import re
    if spec in table:
        return dict(table[spec])
    parts = re.fullmatch(r"(?:[hqnws]\d+)+", spec) and re.findall(r"([hqnws])(\d+)", spec)
    if not parts:
        raise ValueError(f"--variants: {spec!r} is neither one of {list(table)} nor like 'h64q1n32w8s2'")
    return {_SPEC_KEYS[k]: int(v) for k, v in parts}
RAGGED_VARIANTS = {
    "default": {},
    "m64": dict(block_m=64), "n32": dict(block_n=32), "n128": dict(block_n=128),
    "w4": dict(num_warps=4), "s2": dict(num_stages=2), "s4": dict(num_stages=4),
}


def add_arguments(p):
    p.add_argument("--what", nargs="+", choices=["extend", "ragged"], default=["extend", "ragged"])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--qo-len", type=int, default=1024, help="extend: new tokens per request")
    p.add_argument("--kv-len", type=int, default=8192, help="extend: tokens per request, new ones included")
    p.add_argument("--batch", type=int, default=1, help="extend: requests")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--kv", nargs="+", default=["fp8_e4m3", "bf16"], help="extend: pool formats")
    p.add_argument("--tokens", type=int, default=4096, help="ragged: causal prefill length")
    p.add_argument("--compare", nargs="*", default=[], help="ragged: also time torch sdpa ('torch')")
    p.add_argument("--sweep", action="store_true", help="time tile variants (all of the table, or --variants)")
    p.add_argument("--variants", nargs="+", default=None,
                   help="with --sweep: the extend/ragged variants to time, by name or spelled out like "
                        "h64q1n32w8s2 (block_h, block_q, block_n, num_warps, num_stages)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="bench_out", help="directory for prefill.csv")


def _variants(args, table: dict, ragged: bool = False) -> dict:
    if not args.sweep:
        return {"default": {}}
    if not getattr(args, "variants", None):
        return table
    out = {}
    for spec in args.variants:
        if ragged and spec not in table:
            continue  # tile spellings are extend's (block_h/block_q); ragged takes its table's names only
        out[spec] = parse_variant(spec, table)
    return out


def _visible(qo_len: int, kv_len: int) -> int:
    """Tokens seen by all queries of a causal block aligned to the end."""
    return sum(max(0, min(kv_len, kv_len - qo_len + i + 1)) for i in range(qo_len))


def _extend_rows(args, ceil, device):
    from ..kernels.extend import mla_extend
    H, Q, L, B, page = args.heads, args.qo_len, args.kv_len, args.batch, args.page
    pages_per = -(-L // page)
    rows = []
    for fmt_name in args.kv:
        fmt = get_format(fmt_name)
        g = torch.Generator(device=device).manual_seed(0)
        P = B * pages_per + 4
        pool = torch.randn(P, page, DC + DK, device=device, generator=g).to(fmt.storage_dtype)
        ckv, kpe = pool[..., :DC], pool[..., DC:]
        i32 = dict(dtype=torch.int32, device=device)
        kv_indices = torch.randperm(P, device=device, generator=g)[: B * pages_per].to(torch.int32)
        qo_indptr = torch.arange(B + 1, **i32) * Q
        kv_indptr = torch.arange(B + 1, **i32) * pages_per
        kv_len = torch.full((B,), L, **i32)
        q_nope = torch.randn(B * Q, H, DC, device=device, generator=g).to(torch.bfloat16)
        q_pe = torch.randn(B * Q, H, DK, device=device, generator=g).to(torch.bfloat16)
        out = torch.empty(B * Q, H, DC, device=device, dtype=torch.bfloat16)
        lse = torch.empty(B * Q, H, device=device)
        scales = torch.ones(2, device=device)
        sm = 1.0 / math.sqrt(192)
        flops = 2 * H * (DC + DK + DC) * B * _visible(Q, L)
        nbytes = B * L * fmt.bytes_per_token(DC, DK)
        floor = ceil.floor_ms(nbytes, flops)
        variants = _variants(args, EXTEND_VARIANTS)
        for vname, opts in variants.items():
            def fn(o=opts):
                mla_extend(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len, out, lse,
                           sm_scale=sm, causal=True, scales=scales, ckv_scale_arr=None, max_qo_len=Q,
                           fp32_dot=False, **o)
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                # the last 8 queries of request 0 against float64 (aligned to the end, as in the kernel)
                n = min(8, Q)
                ref, _ = mla_reference(q_nope[Q - n:Q], q_pe[Q - n:Q], ckv, kpe, torch.tensor([0, n], **i32),
                                       kv_indptr[:2], kv_indices, kv_len[:1], sm_scale=sm, causal=True)
                err = compare(out[Q - n:Q], ref).rel_l2
                ms = time_ms(fn, reps=args.reps)
            except Exception as e:  # noqa: BLE001 - record and go on
                print(f"  extend[{vname}] {fmt_name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            row = dict(kernel="extend" + ("" if vname == "default" else f"[{vname}]"), kv=fmt_name, H=H, B=B,
                       qo_len=Q, kv_len=L, page=page, ms=ms, tflops=flops / ms / 1e9,
                       pct_matmul=100 * flops / ms / 1e9 / ceil.matmul_tflops, gbps=nbytes / ms / 1e6,
                       pct_floor=100 * floor / ms, rel_l2=err)
            rows.append(row)
            print(f"{row['kernel']:18s} {fmt_name:9s} H{H} B{B} qo{Q} kv{L} page{page}: {ms:8.3f} ms "
                  f"{row['tflops']:6.1f} TFLOP/s {row['pct_matmul']:5.1f}% of matmul  err {err:.2e}", flush=True)
        pool = ckv = kpe = None   # (frees the memory: closures above read these names, so no del)
        torch.cuda.empty_cache()
    return rows


def _ragged_reference_tail(q, k, v, sm, n):
    """float64 causal attention of the last ``n`` queries of one request (H heads, no GQA)."""
    N = q.shape[0]
    qq, kk, vv = q[N - n:].double(), k.double(), v.double()
    s = torch.einsum("qhd,khd->hqk", qq, kk) * sm
    hidden = torch.arange(N, device=q.device)[None, :] > (N - n + torch.arange(n, device=q.device))[:, None]
    s = s.masked_fill(hidden[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


def _ragged_rows(args, ceil, device):
    from ..kernels.ragged import ragged_prefill
    H, N, Dqk, Dv = args.heads, args.tokens, 192, 128
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(N, H, Dqk, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(N, H, Dqk, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn(N, H, Dv, device=device, generator=g).to(torch.bfloat16)
    out = torch.empty(N, H, Dv, device=device, dtype=torch.bfloat16)
    lse = torch.empty(N, H, device=device)
    ind = torch.tensor([0, N], dtype=torch.int32, device=device)
    sm = Dqk ** -0.5
    flops = 2 * H * (Dqk + Dv) * N * (N + 1) // 2
    nbytes = N * H * (2 * Dqk + 2 * Dv) * 2
    floor = ceil.floor_ms(nbytes, flops)
    ref = _ragged_reference_tail(q, k, v, sm, 8)
    runners = {}
    for vname, opts in _variants(args, RAGGED_VARIANTS, ragged=True).items():
        runners["ragged" + ("" if vname == "default" else f"[{vname}]")] = (
            lambda o=opts: ragged_prefill(q, k, v, ind, ind, out, lse, sm_scale=sm, causal=True, max_qo_len=N,
                                          fp32_dot=False, **o))
    if "torch" in args.compare:
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

        def sdpa():
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=sm)
            out.copy_(o[0].transpose(0, 1))
        runners["torch sdpa"] = sdpa
    rows = []
    for name, fn in runners.items():
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = compare(out[N - 8:], ref).rel_l2
            ms = time_ms(fn, reps=args.reps)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        row = dict(kernel=name, kv="bf16", H=H, B=1, qo_len=N, kv_len=N, page=0, ms=ms, tflops=flops / ms / 1e9,
                   pct_matmul=100 * flops / ms / 1e9 / ceil.matmul_tflops, gbps=nbytes / ms / 1e6,
                   pct_floor=100 * floor / ms, rel_l2=err)
        rows.append(row)
        print(f"{name:18s} bf16      H{H} {N} tokens causal 192/128: {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s "
              f"{row['pct_matmul']:5.1f}% of matmul  err {err:.2e}", flush=True)
    return rows


def main(args) -> int:
    ceil = start_run("prefill", args.out)
    if ceil is None:
        return 2
    device = "cuda"
    rows = []
    if "extend" in args.what:
        rows += _extend_rows(args, ceil, device)
    if "ragged" in args.what:
        rows += _ragged_rows(args, ceil, device)
    path = os.path.join(args.out, "prefill.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kernel"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0 if rows else 1
