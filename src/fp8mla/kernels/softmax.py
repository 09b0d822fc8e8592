"""The online softmax shared by the attention kernels (decode, extend, ragged): one place for its NaN and
"no keys" rules.

Scores are in log2 units (pre-multiplied by ``sm_scale * log2(e)``); masked entries are ``-inf``. Rules:
  - a row that has seen no key keeps ``m = -inf`` and ``l = 0``: the update shifts by 0 instead of ``m`` so that
    ``exp2(-inf - -inf)`` never happens, and the finished row is ``out 0, lse -inf`` ("no keys");
  - a NaN score (a NaN / inf in the query or in a key, or a key the kernel refused to read) makes ``p`` NaN, so
    ``l`` becomes NaN and stays NaN (``l * alpha`` keeps it): the finished row is NaN, never the "no keys"
    answer. (``tl.max`` skips NaN, so ``m`` stays finite or -inf; ``l`` is what carries the NaN.)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, FP32_DOT: tl.constexpr):
    """``acc + a @ b``. Under TRITON_INTERPRET=1 tl.dot on bf16/fp16 is wrong without an error: there the same
    (already rounded) operands are multiplied in fp32."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One block of scores ``s [M, N]`` into the running max ``m_i`` and sum ``l_i`` ([M] each).
    Returns ``(p, alpha, m_new, l_new)``: the caller rescales its accumulator by ``alpha`` and adds ``p . V``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def attend_block(acc, m_i, l_i, s, v, FP32_DOT: tl.constexpr):
    """``softmax_step`` plus ``acc = acc * alpha + p . v`` with P rounded to v's dtype (16-bit, never FP8).
    Returns ``(acc, m_new, l_new)``."""
    p, alpha, m_new, l_new = softmax_step(s, m_i, l_i)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT)
    return acc, m_new, l_new


@triton.jit
def mask_scores(s, pos, kv_len, qi, q_len, CAUSAL: tl.constexpr):
    """``-inf`` where key ``pos`` is past ``kv_len`` or (causal, aligned to the end) after query ``qi``'s last
    visible key ``kv_len - q_len + qi``."""
    valid = (pos < kv_len)[None, :]
    if CAUSAL:
        valid = valid & (pos[None, :] <= (kv_len - q_len + qi)[:, None])
    return tl.where(valid, s, float("-inf"))


@triton.jit
def causal_bounds(kv_len, q_len, q_first, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(full, hi)`` for a block of ``BLOCK_Q`` queries starting at query ``q_first``: key blocks below ``full``
    are visible to every query (no masks needed), blocks in ``[full, hi)`` need masks, keys past ``hi`` are
    invisible. ``full`` is a multiple of BLOCK_N."""
    if CAUSAL:
        hi = tl.minimum(kv_len, kv_len - q_len + q_first + BLOCK_Q)
        full = tl.minimum(hi, kv_len - q_len + q_first + 1)
    else:
        hi = kv_len
        full = kv_len
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
    return full, hi


@triton.jit
def finish(acc, m_i, l_i, scale):
    """``(out, lse)`` of a finished row block: ``out = acc * scale / l``, ``lse = m + log2 l``; rows with no key
    get out 0 (by where(): their accumulator may hold 0 x NaN from a masked-but-loaded key) and lse -inf; NaN
    rows stay NaN."""
    empty = l_i == 0
    ls = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc * (scale / ls)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(ls))
    return out, lse
