"""The many-heads prototype on one H200: float64 checks, then CUDA-graph timings beside the current fp8mla Gluon
kernel and FlashInfer fa3 on a BF16 pool, with the read-bandwidth and bf16 matmul ceilings of the same process.

    PYTHONPATH=$PWD/src python3 lab/many_heads/check_device.py            # on the GPU; JSON to $OUT
    PYTHONPATH=$PWD/src python3 lab/many_heads/check_device.py --dry-run  # on a CPU: what can run there
    ... --builds best,conv2,conv2s   # only these builds (checks and timings), beside the product (and fa3)

Fails soft: a case that does not compile or is wrong is reported and the rest still runs; the JSON is rewritten
after every step. The dry run checks the float64 reference (against an independent form of the same sum), that the
checker catches a wrong output, the launcher's argument checks, the merge kernel (Triton interpreter) and a float
model of the prototype's numerics against the reference (its rel L2 predicts the kernel's).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

if "--dry-run" in sys.argv:   # the merge kernel runs under Triton's interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel as mh  # noqa: E402 - after the interpreter switch

DC, DK, PAGE = 512, 64, 64
SM_SCALE = 1.0 / math.sqrt(192)
RESULTS: dict = {"checks": [], "timings": [], "errors": [], "env": {}}


def log(msg):
    print(msg, flush=True)


def save(out_dir):
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "many_heads.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


# -- inputs ---------------------------------------------------------------------------------------------------
def make_case(lens, H, *, device, seed, vmag=1.0, qmag=1.0, extra_pages=5, nan=True):
    """A paged FP8 pool with NaN in every unused page and in every slot past kv_len, page order shuffled.
    Returns a dict of tensors (pool [P, 64, 576] e4m3, q_nope/q_pe bf16, kv_indptr/kv_indices/kv_len int32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    B = len(lens)
    npages = [-(-L // PAGE) for L in lens]
    P = sum(npages) + extra_pages
    data = (torch.randn(P, PAGE, DC + DK, generator=g, device=device) * vmag).to(torch.float8_e4m3fn)
    kv_indices = torch.randperm(P, generator=g, device=device)[: sum(npages)].to(torch.int32)
    if nan:   # e4m3fn NaN (0x7f) everywhere, then each request's first kv_len rows from data
        vals = torch.full((P, PAGE, DC + DK), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        pos = 0
        for L, n in zip(lens, npages):
            pg = kv_indices[pos:pos + n].long()
            used = torch.arange(n * PAGE, device=device).view(n, PAGE) < L
            vals.view(torch.uint8)[pg] = torch.where(used[..., None], data.view(torch.uint8)[pg],
                                                     vals.view(torch.uint8)[pg])
            pos += n
    else:     # timing pools: every slot a number
        vals = data
    kv_indptr = torch.tensor([0] + list(torch.tensor(npages).cumsum(0).tolist()), dtype=torch.int32)
    q_nope = (torch.randn(B, H, DC, generator=g, device=device) * qmag).to(torch.bfloat16)
    q_pe = (torch.randn(B, H, DK, generator=g, device=device) * qmag).to(torch.bfloat16)
    d = dict(pool=vals, q_nope=q_nope, q_pe=q_pe, kv_indptr=kv_indptr, kv_indices=kv_indices,
             kv_len=torch.tensor(lens, dtype=torch.int32))
    return {k: v.to(device) for k, v in d.items()}


def views(pool):
    return pool[..., :DC], pool[..., DC:]


# -- float64 reference and the checker --------------------------------------------------------------------------
def reference(c, *, ckv_scale, kpe_scale, sm_scale=SM_SCALE):
    """Float64 attention of each request over its pages' first kv_len rows: (out [B, H, 512], lse [B, H] base 2;
    an empty request: 0 and -inf)."""
    pool, qn, qp = c["pool"], c["q_nope"].double(), c["q_pe"].double()
    B, H, _ = qn.shape
    out = torch.zeros(B, H, DC, dtype=torch.float64, device=pool.device)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64, device=pool.device)
    ip, idx, lens = c["kv_indptr"].tolist(), c["kv_indices"].long(), c["kv_len"].tolist()
    for b in range(B):
        L = lens[b]
        if L == 0:
            continue
        rows = pool[idx[ip[b]:ip[b + 1]]].reshape(-1, DC + DK)[:L].float().double()   # (fp8 -> fp32 is exact)
        ckv, kpe = rows[:, :DC] * ckv_scale, rows[:, DC:] * kpe_scale
        s = (qn[b] @ ckv.T + qp[b] @ kpe.T) * sm_scale
        m = s.max(dim=1, keepdim=True).values
        p = torch.exp(s - m)
        out[b] = (p @ ckv) / p.sum(1, keepdim=True)
        lse[b] = (m[:, 0] + torch.log(p.sum(1))) / math.log(2.0)
    return out, lse


def check_output(out, lse, ref_out, ref_lse, lens, *, tol=3e-3):
    """Relative L2 of out (<= tol) and of lse (<= 2e-4, as the product's tests) over the non-empty requests, the
    empty ones exactly 0 / -inf, no NaN. Returns (ok, facts)."""
    o, r = out.double().cpu(), ref_out.cpu()
    ls, rl = lse.double().cpu(), ref_lse.cpu()
    live = torch.tensor([L > 0 for L in lens])
    facts = {"nan_out": int(torch.isnan(o).sum()), "nan_lse": int(torch.isnan(ls).sum())}
    if live.any():
        d = (o[live] - r[live]).norm() / r[live].norm()
        facts["rel_l2"] = float(d)
        facts["lse_max_abs"] = float((ls[live] - rl[live]).abs().max())
        facts["lse_rel_l2"] = float((ls[live] - rl[live]).norm() / rl[live].norm().clamp_min(1e-30))
    else:
        facts["rel_l2"], facts["lse_max_abs"], facts["lse_rel_l2"] = 0.0, 0.0, 0.0
    if (~live).any():
        facts["empty_ok"] = bool((o[~live] == 0).all() and (ls[~live] == -math.inf).all())
    else:
        facts["empty_ok"] = True
    if live.any():   # where the error sits (for a remote diagnosis): per request, head group, output half
        d = (o - r).nan_to_num(1e30).abs()
        w = int(d.flatten().argmax())
        H = o.shape[1]
        facts["worst"] = {"request": w // (H * DC), "head": (w // DC) % H, "col": w % DC,
                          "abs": float(d.flatten()[w])}
        facts["rel_l2_by_request"] = [float((o[b] - r[b]).norm() / r[b].norm()) if lens[b] else 0.0
                                      for b in range(len(lens))]
        facts["rel_l2_by_heads64"] = [float((o[live, g:g + 64] - r[live, g:g + 64]).norm()
                                            / r[live, g:g + 64].norm()) for g in range(0, H, 64)]
        facts["rel_l2_by_cols256"] = [float((o[live, :, c:c + 256] - r[live, :, c:c + 256]).norm()
                                            / r[live, :, c:c + 256].norm()) for c in (0, 256)]
    ok = (facts["nan_out"] == 0 and facts["nan_lse"] == 0 and facts["rel_l2"] <= tol
          and facts["lse_rel_l2"] <= 2e-4 and facts["empty_ok"])
    return ok, facts


# -- the GPU checks -----------------------------------------------------------------------------------------------
CHECKS = [
    # name, heads, request lengths, splits (None: the launcher's pick), value / query magnitudes, scales
    ("odd lengths H128 auto splits", 128, [0, 1, 63, 64, 65, 4097, 127, 1000], None, 1.0, 1.0, 0.05, 0.02),
    ("odd lengths H64 auto splits", 64, [0, 1, 63, 64, 65, 4097, 127, 1000], None, 1.0, 1.0, 0.05, 0.02),
    ("odd lengths H128 whole requests", 128, [65, 0, 4097, 1, 63], 1, 1.0, 1.0, 1.0, 1.0),
    ("odd lengths H64 whole requests", 64, [65, 0, 4097, 1, 63], 1, 1.0, 1.0, 1.0, 1.0),
    ("H128 3 splits (empty splits)", 128, [1, 130, 129, 200], 3, 4.0, 1.0, 0.05, 0.02),
    ("H64 7 splits", 64, [4097, 65, 1], 7, 1.0, 1.0, 1.0, 1.0),
    ("H128 B1 L32k many splits", 128, [32768 - 5], 66, 1.0, 1.0, 1.0, 1.0),
    ("H128 large queries", 128, [777, 64], None, 1.0, 300.0, 0.05, 0.02),
    ("H64 small queries", 64, [777, 64], None, 1.0, 1e-3, 1.0, 1.0),
    ("H128 all empty", 128, [0, 0, 0], None, 1.0, 1.0, 1.0, 1.0),
]


BUILDS = {"prototype": dict(owner=False), "prototype owner": dict(owner=True),   # name: decode() options
          # the next tile's conversion under this tile's softmax and P.V (per-chunk release); regs 224: the
          # converter gets 56 registers (no spill with the per-chunk waits)
          "owner release": dict(owner=True, release=True, regs=224),
          # ... and two chunks per converter fence + barrier round
          "owner release pair": dict(owner=True, release=True, pair=True, regs=224),
          # two converter warpgroups in parallel (A: 8, (0, 1), (2, 3) + the TMA; B: (4, 5), (6, 7)); 16 warps:
          # consumers 208, each converter 48 registers (224 / 32 and 216 / 40 spill in the converters)
          "conv2": dict(owner=True, release=True, pair=True, conv2=True, regs=208),
          # ... with one chunk per round (A: 8, 0, 1, 2, 3; B: 4, 5, 6, 7): no chunk waits for its neighbour's release
          "conv2 single": dict(owner=True, release=True, pair=True, conv2=True, conv2_chunks=1, regs=208)}
BUILD_ALIASES = {"prototype": "prototype", "owner": "prototype owner", "release": "owner release",
                 "pair": "owner release pair", "best": "owner release pair", "conv2": "conv2",
                 "conv2s": "conv2 single"}


def select_builds(spec):
    """--builds: comma-separated names or aliases (best = the owner release pair build); keeps BUILDS' order."""
    want = set()
    for w in (x.strip() for x in spec.split(",") if x.strip()):
        name = BUILD_ALIASES.get(w, w)
        if name not in BUILDS:
            raise SystemExit(f"--builds: expected names from {sorted(set(BUILD_ALIASES) | set(BUILDS))}, got {w!r}")
        want.add(name)
    for name in list(BUILDS):
        if name not in want:
            del BUILDS[name]


def run_checks(device, seed0=1000):
    for build, bopts in BUILDS.items():
        run_checks_build(device, build, bopts, seed0)


def run_checks_build(device, build, bopts, seed0):
    for k, (name, H, lens, splits, vmag, qmag, sc, sk) in enumerate(CHECKS):
        name = f"{build}: {name}"
        rec = {"name": name, "build": build, "H": H, "lens": lens, "splits": splits}
        try:
            c = make_case(lens, H, device=device, seed=seed0 + k, vmag=vmag, qmag=qmag)
            ckv, kpe = views(c["pool"])
            ref_o, ref_l = reference(c, ckv_scale=sc, kpe_scale=sk)
            B = len(lens)
            out = torch.full((B, H, DC), float("nan"), dtype=torch.bfloat16, device=device)   # poisoned
            lse = torch.full((B, H), float("nan"), dtype=torch.float32, device=device)
            args = (c["q_nope"], c["q_pe"], ckv, kpe, c["kv_indptr"], c["kv_indices"], c["kv_len"])
            kw = dict(sm_scale=SM_SCALE, ckv_scale=sc, kpe_scale=sk, num_splits=splits, **bopts)
            mh.decode(*args, out=out, lse=lse, **kw)
            torch.cuda.synchronize()
            ok, facts = check_output(out, lse, ref_o, ref_l, lens)
            o2, l2 = mh.decode(*args, **kw)   # a rerun: bit-identical
            torch.cuda.synchronize()
            facts["rerun_identical"] = bool(torch.equal(o2.view(torch.int16), out.view(torch.int16))
                                            and torch.equal(l2, lse))
            rec.update(facts, ok=ok and facts["rerun_identical"])
            if not rec["ok"]:
                log(f"  diagnosis {name}: worst {facts.get('worst')}, by request "
                    f"{[f'{x:.1e}' for x in facts.get('rel_l2_by_request', [])]}, by 64 heads "
                    f"{[f'{x:.1e}' for x in facts.get('rel_l2_by_heads64', [])]}, by 256 columns "
                    f"{[f'{x:.1e}' for x in facts.get('rel_l2_by_cols256', [])]}, nan {facts['nan_out']}/"
                    f"{facts['nan_lse']}")
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        RESULTS["checks"].append(rec)
        save(CHILD_OUT)   # a partial record survives a hang in a later check
        log(f"check {'PASS' if rec['ok'] else 'FAIL'}  {name}: "
            + (rec.get("error") or f"rel_l2 {rec['rel_l2']:.2e} lse rel {rec['lse_rel_l2']:.1e} "
               f"empty_ok {rec['empty_ok']} rerun {rec['rerun_identical']}"))


# -- timing -------------------------------------------------------------------------------------------------------
def events_ms(fn, reps, flush):
    ts = []
    for _ in range(reps):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def graph_ms(fn, flush, reps):
    """Median ms of a CUDA-graph replay of fn() with the L2 flushed before each (plain launches if capture fails)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run, how = fn, "launch"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run, how = g.replay, "graph"
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    return statistics.median(events_ms(run, reps, flush)), how


def ceilings(device, flush):
    n = int(4e9) // 2
    x = torch.randn(n // 4096, 4096, device=device).to(torch.bfloat16)
    t = statistics.median(events_ms(lambda: torch.sum(x, dtype=torch.float32), 20, lambda: None))
    read = x.numel() * 2 / (t * 1e-3) / 1e9
    del x
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = statistics.median(events_ms(lambda: a @ b, 20, lambda: None))
    return read, 2 * 8192 ** 3 / (t * 1e-3) / 1e12


def fp8mla_runner(c, H, out, lse):
    import fp8mla
    ckv, kpe = views(c["pool"])
    B = c["kv_len"].numel()
    attn = fp8mla.MLAPagedAttention(backend="gluon")
    attn.plan(torch.arange(B + 1, dtype=torch.int32, device=ckv.device), c["kv_indptr"], c["kv_indices"],
              c["kv_len"], H, DC, DK, PAGE, True, SM_SCALE, torch.bfloat16, torch.float8_e4m3fn)
    return lambda: attn.run(c["q_nope"], c["q_pe"], ckv, kpe, out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0)


def flashinfer_runner(c, H, out, lse):
    import flashinfer  # noqa: F401 - optional
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    bf = c["pool"].to(torch.bfloat16)   # the same values in a BF16 pool (a NaN-free timing pool)
    ckv, kpe = bf[..., :DC], bf[..., DC:]
    B = c["kv_len"].numel()
    w = BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.int8, device=bf.device), backend="fa3")
    w.plan(torch.arange(B + 1, dtype=torch.int32, device=bf.device), c["kv_indptr"], c["kv_indices"], c["kv_len"],
           H, DC, DK, PAGE, True, SM_SCALE, torch.bfloat16, torch.bfloat16)
    return lambda: w.run(c["q_nope"], c["q_pe"], ckv, kpe, out=out, lse=lse, return_lse=True), bf


SHAPES = [(64, 8192), (8, 8192), (1, 32768)]
PROTOTYPE_OK = {}   # build: timed only when some of its checks passed (none after a hang)
CHILD_OUT = None    # the checks child's JSON directory


def run_timings(device, reps, out_dir, use_flashinfer):
    flush_buf = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8,
                            device=device)
    flush = flush_buf.zero_
    try:
        read, mm = ceilings(device, flush)
        RESULTS["env"].update(read_gbps=read, matmul_tflops=mm)
        log(f"ceilings: read {read:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s")
    except Exception as e:  # noqa: BLE001
        read, mm = float("nan"), float("nan")
        RESULTS["errors"].append(f"ceilings: {e}")
    # pass 1: the prototype and fp8mla's Gluon kernel; pass 2: FlashInfer (its JIT build may be slow: the rows
    # of pass 1 are saved first)
    for fi_pass in ((False, True) if use_flashinfer else (False,)):
        for H in (128, 64):
            for B, L in SHAPES:
                time_shape(device, H, B, L, read, mm, flush, reps, fi_pass)
                save(out_dir)
                torch.cuda.empty_cache()


def time_shape(device, H, B, L, read, mm, flush, reps, fi_pass):
    c = make_case([L] * B, H, device=device, seed=7, extra_pages=8, nan=False)
    ckv, kpe = views(c["pool"])
    flops = 2 * B * H * L * (DC + DK + DC)
    key = (H, B, L)
    row = next((r for r in RESULTS["timings"] if (r["H"], r["B"], r["L"]) == key), None)
    if row is None:
        row = {"H": H, "B": B, "L": L, "flops": flops,
               "floor_ms": max(B * L * 576 / (read * 1e9), flops / (mm * 1e12)) * 1e3}
        RESULTS["timings"].append(row)
    out = torch.empty(B, H, DC, dtype=torch.bfloat16, device=device)
    lse = torch.empty(B, H, dtype=torch.float32, device=device)
    ref_o = None
    try:   # the first request in float64 (every kernel's error on it)
        c1 = dict(c, q_nope=c["q_nope"][:1], q_pe=c["q_pe"][:1], kv_len=c["kv_len"][:1], kv_indptr=c["kv_indptr"][:2])
        ref_o, _ = reference(c1, ckv_scale=1.0, kpe_scale=1.0)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"].append(f"reference H{H} B{B} L{L}: {e}")
    runners = {}
    if not fi_pass:
        for build, bopts in BUILDS.items():
            if not PROTOTYPE_OK.get(build, False):
                continue
            try:
                ns = mh.pick_splits(B, H, -(-L // PAGE))
                part = None if ns == 1 else (torch.empty(B, ns, H, DC, device=device),
                                             torch.empty(B, ns, H, device=device))
                descs = mh.kv_descriptors(ckv, kpe)
                args = (c["q_nope"], c["q_pe"], ckv, kpe, c["kv_indptr"], c["kv_indices"], c["kv_len"])
                runners[build] = (lambda bopts=bopts, ns=ns, part=part, descs=descs, args=args: mh.decode(
                    *args, sm_scale=SM_SCALE, num_splits=ns, max_kv_len=L, out=out, lse=lse, part=part,
                    descs=descs, **bopts))
                row["prototype_splits"] = ns
            except Exception as e:  # noqa: BLE001
                RESULTS["errors"].append(f"{build} H{H} B{B} L{L}: {type(e).__name__}: {e}")
        try:
            runners["fp8mla gluon"] = fp8mla_runner(c, H, out, lse)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"fp8mla gluon H{H} B{B} L{L}: {type(e).__name__}: {e}")
    else:
        try:
            fn, bf = flashinfer_runner(c, H, out, lse)
            runners["flashinfer fa3 bf16"] = fn
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"flashinfer fa3 H{H} B{B} L{L}: {type(e).__name__}: {str(e)[:300]}")
    for name, fn in runners.items():
        try:
            t = time.time()
            ms, how = graph_ms(fn, flush, reps)
            fn()
            torch.cuda.synchronize()
            err = float("nan")
            if ref_o is not None:
                err = float((out[:1].double() - ref_o).norm() / ref_o.norm())
            row[name] = {"ms": ms, "how": how, "tflops": flops / (ms * 1e-3) / 1e12, "rel_l2_req0": err}
            log(f"  {name:20s} H{H} B{B} L{L}: {ms:.4f} ms ({row[name]['tflops']:.0f} TFLOP/s, {how}), "
                f"err {err:.1e}  [{time.time() - t:.0f} s]")
        except Exception as e:  # noqa: BLE001
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            RESULTS["errors"].append(f"{name} H{H} B{B} L{L}: {type(e).__name__}: {str(e)[:300]}")


def table():
    names = list(BUILDS) + ["fp8mla gluon", "flashinfer fa3 bf16"]
    vs_pair = [b for b in ("conv2", "conv2 single") if b in BUILDS and "owner release pair" in BUILDS]
    lines = ["| shape | floor ms | " + " | ".join(names) + " | fa3 / best proto | fp8mla / best proto |"
             + "".join(f" {b} / pair |" for b in vs_pair), "|---" * (len(names) + 4 + len(vs_pair)) + "|"]
    for r in RESULTS["timings"]:
        ms = {n: r.get(n, {}).get("ms") for n in names}
        cells = []
        for n in names:
            if ms[n]:
                cells.append(f"{ms[n]:.4f} ({r[n]['tflops']:.0f} TF/s, err {r[n]['rel_l2_req0']:.1e})")
            else:
                cells.append("error" if n in r else "-")
        p = min([ms[b] for b in BUILDS if ms[b]], default=None)
        g, f = ms["fp8mla gluon"], ms["flashinfer fa3 bf16"]
        ratio = [f"{x / p:.2f}x" if p and x else "-" for x in (f, g)]
        for c2 in vs_pair:   # the new builds against the best one of run 2
            ratio.append(f"{ms[c2] / ms['owner release pair']:.3f}" if ms[c2] and ms["owner release pair"] else "-")
        lines.append(f"| H{r['H']} B{r['B']} L{r['L']} | {r['floor_ms']:.4f} | " + " | ".join(cells + ratio) + " |")
    return "\n".join(lines)


# -- the CPU dry run ----------------------------------------------------------------------------------------------
def numerics_model(c, *, ckv_scale, kpe_scale, sm_scale=SM_SCALE):
    """The prototype's arithmetic in torch (float32 / fp16 roundings where the kernel rounds): Q x scale x f to
    fp16 (f = 2^floor(log2(16384 / max|q|))), K exact in fp16, fp32 scores, P to fp16 per 64-token tile with the
    running max, fp32 accumulation, one split. Its error against float64 is what the kernel's should be."""
    pool, B, H = c["pool"], *c["q_nope"].shape[:2]
    out = torch.zeros(B, H, DC)
    lse_out = torch.full((B, H), -math.inf)
    ip, idx, lens = c["kv_indptr"].tolist(), c["kv_indices"].long(), c["kv_len"].tolist()
    for b in range(B):
        L = lens[b]
        if L == 0:
            continue
        rows = pool[idx[ip[b]:ip[b + 1]]].reshape(-1, DC + DK)[:L].float().half().float()
        qn, qp = c["q_nope"][b].float(), c["q_pe"][b].float()
        amax = torch.maximum(qn.abs().amax(1) * ckv_scale, qp.abs().amax(1) * kpe_scale)
        f = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(16384.0 / amax))), torch.ones_like(amax))
        q16 = torch.cat([(qn * (f * ckv_scale)[:, None]).half(), (qp * (f * kpe_scale)[:, None]).half()], 1).float()
        m = torch.full((H,), -math.inf)
        l = torch.zeros(H)
        o = torch.zeros(H, DC)
        for t in range(0, L, 64):
            k = rows[t:t + 64]
            s = (q16 @ k.T) * (sm_scale * 1.4426950408889634 / f)[:, None]
            mn = torch.maximum(m, s.max(1).values)
            alpha = torch.exp2(m - mn)
            p = torch.exp2(s - mn[:, None])
            l = l * alpha + p.sum(1)
            o = o * alpha[:, None] + p.half().float() @ k[:, :DC]
            m = mn
        out[b] = (o * ckv_scale / l[:, None]).bfloat16().float()   # the kernel writes bf16
        lse_out[b] = m + torch.log2(l)
    return out, lse_out


def dry_run():
    ok_all = True

    def report(name, ok, detail=""):
        nonlocal ok_all
        ok_all &= bool(ok)
        RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        log(f"dry {'PASS' if ok else 'FAIL'}  {name} {detail}")

    c = make_case([0, 1, 63, 65, 130], 64, device="cpu", seed=3)
    ref_o, ref_l = reference(c, ckv_scale=0.05, kpe_scale=0.02)
    # 1. the reference against an independent form: the softmax over each request's rows, by gathering per token
    lens = c["kv_len"].tolist()
    worst = 0.0
    for b, L in enumerate(lens):
        if L == 0:
            continue
        toks = [int(c["kv_indices"][c["kv_indptr"][b] + t // PAGE]) * PAGE + t % PAGE for t in range(L)]
        rows = c["pool"].reshape(-1, DC + DK)[toks].double()
        kk = torch.cat([rows[:, :DC] * 0.05, rows[:, DC:] * 0.02], 1)
        q = torch.cat([c["q_nope"][b], c["q_pe"][b]], 1).double()
        p = torch.softmax(q @ kk.T * SM_SCALE, dim=1)
        worst = max(worst, float((p @ kk[:, :DC] - ref_o[b]).abs().max()))
        worst = max(worst, float((torch.logsumexp(q @ kk.T * SM_SCALE, 1) / math.log(2) - ref_l[b]).abs().max()))
    report("reference = per-token softmax", worst < 1e-10, f"max diff {worst:.1e}")
    report("pool NaN outside kv_len", bool(torch.isnan(c["pool"].float()).any()) and not torch.isnan(ref_o).any())
    # 2. the checker fails on wrong outputs
    good, _ = check_output(ref_o.float(), ref_l.float(), ref_o, ref_l, lens)
    bad1, f1 = check_output((ref_o * 1.01).float(), ref_l.float(), ref_o, ref_l, lens)
    o_nan = ref_o.clone()
    o_nan[4, 3, 7] = float("nan")
    bad2, _ = check_output(o_nan.float(), ref_l.float(), ref_o, ref_l, lens)
    o_empty = ref_o.clone()
    o_empty[0] = 1e-3
    bad3, _ = check_output(o_empty.float(), ref_l.float(), ref_o, ref_l, lens)
    report("checker: exact passes, 1% off / a NaN / a non-zero empty row fail", good and not bad1 and not bad2
           and not bad3, f"(1% off: rel_l2 {f1['rel_l2']:.1e})")
    # 3. the launcher's argument checks name the argument
    ckv, kpe = views(c["pool"])
    args = [c["q_nope"], c["q_pe"], ckv, kpe, c["kv_indptr"], c["kv_indices"], c["kv_len"]]
    bad_cases = {
        "q_nope": [c["q_nope"][:, :48]] + args[1:],
        "q_pe": [args[0], c["q_pe"].float()] + args[2:],
        "ckv_cache": args[:2] + [ckv.to(torch.bfloat16)] + args[3:],
        "kv_len": args[:6] + [c["kv_len"].long()],
        "kv_indptr": args[:4] + [c["kv_indptr"][:-1]] + args[5:],
    }
    for name, a in bad_cases.items():
        try:
            mh.check_args(*a)
            report(f"check_args refuses a bad {name}", False, "no error")
        except ValueError as e:
            report(f"check_args refuses a bad {name}", str(e).startswith(name) or f"{name}" in str(e).split(":")[0],
                   str(e)[:90])
    for bad, kw in (("release", dict(release=True)), ("pair", dict(owner=True, pair=True)),
                    ("conv2", dict(owner=True, release=True, conv2=True)),
                    ("regs", dict(owner=True, release=True, pair=True, conv2=True, regs=240)),
                    ("conv2_chunks", dict(owner=True, release=True, pair=True, conv2=True, conv2_chunks=3, regs=208))):
        try:
            mh.decode(*args, sm_scale=SM_SCALE, **kw)
            report(f"decode refuses {kw}", False, "no error")
        except ValueError as e:
            report(f"decode refuses {kw}", str(e).startswith(bad), str(e)[:90])
        except Exception as e:  # noqa: BLE001 - anything else is the wrong refusal
            report(f"decode refuses {kw}", False, f"{type(e).__name__}: {e}"[:90])
    try:
        mh.check_args(*args)
        report("check_args takes a good call", True)
    except ValueError as e:
        report("check_args takes a good call", False, str(e))
    # 4. the merge kernel (interpreter) against torch's logsumexp merge, empty partials included
    B, S, H = 3, 5, 64
    po = torch.randn(B, S, H, DC)
    pl = torch.randn(B, S, H) * 3
    pl[0, 1:] = -math.inf
    pl[2] = -math.inf
    out = torch.full((B, H, DC), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((B, H), float("nan"))
    mh._merge_kernel[(B * H,)](out, lse, po, pl, H, S, BLOCK_S=2)
    w = torch.softmax(pl * math.log(2), dim=1).nan_to_num(0.0)
    exp_o = (w[..., None] * po).sum(1)
    exp_l = torch.logsumexp(pl * math.log(2), dim=1) / math.log(2)
    ok = (torch.allclose(out[:2].float(), exp_o[:2], atol=2e-2, rtol=1e-2) and torch.allclose(lse[:2], exp_l[:2], atol=1e-4)
          and bool((out[2] == 0).all()) and bool((lse[2] == -math.inf).all()))
    report("merge kernel (interpreter, chunked BLOCK_S 2 over 5 splits)", ok)
    # 5. the numerics model of the prototype against float64
    for name, vm, qm, sc, sk in (("N(0,1), scales .05/.02", 1.0, 1.0, 0.05, 0.02), ("4 N(0,1), scale 1", 4.0, 1.0, 1.0, 1.0),
                                 ("queries x300", 1.0, 300.0, 0.05, 0.02)):
        cc = make_case([4097, 65, 1], 64, device="cpu", seed=11, vmag=vm, qmag=qm)
        ro, rl = reference(cc, ckv_scale=sc, kpe_scale=sk)
        mo, ml = numerics_model(cc, ckv_scale=sc, kpe_scale=sk)
        ok, facts = check_output(mo, ml, ro, rl, cc["kv_len"].tolist())
        report(f"numerics model through the checker ({name})", ok,
               f"rel L2 {facts['rel_l2']:.2e} (budget 3e-3), lse rel L2 {facts['lse_rel_l2']:.1e} "
               f"(max abs {facts['lse_max_abs']:.1e})")
    # 6. the barrier protocol of the builds selected (protocol_model.py: a few seeds; the full model is its own run)
    import protocol_model as pm
    pm_kw = {"prototype": dict(owner=False), "prototype owner": dict(owner=True),
             "owner release": dict(owner=True, release=True),
             "owner release pair": dict(owner=True, release=True, pair=True),
             "conv2": dict(owner=True, release=True, pair=True, conv2=2),
             "conv2 single": dict(owner=True, release=True, pair=True, conv2=1)}
    for build in BUILDS:
        try:
            for n in (0, 1, 2, 3, 5):
                for seed in range(20):
                    pm.run(n, seed=seed, **pm_kw[build])
            report(f"protocol model: {build}, 100 interleavings", True)
        except pm.Violation as e:
            report(f"protocol model: {build}, 100 interleavings", False, str(e)[:120])
    for build in [b for b in ("conv2", "conv2 single") if b in BUILDS]:   # converter A refilling a stage B reads
        found = 0
        for seed in range(50):
            try:
                pm.run(5, seed=seed, **pm_kw[build], drop_stage_wait=True)
            except pm.Violation:
                found += 1
        report(f"protocol model control: {build} without the stage_free wait fails", found > 0, f"{found} of 50")
    report("pick_splits covers the SMs", [mh.pick_splits(B, H, t) for B, H, t in ((64, 128, 128), (8, 128, 128),
                                                                                   (1, 128, 512), (1, 64, 512))]
           == [1, 8, 66, 128])
    return ok_all


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the CPU part only")
    ap.add_argument("--out", default=os.environ.get("OUT", "many_heads_out"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--check-timeout", type=int, default=240, help="seconds for the checks' child process")
    ap.add_argument("--checks-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--builds", default=",".join(BUILDS),
                    help="comma-separated builds to check and time (aliases: prototype, owner, release, pair = best, "
                         "conv2, conv2s = conv2 single); default all")
    a = ap.parse_args()
    select_builds(a.builds)
    RESULTS["env"]["builds"] = list(BUILDS)
    RESULTS["env"].update(torch=torch.__version__, triton=__import__("triton").__version__,
                          date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    if a.dry_run:
        ok = dry_run()
        save(a.out)
        log(f"dry run: {'all passed' if ok else 'FAILURES'}")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run on a CPU")
        return 2
    dev = "cuda"
    RESULTS["env"]["gpu"] = torch.cuda.get_device_name(0)
    t0 = time.time()
    if a.checks_only:   # the child: the checks, into its own JSON (rewritten after each)
        global CHILD_OUT
        CHILD_OUT = a.out
        run_checks(dev)
        save(a.out)
        return 0
    # the checks run in a child process with a time limit: a deadlocked barrier would otherwise hang the run
    import subprocess
    child_out = os.path.join(a.out, "checks_child")
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--checks-only", "--out", child_out,
                            "--builds", ",".join(BUILDS)],
                           timeout=a.check_timeout, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0 and r.stderr:
            RESULTS["errors"].append(f"checks child rc {r.returncode}: {r.stderr[-1500:]}")
        with open(os.path.join(child_out, "many_heads.json")) as f:
            RESULTS["checks"] = json.load(f)["checks"]
    except subprocess.TimeoutExpired as e:
        RESULTS["errors"].append(f"checks: not done within {a.check_timeout} s (a hang?); stdout so far: "
                                 f"{(e.stdout or b'')[-1500:]!r}")
        try:   # the checks done before the hang; the build that hung is the one with checks missing
            with open(os.path.join(child_out, "many_heads.json")) as f:
                RESULTS["checks"] = json.load(f)["checks"]
        except Exception:  # noqa: BLE001
            pass
        hung = [b for b in BUILDS if sum(r.get("build") == b for r in RESULTS["checks"]) < len(CHECKS)]
        RESULTS["checks"].append({"name": f"{hung[0] if hung else '?'}: the next check (hang)", "ok": False,
                                  "build": hung[0] if hung else None, "error": "timed out"})
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"].append(f"checks: {type(e).__name__}: {e}")
    for build in BUILDS:   # timed only if some check passed and none hung (its times would mean nothing, or hang)
        mine = [r for r in RESULTS["checks"] if r.get("build") == build]
        PROTOTYPE_OK[build] = any(r["ok"] for r in mine) and not any(r.get("error") == "timed out" for r in mine)
    save(a.out)
    log(f"checks: {sum(r['ok'] for r in RESULTS['checks'])}/{len(CHECKS) * len(BUILDS)} passed "
        f"({time.time() - t0:.0f} s); timed: {[b for b, ok in PROTOTYPE_OK.items() if ok]}")
    if not a.no_timing:
        run_timings(dev, a.reps, a.out, not a.no_flashinfer)
        log(table())
    for e in RESULTS["errors"]:
        log(f"error: {e[:300]}")
    RESULTS["table"] = table()
    save(a.out)
    log(f"total {time.time() - t0:.0f} s; JSON: {os.path.join(a.out, 'many_heads.json')}")
    return 0 if RESULTS["checks"] and all(r["ok"] for r in RESULTS["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
