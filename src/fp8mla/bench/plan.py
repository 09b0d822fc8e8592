"""``fp8mla bench plan``: the host time of ``MLAPagedAttention.plan()`` on host page tables, on the CPU or a GPU.

Each point ``BxL`` is B requests of L tokens, one query each, their pages shuffled in a pool with a few spare
pages. Tables: ``csr`` (FlashInfer's arrays, each request listing exactly its pages: what engines pass) and
``padded`` (each request lists a few pages past its kv_len, as a padded block table does: the checks mask those).
The arrays are CPU tensors (plan() validates every page id a token uses there); the plan is made for ``--device``.
What is timed is the wall clock of plan() (median of ``--reps``), no kernel. A GPU is not needed: on the CPU the
triton backend is timed when ``TRITON_INTERPRET=1`` is set (its plan is the same host work as on a GPU).
"""
from __future__ import annotations

import os
import subprocess

import torch

from ..attention import MLAPagedAttention
from ..runtime import available_backends
from .common import cpu_time_ms, environment


def add_arguments(p):
    p.add_argument("--points", default="64x8192,64x64,8x8192,512x1024",
                   help="comma-separated BxL: requests x tokens each")
    p.add_argument("--page-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--backends", nargs="+", default=["torch", "triton"])
    p.add_argument("--tables", nargs="+", choices=["csr", "padded"], default=["csr", "padded"])
    p.add_argument("--device", default="cpu", help="where the plan's tensors go (the tables stay on the host)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")


def plan_args(B: int, L: int, page: int, table: str, seed: int = 0) -> dict:
    """plan()'s arguments for B requests of L tokens (host tensors); ``padded``: 3 extra pages listed per request,
    whose ids are past the pool (the checks must skip them, as no token uses them)."""
    g = torch.Generator().manual_seed(seed)
    need = -(-L // page)
    spare = 3 if table == "padded" else 0
    pool = B * need + 7
    ids = torch.randperm(pool, generator=g, dtype=torch.int32)[: B * need].view(B, need)
    if spare:
        ids = torch.cat([ids, torch.full((B, spare), pool + 1000, dtype=torch.int32)], 1)
    i32 = dict(dtype=torch.int32)
    return dict(qo_indptr=torch.arange(B + 1, **i32), kv_indptr=torch.arange(B + 1, **i32) * (need + spare),
                kv_indices=ids.reshape(-1).contiguous(), kv_len_arr=torch.full((B,), L, **i32),
                num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=True,
                sm_scale=192 ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)


def _commit() -> str:
    """The commit of the checkout this package is imported from (n/a outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "n/a"
    except Exception:  # noqa: BLE001 - not a checkout: the record says so
        return "n/a"


def main(args) -> int:
    import sys
    if args.threads:
        torch.set_num_threads(args.threads)
    have = available_backends(args.device)
    env = dict(environment(), commit=_commit(), threads=torch.get_num_threads(), device=args.device)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    for be in args.backends:
        if be not in have:
            print(f"{be}: not available on {args.device} here ({have}; the triton backend on the CPU needs "
                  "TRITON_INTERPRET=1 before start)", file=sys.stderr)
    print(f"{'backend':8s} {'table':7s} {'page':>4s} {'B':>5s} {'L':>7s} {'ids':>8s} {'plan ms':>9s}")
    for be in (b for b in args.backends if b in have):
        for table in args.tables:
            for page in args.page_size:
                for point in args.points.split(","):
                    B, L = (int(x) for x in point.lower().split("x"))
                    a = plan_args(B, L, page, table)
                    attn = MLAPagedAttention(torch.empty(0, device=args.device), backend=be)
                    ms = cpu_time_ms(lambda: attn.plan(**a), args.reps, warmup=3)
                    print(f"{be:8s} {table:7s} {page:4d} {B:5d} {L:7d} {a['kv_indices'].numel():8d} {ms:9.3f}",
                          flush=True)
    return 0
