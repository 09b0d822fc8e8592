"""``fp8mla bench decode --sparse --topk 2048``: sparse (DSA) MLA decode against the ceilings of the same run.

Each request holds ``L`` cached tokens (shuffled pages); its one decode token selects ``topk`` distinct ones at
random (what an indexer hands over). The floor counts what the kernel must read and compute:
bytes = n x topk x record bytes (656 for ``fp8_ds_mla``), FLOPs = 2 x n x H x topk x (576 + 512), floor =
max(bytes / read BW, FLOPs / bf16 matmul peak). Timed: ``backend="auto"``'s pick (the Gluon build on Hopper) and
the Triton kernel (rows ``fp8mla sparse [gluon]`` / ``[triton]``). The dense decode over the same requests (all
``L`` tokens, in the same format where the dense kernel reads it, else per-tensor e4m3) is timed beside it for
comparison.
"""
from __future__ import annotations

import csv
import math
import os

import torch

from ..formats import get_format

DC, DK = 512, 64


def sparse_cost(n: int, num_heads: int, topk: int, kv_format) -> tuple[int, int]:
    """``(bytes, flops)`` of ``n`` query tokens over ``topk`` selected tokens each: the gathered records and the
    two products (q.k over 576 dims, p.v over 512)."""
    fmt = get_format(kv_format, sparse_ok=True)
    return n * topk * fmt.bytes_per_token(DC, DK), 2 * n * num_heads * topk * (DC + DK + DC)


def _pool(B, L, page, fmt, device, g):
    """``kv_cache`` (records or c_kv | k_pe rows), the flat slots of each request's tokens, run kwargs."""
    pages_per = -(-L // page)
    P = B * pages_per + 8
    perm = torch.randperm(P, device=device, generator=g)[: B * pages_per].reshape(B, pages_per)
    vals = torch.randn(P * page, DC + DK, device=device, generator=g)
    if fmt.scale_kind == "record":
        kv = fmt.pack(vals[:, :DC], vals[:, DC:]).reshape(P, page, -1)
        extra = {}
    else:
        kv = vals.clamp(-fmt.max_value, fmt.max_value).to(fmt.storage_dtype).reshape(P, page, -1)
        extra = {}
        if fmt.is_fp8:
            extra = dict(kpe_scale=1.0, **(dict(ckv_scale_arr=torch.ones(P, page, 4, device=device))
                                            if fmt.scale_kind == "group" else dict(ckv_scale=1.0)))
    t = torch.arange(L, device=device)
    slots = perm[:, t // page].long() * page + t % page  # [B, L]
    return kv, slots, perm, extra


def _last_compiled(backend: str):
    """The last launch's compiled kernel of the backend (registers / spills for the log); None for torch."""
    if backend == "gluon":
        from ..kernels.sm90 import sparse as mod
    elif backend == "triton":
        from ..kernels import sparse_decode as mod
    else:
        return None
    return mod.LAST_COMPILED


def main(args) -> int:
    from ..attention import MLAPagedAttention
    from ..reference import sparse_mla_reference
    from ..sparse import MLASparseAttention
    from ..testing import compare
    from .common import start_run, time_ms

    ceil = start_run("decode_sparse", args.out)
    if ceil is None:
        return 2
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    kv_names = args.sparse_kv
    rows = []
    for H in args.heads:
        for page in args.pages:
            for name in kv_names:
                fmt = get_format(name, sparse_ok=True)
                for B, L in shapes:
                    if L < args.topk:
                        print(f"  skip B{B} L{L}: fewer cached tokens than topk {args.topk}")
                        continue
                    kv, slots, perm, extra = _pool(B, L, page, fmt, device, g)
                    pick = torch.rand(B, L, device=device, generator=g).argsort(dim=1)[:, : args.topk]
                    indices = torch.gather(slots, 1, pick).to(torch.int32)
                    q_nope = torch.randn(B, H, DC, device=device, dtype=torch.bfloat16)
                    q_pe = torch.randn(B, H, DK, device=device, dtype=torch.bfloat16)
                    out = torch.empty(B, H, DC, device=device, dtype=torch.bfloat16)
                    lse = torch.empty(B, H, device=device)
                    m = min(B, args.err_requests)
                    ref, _ = sparse_mla_reference(q_nope[:m], q_pe[:m], kv, indices[:m], sm_scale=1.0 / math.sqrt(576),
                                                  kv_format=fmt.name, page_size=page,
                                                  ckv_scale_arr=extra.get("ckv_scale_arr"))
                    nbytes, flops = sparse_cost(B, H, args.topk, fmt)
                    floor = ceil.floor_ms(nbytes, flops)
                    # auto's pick (the Gluon build on Hopper for the plans it takes), then the portable Triton
                    # kernel unless that was the pick
                    attns = []
                    modes = [("auto", False), ("triton", False)]
                    if getattr(args, "batch_invariant", False):
                        modes.append(("triton", True))
                    for requested, invariant in modes:
                        attn = MLASparseAttention(backend=requested, batch_invariant=invariant)
                        attn.plan(H, args.topk, page, 1.0 / math.sqrt(576), torch.bfloat16, fmt.name,
                                  num_pages=kv.shape[0])
                        if invariant or attn.backend not in [a.backend for a in attns if not a.batch_invariant]:
                            attns.append(attn)
                    timed = [(f"fp8mla sparse [{a.backend}{',invariant' if a.batch_invariant else ''}]", a,
                              lambda a=a: a.run(q_nope, q_pe, kv, indices, out=out, lse=lse, **extra))  # noqa: E731
                             for a in attns]
                    if "flashmla" in getattr(args, "compare", []):
                        fm = _flashmla_row(H, kv, indices, q_nope, q_pe, out, f"{fmt.name} H{H} B{B} page{page}")
                        timed += [("flashmla sparse", None, fm)] if fm is not None else []
                    for name, attn, run in timed:
                        out.fill_(float("nan"))
                        run()
                        torch.cuda.synchronize()
                        err = compare(out[:m], ref).rel_l2
                        ms = time_ms(run, reps=args.reps)
                        ck = _last_compiled(attn.backend) if attn is not None else None
                        res = f"regs {ck.n_regs} spills {ck.n_spills}" if hasattr(ck, "n_regs") else ""
                        row = dict(kernel=name, kv=fmt.name, H=H, B=B, L=L, topk=args.topk, page=page,
                                   splits=attn.splits_for(B) if attn is not None else 0, ms=ms, gbps=nbytes / ms / 1e6,
                                   tflops=flops / ms / 1e9, pct_floor=100 * floor / ms, floor_ms=floor, rel_l2=err)
                        rows.append(row)
                        print(f"{name:24s} {fmt.name:10s} H{H:<3d} B{B:<3d} L{L:<6d} topk{args.topk:<5d} "
                              f"page{page:<3d} splits {row['splits']:<3d} {ms:8.4f} ms {row['gbps']:7.0f} GB/s "
                              f"{row['tflops']:6.1f} TFLOP/s {row['pct_floor']:5.1f}% floor  err {err:.2e} {res}",
                              flush=True)
                    rows.append(_dense_row(MLAPagedAttention, ceil, time_ms, kv, perm, fmt, B, L, H, page, q_nope,
                                           q_pe, out, lse, extra, args.reps))
                    kv = None   # (frees the memory: closures above read these names, so no del)
                    torch.cuda.empty_cache()
    path = os.path.join(args.out, "decode_sparse.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kernel"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


def _flashmla_row(H, kv, indices, q_nope, q_pe, out, where: str):
    """FlashMLA's sparse decode over the same records (``fp8mla.bench.flashmla``), or None with the reason."""
    from . import flashmla
    ops = flashmla.load_ops()
    try:
        if isinstance(ops, str):
            raise RuntimeError(ops)
        return flashmla.sparse_runner(ops, H, kv, indices, 1.0 / math.sqrt(576), q_nope, q_pe, out)
    except Exception as e:  # noqa: BLE001 - record and go on
        print(f"  flashmla sparse {where}: skipped: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              flush=True)
        return None


def _dense_row(MLAPagedAttention, ceil, time_ms, kv, perm, fmt, B, L, H, page, q_nope, q_pe, out, lse, extra, reps):
    """The dense decode over the same requests (every one of the L tokens): the comparison point."""
    dense_fmt = fmt if fmt.scale_kind != "record" else get_format("fp8_e4m3")
    if fmt.scale_kind == "record":  # the dense kernels do not read records: the same values as per-tensor e4m3
        c, k = fmt.unpack(kv.reshape(-1, kv.shape[-1]))
        pool = torch.cat([c, k], dim=-1).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(*kv.shape[:2], -1)
        extra = dict(ckv_scale=1.0, kpe_scale=1.0)
    else:
        pool = kv
    i32 = dict(dtype=torch.int32, device=kv.device)
    pages_per = perm.shape[1]
    attn = MLAPagedAttention(backend="auto")
    attn.plan(torch.arange(B + 1, **i32), torch.arange(B + 1, **i32) * pages_per, perm.reshape(-1).to(torch.int32),
              torch.full((B,), L, **i32), H, DC, DK, page, True, 1.0 / math.sqrt(576), torch.bfloat16, dense_fmt.name)
    ckv, kpe = pool[..., :DC], pool[..., DC:]
    ms = time_ms(lambda: attn.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, **extra), reps=reps)
    nbytes = B * L * dense_fmt.bytes_per_token(DC, DK)
    flops = 2 * B * H * L * (DC + DK + DC)
    floor = ceil.floor_ms(nbytes, flops)
    print(f"fp8mla dense   {dense_fmt.name:10s} H{H:<3d} B{B:<3d} L{L:<6d} (all tokens) page{page:<3d} {ms:8.4f} ms "
          f"{nbytes / ms / 1e6:7.0f} GB/s {100 * floor / ms:5.1f}% floor", flush=True)
    return dict(kernel="fp8mla dense", kv=dense_fmt.name, H=H, B=B, L=L, topk=L, page=page, splits=0, ms=ms,
                gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9, pct_floor=100 * floor / ms, floor_ms=floor,
                rel_l2=float("nan"))
