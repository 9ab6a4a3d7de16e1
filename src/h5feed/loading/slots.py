"""The ring of batch slots: one shared-memory file (memfd) of fixed-size slots and a table of their states.

The trainer's process makes the ring and, when CUDA is available, page-locks it once;
writers (reader threads, or DataLoader worker processes, each mapping the file itself)
claim a FREE slot, fill it and mark it FILLED; the trainer's process wraps a slot as a
batch's tensors and gives it back (`SlotReturns`) once nothing reads it any more.
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import threading
import time
import warnings
import weakref
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

from h5feed.flavors import TensorSpec

FREE, FILLING, FILLED, DRAINING = 0, 1, 2, 3  # a slot's states; FREE->FILLED by its writer, then back by the trainer
_ALIGN = 64  # bytes: every tensor of a slot starts on a cache line
_POLL_SECONDS = 0.0005  # how often a writer looks again for a slot whose copy to the GPU is finishing


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SlotLayout:
    """Where each key of a batch lives in a slot: byte offsets fixed by the largest batch the loader makes."""

    def __init__(self, largest: dict[str, TensorSpec]) -> None:
        self.offsets: dict[str, int] = {}
        offset = 0
        for key, (shape, dtype) in largest.items():
            self.offsets[key] = offset
            offset += _round_up(math.prod(shape) * dtype.itemsize, _ALIGN)
        self.nbytes = max(offset, _ALIGN)

    def views(self, memory: torch.Tensor, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
        """The batch's tensors in `memory` (a slot's bytes), each contiguous at the start of its key's region."""
        out = {}
        for key, (shape, dtype) in specs.items():
            start = self.offsets[key]
            out[key] = memory[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        return out


class SlotRing:
    """`count` slots of `slot_bytes` in one memfd, after a table of each slot's state and dirty marks.

    Picklable into DataLoader workers (the file descriptor travels, as torch's own shared
    tensors do).  Every process maps what it uses itself: the trainer's process the whole
    file (it wraps any slot and page-locks them all once), a worker the table and its own
    slots, pre-faulted in one go, so a forked worker never relies on its parent's (possibly
    page-locked) mapping.  The memory goes away with the last process that maps it: a crash
    leaves nothing behind.
    """

    def __init__(self, count: int, slot_bytes: int, dirty_fields: int) -> None:
        self.count, self.slot_bytes, self.dirty_fields = count, slot_bytes, dirty_fields
        self.fd = os.memfd_create("h5feed-batch-slots")
        os.ftruncate(self.fd, self._slot_offset(count))
        self.page_locked_at: int | None = None  # the address cudaHostRegister was given, in this process only
        self._pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"fd": reduction.DupFd(self.fd), "count": self.count, "slot_bytes": self.slot_bytes,
                "dirty_fields": self.dirty_fields, "page_locked_at": None, "_pid": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fd = state.pop("fd")
        self.__dict__.update(state)
        self.fd = fd if isinstance(fd, int) else fd.detach()

    def _table_bytes(self) -> int:
        return _round_up(self.count * (1 + self.dirty_fields) * 8, mmap.PAGESIZE)

    def _slot_offset(self, slot: int) -> int:
        return self._table_bytes() + slot * _round_up(self.slot_bytes, mmap.PAGESIZE)

    def _attach(self) -> None:
        """Map the table in this process (first use in each process: a forked child maps anew)."""
        if self._pid == os.getpid():
            return
        table = mmap.mmap(self.fd, self._table_bytes())
        fields = np.frombuffer(table, np.int64, self.count * (1 + self.dirty_fields)).reshape(self.count, -1)
        self.states, self.dirty = fields[:, 0], fields[:, 1:]
        self.lock = threading.Lock()  # a forked child's copy of the parent's may be held
        self._whole: mmap.mmap | None = None
        self._writable: dict[int, torch.Tensor] = {}
        self._pid = os.getpid()

    def whole(self) -> mmap.mmap:
        """The whole file, mapped once in this process (the trainer's)."""
        self._attach()
        if self._whole is None:
            self._whole = mmap.mmap(self.fd, self._slot_offset(self.count))
        return self._whole

    def memory(self, slot: int) -> torch.Tensor:
        """A slot's bytes, for its writer: from the whole map where this process has it, else mapped alone."""
        self._attach()
        if slot not in self._writable:
            if self._whole is not None:
                self._writable[slot] = torch.frombuffer(self._whole, dtype=torch.uint8, count=self.slot_bytes,
                                                        offset=self._slot_offset(slot))
            else:
                own = mmap.mmap(self.fd, _round_up(self.slot_bytes, mmap.PAGESIZE), offset=self._slot_offset(slot),
                                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                self._writable[slot] = torch.frombuffer(own, dtype=torch.uint8, count=self.slot_bytes)
        return self._writable[slot]

    def batch_memory(self, slot: int, on_release: Any) -> torch.Tensor:
        """A slot's bytes as a tensor of their own: `on_release(slot)` runs when nothing refers to them any more
        (every view of it keeps the numpy array below alive, and with it the finalizer unfired)."""
        array = np.frombuffer(self.whole(), np.uint8, self.slot_bytes, self._slot_offset(slot))
        weakref.finalize(array, on_release, slot).atexit = False
        return torch.frombuffer(array, dtype=torch.uint8)

    def claim(self, slots: range) -> int | None:
        """A free slot of `slots`, now FILLING; waits while one is only finishing its copy to the GPU.
        None when every slot is taken: the trainer holds more batches than the ring keeps."""
        self._attach()
        while True:
            with self.lock:
                for slot in slots:
                    if self.states[slot] == FREE:
                        self.states[slot] = FILLING
                        return slot
                draining = any(self.states[slot] == DRAINING for slot in slots)
            if not draining:
                return None
            time.sleep(_POLL_SECONDS)

    def page_lock(self) -> None:
        """Page-lock the slots once (cudaHostRegister), so copies to the GPU from them are asynchronous DMA."""
        start = np.frombuffer(self.whole(), np.uint8).ctypes.data
        error = int(torch.cuda.cudart().cudaHostRegister(start, self._slot_offset(self.count), 1))  # 1: portable
        if error:
            warnings.warn(f"h5feed: cudaHostRegister failed (cudaError {error}); batches stay in pageable memory",
                          stacklevel=3)
            return
        self.page_locked_at = start

    def free(self) -> None:
        """Give the memory back: unlock it, drop this process's maps of it and close its file (again: nothing).

        Only once nothing reads a slot any more (no batch tensor, no copy to the GPU): the pages go with
        the last map of the file in any process, and a worker's maps go with the worker."""
        if self.page_locked_at is not None and self._pid == os.getpid():  # a forked child's copy is not locked
            torch.cuda.cudart().cudaHostUnregister(self.page_locked_at)
        self.page_locked_at = None
        for mapped in ("states", "dirty", "_whole", "_writable"):
            self.__dict__.pop(mapped, None)
        self._pid = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotReturns:
    """Gives a ring's slots back once nothing reads them, and at the end the ring's memory.

    Without CUDA a slot is free once its batch is dropped.  With CUDA, a copy to the GPU queued
    on the current stream may still read it: the slot is DRAINING until an event recorded at the
    drop has completed, which one thread waits for, in drop order; the ring itself is freed
    behind the last of them, and `free_ring` waits for that thread to end.  Why it waits: a
    daemon thread still inside a CUDA call when the interpreter exits is ended by `pthread_exit`
    through PyTorch's C++ frames, and the process aborts ("terminate called without an active
    exception"); the loader's finalizer runs `free_ring` at exit, before daemon threads are ended.
    """

    def __init__(self, ring: SlotRing) -> None:
        self.ring = ring
        self._pending: queue.SimpleQueue[tuple[int, Any] | None] | None = None  # made with the first CUDA drop
        self._draining: threading.Thread | None = None  # the thread that waits for them, made with it
        self._lock = threading.Lock()

    def give_back(self, slot: int) -> None:
        if not torch.cuda.is_initialized():
            self.ring.states[slot] = FREE
            return
        self.ring.states[slot] = DRAINING
        event = torch.cuda.Event()
        event.record()
        self._queue().put((slot, event))

    def free_ring(self) -> None:
        """Free the ring now, or, where copies to the GPU are pending, once they have completed (waited for)."""
        with self._lock:
            if self._pending is None:
                self.ring.free()
                return
            self._pending.put(None)
            draining = self._draining
        if draining is not None and draining is not threading.current_thread():
            draining.join()

    def _queue(self) -> queue.SimpleQueue[tuple[int, Any] | None]:
        with self._lock:
            if self._pending is None:
                self._pending = queue.SimpleQueue()
                self._draining = threading.Thread(target=self._drain, args=(self._pending,), daemon=True,
                                                  name="h5feed-slot-release")
                self._draining.start()
            return self._pending

    def _drain(self, pending: queue.SimpleQueue[tuple[int, Any] | None]) -> None:
        while (returned := pending.get()) is not None:
            slot, event = returned
            event.synchronize()
            self.ring.states[slot] = FREE
        self.ring.free()
