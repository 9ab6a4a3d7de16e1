"""Per-worker loader counters in shared memory, readable by the main process while training runs: the loaders
write them, and the monitor (`h5feed.observe.monitor`), its watchdog and `h5feed bench` read them.

The counters are one small float64 tensor in shared memory, created by the
dataset in the main process before any worker starts.  torch passes it to
workers by file descriptor under fork, spawn and forkserver alike, and the
memory goes away with the last process that holds it: a crash leaves nothing
behind in /dev/shm.  Each worker writes only its own row; the main process
reads rows at any time (a snapshot is a copy, never a lock).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, runtime_checkable

import torch

from h5feed import tracing

MAX_WORKERS = 64  # rows of the table: DataLoader worker ids must stay below this


class Field(IntEnum):
    SAMPLES = 0
    TOKENS = 1
    BYTES_READ = 2  # from storage (compressed)
    BYTES_DELIVERED = 3  # decoded tensors handed on
    READ_SECONDS = 4
    DECODE_SECONDS = 5
    WAIT_SECONDS = 6  # time the worker's consumer waited on its prefetch queue
    CURRENT_SAMPLE = 7  # store index of the sample being read, -1 when none
    CURRENT_SINCE = 8  # wall time the current read started
    CURRENT_BYTES = 9  # bytes read so far of the current sample
    LAST_PROGRESS = 10  # wall time of the last chunk read or sample finished
    QUEUE_DEPTH = 11  # samples decoded and waiting in the worker's prefetch queue
    PID = 12
    STARTED = 13  # wall time the worker started iterating, 0 before
    CORRUPT = 14  # samples skipped because their stored bytes failed their checksums (on_corrupt="skip")
    REQUESTS = 15  # network requests that succeeded (remote stores)
    NETWORK_BYTES = 16  # payload bytes they brought
    NETWORK_SECONDS = 17  # their seconds, summed (concurrent requests overlap)
    RETRIES = 18  # transient failures retried (resets, timeouts, 5xx, throttling)
    CACHE_HITS = 19  # objects found in the node cache (cache_dir)
    CACHE_MISSES = 20  # objects downloaded into it
    WRITER_WAIT_SECONDS = 21  # time spent waiting for a writer to publish the next sample (a following stream)
    WRITER_WAIT_SINCE = 22  # wall time the current such wait began, 0 when none
    REPEATED = 23  # samples a following stream repeated so that every rank takes as many (equal_per_rank)
    FOLLOW_END = 24  # 1 + the position where this worker's following pass ended, 0 while it has not


NUM_FIELDS = len(Field)


class WorkerCounters:
    """One worker's row, written by that worker's threads (under a process-local lock).

    It implements `store.ReadStats`'s `add_*` methods, so `Store.read_sample(stats=...)`
    updates the shared row chunk by chunk: a stall report can say how far a read got; and
    `h5feed.io`'s counters (`add_request`, `add_retry`, `add_cache`), so a remote store's
    network figures land in the same row (`store.io_stats = counters`).
    """

    def __init__(self, row: torch.Tensor, lock: threading.Lock) -> None:
        self._row = row.numpy()  # a view of the shared row: a numpy scalar update is ~50x cheaper than torch's
        self._lock = lock
        self._began: dict[int, float] = {}  # with a trace: when each sample under way began (h5feed.tracing)

    def __reduce__(self) -> Any:
        raise TypeError("WorkerCounters is a view of a shared row: pickle the LoaderCounters that owns it")

    def _add(self, *pairs: tuple[Field, float]) -> None:
        with self._lock:
            for field, value in pairs:
                self._row[field] += value

    def _set(self, *pairs: tuple[Field, float]) -> None:
        with self._lock:
            for field, value in pairs:
                self._row[field] = value

    # --- the ReadStats protocol -----------------------------------------------------------
    def add_read(self, nbytes: int, seconds: float) -> None:
        self._add((Field.BYTES_READ, nbytes), (Field.CURRENT_BYTES, nbytes), (Field.READ_SECONDS, seconds))
        self._set((Field.LAST_PROGRESS, time.time()))
        if tracing.tracing():
            now = time.perf_counter()
            tracing.span("read", "worker", now - seconds, now, bytes=nbytes)

    def add_decode(self, seconds: float) -> None:
        self._add((Field.DECODE_SECONDS, seconds))
        if tracing.tracing():
            now = time.perf_counter()
            tracing.span("decode", "worker", now - seconds, now)

    def add_delivered(self, nbytes: int) -> None:
        self._add((Field.BYTES_DELIVERED, nbytes))

    # --- the io.IOCounters protocol (called from I/O threads) --------------------------------
    def add_request(self, nbytes: int, seconds: float) -> None:
        self._add((Field.REQUESTS, 1), (Field.NETWORK_BYTES, nbytes), (Field.NETWORK_SECONDS, seconds))
        self._set((Field.LAST_PROGRESS, time.time()))

    def add_retry(self) -> None:
        self._add((Field.RETRIES, 1))

    def add_cache(self, hit: bool, nbytes: int) -> None:
        self._add((Field.CACHE_HITS if hit else Field.CACHE_MISSES, 1))

    # --- sample life cycle ----------------------------------------------------------------
    def start(self) -> None:
        self._set((Field.PID, os.getpid()), (Field.STARTED, time.time()), (Field.CURRENT_SAMPLE, -1))

    def begin_sample(self, index: int) -> None:
        if self._row[Field.STARTED] == 0:
            self.start()
        self._set((Field.CURRENT_SAMPLE, index), (Field.CURRENT_SINCE, time.time()), (Field.CURRENT_BYTES, 0))
        if tracing.tracing():
            self._began[index] = time.perf_counter()

    def end_sample(self, index: int, tokens: int) -> None:
        """Count a finished sample; with several reader threads, `current` stays on the newest read."""
        self._add((Field.SAMPLES, 1), (Field.TOKENS, tokens))
        with self._lock:
            if self._row[Field.CURRENT_SAMPLE] == index:
                self._row[Field.CURRENT_SAMPLE] = -1
            self._row[Field.LAST_PROGRESS] = time.time()
        began = self._began.pop(index, None)
        if began is not None:
            tracing.span("sample", "worker", began, time.perf_counter(), sample=index, tokens=tokens)

    def skip_corrupt(self, index: int) -> None:
        """Count a damaged sample that was skipped instead of delivered."""
        self._add((Field.CORRUPT, 1))
        with self._lock:
            if self._row[Field.CURRENT_SAMPLE] == index:
                self._row[Field.CURRENT_SAMPLE] = -1

    def add_wait(self, seconds: float) -> None:
        self._add((Field.WAIT_SECONDS, seconds))

    def begin_writer_wait(self) -> None:
        """The worker has read every published sample and waits for the writer to publish more."""
        self._set((Field.WRITER_WAIT_SINCE, time.time()))

    def end_writer_wait(self, seconds: float) -> None:
        self._add((Field.WRITER_WAIT_SECONDS, seconds))
        self._set((Field.WRITER_WAIT_SINCE, 0), (Field.LAST_PROGRESS, time.time()))

    def add_repeated(self, samples: int) -> None:
        self._add((Field.REPEATED, samples))

    def end_follow(self, position: int) -> None:
        """The following pass ended at `position` in publication order: what a resume after it starts from."""
        self._set((Field.FOLLOW_END, position + 1))

    def set_queue_depth(self, depth: int) -> None:
        self._set((Field.QUEUE_DEPTH, depth))


@dataclass
class WorkerSnapshot:
    worker: int
    pid: int
    samples: int
    tokens: int
    bytes_read: int
    bytes_delivered: int
    read_seconds: float
    decode_seconds: float
    wait_seconds: float
    queue_depth: int
    corrupt: int  # damaged samples skipped
    requests: int  # network requests (remote stores), their payload bytes and summed seconds
    network_bytes: int
    network_seconds: float
    retries: int  # transient network failures retried
    cache_hits: int  # objects read from the node cache, and downloaded into it
    cache_misses: int
    current_sample: int | None  # None when idle
    current_seconds: float  # how long the current read has taken so far
    current_bytes: int
    seconds_since_progress: float | None
    writer_wait_seconds: float = 0.0  # waiting for a writer to publish (a following stream), in all
    waiting_for_writer_s: float | None = None  # how long the current such wait has lasted; None: not waiting
    repeated: int = 0  # samples repeated to even the ranks at a following stream's end


@dataclass
class LoaderSnapshot:
    time: float
    workers: list[WorkerSnapshot]

    def total(self, name: str) -> float:
        return sum(getattr(w, name) for w in self.workers)

    def as_dict(self) -> dict[str, Any]:
        totals = {
            name: self.total(name)
            for name in ("samples", "tokens", "bytes_read", "bytes_delivered", "read_seconds", "decode_seconds",
                         "wait_seconds", "queue_depth", "corrupt", "requests", "network_bytes", "network_seconds",
                         "retries", "cache_hits", "cache_misses", "writer_wait_seconds", "repeated")
        }
        return {"time": self.time, "total": totals, "workers": [w.__dict__ for w in self.workers]}


@runtime_checkable
class CountedReader(Protocol):
    """A dataset or stream that counts its workers' reads: h5feed's own, which `h5feed.monitor` reads through this
    (a plain torch dataset has no counters, and the monitor says so)."""

    counters: LoaderCounters


def check_worker_count(num_workers: int) -> None:
    """Refuse more DataLoader workers than the counters have rows for, before any starts."""
    if num_workers > MAX_WORKERS:
        raise ValueError(f"num_workers={num_workers}: an h5feed loader runs at most {MAX_WORKERS} DataLoader workers "
                         "(each reads whole samples: 2-8 keep a GPU fed; `h5feed bench --workers N` measures it here)")


class LoaderCounters:
    """The table of all workers' rows, owned by a dataset; picklable into its workers."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.table = torch.zeros(max_workers, NUM_FIELDS, dtype=torch.float64).share_memory_()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.table = state["table"]
        self._lock = threading.Lock()

    def worker(self, worker_id: int | None = None) -> WorkerCounters:
        """This process's row: the DataLoader worker id, or row 0 in the main process."""
        if worker_id is None:
            info = torch.utils.data.get_worker_info()
            worker_id = info.id if info is not None else 0
        if worker_id >= len(self.table):
            raise ValueError(f"DataLoader worker {worker_id}: an h5feed loader runs at most {len(self.table)} DataLoader "
                             f"workers; pass num_workers <= {len(self.table)}")
        return WorkerCounters(self.table[worker_id], self._lock)

    def follow_end(self) -> int | None:
        """Where the latest following pass ended, or None while no worker's has.  Workers agree but for a bound
        that one saw before the writer stopped short of it, or an idle timeout each waits out on its own: the
        nearest end is taken, which a resume reads again rather than skips."""
        ends = self.table[:, Field.FOLLOW_END]
        ended = ends[ends > 0]
        return int(ended.min()) - 1 if len(ended) else None

    def begin_follow(self) -> None:
        """A following pass starts: the ends the workers recorded in the last one no longer hold."""
        self.table[:, Field.FOLLOW_END] = 0

    def snapshot(self) -> LoaderSnapshot:
        """A copy of every active row; rates are the caller's: differences of two snapshots over their times."""
        now = time.time()
        table = self.table.clone()
        workers = []
        for worker_id, row in enumerate(table.tolist()):
            if row[Field.STARTED] == 0:
                continue
            current = int(row[Field.CURRENT_SAMPLE])
            workers.append(
                WorkerSnapshot(
                    worker=worker_id,
                    pid=int(row[Field.PID]),
                    samples=int(row[Field.SAMPLES]),
                    tokens=int(row[Field.TOKENS]),
                    bytes_read=int(row[Field.BYTES_READ]),
                    bytes_delivered=int(row[Field.BYTES_DELIVERED]),
                    read_seconds=row[Field.READ_SECONDS],
                    decode_seconds=row[Field.DECODE_SECONDS],
                    wait_seconds=row[Field.WAIT_SECONDS],
                    queue_depth=int(row[Field.QUEUE_DEPTH]),
                    corrupt=int(row[Field.CORRUPT]),
                    requests=int(row[Field.REQUESTS]),
                    network_bytes=int(row[Field.NETWORK_BYTES]),
                    network_seconds=row[Field.NETWORK_SECONDS],
                    retries=int(row[Field.RETRIES]),
                    cache_hits=int(row[Field.CACHE_HITS]),
                    cache_misses=int(row[Field.CACHE_MISSES]),
                    current_sample=current if current >= 0 else None,
                    current_seconds=now - row[Field.CURRENT_SINCE] if current >= 0 else 0.0,
                    current_bytes=int(row[Field.CURRENT_BYTES]) if current >= 0 else 0,
                    seconds_since_progress=now - row[Field.LAST_PROGRESS] if row[Field.LAST_PROGRESS] else None,
                    writer_wait_seconds=row[Field.WRITER_WAIT_SECONDS],
                    waiting_for_writer_s=now - row[Field.WRITER_WAIT_SINCE] if row[Field.WRITER_WAIT_SINCE] else None,
                    repeated=int(row[Field.REPEATED]),
                )
            )
        return LoaderSnapshot(now, workers)
