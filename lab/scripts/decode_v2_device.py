"""Decode v2 on the H200: correctness of the Gluon sm_90 kernel, then timings against the ceilings measured in the
same run (and the Triton kernel when the package imports). One script, one GPU run:

    python scripts/decode_v2_device.py check            # correctness only (odd lengths, NaN pools, reruns)
    python scripts/decode_v2_device.py bench [--variants ns4,ns5 ...]
    python scripts/decode_v2_device.py all              # both; prints a compact table last
    python scripts/decode_v2_device.py h128             # the wide-heads variant (17..128 heads): checks + timings
                                                        # against the Triton kernel (FP8MLA_GLUON_WIDE=1 inside)
    python scripts/decode_v2_device.py page1            # page size 1 (cp.async producer): checks + page 1 vs page
                                                        # 64 timings on the same values (FP8MLA_GLUON_PAGE1=1
                                                        # inside); <= ~90 s
    python scripts/decode_v2_device.py mtp              # multi-token decode (qo_len 2..8, FP8MLA_GLUON_MTP=1
                                                        # inside): checks against float64 + timings against the
                                                        # Triton kernel (H16 qo 2/4, H128 qo 2, B64 L8k); <= ~90 s

The kernel module is loaded from its file, so this runs even while other parts of the package are mid-edit.
Writes $OUT/decode_v2.json when $OUT is set.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_sm90", os.path.join(ROOT, "src/fp8mla/kernels/decode_sm90.py"))
dsm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dsm)

DC, DK = 512, 64
F8 = torch.float8_e4m3fn
DEV = os.environ.get("DECODE_V2_DEVICE", "cuda")  # "cpu": a dry run of the host code (no kernel launch)
RESULTS = {"checks": [], "bench": [], "env": {}}
T_START = time.time()
BENCH_DEADLINE_S = float(os.environ.get("DECODE_V2_DEADLINE", "170"))   # no new bench shape after this
CHECKS_DEADLINE_S = float(os.environ.get("DECODE_V2_CHECKS_DEADLINE", "120"))   # h128: no new check after this


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------------------
# inputs and reference
# ------------------------------------------------------------------------------------------------------------
def make_case(kv_lens, H, page, *, seed=0, q_dtype=torch.bfloat16, ckv_scale=1.0, kpe_scale=1.0, value=1.0,
              nan_pool=True, spare=3, extra=0):
    """``extra``: pages listed after each request's last needed page (NaN in a NaN pool; kv_len ignores them)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = [-(-L // page) + extra for L in kv_lens]
    P = sum(per) + spare
    perm = torch.randperm(P, generator=g)
    kv_indices, kv_indptr, s = [], [0], 0
    for n in per:
        kv_indices += perm[s:s + n].tolist()
        s += n
        kv_indptr.append(len(kv_indices))
    dev = DEV
    if nan_pool:
        pool = torch.full((P, page, DC + DK), float("nan"), device=dev)
    else:
        pool = torch.randn(P, page, DC + DK, device=dev)
    gd = torch.Generator(device=dev).manual_seed(seed + 1)
    for b, L in enumerate(kv_lens if nan_pool else []):
        ids = torch.tensor(kv_indices[kv_indptr[b]:kv_indptr[b + 1]], device=dev, dtype=torch.long)
        vals = torch.randn(len(ids) * page, DC + DK, device=dev, generator=gd) * value
        flat = pool[ids].reshape(-1, DC + DK)
        flat[:L] = vals[:L]
        pool[ids] = flat.reshape(len(ids), page, DC + DK)
    q8 = torch.empty(P, page, DC + DK, dtype=F8, device=dev)
    q8[..., :DC] = (pool[..., :DC] / ckv_scale).clamp(-448, 448).to(F8)
    q8[..., DC:] = (pool[..., DC:] / kpe_scale).clamp(-448, 448).to(F8)
    B = len(kv_lens)
    i32 = dict(dtype=torch.int32, device=dev)
    case = dict(
        pool=q8, ckv=q8[..., :DC], kpe=q8[..., DC:], page=page, H=H, kv_lens=list(kv_lens),
        qo_indptr=torch.arange(B + 1, **i32), kv_indptr=torch.tensor(kv_indptr, **i32),
        kv_indices=torch.tensor(kv_indices, **i32), kv_len=torch.tensor(kv_lens, **i32),
        q_nope=torch.randn(B, H, DC, device=dev, generator=gd).to(q_dtype),
        q_pe=torch.randn(B, H, DK, device=dev, generator=gd).to(q_dtype),
        scales=torch.tensor([ckv_scale, kpe_scale], dtype=torch.float32, device=dev),
        sm_scale=1.0 / math.sqrt(192))
    return case


def reference(c, nreq=None):
    """float64 (out, lse base 2) on the dequantized KV, first ``nreq`` requests: c_kv x the per-tensor scale (x each
    token's group scales, one per 128 columns, when the case has a ``scale_arr``), k_pe x its scale."""
    B = len(c["kv_lens"]) if nreq is None else nreq
    H = c["H"]
    out = torch.zeros(B, H, DC, dtype=torch.float64, device=DEV)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64, device=DEV)
    sc = c["scales"].double()
    ind, ptr, page = c["kv_indices"].long(), c["kv_indptr"].tolist(), c["page"]
    for b in range(B):
        L = c["kv_lens"][b]
        if L == 0:
            continue
        pos = torch.arange(L, device=DEV)
        pg = ind[ptr[b]:ptr[b + 1]][pos // page]
        rows = c["pool"][pg, pos % page].double()
        ck, kp = rows[:, :DC] * sc[0], rows[:, DC:] * sc[1]
        if "scale_arr" in c:
            ck = ck * c["scale_arr"][pg, pos % page].double().repeat_interleave(128, dim=-1)
        s = (c["q_nope"][b].double() @ ck.T + c["q_pe"][b].double() @ kp.T) * c["sm_scale"]
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        out[b] = (p @ ck) / den
        lse[b] = (m + torch.log(den)).squeeze(-1) / math.log(2.0)
    return out, lse


class Plan:
    """Host schedule -> device arrays, sized once (run() only launches)."""

    def __init__(self, c, *, num_ctas=None, min_tiles=4, ns=None, regs=240, mode=0, merge=True, max_hpw=32,
                 group=False):
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132
        # H > 16 (wide variant): nhg head-group CTAs per schedule slot, partial rows padded to the head groups
        # (max_hpw 16: the group-scale build's variant, dsm.GROUP_MAX_HPW)
        hpw, nhg, wide = dsm.head_config(c["H"], max_hpw)
        # ns None: what the adapter plans (3; the alternating-tile kernel the even depth above where it fits,
        # dsm.ring_depth; an odd depth has per-consumer ready barriers there, kernel logs 25 and 29)
        ns = dsm.ring_depth(3, hpw, wide, group=group) if ns is None else ns
        rows = dsm.padded_heads(c["H"], 1, max_hpw)
        slots, cta_ptr, items, m_ptr, m_list = dsm.schedule(c["kv_lens"], max(1, (num_ctas or n_sm) // nhg),
                                                            min_tiles)
        grid = slots * nhg
        i32 = dict(dtype=torch.int32, device=DEV)
        B = len(c["kv_lens"])
        self.t = dict(qo_indptr=c["qo_indptr"], kv_indptr=c["kv_indptr"], kv_indices=c["kv_indices"],
                      kv_len=c["kv_len"], cta_ptr=torch.tensor(cta_ptr, **i32),
                      item_req=torch.tensor([i[0] for i in items], **i32),
                      item_t0=torch.tensor([i[1] for i in items], **i32),
                      item_t1=torch.tensor([i[2] for i in items], **i32),
                      part_o=torch.empty(max(1, len(items)), rows, DC, dtype=torch.float32, device=DEV),
                      part_lse=torch.empty(max(1, len(items)), rows, dtype=torch.float32, device=DEV),
                      m_ptr=torch.tensor(m_ptr, **i32), m_list=torch.tensor(m_list, **i32),
                      batch_size=torch.tensor([B], **i32))
        self.grid, self.B, self.c, self.ns, self.regs = grid, B, c, ns, regs
        self.mode, self.merge = mode, merge
        self.merge_p, self.merge_c = dsm.merge_blocks(max(b - a for a, b in zip(m_ptr, m_ptr[1:])))
        self.n_items = len(items)
        self.desc = dsm.kv_descriptors(c["ckv"], c["kpe"])
        self.out = torch.empty(B, c["H"], DC, dtype=c["q_nope"].dtype, device=DEV)
        self.lse = torch.empty(B, c["H"], dtype=torch.float32, device=DEV)

    def launch_kw(self) -> dict:
        """The launch options of this plan (subclasses in other device scripts add theirs)."""
        return dict(mode=self.mode, merge=self.merge)

    def run(self):
        c = self.c
        if DEV != "cuda":
            return
        dsm.launch(self.desc[0], self.desc[1], c["q_nope"], c["q_pe"], c["scales"], self.t, self.out, self.lse,
                   grid=self.grid, grid_batch=self.B, max_rows=c["H"], num_heads=c["H"], sm_scale=c["sm_scale"],
                   page_size=c["page"], ns=self.ns, regs=self.regs, merge_p=self.merge_p, merge_c=self.merge_c,
                   **self.launch_kw())


# ------------------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------------------
def check_case(name, c, plan_cls=None, **plan_kw):
    """Plan ``c`` (``plan_cls``, default ``Plan``), run it over poisoned outputs and compare with float64
    (``reference``): rel L2, lse, NaN, empty requests, bit-identical reruns. A row in RESULTS["checks"]."""
    t0 = time.time()
    p = (plan_cls or Plan)(c, **plan_kw)
    p.out.fill_(float("nan"))
    p.lse.fill_(float("nan"))
    p.t["part_o"].fill_(float("nan"))
    p.run()
    torch.cuda.synchronize()
    ref_o, ref_l = reference(c)
    o, lse = p.out.double(), p.lse.double()
    empty = torch.tensor([L == 0 for L in c["kv_lens"]], device=DEV)
    nan_bad = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
    fin = ~empty
    rel = float((o[fin] - ref_o[fin]).norm() / ref_o[fin].norm()) if fin.any() else 0.0
    # lse: absolute error relative to the largest |lse| (>= 8): fp16 Q rounding scales with the scores
    lse_err = float((lse[fin] - ref_l[fin]).abs().max() / ref_l[fin].abs().max().clamp_min(8.0)) if fin.any() else 0.0
    empty_ok = bool((o[empty] == 0).all() and (lse[empty] == -math.inf).all()) if empty.any() else True
    o1 = p.out.clone()
    l1 = p.lse.clone()
    p.run()
    p.run()
    torch.cuda.synchronize()
    same = bool(torch.equal(o1, p.out) and torch.equal(l1.nan_to_num(), p.lse.nan_to_num()))
    ok = nan_bad == 0 and rel <= 3e-3 and lse_err <= 6e-4 and empty_ok and same
    row = dict(name=name, ok=ok, rel_l2=rel, lse_max_abs=lse_err, nan=nan_bad, empty_ok=empty_ok, rerun_identical=same,
               grid=p.grid, items=p.n_items, secs=round(time.time() - t0, 1))
    RESULTS["checks"].append(row)
    log(f"CHECK {'PASS' if ok else 'FAIL'} {name:34s} relL2 {rel:.2e} lse {lse_err:.1e} nan {nan_bad} "
        f"empty {empty_ok} rerun-identical {same} grid {p.grid} items {p.n_items} ({row['secs']} s)")
    return ok


def run_checks():
    ok = True
    odd = [1, 63, 65, 97, 514, 0, 4096, 130]
    ok &= check_case("H16 p64 odd lens", make_case(odd, 16, 64, seed=1))
    ok &= check_case("H16 p64 odd lens, 7 CTAs (ring wraps items)", make_case(odd, 16, 64, seed=2), num_ctas=7)
    ok &= check_case("H16 p64 odd lens, 1 CTA", make_case(odd, 16, 64, seed=3), num_ctas=1)
    ok &= check_case("H8 p64 (padded heads)", make_case([300, 7, 2000], 8, 64, seed=4))
    ok &= check_case("H16 p128", make_case([1, 127, 129, 1000, 64], 16, 128, seed=5))
    ok &= check_case("H16 p16", make_case([1, 15, 17, 63, 65, 1000, 0], 16, 16, seed=13))
    ok &= check_case("H16 p32", make_case([1, 31, 33, 97, 2000], 16, 32, seed=14), num_ctas=5)
    ok &= check_case("H16 p64 fp16 q, scales .05/.02, x4 values",
                     make_case([777, 65, 3000], 16, 64, seed=6, q_dtype=torch.float16, ckv_scale=0.05,
                               kpe_scale=0.02, value=4.0))
    ok &= check_case("H16 p64 B1 L32768 (many splits)", make_case([32768], 16, 64, seed=7))
    ok &= check_case("H16 p64 B4 L8192", make_case([8192] * 4, 16, 64, seed=8))
    ok &= check_case("H16 p64 all empty", make_case([0, 0], 16, 64, seed=9))
    ok &= check_case("H16 p64 ns4", make_case(odd, 16, 64, seed=10), ns=4)
    ok &= check_case("H16 p64 ns2", make_case(odd, 16, 64, seed=12), ns=2)
    log(f"CHECKS {'ALL PASS' if ok else 'SOME FAIL'}")
    return ok


# ------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------
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
    return statistics.median(ts)


class Flush:
    def __init__(self):
        self.buf = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.int8, device=DEV)

    def __call__(self):
        self.buf.zero_()


def graph_ms(fn, flush, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return events_ms(g.replay, reps, flush)


def ceilings(flush):
    x = torch.randn(2 * 10**9 // 4096, 4096, device=DEV).to(torch.bfloat16)
    torch.sum(x, dtype=torch.float32)
    t = events_ms(lambda: torch.sum(x, dtype=torch.float32), 15, lambda: None)
    read = x.numel() * 2 / (t * 1e-3) / 1e9
    del x
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = events_ms(lambda: a @ b, 10, lambda: None)
    del a, b
    torch.cuda.empty_cache()
    return read, 2 * 8192**3 / (t * 1e-3) / 1e12


def triton_runner(c):
    """The project's Triton kernel through MLAPagedAttention (None if the package does not import right now)."""
    try:
        sys.path.insert(0, os.path.join(ROOT, "src"))
        from fp8mla.attention import MLAPagedAttention
        a = MLAPagedAttention(backend="triton")
        B = len(c["kv_lens"])
        a.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["H"], DC, DK, c["page"], True,
               c["sm_scale"], c["q_nope"].dtype, "fp8_e4m3")
        out = torch.empty(B, c["H"], DC, dtype=c["q_nope"].dtype, device=DEV)
        return lambda: a.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, ckv_scale=1.0, kpe_scale=1.0), out
    except Exception as e:  # noqa: BLE001
        log(f"  triton baseline unavailable: {type(e).__name__}: {str(e)[:200]}")
        return None, None


def hgmma_probe():
    """Throughput of wgmma m64nNk16 (A fp16 in registers, B in smem, fp32 acc) at N = 16 and 64: 2 CTAs of one
    warpgroup per SM, 4 independent accumulators, as the decode kernel's consumers issue them."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared

    @gluon.jit
    def k(out, iters, N: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a = gl.full([64, 64], 0.001, gl.float16, a_l)
        bs = gl.allocate_shared_memory(gl.float16, [N, 64], b_l)
        bs.store(gl.full([N, 64], 0.002, gl.float16, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
        fence_async_shared()
        b = bs.permute((1, 0))
        c0 = gl.zeros([64, N], gl.float32, mma)
        c1 = gl.zeros([64, N], gl.float32, mma)
        c2 = gl.zeros([64, N], gl.float32, mma)
        c3 = gl.zeros([64, N], gl.float32, mma)
        for i in range(iters):
            c0 = warpgroup_mma(a, b, c0, is_async=True)
            c1 = warpgroup_mma(a, b, c1, is_async=True)
            c2 = warpgroup_mma(a, b, c2, is_async=True)
            c3 = warpgroup_mma(a, b, c3, is_async=True)
            c0, c1, c2, c3 = warpgroup_mma_wait(2, deps=(c0, c1, c2, c3))
        c0, c1, c2, c3 = warpgroup_mma_wait(0, deps=(c0, c1, c2, c3))
        r = gl.arange(0, 64, gl.SliceLayout(1, mma))[:, None] * N + gl.arange(0, N, gl.SliceLayout(0, mma))[None, :]
        gl.store(out + gl.program_id(0) * 64 * N + r, c0 + c1 + c2 + c3)

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    clk = 1.98e9
    for N in (16, 64):
        out = torch.empty(2 * n_sm, 64, N, device="cuda")
        iters = 4000
        k[(2 * n_sm,)](out, iters, N=N, num_warps=4)
        torch.cuda.synchronize()
        t = events_ms(lambda: k[(2 * n_sm,)](out, iters, N=N, num_warps=4), 5, lambda: None) * 1e-3
        steps = 2 * iters * 4 * 4            # per SM: 2 CTAs x iters x 4 wgmma x 4 k16-steps
        log(f"HGMMA m64n{N}k16 (A regs): {t * clk / steps:.2f} cycles per k16 step per SM at 1.98 GHz "
            f"({2 * 64 * N * 16 * steps * n_sm / t / 1e12:.0f} TFLOP/s)")


SHAPES = [(1, 32768), (8, 8192), (32, 4096), (128, 2048), (64, 8192)]
TARGETS = {(1, 32768): 0.012, (8, 8192): 0.015, (32, 4096): 0.025, (128, 2048): 0.045, (64, 8192): 0.090}
VARIANTS = {"ns4": dict(ns=4), "ns3": dict(ns=3), "ns2": dict(ns=2), "ns4_mt8": dict(ns=4, min_tiles=8),
            "mem_ns3": dict(ns=3, mode=1), "mem_ns4": dict(ns=4, mode=1),
            "cmp_ns4": dict(ns=4, mode=2), "cmp_ns3": dict(ns=3, mode=2), "nomerge": dict(ns=4, merge=False), "mt8_nomerge": dict(min_tiles=8, merge=False),
            "ns4_mt16": dict(ns=4, min_tiles=16), "ns3_mt8": dict(ns=3, min_tiles=8)}


def _probe(v):
    """Timing probes (not results): mem_* = ring without compute, cmp_* = compute without HBM traffic."""
    return v.startswith(("mem_", "cmp_"))


def run_bench(variants, with_triton=True, shapes=SHAPES, H=16, page=64, targets=TARGETS):
    """``shapes``: (B, L) at ``H`` heads, or (H, B, L) triples."""
    flush = Flush()
    read, mm = ceilings(flush)
    RESULTS["env"].update(read_gbps=read, matmul_tflops=mm)
    log(f"ceilings: read {read:.0f} GB/s (torch.sum 4 GB bf16), bf16 matmul {mm:.0f} TFLOP/s")
    table = []
    for shp in shapes:
        if time.time() - T_START > BENCH_DEADLINE_S:
            log(f"  skipped {shp}: past {BENCH_DEADLINE_S} s of the run")
            continue
        H, B, L = shp if len(shp) == 3 else (H, *shp)
        c = make_case([L] * B, H, page, seed=B, nan_pool=False, spare=8)
        nbytes = B * L * (DC + DK)
        floor = max(nbytes / (read * 1e9), 2 * B * H * L * (DC + DK + DC) / (mm * 1e12)) * 1e3
        ref_o, _ = reference(c, nreq=min(B, 2))
        row = dict(shape=f"H{H} B{B} L{L} p{page}", floor=floor, target=targets.get(shp))
        for vn in variants:
            kw = VARIANTS[vn]
            try:
                p = Plan(c, **kw)
                p.run()
                torch.cuda.synchronize()
                err = float((p.out[:2].double() - ref_o).norm() / ref_o.norm())
                ms = graph_ms(p.run, flush)
                row[vn] = ms
                row[vn + "_err"] = err
                log(f"  {row['shape']:16s} {vn:9s} {ms:.4f} ms {nbytes / ms / 1e6:6.0f} GB/s "
                    f"{100 * floor / ms:5.1f}% floor  err {err:.1e}  grid {p.grid} items {p.n_items}")
            except Exception as e:  # noqa: BLE001
                log(f"  {row['shape']} {vn}: {type(e).__name__}: {str(e)[:300]}")
        if with_triton:
            fn, out = triton_runner(c)
            if fn is not None:
                try:
                    fn()
                    torch.cuda.synchronize()
                    err = float((out[:2].double() - ref_o).norm() / ref_o.norm())
                    row["triton"] = graph_ms(fn, flush)
                    log(f"  {row['shape']:16s} triton    {row['triton']:.4f} ms  err {err:.1e}")
                except Exception as e:  # noqa: BLE001
                    log(f"  triton: {type(e).__name__}: {str(e)[:200]}")
        table.append(row)
        RESULTS["bench"].append(row)
        del c
        torch.cuda.empty_cache()
    cols = list(variants) + (["triton"] if with_triton else [])
    log("")
    log(f"{'shape':16s} {'floor':>7s} {'target':>7s} " + " ".join(f"{v:>9s}" for v in cols) + "   best %floor")
    for r in table:
        vals = [r.get(v) for v in cols]
        best = min([r[v] for v in variants if v in r and not _probe(v)] or [float("nan")])
        log(f"{r['shape']:16s} {r['floor']:7.4f} {r['target'] or 0:7.3f} "
            + " ".join(f"{v:9.4f}" if v else f"{'-':>9s}" for v in vals) + f"   {100 * r['floor'] / best:5.1f}%")
    return table


# ------------------------------------------------------------------------------------------------------------
# h128: the wide-heads variant (17..128 heads)
# ------------------------------------------------------------------------------------------------------------
_WATCH = {"name": None, "since": 0.0, "limit": 60.0}


def _watchdog():
    """A kernel that deadlocks (a ring barrier phase wrong) never returns: after ``_WATCH["limit"]`` seconds in
    one step, print what hung and the results so far, then leave the process (the GPU is released; the log
    survives)."""
    import threading

    def loop():
        while True:
            time.sleep(1.0)
            name, limit = _WATCH["name"], _WATCH["limit"]
            if name is not None and time.time() - _WATCH["since"] > limit:
                log(f"HANG: '{name}' ran > {limit:.0f} s; exiting. Results so far:")
                for n, ok, secs in RESULTS.get("h128_summary", []):
                    log(f"  {'PASS' if ok else 'FAIL'}  {n} ({secs} s)")
                if os.environ.get("OUT"):
                    with open(os.path.join(os.environ["OUT"], "decode_v2_h128.json"), "w") as f:
                        json.dump(RESULTS, f, indent=1, default=str)
                os._exit(3)

    threading.Thread(target=loop, daemon=True).start()


def _guarded(name, fn):
    """Run one check; an exception is a FAIL of that check only (the others still run)."""
    t0 = time.time()
    _WATCH.update(name=name, since=t0)
    try:
        ok = bool(fn())
    except Exception as e:  # noqa: BLE001
        import traceback
        ok = False
        log(f"CHECK FAIL {name:34s} {type(e).__name__}: {str(e)[:300]}")
        RESULTS["checks"].append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}",
                                      trace=traceback.format_exc()[-2000:]))
    _WATCH["name"] = None
    RESULTS.setdefault("h128_summary", []).append((name, ok, round(time.time() - t0, 1)))
    return ok


def _api_checks():
    """Through MLAPagedAttention (FP8MLA_GLUON_WIDE=1): auto picks gluon at H128, CUDA-graph replay after a
    re-plan, bit-identical replays, poisoned outputs."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import fp8mla
    from fp8mla.reference import mla_reference
    from fp8mla.testing import capture_then_replay, make_paged_batch

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    def auto_pick():
        H = 128
        b = make_paged_batch([700, 1, 64, 0, 1500], [1] * 5, H, 64, "fp8_e4m3", device=DEV, seed=21)
        attn = fp8mla.MLAPagedAttention(backend="auto")
        attn.plan(**b.plan_args)
        out = torch.full((5, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
        lse = torch.full((5, H), float("nan"), device=DEV)
        attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
        torch.cuda.synchronize()
        ro, rl = b.reference()
        fin = torch.isfinite(rl)
        e, le = rel(out, ro), float((lse[fin] - rl[fin]).abs().max())
        name = attn._plan.backend
        ok = name == "gluon" and e <= 3e-3 and le <= 5e-3 and not torch.isnan(out).any()
        log(f"CHECK {'PASS' if ok else 'FAIL'} {'API H128 auto -> ' + name:34s} relL2 {e:.2e} lse {le:.1e}")
        return ok

    def graph_replan():
        H = 128
        attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
        b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 64, "fp8_e4m3", device=DEV, seed=11, spare_pages=60)
        attn.plan(**b1.plan_args)
        q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
        out = torch.empty_like(q_nope)
        lse = torch.empty(3, H, device=DEV)
        kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
        g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
        e1 = rel(out, b1.reference()[0])
        a = dict(b1.plan_args)
        pages = a["kv_indices"]
        a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEV)
        a["kv_indptr"] = torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEV)
        a["kv_indices"] = torch.cat([pages[3:49]] + [pages[:1]])
        attn.plan(**a)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                               a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
        e2 = rel(out[:2], ref[:2])
        o1 = out.clone()
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(o1, out)
        empty_ok = bool((out[2] == 0).all())
        ok = e1 <= 3e-3 and e2 <= 3e-3 and same and empty_ok
        log(f"CHECK {'PASS' if ok else 'FAIL'} {'API H128 graph replay after re-plan':34s} relL2 {e1:.2e} / "
            f"{e2:.2e} replay-identical {same} empty {empty_ok}")
        return ok

    return [("API H128 auto picks gluon", auto_pick), ("API H128 graph replay after re-plan", graph_replan)]


H128_SHAPES = [(128, 64, 8192), (128, 8, 8192), (128, 1, 32768), (64, 64, 8192)]   # most important first
H128_TARGETS = {(128, 1, 32768): 0.025, (128, 8, 8192): 0.040, (128, 64, 8192): 0.26}


def run_h128(variants, with_triton=True, shapes=H128_SHAPES, page=64):
    os.environ["FP8MLA_GLUON_WIDE"] = "1"
    odd = [1, 63, 64, 65, 0, 97, 514, 4096, 130]
    _WATCH["limit"] = float(os.environ.get("DECODE_V2_HANG_S", "60"))   # per check (compiles included)
    _watchdog()
    # simplest variants first: a hang at H128 still leaves the H16 / H32 / H64 verdicts in the log
    checks = [
        ("H16 p64 odd lens (regression)", lambda: check_case("H16 p64 odd lens (regression)",
                                                             make_case(odd, 16, 64, seed=1))),
        ("H32 p64 odd lens", lambda: check_case("H32 p64 odd lens", make_case(odd, 32, 64, seed=34))),
        ("H20 p64 odd lens (padded, HPW 16)", lambda: check_case("H20 p64 odd lens (padded, HPW 16)",
                                                                 make_case(odd, 20, 64, seed=35))),
        ("H64 p64 odd lens", lambda: check_case("H64 p64 odd lens", make_case(odd, 64, 64, seed=33))),
        ("H128 p64 odd lens", lambda: check_case("H128 p64 odd lens", make_case(odd, 128, 64, seed=31))),
        ("H128 p16 odd lens", lambda: check_case("H128 p16 odd lens", make_case(odd, 128, 16, seed=32))),
        ("H100 p16 (2nd head group padded)", lambda: check_case("H100 p16 (2nd head group padded)",
                                                                make_case(odd, 100, 16, seed=36))),
        ("H40 p32 7 CTAs", lambda: check_case("H40 p32 7 CTAs", make_case([1, 31, 33, 97, 2000], 40, 32, seed=37),
                                              num_ctas=7)),
        ("H128 p64 1 slot (2 CTAs)", lambda: check_case("H128 p64 1 slot (2 CTAs)", make_case(odd, 128, 64, seed=38),
                                                        num_ctas=2)),
        ("H128 p64 fp16 q scales .05/.02 x4", lambda: check_case(
            "H128 p64 fp16 q scales .05/.02 x4", make_case([777, 65, 3000], 128, 64, seed=39, q_dtype=torch.float16,
                                                           ckv_scale=0.05, kpe_scale=0.02, value=4.0))),
        ("H128 p64 B1 L32768 (many splits)", lambda: check_case("H128 p64 B1 L32768 (many splits)",
                                                                make_case([32768], 128, 64, seed=40))),
        ("H128 p64 ns2", lambda: check_case("H128 p64 ns2", make_case(odd, 128, 64, seed=41), ns=2)),
        ("H128 p64 all empty", lambda: check_case("H128 p64 all empty", make_case([0, 0], 128, 64, seed=42))),
    ]
    try:
        checks += _api_checks()
    except Exception as e:  # noqa: BLE001
        log(f"  API checks unavailable: {type(e).__name__}: {str(e)[:200]}")
    results = []
    for name, fn in checks:   # the run must end within ~200 s: later checks give way to the timings
        if time.time() - T_START > CHECKS_DEADLINE_S:
            log(f"CHECK SKIP {name} (past {CHECKS_DEADLINE_S:.0f} s of the run)")
            results.append((name + " (skipped)", False))
            continue
        results.append((name, _guarded(name, fn)))
    ok = all(r for _, r in results)
    table = []
    # timed even when a check failed (the numbers still say where the variant stands); a dead CUDA context just
    # makes every row an error
    _WATCH.update(name="bench", since=time.time(), limit=max(20.0, 195.0 - (time.time() - T_START)))
    try:
        table = run_bench(variants, with_triton=with_triton, shapes=shapes, page=page, targets=H128_TARGETS)
    except Exception as e:  # noqa: BLE001
        log(f"BENCH error: {type(e).__name__}: {str(e)[:300]}")
    _WATCH["name"] = None
    log("")
    log("== h128 summary ==")
    for name, r in results:
        log(f"  {'PASS' if r else 'FAIL'}  {name}")
    log(f"CHECKS {'ALL PASS' if ok else 'SOME FAIL'} ({sum(r for _, r in results)}/{len(results)})")
    for r in table:
        g = min([r[v] for v in variants if v in r and not _probe(v)] or [float("nan")])
        tr = r.get("triton")
        cmp_ = r.get("cmp_ns3")
        log(f"  {r['shape']:18s} floor {r['floor']:.4f}  gluon {g:.4f} ({100 * r['floor'] / g:4.1f}% floor)  "
            f"triton {tr if tr else float('nan'):.4f}  speedup {tr / g if tr else float('nan'):.2f}x  "
            f"target {r['target'] or float('nan'):.3f}"
            + (f"  compute-only probe {cmp_:.4f}" if cmp_ else ""))
    return ok


# ------------------------------------------------------------------------------------------------------------
# page1: page size 1 (SGLang's default; the kernel's cp.async producer), against page 64 on the same values
# ------------------------------------------------------------------------------------------------------------
def to_page1(c, *, seed=0, past=0, spare=5):
    """Case ``c`` (any page size) as a page-1 case holding the same tokens: every pool row of ``c`` moved to a
    shuffled slot of a fresh pool whose other slots are NaN (``spare`` of them never listed); each request lists
    its rows in order, plus ``past`` more of its page's rows after kv_len (NaN in a NaN pool). Same queries."""
    page = c["page"]
    rows = c["pool"].shape[0] * page
    g = torch.Generator(device="cpu").manual_seed(seed + 99)
    slots = torch.randperm(rows + spare, generator=g).to(DEV)
    pool1 = torch.empty(rows + spare, 1, DC + DK, dtype=F8, device=DEV)
    pool1.view(torch.uint8).fill_(0x7F)   # e4m3fn NaN
    pool1.view(torch.uint8)[slots[:rows], 0] = c["pool"].view(torch.uint8).reshape(rows, DC + DK)
    ind, ptr = c["kv_indices"].long(), c["kv_indptr"].tolist()
    lists = []
    ar = torch.arange(page, device=DEV)
    for b, L in enumerate(c["kv_lens"]):
        pg = ind[ptr[b]:ptr[b + 1]]
        r = (pg[:, None] * page + ar[None, :]).reshape(-1)[:L + past]
        lists.append(slots[r])
    i32 = dict(dtype=torch.int32, device=DEV)
    indptr = [0]
    for x in lists:
        indptr.append(indptr[-1] + x.numel())
    return dict(c, pool=pool1, ckv=pool1[..., :DC], kpe=pool1[..., DC:], page=1,
                kv_indptr=torch.tensor(indptr, **i32), kv_indices=torch.cat(lists).to(torch.int32))


def _page1_api_checks():
    """Through MLAPagedAttention (FP8MLA_GLUON_PAGE1=1): auto picks gluon at page 1 (H16, H128); CUDA-graph replay
    after a re-plan at page 1 (H128); bit-identical replays; poisoned outputs."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import fp8mla
    from fp8mla.reference import mla_reference
    from fp8mla.testing import capture_then_replay, make_paged_batch

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    def auto_pick(H):
        def fn():
            b = make_paged_batch([700, 1, 64, 0, 1500], [1] * 5, H, 1, "fp8_e4m3", device=DEV, seed=60 + H,
                                 extra_pages=1)
            attn = fp8mla.MLAPagedAttention(backend="auto")
            attn.plan(**b.plan_args)
            out = torch.full((5, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
            lse = torch.full((5, H), float("nan"), device=DEV)
            attn.run(**b.run_args, out=out, lse=lse, return_lse=True)
            torch.cuda.synchronize()
            ro, rl = b.reference()
            fin = torch.isfinite(rl)
            e, le = rel(out, ro), float((lse[fin] - rl[fin]).abs().max())
            name = attn._plan.backend
            ok = name == "gluon" and e <= 3e-3 and le <= 5e-3 and not torch.isnan(out).any()
            log(f"CHECK {'PASS' if ok else 'FAIL'} {f'API H{H} p1 auto -> ' + name:34s} relL2 {e:.2e} lse {le:.1e}")
            return ok
        return fn

    def graph_replan():
        H = 128
        attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
        b1 = make_paged_batch([100, 3000, 17], [1, 1, 1], H, 1, "fp8_e4m3", device=DEV, seed=71, spare_pages=64)
        attn.plan(**b1.plan_args)
        q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
        out = torch.empty_like(q_nope)
        lse = torch.empty(3, H, device=DEV)
        kw = dict(ckv_cache=b1.pool[..., :512], kpe_cache=b1.pool[..., 512:], ckv_scale=1.0, kpe_scale=1.0)
        g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
        e1 = rel(out, b1.reference()[0])
        a = dict(b1.plan_args)   # same pool, other lengths, a shuffled subset of the used slots
        sub = a["kv_indices"][torch.randperm(a["kv_indices"].numel(), device=DEV)[:2906]]
        a["kv_len_arr"] = torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEV)
        a["kv_indptr"] = torch.tensor([0, 2900, 2905, 2906], dtype=torch.int32, device=DEV)
        a["kv_indices"] = sub
        attn.plan(**a)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                               a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
        e2 = rel(out[:2], ref[:2])
        o1 = out.clone()
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(o1, out)
        empty_ok = bool((out[2] == 0).all())
        ok = e1 <= 3e-3 and e2 <= 3e-3 and same and empty_ok
        log(f"CHECK {'PASS' if ok else 'FAIL'} {'API H128 p1 graph replay re-plan':34s} relL2 {e1:.2e} / "
            f"{e2:.2e} replay-identical {same} empty {empty_ok}")
        return ok

    return [("API H16 p1 auto picks gluon", auto_pick(16)), ("API H128 p1 auto picks gluon", auto_pick(128)),
            ("API H128 p1 graph replay after re-plan", graph_replan)]


def _page1_bad_ids():
    """Page ids outside [0, num_pages) are never read (their rows are zero-filled, as TMA does for page 16): no
    fault, the request with good ids exact, the other finite."""
    c = make_case([100, 70], 16, 1, seed=81)
    ind = c["kv_indices"].clone()
    a, b = c["kv_indptr"].tolist()[1:3]
    P = c["pool"].shape[0]
    ind[a:a + 10] = -7
    ind[a + 10:b] = P + 100000
    c["kv_indices"] = ind
    p = Plan(c)
    p.out.fill_(float("nan"))
    p.run()
    torch.cuda.synchronize()
    ro, _ = reference(dict(c, kv_lens=[100, 0]), nreq=1)
    e = float((p.out[:1].double() - ro).norm() / ro.norm())
    fin = bool(torch.isfinite(p.out[1]).all())
    ok = e <= 3e-3 and fin
    log(f"CHECK {'PASS' if ok else 'FAIL'} {'H16 p1 page ids out of range':34s} relL2 {e:.2e} other finite {fin}")
    return ok


PAGE1_SHAPES = [(16, 64, 8192), (16, 8, 8192), (128, 64, 8192), (128, 1, 32768)]


def run_page1(reps=30):
    os.environ["FP8MLA_GLUON_PAGE1"] = "1"
    os.environ["FP8MLA_GLUON_WIDE"] = "1"
    checks_deadline = float(os.environ.get("DECODE_V2_CHECKS_DEADLINE", "50"))
    bench_deadline = float(os.environ.get("DECODE_V2_DEADLINE", "72"))
    _WATCH["limit"] = float(os.environ.get("DECODE_V2_HANG_S", "40"))   # per step (compiles included)
    _watchdog()
    odd = [0, 1, 63, 64, 65, 1000]
    checks = [
        ("H16 p1 odd lens, NaN slots", lambda: check_case(
            "H16 p1 odd lens, NaN slots", make_case(odd, 16, 1, seed=51, extra=1))),
        ("H128 p1 odd lens, NaN slots", lambda: check_case(
            "H128 p1 odd lens, NaN slots", make_case(odd, 128, 1, seed=52, extra=1))),
        ("H16 p1 from p64 rows, 7 CTAs", lambda: check_case(
            "H16 p1 from p64 rows, 7 CTAs", to_page1(make_case(odd + [97, 514, 4096, 130], 16, 64, seed=53),
                                                     seed=53, past=1), num_ctas=7)),
        ("H128 p1 from p64 rows", lambda: check_case(
            "H128 p1 from p64 rows", to_page1(make_case(odd + [3001], 128, 64, seed=54), seed=54, past=1))),
        ("H128 p1 B1 L32768 (many splits)", lambda: check_case(
            "H128 p1 B1 L32768 (many splits)", make_case([32768], 128, 1, seed=55))),
        ("H16 p1 B4 L8192 ns2", lambda: check_case(
            "H16 p1 B4 L8192 ns2", make_case([8192] * 4, 16, 1, seed=56), ns=2)),
        ("H16 p1 all empty", lambda: check_case("H16 p1 all empty", make_case([0, 0], 16, 1, seed=57))),
    ]
    try:
        checks += _page1_api_checks()
    except Exception as e:  # noqa: BLE001
        log(f"  API checks unavailable: {type(e).__name__}: {str(e)[:200]}")
    results = []
    for name, fn in checks:
        if time.time() - T_START > checks_deadline:
            log(f"CHECK SKIP {name} (past {checks_deadline:.0f} s of the run)")
            results.append((name + " (skipped)", False))
            continue
        results.append((name, _guarded(name, fn)))
    # -- page 1 vs page 64, same values (the page-1 pool: the page-64 rows in shuffled slots, exactly L listed) --
    flush = Flush()
    table = []
    for H, B, L in PAGE1_SHAPES:
        if time.time() - T_START > bench_deadline:
            log(f"  skipped H{H} B{B} L{L}: past {bench_deadline:.0f} s of the run")
            continue
        name = f"H{H} B{B} L{L}"
        _WATCH.update(name="bench " + name, since=time.time())
        try:
            c64 = make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
            c1 = to_page1(c64, seed=B)
            ref_o, _ = reference(c64, nreq=min(B, 2))
            row = dict(shape=name, floor=B * L * (DC + DK) / 4.2e12 * 1e3)
            for tag, c in (("p64", c64), ("p1", c1)):
                p = Plan(c)
                p.run()
                torch.cuda.synchronize()
                row[tag + "_err"] = float((p.out[:2].double() - ref_o).norm() / ref_o.norm())
                row[tag] = graph_ms(p.run, flush, reps=reps)
                del p
            row["ratio"] = row["p1"] / row["p64"]
            log(f"  {name:16s} p64 {row['p64']:.4f} ms  p1 {row['p1']:.4f} ms  p1/p64 {row['ratio']:.3f}  "
                f"err {row['p64_err']:.1e} / {row['p1_err']:.1e}")
            table.append(row)
            RESULTS["bench"].append(row)
            del c64, c1
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: {type(e).__name__}: {str(e)[:300]}")
    _WATCH["name"] = None
    # last: ids out of range (a fault here would poison the context, so after the timings)
    results.append(("H16 p1 page ids out of range", _guarded("H16 p1 page ids out of range", _page1_bad_ids)))
    ok = all(r for _, r in results)
    log("")
    log("== page1 summary ==")
    for name, r in results:
        log(f"  {'PASS' if r else 'FAIL'}  {name}")
    log(f"CHECKS {'ALL PASS' if ok else 'SOME FAIL'} ({sum(r for _, r in results)}/{len(results)})")
    for r in table:
        within = r["ratio"] <= 1.15
        log(f"  {r['shape']:16s} page64 {r['p64']:.4f}  page1 {r['p1']:.4f} ms  p1/p64 {r['ratio']:.3f} "
            f"({'within' if within else 'OVER'} 15%)  floor {r['floor']:.4f}  err p1 {r['p1_err']:.1e}")
    log(f"run time {time.time() - T_START:.0f} s")
    return ok


# ------------------------------------------------------------------------------------------------------------
# multi-token decode (MTP / speculative): rows = (query token, head) pairs on the wide variant
# ------------------------------------------------------------------------------------------------------------
def mtp_case(kv_lens, qo_lens, H, page, *, seed=0, causal=True, nan_pool=True, extra=0, q_dtype=torch.bfloat16,
             ckv_scale=1.0, kpe_scale=1.0, spare=3):
    """``make_case`` (device-side values, NaN pools) with qo_lens[b] query tokens per request."""
    c = make_case(kv_lens, H, page, seed=seed, nan_pool=nan_pool, extra=extra, q_dtype=q_dtype, ckv_scale=ckv_scale,
                  kpe_scale=kpe_scale, spare=spare)
    n = sum(qo_lens)
    gd = torch.Generator(device=DEV).manual_seed(seed + 7)
    qo = [0]
    for q in qo_lens:
        qo.append(qo[-1] + q)
    c.update(qo_indptr=torch.tensor(qo, dtype=torch.int32, device=DEV), qo_lens=list(qo_lens), causal=causal,
             q_nope=torch.randn(n, H, DC, device=DEV, generator=gd).to(q_dtype),
             q_pe=torch.randn(n, H, DK, device=DEV, generator=gd).to(q_dtype))
    return c


def mtp_attn(c, backend, **opts):
    """An MLAPagedAttention planned on case ``c``; returns (attn, run(), out, lse) with poisoned outputs."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from fp8mla.attention import MLAPagedAttention
    a = MLAPagedAttention(backend=backend, **opts)
    a.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], c["H"], DC, DK, c["page"], c["causal"],
           c["sm_scale"], c["q_nope"].dtype, "fp8_e4m3")
    n = c["q_nope"].shape[0]
    out = torch.full((n, c["H"], DC), float("nan"), dtype=c["q_nope"].dtype, device=DEV)
    lse = torch.full((n, c["H"]), float("nan"), dtype=torch.float32, device=DEV)
    sc = c["scales"].tolist()

    def run():
        a.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, lse=lse, ckv_scale=sc[0], kpe_scale=sc[1])
    return a, run, out, lse


def mtp_compare(name, c, out, lse, extra=""):
    from fp8mla.reference import mla_reference
    sc = c["scales"].tolist()
    ro, rl = mla_reference(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], c["qo_indptr"], c["kv_indptr"],
                           c["kv_indices"], c["kv_len"], sm_scale=c["sm_scale"], causal=c["causal"],
                           ckv_scale=sc[0], kpe_scale=sc[1])
    o, l2 = out.double(), lse.double()
    nan = int(torch.isnan(o).sum() + torch.isnan(l2).sum())
    empty = rl == float("-inf")                      # rows that see no token (kv_len 0, causal kv_len < qo_len)
    empty_ok = bool((o[empty] == 0).all() and (l2[empty] == float("-inf")).all())
    fin = ~empty
    rel = float((o[fin] - ro[fin]).norm() / ro[fin].norm().clamp_min(1e-30)) if fin.any() else 0.0
    le = float((l2[fin] - rl[fin]).abs().max()) if fin.any() else 0.0
    ok = nan == 0 and empty_ok and rel <= 3e-3 and le <= 5e-3
    log(f"CHECK {'PASS' if ok else 'FAIL'} {name:44s} relL2 {rel:.2e} lse {le:.1e} nan {nan} "
        f"empty rows {int(empty.sum())} ok {empty_ok} {extra}")
    RESULTS["checks"].append(dict(name=name, ok=ok, rel_l2=rel, lse_max_abs=le, nan=nan, empty_ok=empty_ok))
    return ok


def mtp_check(name, c, backend="gluon", rerun=False, **opts):
    a, run, out, lse = mtp_attn(c, backend, **opts)
    if a._plan.backend != "gluon":
        log(f"CHECK FAIL {name:44s} planned on {a._plan.backend}, not gluon")
        return False
    run()
    torch.cuda.synchronize()
    same = True
    if rerun:
        o1, l1 = out.clone(), lse.clone()
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        same = torch.equal(o1, out) and torch.equal(l1, lse)
    return mtp_compare(name, c, out, lse, f"rerun-identical {same}" if rerun else "") and same


def _mtp_graph_replan(H, qo):
    """Captured at max qo_len ``qo``; replayed after a re-plan with other lengths, pages and a shorter qo split."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from fp8mla.attention import MLAPagedAttention
    from fp8mla.testing import capture_then_replay
    c = mtp_case([100, 3000, 17], [qo, 1, qo], H, 64, seed=60 + H, extra=0)
    n = 2 * qo + 1
    attn = MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8)
    out = torch.empty(n, H, DC, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(n, H, device=DEV)

    def plan(cc):
        attn.plan(cc["qo_indptr"], cc["kv_indptr"], cc["kv_indices"], cc["kv_len"], H, DC, DK, 64, True,
                  cc["sm_scale"], torch.bfloat16, "fp8_e4m3")

    def run():
        attn.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, lse=lse, ckv_scale=1.0, kpe_scale=1.0)
    plan(c)
    g = capture_then_replay(run, out)
    ok1 = mtp_compare(f"H{H} qo{qo} graph: first replay", c, out, lse)
    pages = c["kv_indices"]
    c2 = dict(c, qo_indptr=torch.tensor([0, 1, 1 + qo, n], dtype=torch.int32, device=DEV),
              kv_len=torch.tensor([2900, 5, 0], dtype=torch.int32, device=DEV),
              kv_indptr=torch.tensor([0, 46, 47, 47], dtype=torch.int32, device=DEV),
              kv_indices=torch.cat([pages[2:48], pages[:1]]), kv_lens=[2900, 5, 0])
    plan(c2)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return ok1 and mtp_compare(f"H{H} qo{qo} graph: replay after re-plan", c2, out, lse)


MTP_SHAPES = [(16, 2, 64, 8192), (16, 4, 64, 8192), (128, 2, 64, 8192)]   # H, qo, B, L


def run_mtp(reps=30):
    os.environ["FP8MLA_GLUON_MTP"] = "1"
    os.environ["FP8MLA_GLUON_WIDE"] = "1"
    os.environ["FP8MLA_GLUON_PAGE1"] = "1"
    checks_deadline = float(os.environ.get("DECODE_V2_CHECKS_DEADLINE", "80"))
    bench_deadline = float(os.environ.get("DECODE_V2_DEADLINE", "120"))
    _WATCH["limit"] = float(os.environ.get("DECODE_V2_HANG_S", "40"))   # per step (compiles included)
    _watchdog()
    odd = [0, 1, 2, 63, 64, 65, 129, 514, 3001]          # kv_len 0, 1 and 2 < qo_len: causally empty rows
    q16 = [2, 3, 1, 4, 2, 8, 5, 2, 7]
    q128 = [2, 3, 1, 4, 2, 3, 4, 2, 1]
    checks = [
        ("H16 p64 mixed qo<=8 causal, NaN pages", lambda: mtp_check(
            "H16 p64 mixed qo<=8 causal, NaN pages", mtp_case(odd, q16, 16, 64, seed=71, extra=1))),
        ("H16 p64 mixed qo<=8 non-causal", lambda: mtp_check(
            "H16 p64 mixed qo<=8 non-causal", mtp_case(odd, q16, 16, 64, seed=72, causal=False, extra=1))),
        ("H128 p64 mixed qo<=4 causal, NaN pages", lambda: mtp_check(
            "H128 p64 mixed qo<=4 causal, NaN pages", mtp_case(odd, q128, 128, 64, seed=73, extra=1))),
        ("H128 p1 qo<=4 non-causal, NaN slots", lambda: mtp_check(
            "H128 p1 qo<=4 non-causal, NaN slots", mtp_case(odd, q128, 128, 1, seed=74, causal=False, extra=1))),
        ("H16 p1 qo<=8 causal", lambda: mtp_check(
            "H16 p1 qo<=8 causal", mtp_case(odd, q16, 16, 1, seed=75, extra=1))),
        ("H16 qo4 B1 L20000 splits fp16 scales, rerun", lambda: mtp_check(
            "H16 qo4 B1 L20000 splits fp16 scales, rerun",
            mtp_case([20000, 3], [4, 4], 16, 64, seed=76, q_dtype=torch.float16, ckv_scale=0.05, kpe_scale=3.0),
            rerun=True, min_chunk=64)),
        ("H128 qo2 B3 splits, rerun", lambda: mtp_check(
            "H128 qo2 B3 splits, rerun", mtp_case([9000, 1, 4097], [2, 2, 1], 128, 64, seed=77), rerun=True,
            min_chunk=64)),
        ("H8 qo8 (64 rows) p16", lambda: mtp_check(
            "H8 qo8 (64 rows) p16", mtp_case([1, 15, 17, 700], [8, 3, 8, 6], 8, 16, seed=78, extra=1))),
        ("H16 qo4 graph replay after re-plan", lambda: _mtp_graph_replan(16, 4)),
        ("H128 qo2 graph replay after re-plan", lambda: _mtp_graph_replan(128, 2)),
    ]
    results = []
    for name, fn in checks:
        if time.time() - T_START > checks_deadline:
            log(f"CHECK SKIP {name} (past {checks_deadline:.0f} s of the run)")
            results.append((name + " (skipped)", False))
            continue
        results.append((name, _guarded(name, fn)))
    # -- timings: gluon MTP vs the Triton kernel, same values, CUDA-graph replay, L2 flushed ---------------------
    flush = Flush()
    table = []
    for H, qo, B, L in MTP_SHAPES:
        if time.time() - T_START > bench_deadline:
            log(f"  skipped H{H} qo{qo} B{B} L{L}: past {bench_deadline:.0f} s of the run")
            continue
        name = f"H{H} qo{qo} B{B} L{L}"
        _WATCH.update(name="bench " + name, since=time.time())
        try:
            c = mtp_case([L] * B, [qo] * B, H, 64, seed=B + H + qo, nan_pool=False, spare=8)
            row = dict(shape=name, floor=B * L * (DC + DK) / 4.2e12 * 1e3)
            outs = {}
            for tag in ("gluon", "triton"):
                a, run, out, _ = mtp_attn(c, tag)
                if a._plan.backend != tag:
                    raise RuntimeError(f"{tag} requested, planned on {a._plan.backend}")
                run()
                torch.cuda.synchronize()
                row[tag] = graph_ms(run, flush, reps=reps)
                outs[tag] = out[: 2 * qo].double()
                del a
            row["err_vs_triton"] = float((outs["gluon"] - outs["triton"]).norm() / outs["triton"].norm())
            row["speedup"] = row["triton"] / row["gluon"]
            log(f"  {name:20s} gluon {row['gluon']:.4f} ms  triton {row['triton']:.4f} ms  x{row['speedup']:.2f}  "
                f"floor {row['floor']:.4f}  gluon vs triton {row['err_vs_triton']:.1e}")
            table.append(row)
            RESULTS["bench"].append(row)
            del c
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: {type(e).__name__}: {str(e)[:300]}")
    _WATCH["name"] = None
    ok = all(r for _, r in results)
    log("")
    log("== mtp summary ==")
    for name, r in results:
        log(f"  {'PASS' if r else 'FAIL'}  {name}")
    log(f"CHECKS {'ALL PASS' if ok else 'SOME FAIL'} ({sum(r for _, r in results)}/{len(results)})")
    for r in table:
        log(f"  {r['shape']:20s} gluon {r['gluon']:.4f}  triton {r['triton']:.4f} ms  x{r['speedup']:.2f}  "
            f"floor {r['floor']:.4f}")
    log(f"run time {time.time() - T_START:.0f} s")
    return ok


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    import triton
    p = torch.cuda.get_device_properties(0)
    RESULTS["env"].update(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                          date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    log(" ".join(f"{k}={v}" for k, v in RESULTS["env"].items()))
    variants = ["ns4", "ns5", "ns4_mt8"]
    shapes, page = SHAPES, 64
    argv = sys.argv[2:]
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):   # same as OUT=dir in the environment
            os.environ["OUT"] = argv[i + 1]
            os.makedirs(argv[i + 1], exist_ok=True)
        if a.startswith("--variants="):
            variants = a.split("=", 1)[1].split(",")
        if a.startswith("--page="):
            page = int(a.split("=", 1)[1])
        if a.startswith("--shapes="):
            shapes = [tuple(int(x) for x in v.split("x")) for v in a.split("=", 1)[1].split(",")]
    ok = True
    try:
        if what in ("check", "all"):
            ok = run_checks()
        if what == "probe":
            hgmma_probe()
        if what in ("bench", "all") and ok:
            run_bench(variants, with_triton="--no-triton" not in sys.argv, shapes=shapes, page=page)
        if what == "page1":
            ok = run_page1()
        if what == "mtp":
            ok = run_mtp()
        if what == "h128":
            hv = variants if any(a.startswith("--variants=") for a in sys.argv) else ["ns3", "ns3_mt8", "cmp_ns3"]
            ok = run_h128(hv, with_triton="--no-triton" not in sys.argv, page=page)
    finally:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"decode_v2_{what}.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
