"""The one small interface h5feed reads and writes objects through, whatever holds them.

A store (or a source folder) is a root URL; its objects are named by keys relative to it, with
"/" between folders, e.g. `aux_hidden_states/c/0/0`.  Every backend gives the same guarantees:
ranges are fetched concurrently, a read returns all the bytes asked for or raises (never a partial
body), a put is atomic (readers see the old object or the whole new one), and errors name the
object's URL and what to do.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from h5feed.errors import PathError

Range = tuple[int, int]  # [start, stop) byte offsets into one object
Buffer = bytes | memoryview  # what a range read returns: bytes-like, zero-copy where the client allows

PART_BYTES = 8 << 20  # a large object is fetched as concurrent ranges of this size (AWS advises 8-16 MB)


class ObjectError(PathError):
    """An object that cannot be read or written: `str(err)` is "URL: PROBLEM, what to do"."""


class ObjectNotFound(ObjectError):
    """The object (or its bucket) does not exist."""


class AccessDenied(ObjectError):
    """The credentials in use may not read or write the object."""


class ObjectUnavailable(ObjectError):
    """Transient failures (resets, timeouts, 5xx, throttling) outlasted every retry."""


class TransferMismatch(ObjectError):
    """Bytes that are not what was asked for or sent: a range body of another length, an upload the server
    stored otherwise.  Retried as a fresh request first (bytes garble in transit); raised as it is when they
    come back wrong every time."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or HEAD says of one object: enough to tell that it changed."""

    size: int
    etag: str | None  # None where the backend has none
    modified_ns: int | None  # last modified, by the server's clock (ns since the epoch)


@runtime_checkable
class IOCounters(Protocol):
    """What an ObjectStore reports to: `IOStats` in this process, or a shared-memory row the monitor reads."""

    def add_request(self, nbytes: int, seconds: float) -> None: ...

    def add_retry(self) -> None: ...

    def add_cache(self, hit: bool, nbytes: int) -> None: ...


@dataclass
class IOStats:
    """Network traffic of one process: requests that succeeded, the payload bytes they brought and
    their seconds (summed: concurrent requests overlap), the retries they needed, and node-cache
    hits and misses.  Thread-safe: requests finish on I/O threads."""

    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0  # sizes of the objects opened from the node cache

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add_request(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.seconds += seconds

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def add_cache(self, hit: bool, nbytes: int) -> None:
        with self._lock:
            if hit:
                self.cache_hits += 1
            else:
                self.cache_misses += 1
            self.cache_bytes += nbytes

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


_process_stats: list[IOStats] = [IOStats()]
os.register_at_fork(after_in_child=lambda: _process_stats.__setitem__(0, IOStats()))


def process_stats() -> IOStats:
    """This process's counters; a forked child starts from zero rather than from its parent's figures."""
    return _process_stats[0]


def part_ranges(size: int, part: int = PART_BYTES) -> list[Range]:
    """[0, size) cut into ranges of `part` bytes, the last one shorter."""
    return [(start, min(start + part, size)) for start in range(0, size, part)]


class ObjectStore(ABC):
    """Objects under one root URL.

    Pickles as its configuration only: a client, its connection pool and event loop are made
    lazily in the process that uses them, and made again in a forked child, so a DataLoader
    worker under fork, spawn or forkserver never touches its parent's connections.
    """

    read_only = False

    def __init__(self, url: str, *, stats: IOCounters | None = None) -> None:
        self.url = url.rstrip("/")
        self._stats = stats

    @property
    def stats(self) -> IOCounters:
        """Where requests are counted: this process's `IOStats` unless a caller set its own."""
        return self._stats if self._stats is not None else process_stats()

    @stats.setter
    def stats(self, counters: IOCounters | None) -> None:
        self._stats = counters

    def key_url(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_client")}
        state["_stats"] = None  # counters belong to the process that made them
        return state

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object in one request: metadata and other small objects (never cached; see `get_large`)."""

    @abstractmethod
    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        """The bytes of each [start, stop) range of one object, fetched concurrently; an empty range costs no request.

        `concurrency` bounds the requests in flight per store and process, across all calls and threads."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Bytes of the object; ObjectNotFound when there is none."""

    @abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under the folder `prefix` (recursively), as {key: size} in key order."""

    @abstractmethod
    def put_atomic(self, key: str, data: bytes | memoryview) -> None:
        """Write the object so that readers see either nothing (or the old object) or all of `data`."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing one that is not there is no error."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def get_large(self, key: str, size: int | None = None) -> bytes:
        """The whole object as data (a source `.pt`, a shard): concurrent ranges when larger than one part."""
        size = self.size(key) if size is None else size
        if size <= PART_BYTES:
            return self.get(key)
        return b"".join(self.get_ranges(key, part_ranges(size)))

    def local_path(self, key: str) -> Path | None:
        """The object's file when it sits on a POSIX filesystem (map it, read ahead), else None."""
        return None

    def _check_writable(self, key: str) -> None:
        if self.read_only:
            raise ObjectError(self.key_url(key), "this location is read-only; write the store to a bucket or a folder")


def check_length(url: str, start: int, stop: int, data: Buffer) -> Buffer:
    """A complete range, or an error: the body was cut short on the way (retried), or the object is shorter
    than the reader expects."""
    if len(data) != stop - start:
        raise TransferMismatch(
            url, f"asked for bytes [{start}, {stop}) but got {len(data)}: the object is not the size expected, "
            "so the store is damaged or another store's object is in its place; run `h5feed verify`",
        )
    return data
