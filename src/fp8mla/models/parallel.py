"""Tensor parallelism over torch.distributed for the MLA layer: heads split over the ranks of a process group.

Megatron-style split of one MLA layer over ``world`` ranks (what SGLang and vLLM do for DeepSeek):

- ``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``: replicated. Every rank computes
  the same latents, so every rank's paged cache holds the same tokens (the latent is shared by all heads) and
  the page tables, built by identical allocator calls, are identical.
- ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``: split by output rows, a contiguous block of heads per rank.
- ``o_proj``: split by input columns (the same heads); the partial outputs are summed by ``all_reduce``.

The backend is NCCL on CUDA and gloo on CPU; nothing here is home-made communication.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .._checks import check_positive_int

__all__ = ["TensorParallel", "init_tensor_parallel"]


class TensorParallel:
    """Rank and size of ``group`` (None: one process, no communication)."""

    def __init__(self, group=None):
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            if not dist.is_initialized():
                raise RuntimeError("tp_group: torch.distributed is not initialized (call init_process_group, or "
                                   "launch with torchrun)")
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def head_range(self, num_heads: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's heads: a contiguous block, the same split as the weights."""
        if num_heads % self.size:
            raise ValueError(f"tp_group: {num_heads} attention heads do not split evenly over {self.size} ranks")
        n = num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x


def init_tensor_parallel(tp: int, device: str | None = None):
    """Join the process group that ``torchrun --nproc-per-node tp`` set up (env ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``...). Returns ``(group, device)``: the world group (None when ``tp == 1``) and this rank's
    device (``cuda:LOCAL_RANK`` when CUDA is asked for or available, else ``cpu``). NCCL on CUDA, gloo on CPU."""
    tp = check_positive_int("tp", tp)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if tp == 1:
        return None, dev
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise RuntimeError(f"tp: --tp {tp} needs {tp} processes, found WORLD_SIZE={world}; launch with "
                           f"`torchrun --nproc-per-node {tp} -m fp8mla ...`")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dist.group.WORLD, dev
