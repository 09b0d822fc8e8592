"""Varlen (ragged) flash-attention forward over 16-bit K/V, causal aligned to the end of each request, LSE out.

One program owns ``BLOCK_M`` queries of one request and one query head; it walks the request's keys in
``BLOCK_N`` blocks with an online softmax in fp32 (exp2, scores pre-multiplied by ``sm_scale * log2(e)``), P
rounded to the query dtype for the P.V product (never FP8).

Head dims up to 256 that are not powers of two are split into a power-of-two part and a padded tail, so
DeepSeek's 192 = 128 + 64 costs exactly 192 columns of MMA (padding to 256 would cost a third more).
Blocks that are fully visible run without masks; only the diagonal / ragged-end blocks pay for them. The online
softmax (and its NaN / "no keys" rules) is ``kernels/softmax.py``'s, shared with the paged extend kernel.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .softmax import attend_block, causal_bounds, dot, finish, mask_scores

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _block(acc, l_i, m_i, qa, qb, k_ptr, v_ptr, kv_start, kv_len, n0, offs_m, q_len, hk,
           stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
           DQK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr):
    dt = qa.dtype
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < kv_len
    rows = (kv_start + offs_n).to(tl.int64)
    da = tl.arange(0, DA)
    k_row = k_ptr + rows[:, None] * stride_kn + hk * stride_kh
    # -- s = q . k^T, in log2 units --
    if MASKED:
        ka = tl.load(k_row + da[None, :], mask=nmask[:, None] & (da[None, :] < DQK), other=0.0)
    else:
        ka = tl.load(k_row + da[None, :], mask=da[None, :] < DQK, other=0.0)
    zero = tl.zeros([qa.shape[0], BLOCK_N], tl.float32)
    s = dot(qa, tl.trans(ka.to(dt)), zero, FP32_DOT)
    if DB > 0:
        db = DA + tl.arange(0, DB)
        if MASKED:
            kb = tl.load(k_row + db[None, :], mask=nmask[:, None] & (db[None, :] < DQK), other=0.0)
        else:
            kb = tl.load(k_row + db[None, :], mask=db[None, :] < DQK, other=0.0)
        s = dot(qb, tl.trans(kb.to(dt)), s, FP32_DOT)
    s = s * qk_scale
    if MASKED:
        s = mask_scores(s, offs_n, kv_len, offs_m, q_len, CAUSAL)
    dv = tl.arange(0, BLOCK_DV)
    v_row = v_ptr + rows[:, None] * stride_vn + hk * stride_vh + dv[None, :]
    if MASKED:
        v = tl.load(v_row, mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
    else:
        v = tl.load(v_row, mask=dv[None, :] < DV, other=0.0)
    return attend_block(acc, m_i, l_i, s, v.to(dt), FP32_DOT)


@triton.jit
def _ragged_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qo_indptr, kv_indptr,
    qk_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_ln, stride_lh,
    GQA: tl.constexpr, DQK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    # Last query blocks first: under causal masking they see the most keys (longest programs start early).
    qblk = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    q_len = tl.load(qo_indptr + b + 1) - q_start
    if qblk * BLOCK_M >= q_len:
        return
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    hk = h // GQA

    offs_m = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    q_row = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qn + h * stride_qh
    da = tl.arange(0, DA)
    qa = tl.load(q_row + da[None, :], mask=mmask[:, None] & (da[None, :] < DQK), other=0.0)
    if DB > 0:
        db = DA + tl.arange(0, DB)
        qb = tl.load(q_row + db[None, :], mask=mmask[:, None] & (db[None, :] < DQK), other=0.0)
    else:
        qb = qa

    # Row i sees keys <= kv_len - q_len + i; the tile's first row bounds the unmasked blocks.
    full, hi = causal_bounds(kv_len, q_len, qblk * BLOCK_M, BLOCK_M, BLOCK_N, CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _block(acc, l_i, m_i, qa, qb, k_ptr, v_ptr, kv_start, kv_len, n0, offs_m, q_len, hk,
                               stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
                               DQK, DA, DB, DV, BLOCK_DV, BLOCK_N, False, CAUSAL, FP32_DOT)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _block(acc, l_i, m_i, qa, qb, k_ptr, v_ptr, kv_start, kv_len, n0, offs_m, q_len, hk,
                               stride_kn, stride_kh, stride_vn, stride_vh, qk_scale,
                               DQK, DA, DB, DV, BLOCK_DV, BLOCK_N, True, CAUSAL, FP32_DOT)

    # -- epilogue: rows that saw no key get 0 and lse -inf; NaN rows stay NaN --
    out, lse = finish(acc, m_i, l_i, 1.0)
    dv = tl.arange(0, BLOCK_DV)
    rows = (q_start + offs_m).to(tl.int64)
    tl.store(o_ptr + rows[:, None] * stride_on + h * stride_oh + dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mmask[:, None] & (dv[None, :] < DV))
    tl.store(lse_ptr + rows * stride_ln + h * stride_lh, lse, mask=mmask)


def split_head_dim(d: int) -> tuple[int, int]:
    """``(DA, DB)``: a power-of-two main part and a power-of-two tail (0 if none) covering ``d``; each >= 16
    because tl.dot needs K >= 16. 192 -> (128, 64), 96 -> (64, 32), 128 -> (128, 0), 200 -> (128, 128)."""
    if d <= 16:
        return 16, 0
    da = 1 << (d.bit_length() - 1)
    rest = d - da
    return da, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def default_tiles(dqk: int, dv: int, arch: int | None, fp32_dot: bool) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` for head dims ``dqk`` / ``dv`` on sm_<arch> (None: no GPU)."""
    da, db = split_head_dim(dqk)
    block_dv = max(16, triton.next_power_of_2(dv))
    if fp32_dot:  # the interpreter: fewer, larger numpy ops are faster
        return 32, 32, 4, 1
    if arch is not None and arch != 90:
        # SM80/89/120: 64 x 32 tiles, 2 stages, 4 warps (8 past 192 / 128 dims): no spills and <= 99 KB of
        # shared memory (triton 3.9 compiles; tests/test_compile_targets.py). The sm_90 tiles below spill there.
        return 64, 32, (4 if da + db <= 192 and block_dv <= 128 else 8), 2
    if block_dv <= 128:
        return 128, 64, 8, 3
    return 64, 64, 4, 2  # a 128 x 256 fp32 accumulator would spill: halve the query block


def ragged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
                   kv_indptr: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, sm_scale: float,
                   causal: bool, max_qo_len: int, fp32_dot: bool, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> None:
    """Launch the ragged prefill forward.

    Args:
        q: ``[n, Hq, Dqk]``; k: ``[nk, Hk, Dqk]``; v: ``[nk, Hk, Dvo]`` (bf16/fp16, last dim contiguous; k/v are
            converted to q's dtype in registers). Hq must be a multiple of Hk.
        qo_indptr, kv_indptr: ``[B + 1]`` int32 on the device.
        out: ``[n, Hq, Dvo]`` (q dtype, last dim contiguous); lse: ``[n, Hq]`` fp32 (any strides), written in
            base 2. A row without keys gets 0 / -inf; NaN in a query or a used key / value gives a NaN row.
        max_qo_len: the largest ``qo_indptr[b+1] - qo_indptr[b]`` (sizes the grid; no host sync here).
        fp32_dot: do the dots in fp32 (required under TRITON_INTERPRET=1).
        block_m, block_n: tile overrides, powers of two >= 16.
    Bad arguments raise ValueError / TypeError naming them.
    """
    n, Hq, Dqk = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    B = qo_indptr.numel() - 1
    if Hq % Hk:
        raise ValueError(f"q: its {Hq} heads must be a multiple of k's {Hk}")
    if max(Dqk, Dv) > 256:
        raise ValueError(f"q/v: head dims up to 256, got {Dqk}/{Dv}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {tuple(t.stride())}")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: expected int32, got {t.dtype}")
    if tuple(lse.shape) != (n, Hq) or lse.dtype != torch.float32:
        raise ValueError(f"lse: expected fp32 [{n}, {Hq}], got {lse.dtype} {list(lse.shape)}")
    DA, DB = split_head_dim(Dqk)
    BLOCK_DV = max(16, triton.next_power_of_2(Dv))
    arch = None
    if q.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = major * 10 + minor
    bm, bn, nw, ns = default_tiles(Dqk, Dv, arch, fp32_dot)
    block_m, block_n = block_m or bm, block_n or bn
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {val!r}")
    if n == 0 or B == 0 or max_qo_len == 0:
        return
    grid = (triton.cdiv(max_qo_len, block_m), B, Hq)
    _ragged_fwd_kernel[grid](
        q, k, v, out, lse, qo_indptr, kv_indptr, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
        out.stride(1), lse.stride(0), lse.stride(1),
        GQA=Hq // Hk, DQK=Dqk, DA=DA, DB=DB, DV=Dv, BLOCK_DV=BLOCK_DV, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), FP32_DOT=bool(fp32_dot), num_warps=num_warps or nw, num_stages=num_stages or ns,
    )
