"""Fixed device buffers for CUDA-graph capture, shared by the triton and gluon backends: plan() copies into them,
never reallocates, so a captured run() replays right after a re-plan. The small int32 arrays a plan schedules are
views of one flat buffer (``sizes``: name -> capacity, in the order a caller staging them copies), so a plan
scheduled on the host fills them all with one copy; the large arrays (page ids, partials) are separate tensors.
"""
from __future__ import annotations

import torch


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

    def __init__(self, sizes: dict, big: dict, device, external: dict | None = None, align: int = 1,
                 any_size: tuple = ()):
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

    def load(self, tensors: dict) -> dict:
        for key, v in tensors.items():
            dst = self.buf[key][: v.numel()]
            if dst.data_ptr() != v.data_ptr():  # planned straight from the buffer itself: nothing to copy
                dst.copy_(v, non_blocking=True)
        return self.buf
