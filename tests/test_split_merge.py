"""The split merge (``fp8mla.kernels.split.merge``), every decode path's: a plain Triton kernel, run by the
interpreter on the CPU against float64 merges. Work-item lists (the Triton dense kernel's and the Gluon builds'):
both paths (sequential, chunked), any BLOCK_P, multi-token rows, lists in any order, empty partials and requests;
``launch_merge`` launches at most one resident wave of programs whatever ``grid_batch`` (a CUDA-graph plan's
request slots), bit-identical to one program per request. Index-row splits (the sparse and V4 kernels,
``merge_splits``): strided out / lse, lse scale. The batch-invariant mode's merge: the same bits whatever the
block sizes."""
from __future__ import annotations

import math

import pytest
import torch

from fp8mla.kernels.split import merge as mm

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


def strides(out, lse):
    """The kernel's out / lse stride arguments."""
    return out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1)


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
        ref_o, ref_l, po, pl, t["qo_indptr"], t["m_ptr"], t["m_list"], t["batch_size"], H, 0, 1.0,
        *strides(ref_o, ref_l), po.stride(0), po.stride(1), pl.stride(0), BLOCK_P=merge_p,
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


@pytest.mark.parametrize("block_p", [2, 4, 64])
def test_merge_any_block_p_matches_float64(block_p):
    """The partials' merge (a plain Triton kernel: the interpreter runs it on the CPU) is correct whatever BLOCK_P
    the plan picked (the adapter sizes it to the longest list it knows; a later re-plan under a captured graph may
    have longer lists): lists of 1..9 partials, empty partials (lse -inf), a request whose partials are all empty."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(block_p)
    H, C, B = 3, DC, 5
    counts = [2, 9, 1, 5, 3]                     # request 2: one item, written by the decode kernel (skipped)
    m_ptr = [0]
    for c in counts:
        m_ptr.append(m_ptr[-1] + c)
    n = m_ptr[-1]
    perm = torch.randperm(n, generator=g)         # partials in any order of the part buffers
    lse_p = torch.randn(n, H, generator=g, dtype=torch.float64) * 4
    lse_p[perm[m_ptr[4]:m_ptr[5]]] = -math.inf    # request 4: all empty
    lse_p[perm[m_ptr[1]], 1] = -math.inf          # one empty partial inside a long list
    o_p = torch.randn(n, H, C, generator=g, dtype=torch.float64)
    out = torch.full((B, H, C), math.nan, dtype=torch.float32, device=dev)
    lse = torch.full((B, H), math.nan, dtype=torch.float32, device=dev)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    bp, bc = block_p, 128
    mm._merge_parts_kernel[(B, H, C // bc)](
        out, lse, o_p.float().to(dev), lse_p.float().to(dev), i32(list(range(B + 1))), i32(m_ptr),
        i32(perm.tolist()), i32([B]), H, 0, 1.0, *strides(out, lse), C * H, C, H,
        BLOCK_P=bp, BLOCK_C=bc, num_warps=4)
    for b, c in enumerate(counts):
        if c < 2:
            assert torch.isnan(out[b]).all(), "a single-item request is the decode kernel's to write"
            continue
        idx = perm[m_ptr[b]:m_ptr[b + 1]]
        lp, op = lse_p[idx], o_p[idx]                 # [c, H], [c, H, C]
        m = lp.max(0).values
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w = torch.exp2(lp - m)
        ws = w.sum(0)
        ref_o = torch.where(ws[:, None] > 0, (w[..., None] * op).sum(0) / ws.clamp_min(1e-300)[:, None], 0.0)
        ref_l = torch.where(ws > 0, m + torch.log2(ws.clamp_min(1e-300)), -math.inf)
        torch.testing.assert_close(out[b].double().cpu(), ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].double().cpu(), ref_l, rtol=1e-5, atol=1e-5)


def test_mtp_merge_maps_rows_to_tokens_and_heads():
    """The partials' merge with multi-token requests: row r of request b goes to (qo_indptr[b] + r // H, r % H),
    rows >= qo_len * H of the max_qo * H grid rows are skipped (they would land on the next request's tokens)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    H, C = 3, DC
    qo_lens, counts = [2, 1, 4, 3], [2, 3, 2, 1]        # request 3: one item, the decode kernel's to write
    max_qo, B = max(qo_lens), len(qo_lens)
    qo_ptr = [0]
    for q in qo_lens:
        qo_ptr.append(qo_ptr[-1] + q)
    m_ptr = [0]
    for c in counts:
        m_ptr.append(m_ptr[-1] + c)
    n, rows = m_ptr[-1], max_qo * H
    lse_p = torch.randn(n, rows, generator=g, dtype=torch.float64) * 3
    o_p = torch.randn(n, rows, C, generator=g, dtype=torch.float64)
    out = torch.full((qo_ptr[-1], H, C), math.nan, dtype=torch.float32, device=dev)
    lse = torch.full((qo_ptr[-1], H), math.nan, dtype=torch.float32, device=dev)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    mm._merge_parts_kernel[(B, rows, C // 128)](
        out, lse, o_p.float().to(dev), lse_p.float().to(dev), i32(qo_ptr), i32(m_ptr), i32(list(range(n))),
        i32([B]), H, 0, 1.0, *strides(out, lse), C * rows, C, rows,
        BLOCK_P=2, BLOCK_C=128, num_warps=4)
    for b in range(B):
        for r in range(qo_lens[b] * H):
            i, h = divmod(r, H)   # row r = query token i x H + head h
            tok = qo_ptr[b] + i
            if counts[b] < 2:
                assert torch.isnan(out[tok, h]).all()
                continue
            lp, op = lse_p[m_ptr[b]:m_ptr[b + 1], r], o_p[m_ptr[b]:m_ptr[b + 1], r]
            w = torch.exp2(lp - lp.max())
            torch.testing.assert_close(out[tok, h].double().cpu(), (w[:, None] * op).sum(0) / w.sum(),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[tok, h].double().cpu(), lp.max() + torch.log2(w.sum()),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq,rows,bc,min_parts", [(16, 1, 128, 2), (16, 4, 256, 2), (0, 1, 128, 2),
                                                   (0, 2, 512, 2), (16, 2, 512, 4)])
def test_merge_sequential_and_chunked_paths_match_float64(seq, rows, bc, min_parts):
    """Both paths of the merge kernel (interpreter): lists of at most SEQ partials in one sequential
    order, longer ones in BLOCK_P chunks; several rows per program (ROWS), rows past qo_len x H and requests with
    fewer than min_parts partials (written by the decode kernel) untouched, empty partials, all-empty requests, lists in
    any order of the part buffers."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seq + rows + bc + min_parts)
    H, C = 3, DC
    counts, qo_lens = [2, 9, 1, 5, 3, 18], [1, 2, 1, 1, 3, 1]
    B = len(counts)
    qo_ptr, m_ptr = [0], [0]
    for q, c in zip(qo_lens, counts):
        qo_ptr.append(qo_ptr[-1] + q)
        m_ptr.append(m_ptr[-1] + c)
    n, R = m_ptr[-1], max(qo_lens) * H
    perm = torch.randperm(n, generator=g)
    lse_p = torch.randn(n, R, generator=g, dtype=torch.float64) * 4
    lse_p[perm[m_ptr[4]:m_ptr[5]]] = -math.inf     # request 4: all empty
    lse_p[perm[m_ptr[1]], 1] = -math.inf           # one empty partial inside a list
    o_p = torch.randn(n, R, C, generator=g, dtype=torch.float64)
    out = torch.full((qo_ptr[-1], H, C), math.nan, dtype=torch.float32, device=dev)
    lse = torch.full((qo_ptr[-1], H), math.nan, dtype=torch.float32, device=dev)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    mm._merge_parts_kernel[(B, -(-R // rows), C // bc)](
        out, lse, o_p.float().to(dev), lse_p.float().to(dev), i32(qo_ptr), i32(m_ptr), i32(perm.tolist()),
        i32([B]), H, 0, 1.0, *strides(out, lse), C * R, C, R,
        BLOCK_P=4, BLOCK_C=bc, ROWS=rows, min_parts=min_parts, SEQ=seq, num_warps=4)
    for b, c in enumerate(counts):
        toks = slice(qo_ptr[b], qo_ptr[b + 1])
        if c < max(2, min_parts):
            assert torch.isnan(out[toks]).all() and torch.isnan(lse[toks]).all()
            continue
        idx = perm[m_ptr[b]:m_ptr[b + 1]]
        lp, op = lse_p[idx][:, :qo_lens[b] * H], o_p[idx][:, :qo_lens[b] * H]
        m = lp.max(0).values
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w = torch.exp2(lp - m)
        ws = w.sum(0)
        ref_o = torch.where(ws[:, None] > 0, (w[..., None] * op).sum(0) / ws.clamp_min(1e-300)[:, None], 0.0)
        ref_l = torch.where(ws > 0, m + torch.log2(ws.clamp_min(1e-300)), -math.inf)
        torch.testing.assert_close(out[toks].reshape(-1, C).double().cpu(), ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[toks].reshape(-1).double().cpu(), ref_l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_parts", [3, 20])
def test_merge_splits_matches_float64_strided_and_base_e(num_parts):
    """Index-row splits (``merge_splits``: the sparse and V4 kernels' partials t * num_parts + s): every token's
    partials merged in split order against a float64 merge, into a strided out and a transposed lse (poisoned
    first), lse in base e; 3 partials take the sequential path, 20 the chunked one. A NaN partial makes its row NaN,
    an all-empty row gives 0 / -inf."""
    g = torch.Generator().manual_seed(num_parts)
    n, H, C = 5, 6, DC
    lse_p = torch.randn(n * num_parts, H, generator=g, dtype=torch.float64) * 4
    lse_p[1 * num_parts: 2 * num_parts, 2] = -math.inf                # token 1, head 2: all empty
    lse_p[3 * num_parts + 1, 4] = -math.inf                           # one empty partial
    lse_p[2 * num_parts, 5] = math.nan                                # token 2, head 5: NaN
    o_p = torch.randn(n * num_parts, H, C, generator=g, dtype=torch.float64)
    out = torch.full((H, n, C), math.nan, device=DEV).permute(1, 0, 2)   # [n, H, C], heads outermost
    lse = torch.full((H, n), math.nan, device=DEV).t()
    mm.merge_splits(out, lse, o_p.float().to(DEV), lse_p.float().to(DEV), num_parts=num_parts,
                    lse_scale=math.log(2))
    lp, op = lse_p.view(n, num_parts, H), o_p.view(n, num_parts, H, C)
    m = lp.max(1).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lp - m[:, None])
    ws = w.sum(1)
    ref_o = torch.where(ws[..., None] > 0, (w[..., None] * op).sum(1) / ws.clamp_min(1e-300)[..., None], 0.0)
    ref_l = torch.where(ws > 0, (m + torch.log2(ws.clamp_min(1e-300))) * math.log(2), -math.inf)
    assert torch.isnan(out[2, 5]).all() and torch.isnan(lse[2, 5]) and not torch.isnan(out[2, :5]).any()
    ref_o[2, 5], ref_l[2, 5] = out[2, 5].double().cpu(), lse[2, 5].double().cpu()   # (the NaN row, checked above)
    assert out[1, 2].eq(0).all() and lse[1, 2] == -math.inf
    torch.testing.assert_close(out.double().cpu(), ref_o, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse.double().cpu(), ref_l, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_invariant_merge_bits_follow_the_request_only():
    """The batch-invariant mode's merge (``seq=SEQ_ALWAYS``): a request's out / lse bits are the same merged alone
    or beside other requests, whatever the block sizes the batch would pick (``merge_blocks`` of its longest list)
    and the grid; lists of 20 and 40 partials (past SEQ_PARTS: the default merge would take its chunked path, whose
    sums follow BLOCK_P)."""
    g = torch.Generator().manual_seed(7)
    H = 4
    want = None
    for others, block_p, block_c, grid_batch in (([], 16, 128, 1), ([3, 40, 1], 64, 512, 8), ([40, 2], 256, 32, 2)):
        counts = others[:1] + [20] + others[1:]
        mine = 1 if others else 0
        B = len(counts)
        n = sum(counts)
        torch.manual_seed(0)
        lse_p = torch.randn(n, H, generator=g) * 4
        o_p = torch.randn(n, H, DC, generator=g)
        first = sum(counts[:mine])
        lse_p[first:first + 20] = torch.linspace(-3, 5, 20 * H).view(20, H)        # the request's own partials
        o_p[first:first + 20] = torch.cos(torch.arange(20 * H * DC, dtype=torch.float32)).view(20, H, DC)
        m_ptr = torch.tensor([0] + torch.cumsum(torch.tensor(counts), 0).tolist(), dtype=torch.int32, device=DEV)
        i32 = dict(dtype=torch.int32, device=DEV)
        out = torch.full((B, H, DC), math.nan, dtype=torch.bfloat16, device=DEV)
        lse = torch.full((B, H), math.nan, device=DEV)
        mm.merge_requests(out, lse, o_p.to(DEV), lse_p.to(DEV), torch.arange(B + 1, **i32), m_ptr,
                          torch.arange(n, **i32), torch.tensor([B], **i32), grid_batch=grid_batch, max_rows=H,
                          num_heads=H, block_p=block_p, block_c=block_c, seq=mm.SEQ_ALWAYS)
        got = (bits(out[mine]).clone(), bits(lse[mine]).clone())
        assert not torch.isnan(lse[mine]).any()
        if want is None:
            want = got
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (counts, block_p, block_c)
