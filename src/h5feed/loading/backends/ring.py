"""Decode on the CPU straight into the trainer's batch, in a recycled ring of (page-locked) batch slots: what the
`workers` and `threads` backends share.

When h5feed knows the trainer's collate (`h5feed.flavors`), each sample's stored rows
are decoded directly into their place in the final, padded batch: no item tensors, no
cat, no pad, no hand-off copy into shared memory, no pin_memory copy.  Only pad
positions that an earlier batch left non-zero are zeroed.

Batches live in a bounded ring of slots (`h5feed.loading.slots`): one shared-memory file
(memfd) that the trainer's process makes and, when CUDA is available, page-locks once.

- Writers (reader threads in the trainer's process, or DataLoader worker processes, each
  with slots of its own, each mapping the file itself: fork, spawn and forkserver alike)
  claim a free slot, decode a batch into it (`BatchWriter`) and pass on only the slot
  number and the batch's shapes.
- In the loader's delivery thread the backend takes each filled slot, one batch ahead of the
  trainer, wraps it as the batch's tensors and, with `device=`, queues their copy to the GPU on a
  stream of its own.  The slot goes back to the ring when nothing refers to its tensors
  any more and, if CUDA is in use, once a CUDA event recorded at that moment (behind the
  copy to the GPU) has completed.
- A trainer that keeps more batches than the ring holds gets the rest in fresh memory
  (with a warning), never a slot still in use.
- The ring's memory goes back when the loader does (`close()`, the end of a `with` block, or
  the loader being garbage-collected), once the trainer has dropped the batches it still holds.
"""

from __future__ import annotations

import os
import threading
import weakref
from abc import abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from h5feed import tracing
from h5feed.errors import CorruptSampleError
from h5feed.flavors import Batch, BatchPlan, RowKey, TensorSpec, TrainerCollate
from h5feed.loading.backends.base import DecodeBackend, ReadyBatch
from h5feed.loading.backends.fp8_crossing import DeviceDequantization
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.loading.delivery import TrainerStream
from h5feed.loading.options import Batching
from h5feed.loading.placement import place_items
from h5feed.loading.slots import FILLED, FILLING, FREE, SlotLayout, SlotReturns, SlotRing
from h5feed.observe.metrics import WorkerCounters
from h5feed.store import HIDDEN_ARRAYS, HIDDEN_SCALES, BufferPool, ReadStats, shared_allocator
from h5feed.store.fp8 import dequantize_into


@dataclass
class FilledBatch:
    """What a writer passes on: the slot it filled and the shapes in it, or (no slot free) the batch itself;
    neither when every sample of the batch was damaged and skipped (on_corrupt="skip")."""

    slot: int | None
    specs: dict[str, TensorSpec]
    extras: dict[str, Any]  # the batch's non-tensor values (error_records)
    samples: int  # the schedule's samples it stands for, skipped ones included (the resume position counts them)
    batch: Batch | None = None

    @property
    def empty(self) -> bool:
        return self.slot is None and self.batch is None


@dataclass
class BatchWriter:
    """Decodes the samples of one batch straight into their places in a slot (or fresh memory when none is free)."""

    stream: HiddenStatesStream
    collate: TrainerCollate
    ring: SlotRing
    layout: SlotLayout
    trailing: dict[str, TensorSpec]  # each row key's per-position shape and dtype
    crossing: DeviceDequantization = DeviceDequantization.NONE  # an FP8 store's hidden states kept for the GPU
    _pool: BufferPool = field(init=False, repr=False)  # buffers for rows decoded before a cast (per process)

    def __post_init__(self) -> None:
        self._pool = BufferPool(capacity=8)

    @property
    def row_keys(self) -> list[RowKey]:
        """The keys placed row by row: the collate's, and the scales of hidden states that cross as FP8."""
        return self.crossing.row_keys(self.collate.row_keys)

    def specs(self, plan: BatchPlan) -> dict[str, TensorSpec]:
        """The slot's tensors of a batch of `plan`."""
        return self.crossing.specs(self.collate.specs(plan, self.trailing), self.trailing)

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_pool"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def will_need(self, indices: Sequence[int]) -> None:
        """Start the disk on these samples' chunks now (returns at once)."""
        for i in indices:
            self.stream.store.will_need(i, self.stream.tokens_to_read(i))

    def write(self, indices: Sequence[int], slot: int | None) -> FilledBatch:
        """The batch of these samples, in `slot` (None: fresh memory).

        With on_corrupt="skip" a damaged sample is left out and the batch is made again from the
        sound rest, in their order: the batch is smaller, the batches after it are as scheduled, and
        one of nothing but damaged samples is passed on empty (the trainer gets no batch for it).
        """
        counters = self.stream.counters.worker()
        sound = list(indices)
        while True:
            try:
                return self._fill(sound, slot, len(indices), counters)
            except CorruptSampleError as error:
                if error.sample not in sound:
                    raise
                self.stream.skip_damaged(error, counters)  # raises it with on_corrupt="raise"
                sound.remove(error.sample)
                if slot is not None:  # rows of the abandoned attempt may lie past the slot's marks
                    self.ring.dirty[slot] = np.iinfo(np.int64).max

    def _fill(self, indices: list[int], slot: int | None, scheduled: int, counters: WorkerCounters) -> FilledBatch:
        if not indices:
            if slot is not None:
                self.ring.states[slot] = FREE
            return FilledBatch(None, {}, {}, scheduled)
        store, collate = self.stream.store, self.collate
        tokens = [int(store.sample_lengths[i]) for i in indices]
        plan = collate.plan([collate.item_rows(t) for t in tokens])
        specs = self.specs(plan)
        if slot is None:
            batch: Batch = {key: shared_allocator(*spec) for key, spec in specs.items()}
        else:
            batch = self.layout.views(self.ring.memory(slot), specs)

        def decode_rows(n: int, rows: dict[RowKey, torch.Tensor]) -> None:
            counters.begin_sample(indices[n])
            with tracing.nvtx_range("h5feed: decode a sample"):  # its span: the counters' "sample"
                for rk, dest in rows.items():
                    if rk.array is not None:  # the rest derive_rows writes
                        self._decode(indices[n], rk.array, rk.shift, dest, counters)

        windows = [self.stream.tokens_to_read(i) for i in indices]
        marks = place_items(self.row_keys, plan, batch, decode_rows, windows=windows,
                            dirty=None if slot is None else self.ring.dirty[slot])
        if slot is not None:
            self.ring.dirty[slot] = marks
        for i, place in zip(indices, plan.placements):  # counted once the batch is whole: a retry counts none twice
            counters.end_sample(i, place.count)
        collate.derive_rows(batch, plan)
        collate.write_summary(batch, plan)
        if slot is None:
            return FilledBatch(None, specs, {}, scheduled, batch)
        self.ring.states[slot] = FILLED
        extras = {key: value for key, value in batch.items() if key not in specs}
        return FilledBatch(slot, specs, extras, scheduled)

    def _decode(self, i: int, array: str, start: int, dest: torch.Tensor, stats: ReadStats) -> None:
        """Stored rows [start, start + len(dest)) into `dest`: in place when it has the stored dtype
        (bf16 viewed as its uint16 bits), else through a reused buffer and one cast; an FP8 store's hidden
        states as stored where they cross to the GPU so (a `dest` of bytes), else through a reused buffer,
        dequantized with their tokens' scales."""
        info = self.stream.store.info
        logical, stored = info.logical_dtype(array), info.storage_dtype(array)
        shape = (dest.shape[0], info.width(array)) if info.is_matrix(array) else (dest.shape[0],)
        if info.fp8 and array in HIDDEN_ARRAYS and dest.dtype == stored:
            self.stream.store.read_rows_into(i, array, start, start + dest.shape[0], dest.view(shape), stats)
            return
        if info.fp8 and array in HIDDEN_ARRAYS:
            fp8, scales = self._pool(shape, stored), self._pool((dest.shape[0],), info.storage_dtype(HIDDEN_SCALES))
            self.stream.store.read_rows_into(i, array, start, start + dest.shape[0], fp8, stats)
            self.stream.store.read_rows_into(i, HIDDEN_SCALES, start, start + dest.shape[0], scales, stats)
            dequantize_into(fp8.view(logical), scales.view(torch.float32), dest.view(shape))
            return
        if dest.dtype == logical:
            self.stream.store.read_rows_into(i, array, start, start + dest.shape[0], dest.view(stored).view(shape),
                                             stats)
            return
        scratch = self._pool(shape, stored)
        self.stream.store.read_rows_into(i, array, start, start + dest.shape[0], scratch, stats)
        dest.copy_(scratch.view(logical).view(dest.shape))



class RingBackend(DecodeBackend):
    """A CPU backend: writers decode each batch into a slot of the ring, the delivery thread wraps the slot as the
    trainer's batch (and with `device`, queues its copy to the GPU)."""

    delivery_thread = "h5feed-batch-delivery"
    memory = "batch memory"

    def __init__(self, stream: HiddenStatesStream, collate: TrainerCollate, batching: Batching,
                 device: torch.device | str | None, slots: int, slots_per_writer: int) -> None:
        """`slots_per_writer` slots for each of `slots // slots_per_writer` writers (worker processes, or the
        threads together); with `device`, batches are copied there."""
        store, batch_size = stream.store, batching.batch_size
        self.stream, self.collate, self.batching = stream, collate, batching
        self.device = torch.device(device) if device is not None and torch.device(device).type != "cpu" else None
        self.slots_per_worker = slots_per_writer
        # with a GPU to dequantize on, an FP8 store's hidden states cross as stored (half the bytes, no CPU pass)
        on_gpu = store.info.fp8 and self.device is not None
        crossing = DeviceDequantization.of(collate) if on_gpu else DeviceDequantization.NONE
        trailing = crossing.trailing(collate.trailing())
        longest = max((collate.item_rows(int(store.sample_lengths[i])) for i in stream.indices), default=1)
        largest = collate.specs(collate.largest_plan(batch_size, max(longest, 1)), trailing)
        layout = SlotLayout(crossing.specs(largest, trailing))
        ring = SlotRing(slots, layout.nbytes, len(crossing.row_keys(collate.row_keys)))
        if torch.cuda.is_available():
            ring.page_lock()
        self.writer = BatchWriter(stream, collate, ring, layout, trailing, crossing)
        self._handed_out: set[int] = set()  # slots whose batch the trainer may still hold
        self._lock = threading.RLock()  # _release runs from finalizers, which may fire while it is held
        self._pid = os.getpid()
        self._returns = SlotReturns(ring)
        self._free_ring = weakref.finalize(self, self._returns.free_ring)  # at close(), or when the backend goes
        self._closed = False
        self._copy_stream: torch.cuda.Stream | None = None  # the delivery thread's, for copies to `device`

    @abstractmethod
    def filled_batches(self) -> Generator[FilledBatch, None, None]:
        """The pass's batches as the writers filled them, in the stream's order (in the delivery thread)."""

    def crowded_warning(self) -> str:
        return (f"h5feed: the trainer holds more batches than the {self.slots_per_worker} slots per worker keep; the "
                "rest are built in fresh memory (slower); pass a larger slots_per_worker if that is intended")

    def reclaim(self) -> None:
        """Slots an ended pass had filled go back to the ring."""
        ring = self.writer.ring
        ring.whole()
        with self._lock:
            for slot in range(ring.count):
                if ring.states[slot] in (FILLING, FILLED) and slot not in self._handed_out:
                    ring.states[slot] = FREE

    def close(self) -> None:
        """The ring's memory goes back at once or, while the trainer still holds batches of it, when it drops the
        last."""
        with self._lock:
            self._closed = True
            if not self._handed_out:
                self._free_ring()

    @property
    def holds_memory(self) -> bool:
        return self.writer.ring.fd != -1

    def ready_batches(self, trainer: TrainerStream | None) -> Generator[ReadyBatch, None, None]:
        """Each filled slot wrapped as the trainer's batch (and queued to the GPU)."""
        feed = self.filled_batches()
        skipped = 0  # samples of batches that were all damaged, since the last batch
        try:
            for filled in feed:
                if filled.empty:
                    skipped += filled.samples
                    continue
                yield self._deliver(filled, skipped + filled.samples, trainer)
                skipped = 0
            if skipped:
                yield ReadyBatch(None, skipped)
        finally:
            feed.close()

    def _deliver(self, filled: FilledBatch, passed: int, trainer: TrainerStream | None) -> ReadyBatch:
        """The trainer's batch: the slot wrapped as tensors (or the batch a writer had to make in fresh memory), with
        `device`, its copy queued on the delivery thread's own stream."""
        if filled.slot is None:
            batch = filled.batch
            assert batch is not None
        else:
            with self._lock:
                self._handed_out.add(filled.slot)
            memory = self.writer.ring.batch_memory(filled.slot, self._release)
            batch = {**self.writer.layout.views(memory, filled.specs), **filled.extras}
            del memory
        if trainer is None:
            return ReadyBatch(batch, passed, in_fresh_memory=filled.slot is None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream), \
                tracing.section("h5feed: copy a batch to the GPU", "delivery"):
            on_device = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            if self.writer.crossing.keys:
                on_device = self.writer.crossing.dequantized(on_device)
            copied = torch.cuda.Event()
            copied.record()
            trainer.adopt(on_device)
            del batch  # the slot's last views: its release is recorded on this stream, behind the copy
        return ReadyBatch(on_device, passed, copied, in_fresh_memory=filled.slot is None)

    def _release(self, slot: int) -> None:
        """Nothing refers to the slot's batch any more: it goes back to the ring (`SlotReturns`), and after the
        backend was closed, the last one to go takes the ring's memory with it."""
        if os.getpid() != self._pid:  # a forked child's copy of this backend must not touch the ring
            return
        with self._lock:
            self._handed_out.discard(slot)
            self._returns.give_back(slot)
            if self._closed and not self._handed_out:
                self._free_ring()
