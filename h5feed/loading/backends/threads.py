"""decode="cpu" without workers: reader threads in the trainer's process decode the batches into the ring.

Why threads: no worker process to start or to feed, and the decode (numcodecs, torch copies)
releases the GIL; the cost is a share of the trainer's interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import torch

from h5feed.flavors import TrainerCollate
from h5feed.loading.backends.base import register_backend
from h5feed.loading.backends.ring import FilledBatch, RingBackend
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.loading.readahead import ReadAhead


@register_backend
class ThreadsBackend(RingBackend):
    """`threads` reader threads, `prefetch` batches in flight (at least one a thread), filling the ring's slots."""

    name = "threads"

    def __init__(self, stream: HiddenStatesStream, collate: TrainerCollate, *, batch_size: int, drop_last: bool,
                 device: torch.device | str | None, threads: int | None, prefetch: int,
                 slots_per_worker: int | None) -> None:
        self.threads = threads or min(4, len(os.sched_getaffinity(0)))
        self.prefetch = prefetch
        in_flight = max(prefetch, self.threads)  # the batch the delivery thread has ready counts among them
        per_writer = slots_per_worker or in_flight + 2
        super().__init__(stream, collate, batch_size=batch_size, drop_last=drop_last, device=device,
                         slots=per_writer, slots_per_writer=per_writer)

    def filled_batches(self) -> Generator[FilledBatch, None, None]:
        writer, ring = self.writer, self.writer.ring
        counters = self.stream.counters.worker()
        counters.start()
        batches = self.stream.schedule.worker_batches(self.drop_last)

        def write(indices: list[int]) -> FilledBatch:
            return writer.write(indices, ring.claim(range(ring.count)))

        # held: the batch the delivery thread has ready keeps its slot until the trainer takes it
        with ReadAhead(batches, write, threads=self.threads, depth=max(self.prefetch, self.threads),
                       announce=writer.will_need, counters=counters, held=True, name="h5feed-batch") as writes:
            yield from writes
