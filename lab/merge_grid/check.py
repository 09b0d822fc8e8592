"""Bit-identity of lab/merge_grid's merge launches with the product's ``launch_merge`` (not collected by CI).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD/src python lab/merge_grid/check.py --cpu       # interpreter ~10 min
    PYTHONPATH=$PWD/src python lab/merge_grid/check.py --compile                       # sm_90a compile, registers
    PYTHONPATH=$PWD/src python lab/merge_grid/check.py --gpu                           # the same cases on a GPU

Each case: random fp32 partials (rows = query token x H + head, lse base 2) of 1..300 requests with 0..130
partials each (0 and 1: the decode writes those itself, the merge leaves them), shuffled into ``m_list``, some
partials empty (o = 0, lse = -inf), some requests all empty, rows past a request poisoned with NaN, out / lse
pre-filled with NaN; product and variant (each scheme, at a few ``n_sm`` / ``waves`` so that programs walk one
request or many) must leave the same bits everywhere. ``batch_size`` <= ``grid_batch`` (a graph plan's slots).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--cpu" in sys.argv:   # (set before triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import merge_grid as mg  # noqa: E402 - after the interpreter switch
from fp8mla.kernels.sm90 import merge as pm  # noqa: E402

DC = 512


def make_case(seed: int, *, n_req: int, H: int, max_qo: int, max_parts: int, grid_batch: int, device: str,
              p_empty_part: float = 0.1, p_empty_req: float = 0.05, p_single: float = 0.1):
    """(out, lse, t, launch kwargs) of one random merge problem (module docstring)."""
    if grid_batch < n_req:   # (no plan launches fewer request slots than requests: the product would skip some)
        raise ValueError(f"grid_batch: expected >= n_req = {n_req}, got {grid_batch}")
    g = torch.Generator().manual_seed(seed)
    qo = torch.randint(1, max_qo + 1, (n_req,), generator=g)
    qo[torch.rand(n_req, generator=g) < 0.03] = 0                      # requests without query tokens
    parts = torch.randint(0, max_parts + 1, (n_req,), generator=g)
    parts[torch.rand(n_req, generator=g) < p_single] = 1               # written by the decode itself
    parts[0] = max_parts                                               # the longest list is there
    n_items = int(parts.sum())
    rows_cap = max_qo * H
    part_o = torch.randn(n_items + 2, rows_cap, DC, generator=g)
    part_lse = torch.randn(n_items + 2, rows_cap, generator=g) * 4 + 10
    m_ptr = torch.zeros(n_req + 1, dtype=torch.int64)
    m_ptr[1:] = torch.cumsum(parts, 0)
    owner = torch.repeat_interleave(torch.arange(n_req), parts)
    empty = torch.rand(n_items, generator=g) < p_empty_part
    empty |= (torch.rand(n_req, generator=g) < p_empty_req)[owner]    # some requests: every partial empty
    m_list = torch.randperm(n_items + 2, generator=g)[:n_items]        # items in any order, two never listed
    for j in range(n_items):
        it, nrows = int(m_list[j]), int(qo[owner[j]]) * H
        part_o[it, nrows:] = float("nan")                              # rows past the request: never read
        part_lse[it, nrows:] = float("nan")
        if empty[j]:
            part_o[it, :nrows] = 0.0
            part_lse[it, :nrows] = float("-inf")
    qo_indptr = torch.zeros(n_req + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(qo, 0)
    tokens = int(qo_indptr[-1]) + 1
    i32 = dict(dtype=torch.int32, device=device)
    t = dict(part_o=part_o.to(device), part_lse=part_lse.to(device), qo_indptr=qo_indptr.to(**i32),
             m_ptr=m_ptr.to(**i32), m_list=m_list.to(**i32), batch_size=torch.tensor([n_req], **i32))
    out = torch.full((tokens, H, DC), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((tokens, H), float("nan"), dtype=torch.float32, device=device)
    return out, lse, t, dict(grid_batch=grid_batch, max_rows=max_qo * H, num_heads=H)


def cases(gpu: bool):
    """(name, make_case kwargs, [(merge_p, merge_c)]): merge_blocks' sizes and others (any is correct). The
    interpreter runs the first sizes of each case and the smaller batches (~10 min on 2 cores)."""
    big = 4 if gpu else 1
    return [
        ("rows16 B300 p<=20", dict(n_req=300, H=16, max_qo=1, max_parts=20, grid_batch=300,
                                   p_single=0.1 if gpu else 0.85),
         [pm.merge_blocks(20), (32, 512)]),
        ("rows16 B40 p<=8 grid256", dict(n_req=40, H=16, max_qo=1, max_parts=8, grid_batch=256),
         [pm.merge_blocks(8), pm.merge_blocks(8, 40, 16)]),
        ("rows64 p<=130", dict(n_req=3 * big, H=64, max_qo=1, max_parts=130, grid_batch=16),
         [(128, 64), pm.merge_blocks(130)]),
        ("rows64 p<=16 grid64", dict(n_req=9 * big, H=64, max_qo=1, max_parts=16, grid_batch=64),
         [pm.merge_blocks(16), (16, 128)]),
        ("rows128 p<=130", dict(n_req=2 * big, H=128, max_qo=1, max_parts=130, grid_batch=8),
         [(128, 64), pm.merge_blocks(130)]),
        ("rows128 p<=4", dict(n_req=5 * big, H=128, max_qo=1, max_parts=4, grid_batch=12 * big),
         [pm.merge_blocks(4), (4, 256)]),
        ("MTP rows 16x1..3 B30 p<=24", dict(n_req=30, H=16, max_qo=3, max_parts=24, grid_batch=40),
         [pm.merge_blocks(24), pm.merge_blocks(9)]),
        ("MTP rows 32x1..4 p<=12", dict(n_req=7 * big, H=32, max_qo=4, max_parts=12, grid_batch=7 * big),
         [pm.merge_blocks(12), (16, 512)]),
        ("B1 p130 rows128 grid256", dict(n_req=1, H=128, max_qo=1, max_parts=130, grid_batch=256),
         [(128, 64)]),   # (B1 L32k's merge sizes at 128 heads)
    ]


def machines(per: int, gpu: bool):
    """(n_sm, waves) of the variant launches, for ``per`` units (row x column blocks) per request: a machine of
    2 x per + 1 program slots (strided: G = 2, each program walks every other request; flat: units of one request
    split unevenly between programs), and on the GPU also the device's SMs at the kernel's resident count (None)."""
    if not gpu:
        return ((2 * per + 1, 1),)
    import torch
    return ((2 * per + 1, 1), (torch.cuda.get_device_properties(0).multi_processor_count, None))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def run_checks(device: str, only: str | None = None) -> int:
    fails = total = 0
    for ci, (name, kw, sizes) in enumerate(cases(device != "cpu")):
        if only and only not in name:
            continue
        out0, lse0, t, lk = make_case(1000 + ci, device=device, **kw)
        for mp, mc in sizes if device != "cpu" else sizes[:1]:
            t0 = time.time()
            ref_o, ref_l = out0.clone(), lse0.clone()
            pm.launch_merge(ref_o, ref_l, t, merge_p=mp, merge_c=mc, **lk)
            merged = int((~torch.isnan(ref_l)).sum())
            n_prod = mg.programs(mg.grid_of("product", grid_batch=lk["grid_batch"], max_rows=lk["max_rows"],
                                            merge_p=mp, merge_c=mc, n_sm=1))
            for scheme in mg.SCHEMES:
                _, n_r, n_c = mg.merge_geometry(max_rows=lk["max_rows"], merge_p=mp, merge_c=mc)
                for n_sm, waves in machines(n_r * n_c, device != "cpu"):
                    o, ls = out0.clone(), lse0.clone()
                    launch = mg.make_launch_merge(scheme, n_sm, waves)
                    launch(o, ls, t, merge_p=mp, merge_c=mc, **lk)
                    grid = launch.last["grid"]
                    same = torch.equal(bits(o), bits(ref_o)) and torch.equal(bits(ls), bits(ref_l))
                    total += 1
                    fails += not same
                    print(f"{'ok  ' if same else 'FAIL'} {name:28s} p{mp:<3d} c{mc:<3d} {scheme:7s} sm{n_sm:<3d} "
                          f"w{launch.last['waves']} grid {grid}: {mg.programs(grid)} programs, product {n_prod}, "
                          f"rows merged {merged}", flush=True)
            print(f"     ({time.time() - t0:.1f} s)", flush=True)
        if merged == 0:
            print(f"FAIL {name}: no row merged (the case tests nothing)")
            fails += 1
    print(f"{total - fails} of {total} bit-identical" + ("" if not fails else f", {fails} FAILED"))
    return 1 if fails else 0


def compile_report() -> int:
    """Both variants and the product compiled for sm_90a (GPUTarget cuda 90): registers, spills, and the programs
    of 4 warps an H200 SM holds by registers (what ``resident_per_sm`` computes on the device)."""
    for kern in (pm._merge_parts_kernel, mg._merge_strided_kernel, mg._merge_flat_kernel):
        for mp, mc in ((128, 64), (256, 32), (16, 512), (4, 512), (32, 256), (8, 128)):
            r = mg.compile_sm90(kern, merge_p=mp, merge_c=mc, max_rows=128)
            print(f"{kern.__name__:24s} BLOCK_P {mp:3d} BLOCK_C {mc:3d} ROWS {r['rows']}: {r['regs']} registers, "
                  f"{r['stack']} B spill frame, {r['resident']} resident per SM", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="under TRITON_INTERPRET=1 (set by this flag)")
    mode.add_argument("--gpu", action="store_true")
    mode.add_argument("--compile", action="store_true", help="sm_90a compiles without a GPU: registers, spills")
    p.add_argument("--only", default=None, help="cases whose name contains this")
    a = p.parse_args()
    if a.compile:
        return compile_report()
    return run_checks("cpu" if a.cpu else "cuda", a.only)


if __name__ == "__main__":
    sys.exit(main())
