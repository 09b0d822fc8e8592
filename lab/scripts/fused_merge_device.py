"""The fused ("last arriver") merge of the Gluon decode kernel on the H200: checks, then timings against the
separate merge kernel. One command, <= ~3 minutes, a compact summary last:

    PYTHONPATH=$PWD/src python3 scripts/fused_merge_device.py [--out DIR]

Checks (each under a hang watchdog; a kernel that never returns ends the run with what passed so far): H16/H128,
pages 1/64, odd lengths (0/1/63/65/97/514/...) with NaN in every unused slot, B1 L32k (many splits: hybrid
<= 16 partials fused and 'all' fused), B8 / B64 L8k: out/lse bit-identical to the separate merge kernel (lists of
<= decode_sm90.SEQ_PARTS partials; longer lists fused with 'all' are checked against float64 only), float64 error,
arrival counters back at 0 after every run, 100 reruns bit-identical (a missing release/acquire would show as a
run-to-run difference), CUDA-graph replay after a re-plan through MLAPagedAttention (FP8MLA_GLUON_FUSED_MERGE=1).
Timings (CUDA graphs, L2 flushed, median): kernel without any merge (a lower bound, output not merged; built
without and with FUSED_MERGE, nothing fused: the fused build's cost in the tile loop), kernel +
merge kernel (today's path), fused with every request ('all': no merge launch), fused <= 16 + merge kernel for
longer lists, and the merge kernel as it was before (separate_v1, the switch-off path until now); floor = KV
bytes / the read ceiling measured in this process. Writes $OUT/fused_merge.json.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("decode_v2_device", os.path.join(ROOT, "scripts/decode_v2_device.py"))
dv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dv)
dsm = dv.dsm          # the kernel module, loaded from its file
log, DEV, DC, DK = dv.log, dv.DEV, dv.DC, dv.DK
RESULTS = dv.RESULTS
T0 = time.time()
CHECKS_DEADLINE = float(os.environ.get("FUSED_CHECKS_DEADLINE", "110"))
BENCH_DEADLINE = float(os.environ.get("FUSED_BENCH_DEADLINE", "165"))
SHAPES = [(16, 1, 32768), (16, 8, 8192), (16, 64, 8192), (128, 8, 8192), (128, 64, 8192)]
TARGETS = {(16, 1, 32768): .012, (16, 8, 8192): .015, (16, 64, 8192): .090, (128, 8, 8192): .040,
           (128, 64, 8192): .26}


class FPlan(dv.Plan):
    """decode_v2_device.Plan (host schedule) + the fused merge: zeroed arrival counters, the merge sized as the
    adapter sizes it (decode_sm90.merge_blocks from the real batch and longest list)."""

    def __init__(self, c, *, fused=False, fuse_max=None, merge=True, **kw):
        super().__init__(c, merge=merge, **kw)
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 132
        m_ptr = self.t["m_ptr"].tolist()
        self.max_parts = max(b - a for a, b in zip(m_ptr, m_ptr[1:])) if self.B else 1
        self.merge_p, self.merge_c = dsm.merge_blocks(self.max_parts, self.B, c["H"], n_sm)
        self.fused = fused
        self.fuse_max = dsm.FUSE_ALL if fuse_max is None else fuse_max
        self.t["merge_cnt"] = torch.zeros(dsm.merge_counters(self.B, c["H"]), dtype=torch.int32, device=DEV)

    def launch_kw(self) -> dict:
        return dict(super().launch_kw(), fused_merge=self.fused, fuse_max=self.fuse_max)


import triton                 # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _merge_v1_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H,
                     stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # The merge kernel as measured before the fused merge (commit f51e41b): one (request, row) per program, an
    # online merge over BLOCK_P partials per step. Timed here as "separate_v1" (what the switch-off path was).
    b = tl.program_id(0)
    if b >= tl.load(batch_size):
        return
    r = tl.program_id(1)
    q0 = tl.load(qo_indptr + b)
    if r >= (tl.load(qo_indptr + b + 1) - q0) * H:
        return
    i0 = tl.load(m_ptr + b)
    i1 = tl.load(m_ptr + b + 1)
    if i1 - i0 < 2:
        return
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_run = float("-inf")
    wsum = 0.0
    acc = tl.zeros([BLOCK_C], tl.float32)
    for i in range(i0, i1, BLOCK_P):
        idx = i + tl.arange(0, BLOCK_P)
        ok = idx < i1
        p = tl.load(m_list + idx, mask=ok, other=0).to(tl.int64)
        lse_i = tl.load(part_lse + p * stride_pl_i + r, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lse_i, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.exp2(m_run - m_use)
        w = tl.exp2(lse_i - m_use)
        o = tl.load(part_o + p[:, None] * stride_po_i + r * stride_po_r + offs_c[None, :],
                    mask=ok[:, None] & (w > 0)[:, None], other=0.0)
        acc = acc * keep + tl.sum(w[:, None] * o, axis=0)
        wsum = wsum * keep + tl.sum(w, axis=0)
        m_run = m_new
    seen = wsum > 0
    o = acc / tl.where(seen, wsum, 1.0)
    tok = (q0 + r // H).to(tl.int64)
    head = r % H
    tl.store(out + tok * stride_o_t + head * stride_o_h + offs_c, o.to(out.dtype.element_ty))
    if tl.program_id(2) == 0:
        m_fin = tl.where(m_run == float("-inf"), 0.0, m_run)
        tl.store(lse_out + tok * stride_lse_t + head,
                 tl.where(seen, m_fin + tl.log2(tl.where(seen, wsum, 1.0)), float("-inf")))


def v1_runner(c):
    """The decode kernel + the pre-fused-merge merge kernel, sized as the adapter sized it then."""
    p = FPlan(c, merge=False)
    bp = min(256, max(2, 1 << (max(1, p.max_parts) - 1).bit_length()))
    bc = min(DC, max(32, 8192 // bp))
    t, H = p.t, c["H"]

    def run():
        p.run()
        _merge_v1_kernel[(p.B, H, DC // bc)](
            p.out, p.lse, t["part_o"], t["part_lse"], t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], H,
            p.out.stride(0), p.out.stride(1), p.lse.stride(0), t["part_o"].stride(0), t["part_o"].stride(1),
            t["part_lse"].stride(0), BLOCK_P=bp, BLOCK_C=bc, num_warps=4)
    return run, p


def _err(c, o, lse):
    ref_o, ref_l = dv.reference(c)
    fin = torch.tensor([L > 0 for L in c["kv_lens"]], device=DEV)
    o, lse = o.double(), lse.double()
    nan = int(torch.isnan(o).sum() + torch.isnan(lse).sum())
    if not fin.any():
        return 0.0, 0.0, nan, bool((o == 0).all() and (lse == -math.inf).all())
    rel = float((o[fin] - ref_o[fin]).norm() / ref_o[fin].norm())
    le = float((lse[fin] - ref_l[fin]).abs().max() / ref_l[fin].abs().max().clamp_min(8.0))
    e = ~fin
    empty_ok = bool((o[e] == 0).all() and (lse[e] == -math.inf).all()) if e.any() else True
    return rel, le, nan, empty_ok


def fused_check(name, c, *, fuse_max=None, identical=True, reruns=100, **kw):
    """Fused vs separate on case c: float64 error, bit-identical (when ``identical``), counters 0, reruns."""
    sep = FPlan(c, **kw)
    fus = FPlan(c, fused=True, fuse_max=fuse_max, **kw)
    for p in (sep, fus):
        p.out.fill_(float("nan"))
        p.lse.fill_(float("nan"))
        p.t["part_o"].fill_(float("nan"))
        p.run()
    torch.cuda.synchronize()
    rel, le, nan, empty_ok = _err(c, fus.out, fus.lse)
    same = bool(torch.equal(sep.out, fus.out) and torch.equal(sep.lse, fus.lse))
    cnt0 = not bool(fus.t["merge_cnt"].any())
    o1, l1 = fus.out.clone(), fus.lse.clone()
    stable = True
    for _ in range(reruns):
        fus.run()
        stable &= bool(torch.equal(o1, fus.out) and torch.equal(l1, fus.lse))   # (syncs every run: fine here)
    cnt0 &= not bool(fus.t["merge_cnt"].any())
    ok = rel <= 3e-3 and le <= 6e-4 and nan == 0 and empty_ok and cnt0 and stable and (same or not identical)
    row = dict(name=name, ok=ok, rel_l2=rel, lse_err=le, nan=nan, empty_ok=empty_ok, identical=same,
               counters_zero=cnt0, reruns_identical=stable, max_parts=fus.max_parts, grid=fus.grid)
    RESULTS["checks"].append(row)
    log(f"CHECK {'PASS' if ok else 'FAIL'} {name:40s} relL2 {rel:.1e} lse {le:.1e} nan {nan} bit-identical "
        f"{same}{'' if identical else ' (not required)'} counters0 {cnt0} {reruns} reruns {stable} "
        f"parts<= {fus.max_parts}")
    return ok


def graph_api_check(H):
    """MLAPagedAttention (CUDA graphs, FP8MLA_GLUON_FUSED_MERGE=1): capture, replay, re-plan (other lengths and
    splits), replay; float64 reference each time, counters 0 after, same counter buffer."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import fp8mla
    from fp8mla.reference import mla_reference
    from fp8mla.testing import capture_then_replay, make_paged_batch
    os.environ["FP8MLA_GLUON_FUSED_MERGE"] = "1"
    os.environ["FP8MLA_GLUON_WIDE"] = "1"
    attn = fp8mla.MLAPagedAttention(use_cuda_graph=True, backend="gluon", max_batch_size=8, min_chunk=256)
    b1 = make_paged_batch([100, 3000, 17, 5000], [1] * 4, H, 64, "fp8_e4m3", device=DEV, seed=11 + H,
                          spare_pages=60)
    attn.plan(**b1.plan_args)
    q_nope, q_pe = b1.run_args["q_nope"].clone(), b1.run_args["q_pe"].clone()
    out = torch.empty_like(q_nope)
    lse = torch.empty(4, H, device=DEV)
    kw = dict(ckv_cache=b1.pool[..., :DC], kpe_cache=b1.pool[..., DC:], ckv_scale=1.0, kpe_scale=1.0)
    g = capture_then_replay(lambda: attn.run(q_nope, q_pe, out=out, lse=lse, **kw), out)
    impl = attn._plan.impl
    cnt = impl.t["merge_cnt"]
    r1 = float((out.double() - b1.reference()[0].double()).norm() / b1.reference()[0].double().norm())
    a = dict(b1.plan_args)
    pages = a["kv_indices"]
    # (request 1's pages 3..48 hold 2900 valid tokens from their start, request 0's first page 100, request 3's
    # pages 50..126 4900)
    a["kv_len_arr"] = torch.tensor([2900, 5, 0, 4900], dtype=torch.int32, device=DEV)
    a["kv_indptr"] = torch.tensor([0, 46, 47, 47, 124], dtype=torch.int32, device=DEV)
    a["kv_indices"] = torch.cat([pages[3:49], pages[:1], pages[50:127]])
    attn.plan(**a)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = mla_reference(q_nope, q_pe, kw["ckv_cache"], kw["kpe_cache"], a["qo_indptr"], a["kv_indptr"],
                           a["kv_indices"], a["kv_len_arr"], sm_scale=a["sm_scale"], causal=True)
    r2 = float((out.double() - ref.double()).norm() / ref.double().norm())
    ok = (impl.fuse_max > 0 and r1 <= 3e-3 and r2 <= 3e-3 and not cnt.any()
          and attn._plan.impl.t["merge_cnt"].data_ptr() == cnt.data_ptr() and not torch.isnan(out).any())
    log(f"CHECK {'PASS' if ok else 'FAIL'} API graph replay after re-plan H{H}      relL2 {r1:.1e} / {r2:.1e} "
        f"counters0 {not cnt.any()} fuse_max {impl.fuse_max}")
    RESULTS["checks"].append(dict(name=f"graph H{H}", ok=ok, rel=(r1, r2)))
    return ok


def run_checks():
    odd = [0, 1, 63, 65, 97, 514, 4096, 130, 3001]
    mk = dv.make_case
    checks = [
        ("H16 p64 odd lens NaN", lambda: fused_check("H16 p64 odd lens NaN", mk(odd, 16, 64, seed=1, extra=1))),
        ("H128 p64 odd lens NaN", lambda: fused_check("H128 p64 odd lens NaN", mk(odd, 128, 64, seed=2, extra=1))),
        ("H16 p1 odd lens NaN slots", lambda: fused_check(
            "H16 p1 odd lens NaN slots", dv.to_page1(mk(odd, 16, 64, seed=3), seed=3, past=1))),
        ("H128 p1 odd lens NaN slots", lambda: fused_check(
            "H128 p1 odd lens NaN slots", dv.to_page1(mk(odd, 128, 64, seed=4), seed=4, past=1), reruns=20)),
        ("H16 B1 L32k fused<=16 + merge", lambda: fused_check(
            "H16 B1 L32k fused<=16 + merge", mk([32768], 16, 64, seed=5), fuse_max=dsm.SEQ_PARTS)),
        ("H16 B1 L32k fused all (132 parts)", lambda: fused_check(
            "H16 B1 L32k fused all (132 parts)", mk([32768], 16, 64, seed=5), identical=False)),
        ("H16 B8 L8k 7 CTAs", lambda: fused_check("H16 B8 L8k 7 CTAs", mk([8192] * 8, 16, 64, seed=6),
                                                  num_ctas=7, fuse_max=dsm.SEQ_PARTS)),
        ("H16 B64 L8k", lambda: fused_check("H16 B64 L8k", mk([8192] * 64, 16, 64, seed=7), reruns=20)),
        ("H128 B8 L8k", lambda: fused_check("H128 B8 L8k", mk([8192] * 8, 128, 64, seed=8), reruns=20)),
        ("H128 B64 L8k", lambda: fused_check("H128 B64 L8k", mk([8192] * 64, 128, 64, seed=9), reruns=10)),
        ("H16 all empty", lambda: fused_check("H16 all empty", mk([0, 0], 16, 64, seed=10))),
        ("API graph H16", lambda: graph_api_check(16)),
        ("API graph H128", lambda: graph_api_check(128)),
    ]
    res = []
    for name, fn in checks:
        if time.time() - T0 > CHECKS_DEADLINE:
            log(f"CHECK SKIP {name} (past {CHECKS_DEADLINE:.0f} s)")
            res.append((name + " (skipped)", False))
            continue
        res.append((name, dv._guarded(name, fn)))
        torch.cuda.empty_cache()
    return res


def run_bench(reps=30):
    flush = dv.Flush()
    read, _ = dv.ceilings(flush)
    RESULTS["env"].update(read_gbs=read, device=torch.cuda.get_device_name(0), torch=torch.__version__,
                          triton=dsm.triton.__version__)
    log(f"read ceiling {read:.0f} GB/s")
    table = []
    for H, B, L in SHAPES:
        if time.time() - T0 > BENCH_DEADLINE:
            log(f"  skipped H{H} B{B} L{L}: past {BENCH_DEADLINE:.0f} s")
            continue
        name = f"H{H} B{B} L{L}"
        dv._WATCH.update(name="bench " + name, since=time.time())
        try:
            c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
            row = dict(shape=name, floor=B * L * (DC + DK) / (read * 1e9) * 1e3, target=TARGETS[(H, B, L)])
            # kernel_only / fused_kernel_only: no merge at all (output not merged), the kernel built without /
            # with FUSED_MERGE (fuse_max 1: nothing fused): what the fused build costs the tile loop
            for tag, kw in (("kernel_only", dict(merge=False)), ("fused_kernel_only",
                                                                  dict(fused=True, fuse_max=1, merge=False)),
                            ("separate", {}), ("fused_all", dict(fused=True)),
                            ("fused16", dict(fused=True, fuse_max=dsm.SEQ_PARTS))):
                p = FPlan(c, **kw)
                row[tag] = dv.graph_ms(p.run, flush, reps=reps)
                row["parts"] = p.max_parts
                del p
            run_v1, p = v1_runner(c)
            row["separate_v1"] = dv.graph_ms(run_v1, flush, reps=reps)
            del p
            log(f"  {name:16s} parts {row['parts']:3d}  kernel-only {row['kernel_only']:.4f} (fused build "
                f"{row['fused_kernel_only']:.4f})  separate_v1 {row['separate_v1']:.4f}  separate "
                f"{row['separate']:.4f}  fused-all {row['fused_all']:.4f}  fused<=16 {row['fused16']:.4f} ms  "
                f"floor {row['floor']:.4f}")
            table.append(row)
            RESULTS["bench"].append(row)
            del c
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: {type(e).__name__}: {str(e)[:300]}")
    dv._WATCH["name"] = None
    return table


def main():
    argv = sys.argv[1:]
    if "--out" in argv:
        os.environ["OUT"] = argv[argv.index("--out") + 1]
    out_dir = os.environ.get("OUT")
    dv._WATCH["limit"] = float(os.environ.get("FUSED_HANG_S", "45"))
    dv._watchdog()
    os.environ["FP8MLA_GLUON_WIDE"] = "1"
    res = run_checks()
    table = run_bench()
    ok = all(r for _, r in res)
    log("")
    log("== fused merge summary ==")
    for name, r in res:
        log(f"  {'PASS' if r else 'FAIL'}  {name}")
    for r in table:
        best = min(r["fused_all"], r["fused16"])
        log(f"  {r['shape']:16s} separate_v1 {r['separate_v1']:.4f}  separate {r['separate']:.4f}  fused-all "
            f"{r['fused_all']:.4f}  fused<=16 "
            f"{r['fused16']:.4f}  kernel-only {r['kernel_only']:.4f} / fused build {r['fused_kernel_only']:.4f} ms  "
            f"(saved {1e3 * (r['separate'] - best):.1f} "
            f"us; merge was {1e3 * (r['separate'] - r['kernel_only']):.1f} us)  floor {r['floor']:.4f} target "
            f"{r['target']:.3f}  parts {r['parts']}")
    log(f"run time {time.time() - T0:.0f} s")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "fused_merge.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log(f"CHECKS {'ALL PASS' if ok else 'SOME FAIL'} ({sum(r for _, r in res)}/{len(res)})")
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
