"""The sm_90 split merge's grid: ``launch_merge`` launches at most one resident wave of programs whatever
``grid_batch`` (a CUDA-graph plan's request slots), each walking requests g, g + G, ... < batch_size; the out / lse
of every request are bit-identical to one program per request, for any wave size (the rerun guarantee does not
depend on which program took a request). A plain Triton kernel: the interpreter runs it on the CPU."""
from __future__ import annotations

import pytest
import torch

from fp8mla.kernels.sm90 import merge as mm

DC = 512
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def problem(seed: int, n_req: int, H: int, max_parts: int):
    """Random partials: lists of 0..max_parts (some single, written by the decode itself), empty partials and
    requests, requests without query tokens, items listed in any order, NaN in rows past a request."""
    g = torch.Generator().manual_seed(seed)
    qo = torch.ones(n_req, dtype=torch.int64)
    qo[torch.rand(n_req, generator=g) < 0.15] = 0
    parts = torch.randint(0, max_parts + 1, (n_req,), generator=g)
    parts[0] = max_parts
    n_items = int(parts.sum())
    part_o = torch.randn(n_items + 1, H, DC, generator=g)
    part_lse = torch.randn(n_items + 1, H, generator=g) * 4 + 10
    owner = torch.repeat_interleave(torch.arange(n_req), parts)
    m_list = torch.randperm(n_items + 1, generator=g)[:n_items]
    for j in range(n_items):
        it = int(m_list[j])
        if qo[owner[j]] == 0:
            part_o[it], part_lse[it] = float("nan"), float("nan")
        elif torch.rand(1, generator=g) < 0.1:
            part_o[it], part_lse[it] = 0.0, float("-inf")
    m_ptr = torch.zeros(n_req + 1, dtype=torch.int64)
    m_ptr[1:] = torch.cumsum(parts, 0)
    qo_indptr = torch.zeros(n_req + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(qo, 0)
    i32 = dict(dtype=torch.int32, device=DEV)
    t = dict(part_o=part_o.to(DEV), part_lse=part_lse.to(DEV), qo_indptr=qo_indptr.to(**i32),
             m_ptr=m_ptr.to(**i32), m_list=m_list.to(**i32), batch_size=torch.tensor([n_req], **i32))
    tokens = int(qo_indptr[-1]) + 1
    out = torch.full((tokens, H, DC), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((tokens, H), float("nan"), dtype=torch.float32, device=DEV)
    return out, lse, t


def bits(x):
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("waves,n_sm", [(1, 1), (3, 2), (7, 132)])
@pytest.mark.parametrize("merge_p,merge_c", [(8, 512), (32, 256)])
def test_wave_grid_bit_identical_to_one_program_per_request(waves, n_sm, merge_p, merge_c, monkeypatch):
    H, n_req = 4, 7
    out0, lse0, t = problem(merge_p + merge_c + waves, n_req, H, max_parts=merge_p if merge_p > 16 else 6)
    # one program per request (G = batch), the grid the kernel had before the wave
    rows_blk = min(mm.merge_tile(merge_c), H, max(1, 8192 // (merge_p * merge_c)))
    ref_o, ref_l = out0.clone(), lse0.clone()
    po, pl = t["part_o"], t["part_lse"]
    mm._merge_parts_kernel[(n_req, -(-H // rows_blk), DC // merge_c)](
        ref_o, ref_l, po, pl, t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], H, ref_o.stride(0),
        ref_o.stride(1), ref_l.stride(0), po.stride(0), po.stride(1), pl.stride(0), BLOCK_P=merge_p,
        BLOCK_C=merge_c, ROWS=rows_blk, min_parts=2, SEQ=mm.SEQ_PARTS, num_warps=4)
    assert (~torch.isnan(ref_l)).any(), "no request was merged: the case tests nothing"
    grids = []
    real = mm._merge_parts_kernel

    class Spy:   # the launch's grid, then the real kernel
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(mm, "_merge_parts_kernel", Spy())
    monkeypatch.setattr(mm, "resident_per_sm", lambda *a, **k: (n_sm, waves))
    for grid_batch in (n_req, 256):     # a plain plan's slots, a CUDA-graph wrapper's
        o, ls = out0.clone(), lse0.clone()
        mm.launch_merge(o, ls, t, grid_batch=grid_batch, max_rows=H, num_heads=H, merge_p=merge_p, merge_c=merge_c)
        g0, n_r, n_c = grids[-1]
        assert g0 == max(1, min(grid_batch, waves * n_sm // (n_r * n_c))), grids[-1]
        assert torch.equal(bits(o), bits(ref_o)) and torch.equal(bits(ls), bits(ref_l)), (grid_batch, grids[-1])
    assert grids[-1][0] <= max(1, waves * n_sm // (grids[-1][1] * grids[-1][2])), "the wave does not grow"


@pytest.mark.skipif(DEV != "cpu", reason="the count off a GPU")
def test_resident_count_off_gpu_is_the_unmeasured_default():
    out, _, _ = problem(0, 2, 2, 3)
    assert mm.resident_per_sm(mm._merge_parts_kernel, (out,), dict(num_warps=4, BLOCK_P=4)) == (1, mm.WAVES)
