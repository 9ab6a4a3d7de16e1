"""Reading a store while its writer appends: a trainer starts on the first published samples.

Why: extraction that writes straight into a store (`h5feed.open_writer`) publishes samples as it
goes; a trainer that had to wait for the last one would waste the whole extraction's time.  A
stream given `follow=Follow(...)` reads the samples in the order they were published, and when it
has read them all, waits for more (re-reading the store's small index), until a bound: the writers
(one, or several appending together) let the store go with nothing left unread, a number of samples,
or a time without a new one.

Letting the store go is a writer's `close()`, which removes its lock; a writer that went away without
closing (killed, its machine lost) leaves its lock behind, and its journaled samples come only once
the same writer id is opened again.  Such a crash never ends a stream as if the writer had finished:
the follower warns, naming the writer and what to do, waits for the restart as long as its bound
allows (`WriterWatch`), then raises a `StoreError` naming the writer.  A store replaced or rewritten
under the follower (the index rows it read no longer the first rows of the store's) raises too
(`Store.reload`), so a stream never hands out two stores' samples as one.

The order is publication order from the pass's start position s, sharded as every schedule is:
rank r of W takes positions s + q*W + r (its q-th sample), and worker w of K the batches j of its
rank's samples with j % K == w, so the DataLoader hands the rank's samples over in order.  A worker
waits only for the samples it reads: another rank's, or another worker's, never hold it up, and
only its own waits count as waiting for the writer (`writer_wait_seconds`), which the monitor tells
from waiting for the disk.

Where the stream ends, ranks must agree on their count, or DDP waits forever for the rank that has
no batch left.  With `equal_per_rank`, each rank takes as many samples as rank 0, which holds the
first position of every round of W: a rank whose own sample of the last round was not published
repeats that round's first sample (at most one repeat a rank, counted and logged, as
DistributedSampler pads).  A rank learns that the round exists from its own sample's wait, since
positions are published in order; only when the `samples` bound falls inside the round does it
wait for the round's first position instead.  Ranks agree when the stream ends by the bound or by
the writer letting the store go (its count is final then); an `idle_timeout` is each rank's own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h5feed.errors import StoreError
from h5feed.io import FsspecStore, is_remote, open_url
from h5feed.loading.sample_folder import open_or_explain
from h5feed.observe.metrics import WorkerCounters
from h5feed.store import Store
from h5feed.store.layout import read_info
from h5feed.store.opening import local_path
from h5feed.store.writer_state import (
    WRITER_API,
    WRITERS_DIR,
    DepartedWriter,
    WriterLocks,
    bucket_writer_locks,
    current_writer,
    holds_no_samples,
    writer_locks,
)

log = logging.getLogger(__name__)

REMIND_S = 60.0  # how often a follower waiting for a writer that went away says so again


@dataclass(frozen=True)
class Follow:
    """How long a stream follows its store's writer.

    Args:
        samples: stop after this many samples in all (every rank's, positions in publication order), published
            or not yet; None: no bound.
        idle_timeout: stop when no new sample has been published for this many seconds; None: no bound.
            Each worker of each rank times out on its own: several ranks should end by `samples` or by
            the writer letting the store go, on which they agree.
        poll_s: seconds between looks at the store's index while waiting.

    With neither bound, the stream ends once no writer holds the store and every published sample is read.
    A writer that went away without closing is waited for up to `idle_timeout`, or with `samples` alone until
    the samples come, and then (at once with neither bound) named in a `StoreError` (see `WriterWatch`).
    """

    samples: int | None = None
    idle_timeout: float | None = None
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 0:
            raise ValueError(f"Follow(samples={self.samples}) must be >= 0")
        if self.poll_s <= 0 or (self.idle_timeout is not None and self.idle_timeout < 0):
            raise ValueError("Follow's poll_s must be positive and idle_timeout >= 0")


@dataclass(frozen=True)
class FollowedShare:
    """One worker's share of the publication order from position `start` (see the module docstring)."""

    rank: int
    world_size: int
    worker: int
    workers: int
    batch_size: int
    start: int = 0
    equal_per_rank: bool = False

    def rank_items(self) -> Iterator[int]:
        """The numbers q of the rank's samples this worker reads, in order: its batches', one after another."""
        batch = self.worker
        while True:
            yield from range(batch * self.batch_size, (batch + 1) * self.batch_size)
            batch += self.workers

    def position(self, q: int) -> int:
        """The publication position of the rank's q-th sample."""
        return self.round_start(q) + self.rank

    def round_start(self, q: int) -> int:
        """The first position of round q (rank 0's q-th sample): every rank has a q-th sample iff it exists."""
        return self.start + q * self.world_size


class FollowedPositions(Iterator[int]):
    """The store indices one worker reads, in publication order, each waited for until it is published.

    When the stream ends, the position it ended at is recorded in `counters` (`end_follow`), for the resume
    position; with `share.equal_per_rank`, a rank short of the last round's sample repeats the round's first.
    `ready()` says whether the next index can be given without waiting: a read-ahead hands over what it has
    read rather than wait for a sample the writer has not published (`ReadAhead(can_draw=)`)."""

    def __init__(self, store: Store, follow: Follow, share: FollowedShare, counters: WorkerCounters) -> None:
        self.store, self.follow, self.share, self.counters = store, follow, share, counters
        self._items = share.rank_items()
        self._q = next(self._items)  # the rank's sample number that comes next
        self._ended = False

    def __next__(self) -> int:
        if self._ended:
            raise StopIteration
        share, bound, q = self.share, self.follow.samples, self._q
        position = share.position(q)
        if bound is None or position < bound:
            if wait_for(self.store, position, self.follow, self.counters):
                self._q = next(self._items)
                return position
            round_exists = share.round_start(q) < len(self.store)  # just re-read: no second wait
            end = len(self.store)
        else:  # the bound ends the rank's own samples; with equal_per_rank, the round's first says if it pads
            first = share.round_start(q)
            round_exists = share.equal_per_rank and first < bound and wait_for(self.store, first, self.follow,
                                                                                  self.counters)
            cut_short = share.equal_per_rank and first < bound and not round_exists  # the writer stopped first
            end = len(self.store) if cut_short else bound
        self._ended = True
        self.counters.end_follow(end)
        if not (share.equal_per_rank and round_exists):
            raise StopIteration
        self.counters.add_repeated(1)
        log.info("%s: rank %d of %d repeats sample %d: its own sample of the last round (position %d) lies past "
                 "where the stream ends, and every rank must take the same number of batches", self.store.path,
                 share.rank, share.world_size, share.round_start(q), position)
        return share.round_start(q)

    def ready(self) -> bool:
        """Whether `next()` returns without waiting for the writer (the store's index re-read if need be)."""
        if self._ended:
            return True
        share, bound = self.share, self.follow.samples
        position = share.position(self._q)
        if bound is not None and position >= bound:
            first = share.round_start(self._q)
            if not (share.equal_per_rank and first < bound):
                return True
            position = first
        return position < len(self.store) or self.store.reload() > position


def wait_for(store: Store, position: int, follow: Follow, counters: WorkerCounters) -> bool:
    """Whether sample `position` is published, waiting for it (the wait counted as the writer's); False once it
    will not be: the writers let the store go without it, or `idle_timeout` passed with no new sample.  A writer
    that went away without closing is waited for (see `WriterWatch`), never taken for one that let go."""
    if position < len(store):
        return True
    since = time.monotonic()
    watch = WriterWatch(store, follow)
    counters.begin_writer_wait()
    try:
        while True:
            writers = watch.look()  # first: what any writer published is seen below
            if store.reload() > position:
                return True
            if not writers.live:
                if not writers.departed:
                    return False  # every writer let the store go and left nothing more
                watch.went_away(writers.departed, position, time.monotonic() - since)
            elif follow.idle_timeout is not None and time.monotonic() - since >= follow.idle_timeout:
                return False
            time.sleep(follow.poll_s)
    finally:
        counters.end_writer_wait(time.monotonic() - since)


class WriterWatch:
    """A follower's look at its store's writers while it waits for a sample.

    A writer that went away without closing (killed, or its machine lost) leaves its lock behind: its samples
    journaled and not yet published come once the same writer id is opened again, which publishes them and goes
    on.  So it is said (a warning naming the writer and what to do), and waited for: with `idle_timeout`, as long
    as that; with `samples` alone, until the samples come (said again every `REMIND_S`); with neither bound, not
    at all: the stream raises at once rather than end as if the writer had finished.  Once the wait is over, a
    `StoreError` names the writer and what was read."""

    def __init__(self, store: Store, follow: Follow) -> None:
        self.store, self.follow = store, follow
        self._objects = open_url(store.path, store.storage_options) if store.remote else None  # uncached: locks change
        self._seen_ns: dict[str | None, int] = {}  # writer id -> when this follower last saw it hold the store
        self._said_at: float | None = None

    def look(self) -> WriterLocks:
        """The writers holding the store now, and when none does, those that went away without closing."""
        if self._objects is not None:
            writers = bucket_writer_locks(self._objects)
        else:
            holder = current_writer(Path(self.store.path))
            writers = writer_locks(Path(self.store.path)) if holder is None else WriterLocks(
                holder.get("writers", [holder]), [])
        now = time.time_ns()
        self._seen_ns.update((holder.get("writer"), now) for holder in writers.live)
        return writers

    def went_away(self, departed: list[DepartedWriter], position: int, waited_s: float) -> None:
        """Say that the writers in `departed` went away without closing, and raise once the wait for them is over."""
        follow, read = self.follow, len(self.store)
        who = "; ".join(self._describe(writer) for writer in departed)
        bound = follow.idle_timeout
        if follow.samples is None and bound is None:
            waits = "this follower stops (give Follow an idle_timeout to wait for the restart)"
        elif bound is not None:
            waits = f"this follower waits for it up to {bound:g} s (Follow's idle_timeout)"
        else:
            waits = f"this follower waits for it until sample {position} comes (Follow(samples={follow.samples}))"
        if self._said_at is None or time.monotonic() - self._said_at >= REMIND_S:
            self._said_at = time.monotonic()
            log.warning("%s: %s; %s", self.store.path, who, waits)
        if (follow.samples is None and bound is None) or (bound is not None and waited_s >= bound):
            waited = "" if bound is None else f" and did not come back in {bound:g} s"
            raise StoreError(self.store.path, f"{who}{waited}. {read} samples were read (every one published); "
                             f"sample {position} and those after it come only once the writer is restarted: "
                             "restart it, then follow the store again from where this stream stopped")

    def _describe(self, writer: DepartedWriter) -> str:
        seen = max(filter(None, (self._seen_ns.get(writer.writer), writer.last_heard_ns)), default=None)
        when = "?" if seen is None else datetime.fromtimestamp(seen / 1e9, timezone.utc).isoformat(timespec="seconds")
        return (f"{writer.describe()} went away without closing ({WRITERS_DIR}/{writer.lock}: {writer.why}); last "
                f"seen {when}: restart it with writer={writer.writer!r} (open_writer on this store) to publish what "
                "it journaled and go on")


def open_followed(location: str | os.PathLike[str], follow: Follow, **store_options: Any) -> Store:
    """The store at `location` (a local folder or a bucket's URL), opened once its writer has published a first
    sample: a follower may start before it (a store with none is refused to plain readers as unfinished).

    Refused at once, naming the store, when no writer holds it and nothing is published (nothing will come),
    and when `idle_timeout` passes before the first sample."""
    remote = is_remote(location)
    where: Path | str = os.fspath(location).rstrip("/") if remote else local_path(location)
    objects = open_url(where, store_options.get("storage_options")) if remote else None
    since = time.monotonic()
    while True:
        writing = writing_now(where, objects)  # looked at first, as in `wait_for`
        status = _status(objects if objects is not None else Path(where))
        if status == "complete":
            return Store(where, **store_options)
        if not writing:
            if isinstance(where, Path) and where.is_dir() and holds_no_samples(where):
                raise StoreError(where, "nothing was ever published in it (an open_writer that appended no sample "
                                 "leaves an empty folder) and no writer holds it: start the writer, then follow it")
            if status is None:
                return open_or_explain(where, **store_options)  # not a store at all: its error says what it is
            raise StoreError(where, f"no writer holds it and it has no published sample: its writer ({WRITER_API}) "
                             "let it go before publishing one; nothing will come to follow. Append samples with "
                             "open_writer on it again, then follow it")
        if follow.idle_timeout is not None and time.monotonic() - since >= follow.idle_timeout:
            raise StoreError(where, f"its writer published no sample in {follow.idle_timeout} s (Follow's "
                             "idle_timeout); it still holds the store: wait longer, or look at why it is slow")
        time.sleep(follow.poll_s)


def writing_now(where: Path | str, objects: FsspecStore | None) -> bool:
    """Whether a writer holds the store now: a local one's locks, or a bucket store's writers' lock objects
    (`objects`: the bucket store's, read uncached)."""
    if objects is None:
        return current_writer(Path(where)) is not None
    return bool(bucket_writer_locks(objects).live)


def _status(location: Path | FsspecStore) -> str | None:
    """The store's status ("complete" once a sample is published), or None where there is no readable root."""
    try:
        return read_info(location).status
    except StoreError:
        return None
