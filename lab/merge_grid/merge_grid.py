"""The split merge on a grid that does not grow with ``max_batch_size`` (lab: the A/B that made ``strided`` the
product's merge grid on 2026-12-02; the product's ``_merge_block`` is now the unit both variants here walk).

The product's ``launch_merge`` (``fp8mla.kernels.sm90.merge``) launches one program per (request slot, row block,
column block) over ``grid_batch`` request slots: a CUDA-graph plan passes the wrapper's ``max_batch_size`` (256),
and the programs past the real batch return at once. At one request of 32k tokens and 128 heads that is 262,144
programs for 1,024 that work, measured +0.153 ms on a 0.047 ms decode (docs/benchmarks.md, "What the CUDA-graph
wrapper adds"). The two launches here keep the program count near one resident wave whatever ``grid_batch``
(``waves``: programs per SM, by default the compiled kernel's resident count, ``resident_per_sm``):

* ``strided``: grid (G, row blocks, column blocks), G = max(1, min(grid_batch, floor(waves x SMs / (row blocks x
  column blocks)))); program (g, r, c) merges block (r, c) of requests g, g + G, ... < batch_size.
* ``flat``: a 1-D grid of min(grid_batch x blocks per request, waves x SMs) programs walking the flattened units
  u = (request x row blocks + row block) x column blocks + column block, u = pid, pid + P, ... < batch_size x
  blocks per request (no rounding to whole requests; neighbouring programs take neighbouring column blocks of a row).

Both read batch_size from device memory, as the product does, so a captured launch replays after any re-plan.
Each unit is ``_merge_block``: the product kernel's per-request arithmetic in its order (the same formulas, the
product's own ``_merge_load_tl`` / ``_merge_step_tl``), with its early returns as one guard, so every request's
out / lse are bit-identical to the product's (the rerun guarantee; lab/merge_grid/check.py checks it).
"""
from __future__ import annotations

import triton
import triton.language as tl

from fp8mla.kernels.sm90.config import DC
from fp8mla.kernels.sm90.merge import SEQ_PARTS, _merge_block, merge_tile
from fp8mla.kernels.sm90.merge import resident_per_sm as pm_resident

# Programs per SM the variants launch: on a GPU, by default, as many of the compiled kernel as an SM holds at once
# (registers, threads, shared memory: ``resident_per_sm``), so the launch is one resident wave and every program
# walks an even share of the units (more would start a second round of whole walks: a tail of several units;
# fewer would leave memory parallelism unused). The sm_90 merge kernels take 72-255 registers per thread (check.py
# --compile): 2-7 programs of 4 warps per SM. WAVES: the count where none is measured (the interpreter, the README's
# program counts), the resident count of the (128, 64) merge (165 registers).
WAVES = 3
SCHEMES = ("strided", "flat")


@triton.jit
def _merge_strided_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H,
                          stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, min_parts=2,
                          SEQ: tl.constexpr = 16):
    """Block (pid 1, pid 2) of requests pid 0, pid 0 + G, ... < batch_size (G = the grid's first size)."""
    for b in range(tl.program_id(0), tl.load(batch_size), tl.num_programs(0)):
        _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, tl.program_id(1),
                     tl.program_id(2), H, stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r,
                     stride_pl_i, BLOCK_P, BLOCK_C, ROWS, min_parts, SEQ)


@triton.jit
def _merge_flat_kernel(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, batch_size, H, n_rblk, n_cblk,
                       stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, min_parts=2,
                       SEQ: tl.constexpr = 16):
    """Units u = pid, pid + P, ... < batch_size x n_rblk x n_cblk, u = (b x n_rblk + row block) x n_cblk + col."""
    per = n_rblk * n_cblk
    for u in range(tl.program_id(0), tl.load(batch_size) * per, tl.num_programs(0)):
        b = u // per
        rc = u - b * per
        rblk = rc // n_cblk
        _merge_block(out, lse_out, part_o, part_lse, qo_indptr, m_ptr, m_list, b, rblk, rc - rblk * n_cblk, H,
                     stride_o_t, stride_o_h, stride_lse_t, stride_po_i, stride_po_r, stride_pl_i,
                     BLOCK_P, BLOCK_C, ROWS, min_parts, SEQ)


def merge_geometry(*, max_rows: int, merge_p: int, merge_c: int) -> tuple[int, int, int]:
    """(rows per program, row blocks, column blocks) of a merge launch: the product ``launch_merge``'s choice."""
    rows_blk = min(merge_tile(merge_c), triton.next_power_of_2(max_rows), max(1, 8192 // (merge_p * merge_c)))
    return rows_blk, triton.cdiv(max_rows, rows_blk), DC // merge_c


def grid_of(scheme: str, *, grid_batch: int, max_rows: int, merge_p: int, merge_c: int, n_sm: int,
            waves: int = WAVES) -> tuple[int, ...]:
    """The launch grid of ``scheme`` ("product": the product's, for the counts in the README)."""
    _, n_r, n_c = merge_geometry(max_rows=max_rows, merge_p=merge_p, merge_c=merge_c)
    per = n_r * n_c
    if scheme == "product":
        return (grid_batch, n_r, n_c)
    if scheme == "strided":   # (rounded down: a program more than the resident wave would be a second round)
        return (max(1, min(grid_batch, waves * n_sm // per)), n_r, n_c)
    if scheme == "flat":
        return (max(1, min(grid_batch * per, waves * n_sm)),)
    raise ValueError(f"scheme: expected one of ('product',) + {SCHEMES}, got {scheme!r}")


def programs(grid: tuple[int, ...]) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def resident_per_sm(kern, args: tuple, kwargs: dict) -> int:
    """Programs of ``kern`` one SM holds at once for these arguments: the product's count (its launch_merge's wave)."""
    return pm_resident(kern, args, kwargs)[1]


def compile_sm90(kern, *, merge_p: int, merge_c: int, max_rows: int) -> dict:
    """``kern`` (the product's or a variant) compiled for sm_90a without a GPU (triton.compile, GPUTarget cuda 90)
    at the launch's constexprs: registers, spill frame (devtools.sass) and programs of 4 warps an H200 SM holds by
    registers (65,536 per SM, rounded up to 8 per thread; at most 16 by threads). Cached per configuration."""
    key = (kern.__name__, merge_p, merge_c, max_rows)
    if key not in _COMPILED:
        import os
        import sys
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from devtools import sass   # (the repository's SASS reader: ptxas / cuobjdump of the triton wheel)
        rows, _, _ = merge_geometry(max_rows=max_rows, merge_p=merge_p, merge_c=merge_c)
        const = dict(BLOCK_P=merge_p, BLOCK_C=merge_c, ROWS=rows, SEQ=SEQ_PARTS)
        ptrs = dict(out="*bf16", lse_out="*fp32", part_o="*fp32", part_lse="*fp32")
        ints = ("H", "n_rblk", "n_cblk", "min_parts")
        names = kern.arg_names
        sig = {n: "constexpr" if n in const else ptrs.get(n, "i32" if n.startswith("stride") or n in ints else "*i32")
               for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
        src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                        attrs=attrs)
        r = sass.analyse(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)))
        _COMPILED[key] = dict(rows=rows, regs=r["regs"], stack=r["stack"],
                              resident=min(16, 65536 // (-(-r["regs"] // 8) * 8 * 128)))
    return _COMPILED[key]


_COMPILED: dict = {}


def make_launch_merge(scheme: str, n_sm: int, waves: int | None = None):
    """A function with ``launch_merge``'s signature that launches ``scheme``'s kernel (to monkeypatch into
    fp8mla.kernels.sm90.kernel / .heads_on_m, which call ``launch_merge`` by their module's name). ``waves``:
    programs per SM; None: ``resident_per_sm`` of the compiled kernel (a GPU only)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    if n_sm < 1 or (waves is not None and waves < 1):
        raise ValueError(f"n_sm / waves: expected >= 1 / None or >= 1, got {n_sm} / {waves}")

    def launch_merge(out, lse, t: dict, *, grid_batch: int, max_rows: int, num_heads: int, merge_p: int,
                     merge_c: int, min_parts: int = 2) -> None:
        po, pl = t["part_o"], t["part_lse"]
        rows_blk, n_r, n_c = merge_geometry(max_rows=max_rows, merge_p=merge_p, merge_c=merge_c)
        args = (out, lse, po, pl, t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], num_heads)
        if scheme == "flat":
            args += (n_r, n_c)
        args += (out.stride(0), out.stride(1), lse.stride(0), po.stride(0), po.stride(1), pl.stride(0))
        kw = dict(BLOCK_P=merge_p, BLOCK_C=merge_c, ROWS=rows_blk, min_parts=min_parts, SEQ=SEQ_PARTS, num_warps=4)
        kern = _merge_flat_kernel if scheme == "flat" else _merge_strided_kernel
        w = waves if waves is not None else resident_per_sm(kern, args, kw)
        launch_merge.last = dict(waves=w, grid=grid_of(scheme, grid_batch=grid_batch, max_rows=max_rows,
                                                       merge_p=merge_p, merge_c=merge_c, n_sm=n_sm, waves=w))
        launch_merge.calls += 1
        kern[launch_merge.last["grid"]](*args, **kw)

    launch_merge.__name__ = f"launch_merge_{scheme}"
    launch_merge.calls, launch_merge.last = 0, None   # (the A/B checks its monkeypatch took, and prints the grid)
    return launch_merge
