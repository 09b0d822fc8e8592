"""Sizes and variant geometry of the Hopper decode kernel (``docs/kernels/sm90.md``), and the Gluon API it is
written against (triton 3.6's names, with the renames of later versions): importable without Gluon (``gluon`` is
then None and ``GLUON_IMPORT_ERROR`` says why)."""
from __future__ import annotations

from dataclasses import dataclass

try:  # Gluon ships inside triton >= 3.4; the kernel is written against triton 3.6's API
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    # (mbarrier, fence_async_shared and the wgmma are re-exported: the kernel modules import the API from here)
    from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared,  # noqa: F401
                                                                 warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    GLUON_IMPORT_ERROR = None
    # page 1 (cp.async): triton 3.6 names the copy async_copy_global_to_shared; later versions async_load (same
    # arguments; there the old name still exists but raises)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # ... and shared_memory_descriptor._reinterpret became reinterpret
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    # ... and thread_barrier became barrier
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon here"
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"


# exp(x) = exp2(x * LOG2E) (the softmax runs in base 2). fp8mla.runtime.LOG2E is the package's copy; kernels import
# nothing above their layer (docs/architecture.md's layers), so the kernel keeps its own, the same float.
LOG2E = 1.4426950408889634
TILE = 64          # tokens per tile (the MMA's M)
HP = 16            # heads per CTA (the MMA's N), padded
DC, DK = 512, 64
ROW_BYTES = DC + DK
GROUPS = 4         # per-token group scales: one per 128 c_kv columns (fmt fp8_e4m3_group), one per K slab
GROUP_MAX_HPW = 16  # group scales: heads (rows) per consumer of the build (H > 32: more head-group CTAs per slot)
STAGE_BYTES = TILE * ROW_BYTES
SMEM_LIMIT = 232448  # dynamic shared memory per block on sm_90
P8_SCALE = 256.0     # fp8_math: P (<= 1) x this in e4m3 (max 448); P >= 2^-14 stays a normal e4m3 number
FP8_MATH_TERMS = 2   # fp8_math: Q as hi + lo e4m3 terms (exact for bf16 queries)
MAX_WIDE_HEADS = 128
MAX_MTP_QO = 8       # multi-token decode: query tokens per request
MAX_MTP_ROWS = 512   # virtual heads max_qo * H (H16 up to qo 8, H128 up to qo 4)
# The heads-on-M build (``heads_on_m``): 64 heads per CTA on the MMA's M side, 2 FP8 stages, 208 registers for the
# two consumers (16 warps: 48 for each of the two converters); it takes 33..128 heads
MH_HEADS, MH_STAGES, MH_REGS = 64, 2, 208
MH_MIN_HEADS = 33

if gluon is not None:
    GROUPS_C = gl.constexpr(GROUPS)
    P8_SCALE_C = gl.constexpr(P8_SCALE)


def smem_bytes(ns: int, hpw: int = HP, wide: bool = False, qk8: int = 0, group: bool = False) -> int:
    """Shared memory of one CTA: the ring, two Q^T copies (fp16, or ``qk8`` e4m3 terms each plus an unused
    fp16 chunk), two P^T tiles, the consumers' exchange buffer (o, m, l in fp32; a 64-row token in the wide
    variant, which has no exchange), barriers (estimate, +1 KB slack). ``group``: per-token group scales, a
    [64, 4] fp32 scale tile per ring stage and four P^T tiles per consumer (one per group)."""
    xr = 64 if wide else DC
    q = 2 * hpw * (DC + DK) * 2 if not qk8 else 2 * hpw * (qk8 * (DC + DK) + (128 + DK) * 2)
    g = ns * TILE * GROUPS * 4 + 2 * (GROUPS - 1) * hpw * TILE * 2 if group else 0
    return ns * STAGE_BYTES + q + 2 * hpw * TILE * 2 + xr * hpw * 4 + 2 * hpw * 4 + 1024 + g


def mh_smem_bytes(ns: int = MH_STAGES) -> int:
    """Shared memory of the heads-on-M build: Q 72 KB, the fp16 tile 72 KB, ns FP8 stages of 36 KB, P 8 KB, the
    consumers' exchange, barriers (ready and stage-free per stage, ready and free per chunk, three others)."""
    return 64 * 576 * 2 + 64 * 576 * 2 + ns * 64 * 576 + 64 * 64 * 2 + 4 * 64 * 4 + 8 * (ns + 9 + 3 + 9 + ns)


def head_config(num_heads: int, max_hpw: int = 32) -> tuple[int, int, bool]:
    """(hpw, nhg, wide) for ``num_heads``: H <= 16 -> the alternating-tile kernel (16 heads, one CTA per slot);
    17..32 -> wide with 16 heads per consumer (one head group of 32); 33..128 -> wide with 32 heads per consumer,
    ceil(H / 64) head groups of 64 (H = 128: two CTAs per schedule slot). ``max_hpw`` 16 (the group-scale build,
    ``GROUP_MAX_HPW``): 16 heads per consumer at any H, ceil(H / 32) head groups (H = 128: four CTAs per slot)."""
    if num_heads < 1 or num_heads > MAX_WIDE_HEADS:
        raise ValueError(f"num_heads: expected 1..{MAX_WIDE_HEADS}, got {num_heads}")
    if num_heads <= HP:
        return HP, 1, False
    hpw = 16 if num_heads <= 32 or max_hpw < 32 else 32
    return hpw, -(-num_heads // (2 * hpw)), True


def mtp_config(num_heads: int, max_qo: int, max_hpw: int = 32) -> tuple[int, int, bool]:
    """(hpw, nhg, wide) of multi-token decode (max_qo >= 2): rows r = query token r // H, head r % H of a request
    ("virtual heads" Hv = max_qo * H) on the wide variant: 16 rows per consumer for Hv <= 32 (or ``max_hpw`` 16),
    else 32, and ceil(Hv / (2 hpw)) row-group CTAs per schedule slot."""
    if num_heads < 1 or max_qo < 2 or max_qo > MAX_MTP_QO or max_qo * num_heads > MAX_MTP_ROWS:
        raise ValueError(f"num_heads, max_qo: expected 2 <= max_qo <= {MAX_MTP_QO} and max_qo * num_heads <= "
                         f"{MAX_MTP_ROWS}, got num_heads {num_heads}, max_qo {max_qo}")
    hv = max_qo * num_heads
    hpw = 16 if hv <= 32 or max_hpw < 32 else 32
    return hpw, -(-hv // (2 * hpw)), True


def row_config(num_heads: int, max_qo: int = 1, max_hpw: int = 32) -> tuple[int, int, bool]:
    """``head_config`` for one query token per request, ``mtp_config`` for more."""
    return head_config(num_heads, max_hpw) if max_qo <= 1 else mtp_config(num_heads, max_qo, max_hpw)


def padded_heads(num_heads: int, max_qo: int = 1, max_hpw: int = 32) -> int:
    """Rows per work item of the partial buffers (part_o [items, rows, 512], part_lse [items, rows])."""
    hpw, nhg, wide = row_config(num_heads, max_qo, max_hpw)
    return 2 * hpw * nhg if wide else HP


def mtp_row(r: int, num_heads: int) -> tuple[int, int]:
    """(query token, head) of row r of a request in multi-token decode (the kernel's and the merge's mapping)."""
    return r // num_heads, r % num_heads


def mtp_visible(kv_len: int, qo_len: int, i: int, causal: bool) -> int:
    """kv positions [0, n) that query token i of a request sees: causal aligns the queries to the end
    (token i sees positions <= kv_len - qo_len + i, none when that is negative), else all kv_len."""
    return max(0, min(kv_len, kv_len - qo_len + i + 1)) if causal else kv_len


# mla_decode_sm90_kernel's constexprs in the order its ``BUILD`` tuple holds them (the kernel reads BUILD[i] back)
DECODE_CONSTEXPRS = ("PAGE", "NS", "REGS", "HPW", "WIDE", "NHG", "MTP", "QK8", "QKC", "GROUP", "PV8")


@dataclass(frozen=True)
class Sm90Build:
    """One compiled variant of the kernel: every constexpr of ``mla_decode_sm90_kernel`` follows from these fields
    (``constexprs``). ``hpw`` rows per consumer (the MMA's N: heads, or (query token, head) pairs in multi-token
    decode), ``nhg`` head-group CTAs per schedule slot, ``wide`` both consumers on every tile (H > 16 or MTP),
    ``mtp`` 0 one query per request / 1 multi-token causal / 2 not causal, ``group`` per-token group scales,
    ``fp8_math`` e4m3 x e4m3 wgmma for both products, ``stages`` the ring depth, ``regs`` the consumers'
    setmaxnreg. ``for_plan`` derives one from a plan's sizes. ``heads_on_m``: the heads-on-M kernel
    (``heads_on_m.py``; ``for_heads_on_m``): 64 heads per CTA (``hpw`` 64), ``nhg`` = ceil(H / 64) CTAs per work
    item, 2 FP8 stages, 208 registers for the consumers."""
    page_size: int
    hpw: int
    nhg: int
    wide: bool
    mtp: int = 0
    group: bool = False
    fp8_math: bool = False
    stages: int = 3
    regs: int = 240
    heads_on_m: bool = False

    @classmethod
    def for_plan(cls, num_heads: int, page_size: int, max_qo: int = 1, causal: bool = True, group: bool = False,
                 fp8_math: bool = False, stages: int = 3) -> "Sm90Build":
        hpw, nhg, wide = row_config(num_heads, max_qo, GROUP_MAX_HPW if group else 32)
        return cls(page_size, hpw, nhg, wide, 0 if max_qo <= 1 else (1 if causal else 2), group, fp8_math, stages)

    @classmethod
    def for_heads_on_m(cls, num_heads: int, page_size: int) -> "Sm90Build":
        if not MH_MIN_HEADS <= num_heads <= MAX_WIDE_HEADS or page_size % TILE:
            raise ValueError(f"num_heads, page_size: the heads-on-M build takes {MH_MIN_HEADS}..{MAX_WIDE_HEADS} "
                             f"heads and pages of a multiple of {TILE}, got {num_heads}, {page_size}")
        return cls(page_size, MH_HEADS, -(-num_heads // MH_HEADS), True, stages=MH_STAGES, regs=MH_REGS,
                   heads_on_m=True)

    @property
    def q_terms(self) -> int:
        return FP8_MATH_TERMS if self.fp8_math else 0

    def smem(self) -> int:
        if self.heads_on_m:
            return mh_smem_bytes(self.stages)
        return smem_bytes(self.stages, self.hpw, self.wide, self.q_terms, self.group)

    def constexprs(self) -> dict:
        """The kernel's constexprs by name: for the decode kernel every one of ``DECODE_CONSTEXPRS`` (the defaults
        included), for the heads-on-M kernel its four."""
        if self.heads_on_m:   # heads_on_m_kernel's constexprs
            return dict(PAGE=self.page_size, NS=self.stages, REGS=self.regs, NHG=self.nhg)
        # QKC: one score accumulator per 128-column chunk, on the one-query H <= 16 fp8_math kernel only
        return dict(PAGE=self.page_size, NS=self.stages, REGS=self.regs, HPW=self.hpw, WIDE=self.wide,
                    NHG=self.nhg, MTP=self.mtp, QK8=FP8_MATH_TERMS if self.fp8_math else 0,
                    QKC=self.fp8_math and not self.mtp and not self.wide, GROUP=self.group, PV8=self.fp8_math)

    def kernel_constexprs(self) -> dict:
        """The constexpr keyword arguments of a launch: the decode kernel takes its eleven as one tuple ``BUILD``
        (``DECODE_CONSTEXPRS`` order; one parameter instead of eleven), the heads-on-M kernel its four by name."""
        c = self.constexprs()
        return c if self.heads_on_m else {"BUILD": tuple(c[n] for n in DECODE_CONSTEXPRS)}


# The measured builds (H200; the SASS guard, tests/test_sm90_golden.py, compiles each): any plan the selector
# accepts gets the build ``Sm90Build.for_plan`` derives, which is one of these or differs only in sizes.
KNOWN_BUILDS = {
    "h16_p64": Sm90Build.for_plan(16, 64, stages=4),
    "h16_p1": Sm90Build.for_plan(16, 1, stages=4),
    "h128_p64": Sm90Build.for_plan(128, 64),
    "h128_p1": Sm90Build.for_plan(128, 1),
    "mtp_h16_qo2": Sm90Build.for_plan(16, 64, max_qo=2),
    "group_h16": Sm90Build.for_plan(16, 64, group=True),
    "group_h128": Sm90Build.for_plan(128, 64, group=True),
    "fp8_math_h16": Sm90Build.for_plan(16, 64, fp8_math=True),
    "mh128_p64": Sm90Build.for_heads_on_m(128, 64),
    "mh64_p64": Sm90Build.for_heads_on_m(64, 64),
}
