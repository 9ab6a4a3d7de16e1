"""Where decoded samples land: plain, shared or pooled memory.

A fresh 100 MB buffer costs ~30 ms of page faults in plain memory and ~55-80 ms
in shared memory; which one is right depends on where the tensor goes next.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def plain_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Ordinary memory (huge pages where the kernel gives them): the cheapest to fill, and right
    whenever the tensor stays in this process or a collate copies it anyway (speculators', SpecForge's)."""
    return torch.empty(shape, dtype=dtype)


def shared_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Shared memory inside a DataLoader worker, so that an item handed on uncollated passes a file
    descriptor instead of being copied (what default_collate does too); plain memory elsewhere.
    Filling fresh shared memory costs about twice plain memory (no huge pages)."""
    if torch.utils.data.get_worker_info() is None:
        return plain_allocator(shape, dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # references to a storage, as torch.utils.weak counts them


class BufferPool:
    """An allocator that hands out big buffers again once nothing outside the pool refers to them.

    A fresh 100 MB buffer costs ~30 ms of page faults (the kernel zeroes every page, 4 KB at a
    time), a third of what decoding it costs; a reused one costs nothing.  A buffer that was sent
    to another process has been moved into shared memory in place, and leaves the pool.
    """

    MIN_BYTES = 1 << 20  # smaller buffers are cheap to make
    ROUND_BYTES = 16 << 20  # sizes are rounded up so that samples of different lengths share buffers

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.saw_sends = False  # a buffer was moved into shared memory: items leave this process as they are
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or _use_count is None:
            return plain_allocator(shape, dtype)
        with self._lock:  # find and claim (set_ adds a reference) in one step
            storage = self._claim(nbytes)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _claim(self, nbytes: int) -> torch.UntypedStorage:
        # Sending a tensor to another process (a DataLoader worker's result queue) moves its storage
        # into shared memory in place: from then on the other process reads it, so never reuse it.
        kept = [s for s in self._storages if not s.is_shared()]
        self.saw_sends = self.saw_sends or len(kept) < len(self._storages)
        self._storages = kept
        free = [s for s in self._storages if _use_count(s._cdata) == 1]
        fitting = [s for s in free if s.nbytes() >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.nbytes())
        storage = torch.UntypedStorage(-(-nbytes // self.ROUND_BYTES) * self.ROUND_BYTES)
        if len(self._storages) >= self.capacity and free:  # make room: drop a free one that is too small
            self._storages.remove(min(free, key=lambda s: s.nbytes()))
        if len(self._storages) < self.capacity:
            self._storages.append(storage)
        return storage
