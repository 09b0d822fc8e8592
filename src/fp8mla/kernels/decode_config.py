"""The host side of the split-KV decode kernel (``kernels.decode``): its mode constants (``KV_MODE``, ``V_CVT``,
``RAW_FP8``) and the launch configuration a GPU gets by default (tile sizes, warps, stages, V conversion, column
chunks), kept apart from the ``@triton.jit`` code so that choosing a configuration needs no kernel source."""
from __future__ import annotations

__all__ = ["GROUP_SIZE", "KV_BF16", "KV_FP8_FP16_MATH", "KV_GROUP", "LOG2E", "RAW_E4M3", "RAW_E5M2", "V_ASM",
           "V_CONVERT", "V_PLAIN", "check_tile", "column_chunks", "default_config", "device_arch", "is_pow2"]

# KV_MODE values. KV_FP8_FP16_MATH: FP8 (or fp16) storage, fp16 MMAs.
KV_FP8_FP16_MATH, KV_BF16, KV_GROUP = 0, 1, 2
V_PLAIN, V_ASM = 0, 1          # V_CVT values
V_CONVERT = {"plain": V_PLAIN, "asm": V_ASM}
RAW_E4M3, RAW_E5M2 = 1, 2      # RAW_FP8 values (uint8 pools, SM80)
GROUP_SIZE = 128
LOG2E = 1.4426950408889634


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_tile(name: str, value: int, lo: int = 16) -> None:
    """Tile sizes are powers of two (tl.arange) and at least ``lo`` (tl.dot needs 16 rows / columns)."""
    if isinstance(value, bool) or not isinstance(value, int) or not is_pow2(value) or value < lo:
        raise ValueError(f"{name}: expected a power of two >= {lo}, got {value!r}")


def column_chunks(kv_mode: int, head_dim_ckv: int, v_cvt: int) -> int:
    """NCH for a launch: group mode needs chunks inside one 128-channel group; the asm V conversion works on
    <= 128-column chunks; otherwise one chunk (the layout measured on the H200)."""
    if kv_mode == KV_BF16:
        return 1
    if kv_mode == KV_GROUP or v_cvt == V_ASM:
        return max(1, min(4, head_dim_ckv // GROUP_SIZE)) if head_dim_ckv >= GROUP_SIZE else 1
    return 1


def default_config(rows: int, kv_mode: int, arch: int | None) -> dict:
    """``block_m, block_n, num_warps, num_stages, v_convert`` for ``rows`` = heads x longest query on sm_<arch>
    (``arch`` = major * 10 + minor; None = the CPU interpreter).

    sm_90 (and the interpreter): the fastest configuration on the H200: plain V conversion, 4 warps
    for 16-row tiles, BLOCK_N 64 (group format: asm V, BLOCK_N 32, as the backend already used). (Compiled
    with triton 3.9 it spills and has 256 LDS.U8 per tile; the portable
    configuration below has neither: measure ``v_convert="asm", num_warps=8`` there before switching.)
    Other targets (SM80/89/120, the portable path): V converted by inline asm in 128-column chunks, 8 warps,
    16-row tiles with BLOCK_N 64 or 32-row tiles with BLOCK_N 32: no spills, no LDS.U8, <= 95 KB of shared
    memory (SM89/120 allow 99 KB), compiled with triton 3.9 (tests/test_compile_targets.py checks it).
    """
    group = kv_mode == KV_GROUP
    block_m = 16 if rows <= 16 else (32 if arch not in (None, 90) or group else 64)
    if arch in (None, 90):
        if group and block_m > 16:
            # The group format with 64-row wgmma tiles spills (345 spill ops) and faults on the H200 (illegal
            # address under triton 3.6): the portable 32-row tile (mma.sync, asm V, no spills) instead.
            return dict(block_m=32, block_n=32, num_warps=8, num_stages=2, v_convert="asm")
        # BF16 pools with 64-row tiles: BLOCK_N 64 needs 295 KB of shared memory under triton 3.6 (over
        # sm_90's 227 KB; the H200 refused the launch), BLOCK_N 32 half of that.
        block_n = 32 if group or (kv_mode == KV_BF16 and block_m > 16) else 64
        return dict(block_m=block_m, block_n=block_n, num_warps=4 if block_m <= 16 else 8,
                    num_stages=2, v_convert="asm" if group else "plain")
    if group and arch is not None and arch < 89:
        block_m = 16  # SM80 (FP8 as uint8 bits) with group scales: the 32-row tile spills (16 B), the 16-row one not
    return dict(block_m=block_m, block_n=64 if block_m <= 16 else 32, num_warps=8, num_stages=2, v_convert="asm")


def device_arch(t) -> int | None:
    """sm_XX of a CUDA tensor's device as major * 10 + minor (None off CUDA)."""
    if t.device.type != "cuda":
        return None
    import torch
    major, minor = torch.cuda.get_device_capability(t.device)
    return major * 10 + minor
