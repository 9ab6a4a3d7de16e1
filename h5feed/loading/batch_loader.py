"""Decode once, straight into the batch: the trainer's batches, built where the GPU copy reads them.

When h5feed knows the trainer's collate (`h5feed.flavors`), each sample's stored rows
are decoded directly into their place in the final, padded batch: no item tensors, no
cat, no pad, no hand-off copy into shared memory, no pin_memory copy.  Only pad
positions that an earlier batch left non-zero are zeroed.

Batches live in a bounded ring of slots: one shared-memory file (memfd) that the
trainer's process makes and, when CUDA is available, page-locks once.

- Reader threads in the trainer's process (num_workers=0), or DataLoader worker
  processes (each with slots of its own, each mapping the file itself: fork, spawn and
  forkserver alike), claim a free slot, decode a batch into it and pass on only the slot
  number and the batch's shapes.
- A delivery thread in the trainer's process (`h5feed.loading.delivery`) takes each filled
  slot, one batch ahead of the trainer, wraps it as the batch's tensors and, with `device=`,
  queues their copy to the GPU on a stream of its own: the trainer's `next()` only hands
  over a ready batch.  The slot goes back to the ring when nothing refers to its tensors
  any more and, if CUDA is in use, once a CUDA event recorded at that moment (behind the
  copy to the GPU) has completed.
- A trainer that keeps more batches than the ring holds gets the rest in fresh memory
  (with a warning), never a slot still in use.
- The ring's memory goes back when the loader does (`close()`, the end of a `with` block, or
  the loader being garbage-collected), once the trainer has dropped the batches it still holds.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
import warnings
import weakref
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from h5feed.errors import CorruptSampleError
from h5feed.flavors import Batch, RowKey, TensorSpec, TrainerCollate, trainer_collate
from h5feed.gpu import why_unavailable
from h5feed.loading.controls import LoaderControls
from h5feed.loading.cuda_loader import CudaBatchLoader, store_refusal
from h5feed.loading.datasets import HiddenStatesStream, naming_dead_workers, stream_of
from h5feed.loading.delivery import Delivery, TrainerStream
from h5feed.loading.readahead import ReadAhead
from h5feed.loading.schedule import current_worker
from h5feed.loading.slots import FILLED, FILLING, FREE, SlotLayout, SlotReturns, SlotRing
from h5feed.metrics import WorkerCounters, check_worker_count
from h5feed.placement import place_items
from h5feed.store import (
    HIDDEN_ARRAYS,
    HIDDEN_SCALES,
    BufferPool,
    ReadStats,
    Store,
    shared_allocator,
)
from h5feed.store.fp8 import dequantize_into

Decode = Literal["cpu", "cuda", "auto"]
_CPU_DECODE_ONLY = ("num_workers", "slots_per_worker", "multiprocessing_context", "worker_init_fn", "timeout")
_GPU_DECODE_TAKES = ("batch_size", "drop_last", "threads", "prefetch", "device")  # CudaBatchLoader's own arguments
READ_AHEAD_BATCHES = 3  # a worker's batches the disk is asked for ahead of the one it decodes (a cold cache
# needs several requests in flight to reach the disk's rate: one sample ahead per worker left 2 workers at ~60% of it)


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
    _pool: BufferPool = field(init=False, repr=False)  # buffers for rows decoded before a cast (per process)

    def __post_init__(self) -> None:
        self._pool = BufferPool(capacity=8)

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
        specs = collate.specs(plan, self.trailing)
        if slot is None:
            batch: Batch = {key: shared_allocator(*spec) for key, spec in specs.items()}
        else:
            batch = self.layout.views(self.ring.memory(slot), specs)

        def decode_rows(n: int, rows: dict[RowKey, torch.Tensor]) -> None:
            counters.begin_sample(indices[n])
            for rk, dest in rows.items():
                if rk.array is not None:  # the rest derive_rows writes
                    self._decode(indices[n], rk.array, rk.shift, dest, counters)

        windows = [self.stream.tokens_to_read(i) for i in indices]
        marks = place_items(collate.row_keys, plan, batch, decode_rows, windows=windows,
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
        states through a reused buffer, dequantized with their tokens' scales."""
        info = self.stream.store.info
        logical, stored = info.logical_dtype(array), info.storage_dtype(array)
        shape = (dest.shape[0], info.width(array)) if info.is_matrix(array) else (dest.shape[0],)
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


@dataclass
class ReadyBatch:
    """What the delivery thread hands the trainer's thread: a batch (None: only damaged samples were left), the
    schedule's samples it moves the position past, and with `device=` the event its copy to the GPU completes."""

    batch: Batch | None
    passed: int
    copied: torch.cuda.Event | None = None
    in_fresh_memory: bool = False  # no slot was free: the trainer holds more batches than the ring keeps


def _as_is(message: Any) -> Any:
    """The DataLoader's collate for slot messages: they are already what the trainer's process needs."""
    return message


class _SlotFeed(IterableDataset[FilledBatch]):
    """What each DataLoader worker runs: its batches of the stream's order, each decoded into one of its own slots."""

    def __init__(self, writer: BatchWriter, batch_size: int, drop_last: bool, slots_per_worker: int) -> None:
        self.writer, self.batch_size, self.drop_last = writer, batch_size, drop_last
        self.slots_per_worker = slots_per_worker

    def __iter__(self) -> Iterator[FilledBatch]:
        worker, workers = current_worker()
        own = range(worker * self.slots_per_worker, (worker + 1) * self.slots_per_worker)
        batches = self.writer.stream.schedule.worker_batches(self.drop_last, worker, workers)
        self.writer.stream.counters.worker().start()
        for indices in batches[:READ_AHEAD_BATCHES]:
            self.writer.will_need(indices)
        for j, indices in enumerate(batches):
            if j + READ_AHEAD_BATCHES < len(batches):  # the disk works on later batches while this one decodes
                self.writer.will_need(batches[j + READ_AHEAD_BATCHES])
            yield self.writer.write(indices, self.writer.ring.claim(own))


class BatchLoader(LoaderControls):
    """The trainer's batches, decoded straight into a recycled ring of (page-locked) batch buffers.

    Yields exactly what `DataLoader(HiddenStatesStream(...), batch_size=..., collate_fn=
    trainer_collate(flavor, max_len), pin_memory=True)` yields, in the same order, with
    the same sharding and resume (`state_dict`, `set_epoch` as the stream's).

    Args:
        data: an h5feed store (path or `Store`), or a `HiddenStatesStream` (then leave out
            the stream's own arguments).
        decode: where the chunks are decoded: "cpu" (default: worker processes or threads, into
            the ring), "cuda" (a `CudaBatchLoader`: threads read and check the compressed chunks,
            the GPU decodes them; batches arrive on the GPU), or "auto": "cuda" when CUDA and nvCOMP
            are here, the store is Blosc-zstd and exact (not FP8) and no argument of CPU decode
            (num_workers, ...) is given, else "cpu".  An FP8 store's batches hold its hidden states
            dequantized as hs-connectors' FP8Transfer returns them (bf16).
        flavor, max_len, hidden_states_dtype: as `HiddenStatesStream` / `trainer_collate`; without a flavor,
            speculators-legacy where the store fits it, else a ValueError naming the flavors that do.
        batch_size: items per batch (speculators packs them into one max_len row).
        drop_last: leave out the last batch when it is short (SpecForge's loader does).
        num_workers: DataLoader worker processes; 0: `threads` reader threads in this process.
        threads: reader threads with num_workers=0 (default: the cores this process may use, at most 4).
        prefetch: batches in flight per worker (the DataLoader's prefetch_factor), or in all
            with threads.
        device: when given (e.g. "cuda"), batches arrive on it: the delivery thread queues the copy
            from the page-locked slot on a stream of its own, and the trainer's stream waits for it
            (an event; `next()` itself does not wait); otherwise they are CPU tensors in the slot,
            page-locked when CUDA is available.
        slots_per_worker: slots each worker (or the threads) may fill; the default, the batches in
            flight + 2, covers a trainer that holds the batch it is given (in flight: with threads,
            max(prefetch, threads), the delivery thread's ready batch among them; with workers,
            prefetch + 1, the ready batch besides).
        multiprocessing_context, worker_init_fn, timeout: passed to the DataLoader.
        **stream_kwargs: `HiddenStatesStream`'s other arguments (samples, shuffle, seed, rank, on_corrupt, ...).

    With on_corrupt="skip", a batch is its scheduled samples less the damaged ones (see `BatchWriter.write`).
    A worker that dies raises a `WorkerDiedError` naming it, its pid and the sample it was reading.
    `close()` (or the end of a `with` block) gives the ring's memory back; so does dropping the loader.
    """

    def __new__(cls, data: HiddenStatesStream | Store | str | os.PathLike[str], *, decode: Decode = "cpu",
                **kwargs: Any) -> Any:
        """This CPU loader, or for decode on the GPU a `CudaBatchLoader` (then `__init__` does not run)."""
        if decode not in ("cpu", "cuda", "auto"):
            raise ValueError(f"decode must be 'cpu', 'cuda' or 'auto', not {decode!r}")
        cpu_only = [name for name in _CPU_DECODE_ONLY if kwargs.get(name)]
        if decode == "cpu" or (decode == "auto" and (cpu_only or why_unavailable() is not None)):
            return super().__new__(cls)
        if cpu_only:
            raise ValueError(f"{', '.join(cpu_only)} belong to decode='cpu'; decode='cuda' reads with threads in this "
                             "process (threads=, prefetch=)")
        taken = {name: kwargs.pop(name) for name in _GPU_DECODE_TAKES if kwargs.get(name) is not None}
        stream = stream_of(data, kwargs.pop("flavor", None), kwargs.pop("max_len", None),
                           kwargs.pop("hidden_states_dtype", None), kwargs)
        if decode == "auto" and store_refusal(stream.store) is not None:
            return super().__new__(cls)
        return CudaBatchLoader(stream, **taken)

    def __init__(
        self,
        data: HiddenStatesStream | Store | str | os.PathLike[str],
        *,
        decode: Decode = "cpu",
        flavor: str | None = None,
        max_len: int | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        num_workers: int = 0,
        threads: int | None = None,
        prefetch: int = 2,
        device: torch.device | str | None = None,
        slots_per_worker: int | None = None,
        multiprocessing_context: Any = None,
        worker_init_fn: Any = None,
        timeout: float = 0,
        **stream_kwargs: Any,
    ) -> None:
        stream = stream_of(data, flavor, max_len, hidden_states_dtype, stream_kwargs)
        if stream.transform is not None:
            raise ValueError("BatchLoader decodes stored rows straight into the batch, so it cannot run a per-item "
                             "transform; apply noise to the batch instead (see examples/), or use a DataLoader over "
                             "the stream with trainer_collate")
        if batch_size < 1 or num_workers < 0 or prefetch < 1:
            raise ValueError("batch_size and prefetch must be >= 1 and num_workers >= 0")
        check_worker_count(num_workers)
        store = stream.store
        stream.batch_size = batch_size
        stream.schedule.counted_by_loader = True
        self.dataset = stream  # what h5feed.monitor reads its counters from
        self.batch_size, self.drop_last, self.num_workers, self.prefetch = batch_size, drop_last, num_workers, prefetch
        self.threads = threads or min(4, len(os.sched_getaffinity(0)))
        if isinstance(multiprocessing_context, str):  # as DataLoader keeps it (h5feed.monitor reads it)
            multiprocessing_context = multiprocessing.get_context(multiprocessing_context)
        self.multiprocessing_context, self.worker_init_fn, self.timeout = multiprocessing_context, worker_init_fn, timeout
        self.device = torch.device(device) if device is not None and torch.device(device).type != "cpu" else None
        self.collate = trainer_collate(stream.flavor.name, stream.max_len,
                                       hidden_states_dtype=stream.hidden_states_dtype or store.info.torch_dtype
                                       ).for_store(store.info)
        trailing = self.collate.trailing()
        longest = max((self.collate.item_rows(int(store.sample_lengths[i])) for i in stream.indices), default=1)
        layout = SlotLayout(self.collate.specs(self.collate.largest_plan(batch_size, max(longest, 1)), trailing))
        # threads: the batch the delivery thread has ready counts among those in flight; workers: it is one more
        in_flight = prefetch + 1 if num_workers else max(prefetch, self.threads)
        self.slots_per_worker = slots_per_worker or in_flight + 2
        ring = SlotRing(self.slots_per_worker * max(num_workers, 1), layout.nbytes, len(self.collate.row_keys))
        if torch.cuda.is_available():
            ring.page_lock()
        self._writer = BatchWriter(stream, self.collate, ring, layout, trailing)
        self._handed_out: set[int] = set()  # slots whose batch the trainer may still hold
        self._lock = threading.RLock()  # _release runs from finalizers, which may fire while it is held
        self._pid = os.getpid()
        self._returns = SlotReturns(ring)
        self._free_ring = weakref.finalize(self, self._returns.free_ring)  # at close(), or when the loader goes
        self._closed = False
        self._active: weakref.ref[Generator[Batch, None, None]] | None = None  # weak: a dropped pass ends at once
        self._warned = False
        self._copy_stream: torch.cuda.Stream | None = None  # the delivery thread's, for copies to `device`

    # --- what DataLoader users call ----------------------------------------------------------
    def __len__(self) -> int:
        samples = len(self.dataset)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        """One pass over this rank's batches; starting another ends the one before."""
        if self._closed:
            raise ValueError("this BatchLoader is closed (its batch memory was given back): make a new one")
        self._end_pass()
        batches = self._batches()
        self._active = weakref.ref(batches)
        return batches

    def close(self) -> None:
        """End the current pass (its workers or threads stop) and give the ring's memory back, at once or, while
        the trainer still holds batches of it, when it drops the last.  The loader cannot be iterated again."""
        if self._closed:
            return
        self._end_pass()
        with self._lock:
            self._closed = True
            if not self._handed_out:
                self._free_ring()

    def _end_pass(self) -> None:
        """Stop the current pass's workers or threads; slots it had filled go back to the ring."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None
        ring = self._writer.ring
        ring.whole()
        with self._lock:
            for slot in range(ring.count):
                if ring.states[slot] in (FILLING, FILLED) and slot not in self._handed_out:
                    ring.states[slot] = FREE

    # --- one pass ----------------------------------------------------------------------------
    def _batches(self) -> Generator[Batch, None, None]:
        """The pass on the trainer's thread: each batch, made ready by the delivery thread, is only handed over."""
        stream = self.dataset
        stream.schedule.begin_pass()  # every pass starts at the stream's start: a second one replays the epoch
        trainer = TrainerStream(self.device) if self.device is not None else None
        delivery = Delivery(functools.partial(self._ready_batches, trainer),
                            on_take=functools.partial(self._wait_for_copy, trainer), name="h5feed-batch-delivery")
        try:
            for ready in delivery:
                stream.note_consumed(ready.passed)
                if ready.batch is not None:  # None: only damaged samples were left, the position moved past them
                    yield self._hand_over(ready)  # the generator keeps no reference to the batch while it waits
        finally:
            delivery.close()

    @staticmethod
    def _wait_for_copy(trainer: TrainerStream | None, ready: ReadyBatch) -> None:
        """With `device`: the trainer's stream waits for the batch's copy (on the trainer's thread, as it takes it)."""
        if trainer is not None and ready.copied is not None and ready.batch is not None:
            trainer.take(ready.batch, ready.copied)

    def _hand_over(self, ready: ReadyBatch) -> Batch:
        """The ready batch, taken out of `ready`, in the trainer's structure."""
        batch, ready.batch = ready.batch, None
        assert batch is not None
        if ready.in_fresh_memory and not self._warned:
            self._warned = True
            warnings.warn(f"h5feed: the trainer holds more batches than the {self.slots_per_worker} slots per worker "
                          "keep; the rest are built in fresh memory (slower); pass a larger slots_per_worker if that "
                          "is intended", stacklevel=3)
        return self.collate.finish(batch)

    def _ready_batches(self, trainer: TrainerStream | None) -> Generator[ReadyBatch, None, None]:
        """The delivery thread's work: each filled slot wrapped as the trainer's batch (and queued to the GPU)."""
        feed = self._from_workers() if self.num_workers else self._from_threads()
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

    def _from_workers(self) -> Generator[FilledBatch, None, None]:
        loader = DataLoader(
            _SlotFeed(self._writer, self.batch_size, self.drop_last, self.slots_per_worker), batch_size=None,
            num_workers=self.num_workers, collate_fn=_as_is, prefetch_factor=self.prefetch,
            multiprocessing_context=self.multiprocessing_context, worker_init_fn=self.worker_init_fn,
            timeout=self.timeout,
        )
        iterator = iter(loader)
        try:
            with naming_dead_workers(iterator, self.dataset):
                yield from iterator
        finally:
            iterator._shutdown_workers()  # type: ignore[attr-defined]

    def _from_threads(self) -> Generator[FilledBatch, None, None]:
        writer, ring = self._writer, self._writer.ring
        counters = self.dataset.counters.worker()
        counters.start()
        batches = self.dataset.schedule.worker_batches(self.drop_last)

        def write(indices: list[int]) -> FilledBatch:
            return writer.write(indices, ring.claim(range(ring.count)))

        # held: the batch the delivery thread has ready keeps its slot until the trainer takes it
        with ReadAhead(batches, write, threads=self.threads, depth=max(self.prefetch, self.threads),
                       announce=writer.will_need, counters=counters, held=True, name="h5feed-batch") as writes:
            yield from writes

    def _deliver(self, filled: FilledBatch, passed: int, trainer: TrainerStream | None) -> ReadyBatch:
        """The trainer's batch: the slot wrapped as tensors (or the batch a writer had to make in fresh memory), with
        `device`, its copy queued on the delivery thread's own stream."""
        if filled.slot is None:
            batch = filled.batch
            assert batch is not None
        else:
            with self._lock:
                self._handed_out.add(filled.slot)
            memory = self._writer.ring.batch_memory(filled.slot, self._release)
            batch = {**self._writer.layout.views(memory, filled.specs), **filled.extras}
            del memory
        if trainer is None:
            return ReadyBatch(batch, passed, in_fresh_memory=filled.slot is None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
            on_device = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            copied = torch.cuda.Event()
            copied.record()
            trainer.adopt(on_device)
            del batch  # the slot's last views: its release is recorded on this stream, behind the copy
        return ReadyBatch(on_device, passed, copied, in_fresh_memory=filled.slot is None)

    def _release(self, slot: int) -> None:
        """Nothing refers to the slot's batch any more: it goes back to the ring (`SlotReturns`), and after the
        loader was closed, the last one to go takes the ring's memory with it."""
        if os.getpid() != self._pid:  # a forked child's copy of this loader must not touch the ring
            return
        with self._lock:
            self._handed_out.discard(slot)
            self._returns.give_back(slot)
            if self._closed and not self._handed_out:
                self._free_ring()
