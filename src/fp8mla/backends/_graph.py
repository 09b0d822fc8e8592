"""Fixed device buffers for CUDA-graph capture, shared by the triton and gluon backends: plan() copies into them,
never reallocates, so a captured run() replays right after a re-plan. The small int32 arrays a plan schedules are
views of one flat buffer (``sizes``: name -> capacity, in the order a caller staging them copies), so a plan
scheduled on the host fills them all with one copy; the large arrays (page ids, partials) are separate tensors.
"""
from __future__ import annotations

import torch


MAX_REPLAYS = 128   # recorded device schedules per buffer set (GraphBuffers.replay)


class GraphBuffers:
    """``sizes``: the small int32 arrays' capacities, in flat-buffer order (each rounded up to ``align`` entries:
    4 keeps every view 16-byte aligned); ``big``: the other buffers by name; ``external``: the caller's own
    tensors (FlashInfer's constructor buffers) that replace the buffers of the same name, where on the same device
    and at least as large (``any_size``: names taken at any size, the capacity then being theirs)."""

    # A list while a caller stages the small arrays itself (the decode runner: its own arrays and these in one
    # host -> device copy into a buffer that ``flat`` is a view of, see rebase): load_host appends its
    # ``(values, capacity)`` segments there, in the flat buffer's order, instead of copying.
    sink = None
    rebased = False
    _pool = None

    def __init__(self, sizes: dict, big: dict, device, external: dict | None = None, align: int = 1,
                 any_size: tuple = ()):
        self._replays = {}   # replay(): key -> the recorded CUDA graph (None: eager)
        self.sizes = {key: -(-n // align) * align for key, n in sizes.items()}
        self.flat = torch.zeros(sum(self.sizes.values()), dtype=torch.int32, device=device)
        self.buf, o = {}, 0
        for key, n in self.sizes.items():
            self.buf[key] = self.flat[o: o + n]
            o += n
        self.buf.update(big)
        self.external = set()
        for key, t in (external or {}).items():
            if key in self.buf and t.device == self.buf[key].device and (
                    key in any_size or t.numel() >= self.buf[key].numel()):
                self.buf[key] = t
                self.external.add(key)

    def rebase(self, flat: torch.Tensor) -> None:
        """Move the small int32 arrays into ``flat`` (an int32 device view with room for them, which the caller
        fills through ``sink``). Before any capture: graphs captured earlier would read the old buffer."""
        if flat.numel() < self.flat.numel() or flat.dtype != torch.int32 or self.external & set(self.sizes):
            raise ValueError("rebase: needs an int32 buffer of the flat buffer's size and no external small buffers")
        flat = flat[: self.flat.numel()]
        flat.copy_(self.flat)
        self._replays.clear()   # (recorded on the old buffer)
        self.flat, o = flat, 0
        for key, n in self.sizes.items():
            self.buf[key] = flat[o: o + n]
            o += n
        self.rebased = True

    def load_host(self, arrays: dict, kv_indices: torch.Tensor) -> dict:
        """Fill the buffers from host lists (the host schedule: ``kernels.split.chunk_items_host`` or
        ``tile_items_host``): one copy into the flat buffer
        (zero-padded to each capacity; plus one per external small buffer), and the page ids from ``kv_indices``
        (none when planned from the buffer itself)."""
        if self.sink is not None:
            self.sink += [(arrays[key], n) for key, n in self.sizes.items()]
            if kv_indices.data_ptr() == self.buf["kv_indices"].data_ptr():  # planned from the buffer itself
                return self.buf
            return self.load(dict(kv_indices=kv_indices))
        from ..layout import stage_ints  # pinned: the caching host allocator keeps it until the copy ran
        self.flat.copy_(stage_ints([(arrays[key], n) for key, n in self.sizes.items()], pin=self.flat.is_cuda),
                        non_blocking=True)
        o = 0
        for key, n in self.sizes.items():
            if key in self.external:
                self.buf[key][:n].copy_(self.flat[o: o + n], non_blocking=True)
            o += n
        return self.load(dict(kv_indices=kv_indices))

    def replay(self, key, ops) -> None:
        """Run ``ops`` -- small torch ops that read and write only these buffers (a device schedule: 50-100
        launches, 1.2-2.6 ms of host time per plan on an H100 host, for a decode kernel of ~0.03 ms) -- from a CUDA
        graph recorded at the first call per ``key`` (every shape the ops depend on): one launch after that.
        Eager on a CPU device, inside another capture (the ops are then part of that graph), and for a key whose
        recording failed. The graphs share one memory pool: their temporaries are dead when a replay ends (every
        result is copied into the buffers), and replays run one at a time on the plan's stream."""
        g = self._replays.get(key)
        if g is not None:
            g.replay()
            return
        ops()   # this plan's result (a recording runs nothing)
        if key in self._replays or not self.flat.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        if len(self._replays) >= MAX_REPLAYS:   # the oldest shape goes (an engine's batch sizes are a few dozen)
            self._replays.pop(next(iter(self._replays)))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                ops()
        except RuntimeError:   # an op that cannot be captured: this key stays eager
            g = None
        self._replays[key] = g

    def load(self, tensors: dict) -> dict:
        for key, v in tensors.items():
            dst = self.buf[key][: v.numel()]
            if dst.data_ptr() != v.data_ptr():  # planned straight from the buffer itself: nothing to copy
                dst.copy_(v, non_blocking=True)
        return self.buf
