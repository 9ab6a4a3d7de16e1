"""Reading a store while its writer appends: a trainer starts on the first published samples.

Why: extraction that writes straight into a store (`h5feed.open_writer`) publishes samples as it
goes; a trainer that had to wait for the last one would waste the whole extraction's time.  A
stream given `follow=Follow(...)` reads the samples in the order they were published, and when it
has read them all, waits for more (re-reading the store's small index), until a bound: the writers
(one, or several appending together) let the store go with nothing left unread, a number of samples,
or a time without a new one.

The order is publication order, sharded as every schedule is: rank r of W takes the samples whose
position p has p % W == r, and worker w of K the batches j of its rank's samples with j % K == w,
so the DataLoader hands the rank's samples over in order.  The time workers wait for the writer is
counted (`writer_wait_seconds`), so the monitor can tell waiting for the writer from waiting for
the disk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from h5feed.metrics import WorkerCounters
from h5feed.store import Store
from h5feed.store.writer_state import current_writer


@dataclass(frozen=True)
class Follow:
    """How long a stream follows its store's writer.

    Args:
        samples: stop after this many samples in all (every rank's), published or not yet; None: no bound.
            Several ranks should give one (a multiple of world size x batch size): a stream that ends when
            the writer does may give ranks one batch more or less, and DDP waits for the rank that has none.
        idle_timeout: stop when no new sample has been published for this many seconds; None: no bound.
        poll_s: seconds between looks at the store's index while waiting.

    With neither bound, the stream ends once no writer holds the store and every published sample is read.
    """

    samples: int | None = None
    idle_timeout: float | None = None
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 0:
            raise ValueError(f"Follow(samples={self.samples}) must be >= 0")
        if self.poll_s <= 0 or (self.idle_timeout is not None and self.idle_timeout < 0):
            raise ValueError("Follow's poll_s must be positive and idle_timeout >= 0")


def followed_positions(store: Store, follow: Follow, rank: int, world: int, worker: int, workers: int,
                       batch_size: int, counters: WorkerCounters, start: int = 0) -> Iterator[int]:
    """The store indices this worker reads, in publication order from position `start`, waiting for each
    one to be published (see the module docstring)."""
    position = start
    while follow.samples is None or position < follow.samples:
        if position >= len(store) and not _wait_for(store, position, follow, counters):
            return
        q, mine = divmod(position, world)
        if mine == rank and (q // batch_size) % workers == worker:
            yield position
        position += 1


def _wait_for(store: Store, position: int, follow: Follow, counters: WorkerCounters) -> bool:
    """Wait until sample `position` is published; False once it will not be (a bound was reached)."""
    since = time.monotonic()
    counters.begin_writer_wait()
    try:
        while True:
            writing = current_writer(Path(store.path)) is not None  # first: what any writer published is seen below
            if store.reload() > position:
                return True
            if not writing:
                return False  # every writer is gone and left nothing more
            if follow.idle_timeout is not None and time.monotonic() - since >= follow.idle_timeout:
                return False
            time.sleep(follow.poll_s)
    finally:
        counters.end_writer_wait(time.monotonic() - since)
