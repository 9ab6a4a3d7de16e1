"""decode="cpu" with num_workers: DataLoader worker processes decode the batches, each into slots of its own.

Why processes: decoding a sample is ~40 ms of one core; worker processes spread it over the
cores without sharing the trainer's interpreter (its GIL).  Only the slot number and the batch's
shapes cross back; a worker that dies is named (`WorkerDiedError`: which one, its pid, the sample).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from h5feed.flavors import TrainerCollate
from h5feed.loading.backends.base import register_backend
from h5feed.loading.backends.ring import BatchWriter, FilledBatch, RingBackend
from h5feed.loading.datasets import HiddenStatesStream, naming_dead_workers
from h5feed.loading.options import Batching
from h5feed.loading.schedule import current_worker
from h5feed.observe.metrics import check_worker_count

READ_AHEAD_BATCHES = 3  # a worker's batches the disk is asked for ahead of the one it decodes (a cold cache
# needs several requests in flight to reach the disk's rate: one sample ahead per worker left 2 workers at ~60% of it)


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


@dataclass(frozen=True)
class WorkersOptions:
    """The workers backend's own options.

    num_workers: DataLoader worker processes.
    prefetch: batches in flight per worker (the DataLoader's prefetch_factor).
    slots_per_worker: slots each worker may fill (None: the batches in flight, prefetch + 1 with the delivery
        thread's ready batch, + 2, which covers a trainer that holds the batch it is given).
    multiprocessing_context, worker_init_fn, timeout: passed to the DataLoader.
    device: when given (e.g. "cuda"), batches arrive on it, copied from the page-locked slot.
    """

    num_workers: int
    prefetch: int = 2
    slots_per_worker: int | None = None
    multiprocessing_context: Any = None
    worker_init_fn: Any = None
    timeout: float = 0
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 0 (0: reader threads in this process), not {self.num_workers}")
        check_worker_count(self.num_workers)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, not {self.prefetch}")


@register_backend
class WorkersBackend(RingBackend):
    """DataLoader worker processes, each filling slots of its own; the DataLoader's arguments as it takes them."""

    name = "workers"
    Options = WorkersOptions

    @classmethod
    def default_options(cls, num_workers: int, device: torch.device | str | None) -> WorkersOptions:
        return WorkersOptions(num_workers=num_workers, device=device)

    def __init__(self, stream: HiddenStatesStream, collate: TrainerCollate, batching: Batching,
                 options: WorkersOptions) -> None:
        self.options, self.num_workers = options, options.num_workers
        context = options.multiprocessing_context
        # as DataLoader keeps it (h5feed.monitor reads it)
        self.multiprocessing_context = multiprocessing.get_context(context) if isinstance(context, str) else context
        per_worker = options.slots_per_worker or options.prefetch + 1 + 2  # in flight: prefetch, and the ready batch
        super().__init__(stream, collate, batching, options.device, slots=per_worker * options.num_workers,
                         slots_per_writer=per_worker)

    def filled_batches(self) -> Generator[FilledBatch, None, None]:
        options = self.options
        loader = DataLoader(
            _SlotFeed(self.writer, self.batching.batch_size, self.batching.drop_last, self.slots_per_worker),
            batch_size=None, num_workers=self.num_workers, collate_fn=_as_is, prefetch_factor=options.prefetch,
            multiprocessing_context=self.multiprocessing_context, worker_init_fn=options.worker_init_fn,
            timeout=options.timeout,
        )
        iterator = iter(loader)
        try:
            with naming_dead_workers(iterator, self.stream):
                yield from iterator
        finally:
            iterator._shutdown_workers()  # type: ignore[attr-defined]
