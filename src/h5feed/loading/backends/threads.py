"""decode="cpu" without workers: reader threads in the trainer's process decode the batches into the ring.

Why threads: no worker process to start or to feed, and the decode (numcodecs, torch copies)
releases the GIL; the cost is a share of the trainer's interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass

import torch

from h5feed.flavors import TrainerCollate
from h5feed.loading.backends.base import register_backend
from h5feed.loading.backends.ring import FilledBatch, RingBackend
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.loading.options import Batching
from h5feed.loading.readahead import ReadAhead


@dataclass(frozen=True)
class ThreadsOptions:
    """The threads backend's own options.

    threads: reader threads in this process (None: the cores this process may use, at most 4).
    prefetch: batches in flight in all (at least one a thread).
    slots_per_worker: slots the threads may fill (None: the batches in flight, the delivery thread's ready batch
        among them, + 2, which covers a trainer that holds the batch it is given).
    device: when given (e.g. "cuda"), batches arrive on it, copied from the page-locked slot.
    """

    threads: int | None = None
    prefetch: int = 2
    slots_per_worker: int | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, not {self.prefetch}")


@register_backend
class ThreadsBackend(RingBackend):
    """`threads` reader threads, `prefetch` batches in flight (at least one a thread), filling the ring's slots."""

    name = "threads"
    Options = ThreadsOptions

    @classmethod
    def default_options(cls, num_workers: int, device: torch.device | str | None) -> ThreadsOptions:
        return ThreadsOptions(device=device)

    def __init__(self, stream: HiddenStatesStream, collate: TrainerCollate, batching: Batching,
                 options: ThreadsOptions) -> None:
        self.options = options
        self.threads = options.threads or min(4, len(os.sched_getaffinity(0)))
        self.prefetch = options.prefetch
        in_flight = max(options.prefetch, self.threads)  # the batch the delivery thread has ready counts among them
        per_writer = options.slots_per_worker or in_flight + 2
        super().__init__(stream, collate, batching, options.device, slots=per_writer, slots_per_writer=per_writer)

    def filled_batches(self) -> Generator[FilledBatch, None, None]:
        writer, ring = self.writer, self.writer.ring
        counters = self.stream.counters.worker()
        counters.start()
        batches = self.stream.schedule.worker_batches(self.batching.drop_last)

        def write(indices: list[int]) -> FilledBatch:
            return writer.write(indices, ring.claim(range(ring.count)))

        # held: the batch the delivery thread has ready keeps its slot until the trainer takes it
        with ReadAhead(batches, write, threads=self.threads, depth=max(self.prefetch, self.threads),
                       announce=writer.will_need, counters=counters, held=True, name="h5feed-batch") as writes:
            yield from writes
