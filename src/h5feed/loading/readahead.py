"""The one ordered read-ahead loop: work read by a thread pool a bounded distance ahead, handed back in order.

Reads release the GIL (file I/O, mmap, Blosc, crc32c), so threads in one process read
and decode in parallel.  Each piece of work is announced first (`announce`: the disk
starts on its chunks at once) and then read by a thread; the results come back in
the order of the work, whatever order the threads finish in.

Announcing runs on a thread of its own, in the work's order: asking the kernel to read a
cold file ahead (`posix_fadvise(WILLNEED)`) blocks while it queues the file's reads (~40 ms
for a 70 MB sample on the H200 box), and done by the consumer it held back the next
submission while reader threads sat idle.  A piece is announced before its read starts or not at
all: a read that starts first (the announcer is behind) skips its announcement, and one that starts
while its own announcement runs waits for it.  A late announcement would ask for the piece again
after it was read, and a bucket's reader would fetch it a second time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from h5feed.observe.metrics import WorkerCounters

Work = TypeVar("Work")
Result = TypeVar("Result")


class _Piece(Generic[Work]):
    """One piece of work, announced before its read starts or not at all."""

    def __init__(self, work: Work) -> None:
        self.work = work
        self._lock = threading.Lock()  # held while announcing: a read that starts meanwhile waits
        self._read_started = False

    def announce(self, announce: Callable[[Work], None]) -> None:
        with self._lock:
            if not self._read_started:
                announce(self.work)

    def start_read(self) -> Work:
        with self._lock:
            self._read_started = True
        return self.work


class ReadAhead(Generic[Work, Result]):
    """`read(work)` for each piece of `work`, by `threads` threads, at most `depth` pieces ahead, in order.

    Taking a result submits the next piece of work, so the work iterable is drawn from only as the
    consumer moves on (it may compute what a piece needs at that moment).  With `held=True` the result
    taken last keeps its place among the `depth` until the next take: for results that live in memory
    the reads share (a slot of a ring), which the consumer holds until it takes the next.  The time
    the consumer waits for a result, and how many are ready, go to `counters` when given.  `close()`
    (or the end of a `with` block) drops what was not started and waits for what was.

    Drawing a piece of work may wait (a following stream's next sample, not yet published).  `can_draw`, when
    given, says whether the next piece can be drawn now: while results are in flight, one that cannot is
    drawn later, so a result already read is never held back behind work that does not exist yet.
    """

    def __init__(self, work: Iterable[Work], read: Callable[[Work], Result], *, threads: int, depth: int,
                 announce: Callable[[Work], None] | None = None, counters: WorkerCounters | None = None,
                 held: bool = False, name: str = "h5feed-read", can_draw: Callable[[], bool] | None = None) -> None:
        self._upcoming = iter(work)
        self._read, self._announce, self._counters = read, announce, counters
        self._can_draw, self._owed = can_draw, 0  # pieces to draw once `can_draw` says they can be
        self._held, self._holding = held, False
        self._in_flight: deque[Future[Result]] = deque()
        self.exhausted = False  # no work is left to draw: what is in flight is all that remains
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)
        self._announcer = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-announce") if announce else None
        for _ in range(max(depth, 1)):
            self._submit_next()

    def _submit_next(self) -> None:
        if self._can_draw is None:
            self._draw()
            return
        self._owed += 1
        self._draw_owed(wait=False)  # a result may be on its way to the consumer: never wait here

    def _draw_owed(self, wait: bool = True) -> None:
        """Draw the pieces owed that can be drawn now; with `wait` and nothing in flight, one whatever the wait
        (the consumer has nothing else to take)."""
        while self._owed and self._can_draw is not None and (self._can_draw() or wait and not self._in_flight):
            self._owed -= 1
            self._draw()

    def _draw(self) -> None:
        for work in self._upcoming:
            piece = _Piece(work)
            if self._announcer is not None:  # what it raises is left to the read that follows to report
                self._announcer.submit(piece.announce, self._announce)  # type: ignore[arg-type]
            self._in_flight.append(self._pool.submit(self._read_piece, piece))
            return
        self.exhausted = True

    def _read_piece(self, piece: _Piece[Work]) -> Result:
        return self._read(piece.start_read())

    def _give_up_held(self) -> None:
        """The result taken last is given up: its place goes to the next piece of work."""
        if self._holding:
            self._holding = False
            self._submit_next()

    def __bool__(self) -> bool:
        """Whether results are in flight (with held=True, the one held back may not be started yet: iterate)."""
        return bool(self._in_flight)

    def ready(self) -> Result | None:
        """The next result if it is ready now (it stays the next); None while it is not (or none remains)."""
        if self._in_flight and self._in_flight[0].done():
            return self._in_flight[0].result()
        return None

    def ready_count(self, limit: int) -> int:
        """How many results, from the next one on, are ready now without a gap (at most `limit`)."""
        count = 0
        for future in self._in_flight:
            if count >= limit or not future.done():
                break
            count += 1
        return count

    def in_flight(self) -> int:
        """The results in flight: being read, or read and not taken yet."""
        return len(self._in_flight)

    def take(self) -> Result:
        """The next result, waited for; the next piece of work starts."""
        self._give_up_held()
        self._draw_owed()
        return self._take_next()

    def _take_next(self) -> Result:
        """The result at the head, waited for (what is owed was drawn by the caller)."""
        t0 = time.perf_counter()
        result = self._in_flight.popleft().result()
        waited = time.perf_counter() - t0
        self._holding = self._held
        if not self._held:
            self._submit_next()
        if self._counters is not None:
            self._counters.add_wait(waited)
            self._counters.set_queue_depth(sum(future.done() for future in self._in_flight))
        return result

    def __iter__(self) -> Iterator[Result]:
        while True:
            self._give_up_held()
            self._draw_owed()
            if not self._in_flight:
                return
            yield self._take_next()

    def close(self) -> None:
        for future in self._in_flight:
            future.cancel()
        self._in_flight.clear()
        if self._announcer is not None:
            self._announcer.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ReadAhead[Work, Result]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
