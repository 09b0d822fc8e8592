"""The V4 backends' split counts (``backends.v4_gluon.splits``, ``backends.v4_triton.splits``) and the Gluon launch's
tile chunk, over a grid of sizes on the CPU, against their rules written out here: the Gluon build's one wave of
one CTA per SM, each split walking at least ``min_split`` entries and whole 64-entry tiles of the token's row
(each segment padded to whole tiles); the Triton kernel's twice the SMs in programs, whole key blocks a split; the
batch-invariant cut's ``ceil(entries / invariant_chunk)`` pieces, at least one. No kernel runs."""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from fp8mla.backends import v4_gluon, v4_triton  # noqa: E402
from fp8mla.kernels.sm90 import v4 as sm90_v4  # noqa: E402

SMS = (1, 7, 78, 132)
TOKENS = (1, 2, 3, 5, 64, 200)
HEADS = (1, 8, 64, 65, 128)
TOPKS = ((1, 0), (37, 0), (64, 64), (100, 37), (128, 512), (128, 2048), (640, 1))
MIN_SPLITS = (1, 16, 64, 100, 256, 4096)
PINNED = (None, 1, 2, 3, 7, 40, 1000)


def _cdiv(a, b):
    return -(-a // b)


def _gluon_rule(sms, n, heads, wt, ct, min_split, pinned):
    tiles = _cdiv(wt, 64) + _cdiv(ct, 64)
    if pinned is None:
        most = max(1, min(tiles, tiles * 64 // min_split))
        want = max(1, min(sms // max(1, n * _cdiv(heads, 64)), most))
    else:
        want = pinned
    chunk = _cdiv(tiles, want)
    return chunk, _cdiv(tiles, chunk)


def _triton_rule(sms, n, heads, total, min_split, pinned, block_h, block_n):
    if pinned is None:
        want = max(1, min(_cdiv(2 * sms, max(1, n * _cdiv(heads, block_h))), total // min_split))
    else:
        want = max(1, min(pinned, total))
    chunk = _cdiv(_cdiv(total, want), block_n) * block_n
    return _cdiv(total, chunk)


class _Plan:
    def __init__(self, heads, wt, ct, min_split, pinned, config=None, invariant_chunk=None):
        self.num_heads, self.window_topk, self.compressed_topk = heads, wt, ct
        self.min_split, self.num_splits, self.invariant_chunk = min_split, pinned, invariant_chunk
        self.device, self.config = torch.device("cpu"), config


@pytest.mark.parametrize("sms", SMS)
def test_gluon_splits_are_one_wave_of_whole_tiles(monkeypatch, sms):
    monkeypatch.setattr(v4_gluon, "num_sms", lambda device: sms)
    for n, heads, (wt, ct), min_split, pinned in itertools.product(TOKENS, HEADS, TOPKS, MIN_SPLITS, PINNED):
        p = _Plan(heads, wt, ct, min_split, pinned)
        want = _gluon_rule(sms, n, heads, wt, ct, min_split, pinned)
        assert v4_gluon.splits(p, n) == want[1], (n, heads, wt, ct, min_split, pinned)


def test_gluon_launch_chunks_are_whole_tiles():
    """The tiles each split of ``sm90_v4.v4_attention`` walks (its ``chunk``) and the splits it launches."""
    for (wt, ct), want in itertools.product(TOPKS, (1, 2, 3, 7, 40, 1000)):
        tiles = sm90_v4.tiles_of(wt, ct)[1]
        assert sm90_v4.tile_splits(tiles, want) == _gluon_rule(0, 1, 1, wt, ct, 1, want), (wt, ct, want)


@pytest.mark.parametrize("block_h,block_n", [(16, 32), (64, 64), (32, 128)])
def test_triton_splits_fill_twice_the_sms(monkeypatch, block_h, block_n):
    monkeypatch.setattr(v4_triton, "num_sms", lambda device: 78)
    config = {"block_h": block_h, "block_n": block_n}
    for n, heads, (wt, ct), min_split, pinned in itertools.product(TOKENS, HEADS, TOPKS, MIN_SPLITS, PINNED):
        p = _Plan(heads, wt, ct, min_split, pinned, config)
        want = _triton_rule(78, n, heads, wt + ct, min_split, pinned, block_h, block_n)
        assert v4_triton.splits(p, n) == want, (n, heads, wt, ct, min_split, pinned)


def test_invariant_splits_cut_the_longest_row():
    for (wt, ct), chunk in itertools.product(TOPKS, (64, 128, 512)):
        p = _Plan(64, wt, ct, 256, None, {"block_h": 64, "block_n": 64}, invariant_chunk=chunk)
        assert v4_triton.splits(p, 1) == v4_triton.splits(p, 200) == max(1, _cdiv(wt + ct, chunk))
    from fp8mla.kernels.v4_attention import invariant_programs
    assert invariant_programs(0, 64) == 1   # a row without entries still has the program that writes its output
