"""Where the checked reader gets a store's objects from: mapped local files, or bytes fetched from a bucket.

- `LocalSource` (a path, file://): the POSIX fast path, unchanged: objects are files, mapped
  (populated in one go when all of it is wanted) with kernel read-ahead as the hint that a
  sample will be needed.
- `RemoteSource` (s3://, gs://, az://, https://, chained URLs): objects fetched through
  `h5feed.io` (counted retries, errors naming the object).  A shard costs its index (its last
  bytes), then the inner chunks wanted (all, or the first few for a `max_len` read) as concurrent
  ranges of whole chunks, at most 16 MiB each: each chunk decodes from the bytes its request
  brought, with no copy (joining 8 MiB parts into one buffer cost ~45 ms of CPU per Kimi sample).
- `CachedSource` (a bucket with `cache_dir`): objects downloaded whole into the node cache by
  the first process that needs them, then mapped from there like local files.

The two remote sources fetch ahead: `will_need` starts a sample's objects now, concurrently,
on a per-process pool, within a byte budget (`PREFETCH_BYTES`); the read then takes what was
fetched, or has it fetched when nothing was asked ahead, and waits for it until its `Deadline`.
The reader checks every inner chunk it decodes, whatever its source; when bytes fail it opens the
object again `fresh` (a new request, a new download into the cache, the file mapped again) before
it calls them damage.  A download enters the node cache only once every inner chunk passes its
crc32c (`check_shard`).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import functools
import hashlib
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from h5feed.io import (
    PART_BYTES,
    Buffer,
    CachedObject,
    CachedStore,
    ObjectNotFound,
    ObjectStore,
    ObjectUnavailable,
    Range,
    part_ranges,
)
from h5feed.store.format import CRC_BYTES, EMPTY
from h5feed.store.layout import check_crc32c, decode_shard_index, shard_index_nbytes

PREFETCH_BYTES = 1 << 30  # per process: fetched objects not yet read (an estimate: their decoded size)
PREFETCH_OBJECTS = 64  # per process: objects fetched ahead and not yet read
PREFETCH_THREADS = 4  # objects fetched at once per process (each as concurrent ranges, up to the store's concurrency):
# about one sample's, so that the next sample to be read comes first rather than sharing the bandwidth with later ones
READ_THREADS = 16  # per process: objects fetched at once for reads that asked nothing ahead (a BatchLoader's threads)
MAX_RANGE_BYTES = 2 * PART_BYTES  # the longest range request: 16 MiB

# Read a mapped file's pages in one go (Linux), rather than one page fault at a time.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class DamagedObject(ValueError):
    """Bytes of one of a store's objects that fail a check (empty, too large, missing, a shard index or an inner
    chunk that fails its crc32c): `where` is the object's file or URL, `problem` what failed (`str(exc)`).

    Never raised to the trainer: the reader reads the object once more, fresh, then raises a `CorruptSampleError`
    naming the sample and `where`.  A ValueError, as the node cache's check of a download raises (`io.cache`)."""

    def __init__(self, where: str | Path, problem: str) -> None:
        super().__init__(problem)
        self.where = where
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str | Path, str]]:
        return type(self), (self.where, self.problem)


def check_inner_chunk(encoded: memoryview, k: int) -> None:
    """Inner chunk `k` of a shard (its frame, then the frame's crc32c) against its checksum: ValueError if it fails."""
    check_crc32c(encoded[:-CRC_BYTES], bytes(encoded[-CRC_BYTES:]), f"inner chunk {k}")


def check_shard(chunks_per_shard: int, url: str, data: memoryview) -> None:
    """Every inner chunk of a whole shard against its crc32c, and its index: what a download must pass
    to enter the node cache."""
    try:
        index = decode_shard_index(data[-shard_index_nbytes(chunks_per_shard):], chunks_per_shard, len(data))
        for k, (offset, length) in enumerate(index.tolist()):
            if offset != EMPTY:
                check_inner_chunk(data[offset : offset + length], k)
    except ValueError as exc:
        raise DamagedObject(url, str(exc)) from None


@dataclass(frozen=True)
class Deadline:
    """When a sample's read must be done by (`time.monotonic()`), and what the error says when it is not."""

    sample: int
    seconds: float
    at: float

    @classmethod
    def after(cls, sample: int, seconds: float) -> Deadline:
        return cls(sample, seconds, time.monotonic() + seconds)

    def wait(self, future: Future[Any], where: str) -> Any:
        """The future's result; ObjectUnavailable once the deadline passes (what it fetches is closed when it comes)."""
        concurrent.futures.wait([future], timeout=max(0.0, self.at - time.monotonic()))
        if not future.done():
            future.add_done_callback(_close_result)
            raise ObjectUnavailable(
                where, f"sample {self.sample} was not read within its deadline of {self.seconds:g} s: the bucket is "
                "slow or unreachable; check the network, or give the Store a longer read_deadline")
        return future.result()  # the fetch's own error, if it failed


def _close_result(future: Future[Any]) -> None:
    """Close what a future fetched, once it is there, when nobody will read it."""
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class ObjectView(Protocol):
    """The bytes of one object that a read may use (the whole object, or its index and some inner chunks)."""

    size: int  # of the whole object

    def tail(self, n: int) -> bytes:
        """The object's last `n` bytes (a shard's index)."""

    def span(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of the object: a view, valid until `close`."""

    def close(self) -> None: ...


class ObjectSource(ABC):
    """A store's objects, by key, for the reader: `open` a view, or say early that one `will_need` it.

    `inner` is the range of inner chunks of a shard the read decodes; `whole` says they are all its chunks.
    `fresh` asks for new bytes, never ones fetched before (the ones it gave failed a check); a remote source
    gives up waiting at the `deadline`.
    """

    @abstractmethod
    def where(self, key: str) -> str | Path:
        """How errors name the object: its file or its URL."""

    @abstractmethod
    def open(self, key: str, inner: range, whole: bool, fresh: bool = False,
             deadline: Deadline | None = None) -> contextlib.AbstractContextManager[ObjectView]: ...

    @abstractmethod
    def will_need(self, key: str, inner: range, whole: bool, nbytes: int) -> None:
        """Start getting the object now, without waiting (`nbytes`: about how much memory it takes)."""


# --- local files ------------------------------------------------------------------------------------


class MappedObject:
    """A file mapped read-only; spans are views of the map."""

    def __init__(self, fd: int, where: str | Path, populate: bool, max_nbytes: int | None = None) -> None:
        self.size = os.fstat(fd).st_size
        if self.size == 0:
            raise DamagedObject(where, "is empty")
        if max_nbytes is not None and self.size > max_nbytes:  # e.g. a sparse file: refused before it is mapped
            raise DamagedObject(where, f"is {self.size} bytes, more than an object of its array can take ({max_nbytes})")
        self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0),
                              prot=mmap.PROT_READ)
        self._view = memoryview(self._map)

    def tail(self, n: int) -> bytes:
        return bytes(self._view[max(0, self.size - n) :])  # small: a copy keeps no view of the map

    def span(self, offset: int, length: int) -> memoryview:
        return self._view[offset : offset + length]

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a traceback still holds a view of it: the map closes when that is collected
            pass


class LocalSource(ObjectSource):
    """Objects as files under a folder; a file larger than `max_nbytes[array]` is refused before it is mapped."""

    def __init__(self, root: Path, max_nbytes: Mapping[str, int] | None = None) -> None:
        self.root = root
        self.max_nbytes = dict(max_nbytes or {})

    def where(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def open(self, key: str, inner: range, whole: bool, fresh: bool = False,
             deadline: Deadline | None = None) -> Iterator[ObjectView]:
        """The file, mapped (afresh each time: `fresh` needs nothing more)."""
        path = self.root / key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise DamagedObject(path, "is missing") from None
        try:
            view = MappedObject(fd, path, populate=whole, max_nbytes=self.max_nbytes.get(key.split("/", 1)[0]))
        finally:
            os.close(fd)
        try:
            yield view
        finally:
            view.close()

    def will_need(self, key: str, inner: range, whole: bool, nbytes: int) -> None:
        read_ahead(self.root / key)


def read_ahead(path: Path) -> None:
    """Ask the kernel to start reading `path` into the page cache, without waiting for it.
    A missing file is left to the read that follows to report."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


# --- fetching ahead -----------------------------------------------------------------------------------


@dataclass
class _Ahead:
    inner: range
    whole: bool
    nbytes: int
    future: Future[Any]

    def covers(self, inner: range, whole: bool) -> bool:
        return self.whole or (not whole and self.inner.start <= inner.start and inner.stop <= self.inner.stop)

    def discard(self) -> None:
        """Close what was fetched once it is there (eviction never waits)."""
        self.future.add_done_callback(_close_result)


class _Prefetcher:
    """Objects fetched ahead of their reads, at most `max_bytes` and `max_objects` of them not yet read,
    and the fetches of reads that asked for nothing ahead (`fetch_now`), on their own threads, so that
    every read can stop waiting at its deadline.

    One per process (a forked child makes its own): a read takes its object out, so each
    fetched object is read once; beyond the budget the oldest finished ones are dropped
    (their reads fetch again), and asks that still do not fit are ignored (the read fetches).
    """

    def __init__(self, fetch: Callable[[str, range, bool, bool], Any], max_bytes: int, max_objects: int) -> None:
        self._fetch = fetch
        self._max_bytes, self._max_objects = max_bytes, max_objects
        self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="h5feed-prefetch")
        self._now = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="h5feed-read")
        self._ahead: OrderedDict[str, _Ahead] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def want(self, key: str, inner: range, whole: bool, nbytes: int) -> None:
        with self._lock:
            if key in self._ahead and self._ahead[key].covers(inner, whole):
                return
            self._drop(self._ahead.pop(key, None))
            for old in [k for k, a in self._ahead.items() if a.future.done()]:  # oldest first
                if self._bytes + nbytes <= self._max_bytes and len(self._ahead) < self._max_objects:
                    break
                self._drop(self._ahead.pop(old))
            if self._bytes + nbytes > self._max_bytes or len(self._ahead) >= self._max_objects:
                return
            self._ahead[key] = _Ahead(inner, whole, nbytes, self._pool.submit(self._fetch, key, inner, whole, False))
            self._bytes += nbytes

    def take(self, key: str, inner: range, whole: bool) -> Future[Any] | None:
        """What is fetched ahead for this read (its result: the fetch's own error, if it failed), or None."""
        with self._lock:
            ahead = self._ahead.get(key)
            if ahead is None or not ahead.covers(inner, whole):
                return None
            del self._ahead[key]
            self._bytes -= ahead.nbytes
        return ahead.future

    def forget(self, key: str) -> None:
        """Drop what is fetched ahead of `key`: its bytes may be the ones that failed."""
        with self._lock:
            self._drop(self._ahead.pop(key, None))

    def fetch_now(self, key: str, inner: range, whole: bool, fresh: bool) -> Future[Any]:
        return self._now.submit(self._fetch, key, inner, whole, fresh)

    def _drop(self, ahead: _Ahead | None) -> None:
        if ahead is not None:
            self._bytes -= ahead.nbytes
            ahead.discard()


class _FetchingSource(ObjectSource):
    """What the bucket's two sources share: keys to URLs, fetching ahead in each process, and the most bytes
    an object of each array can take (`max_nbytes`: larger objects are refused before they are read)."""

    def __init__(self, objects: ObjectStore, chunks_per_shard: int, max_nbytes: Mapping[str, int] | None = None) -> None:
        self.objects = objects
        self.chunks_per_shard = chunks_per_shard  # 0: format 1 (objects are chunks, always read whole)
        self.max_nbytes = dict(max_nbytes or {})

    def _max_nbytes(self, key: str) -> int | None:
        return self.max_nbytes.get(key.split("/", 1)[0])

    def where(self, key: str) -> str:
        return self.objects.key_url(key)

    @abstractmethod
    def _fetch(self, key: str, inner: range, whole: bool, fresh: bool) -> Any:
        """The object's view (a remote fetch is always a new request; `fresh` matters to the cache only)."""

    def _prefetcher(self) -> _Prefetcher:
        if self.__dict__.get("_prefetcher_pid") != os.getpid():  # a forked child makes its own pool
            self._prefetcher_made = _Prefetcher(self._fetch, PREFETCH_BYTES, PREFETCH_OBJECTS)
            self._prefetcher_pid = os.getpid()
        return self._prefetcher_made

    def will_need(self, key: str, inner: range, whole: bool, nbytes: int) -> None:
        self._prefetcher().want(key, inner, whole or not self.chunks_per_shard, nbytes)

    @contextlib.contextmanager
    def open(self, key: str, inner: range, whole: bool, fresh: bool = False,
             deadline: Deadline | None = None) -> Iterator[ObjectView]:
        whole = whole or not self.chunks_per_shard
        view = self._get(key, inner, whole, fresh, deadline)
        try:
            yield view
        finally:
            view.close()

    def _get(self, key: str, inner: range, whole: bool, fresh: bool, deadline: Deadline | None) -> Any:
        """What `_fetch` gives for this read: fetched ahead unless `fresh`; waited for until the deadline."""
        fetches = self._prefetcher()
        if fresh:
            fetches.forget(key)
        future = (None if fresh else fetches.take(key, inner, whole)) or fetches.fetch_now(key, inner, whole, fresh)
        return future.result() if deadline is None else deadline.wait(future, self.where(key))


# --- a bucket, read directly ----------------------------------------------------------------------------


class FetchedObject:
    """Bytes of one object held in memory: its tail (a shard's index) and pieces of it, each a whole number of chunks."""

    def __init__(self, size: int, tail: Buffer, pieces: list[tuple[int, Buffer]]) -> None:
        self.size, self._tail = size, bytes(tail)
        self._starts = [start for start, _ in pieces]
        self._pieces = [memoryview(data) for _, data in pieces]

    def tail(self, n: int) -> bytes:
        return self._tail[-n:]

    def span(self, offset: int, length: int) -> memoryview:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + length > self._starts[i] + len(self._pieces[i]):
            raise ValueError(f"bytes [{offset}, {offset + length}) were not fetched")
        begin = offset - self._starts[i]
        return self._pieces[i][begin : begin + length]

    def close(self) -> None:
        self._pieces = []


def coalesce(spans: list[Range], limit: int = MAX_RANGE_BYTES) -> list[Range]:
    """Chunk spans, in order, joined where adjacent into ranges of at most `limit` bytes: no chunk is cut,
    so each decodes from the bytes its request brought (no copy); a longer chunk is a range of its own."""
    ranges: list[Range] = []
    for start, stop in spans:
        if ranges and ranges[-1][1] == start and stop - ranges[-1][0] <= limit:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    return ranges


class RemoteSource(_FetchingSource):
    """Objects fetched into memory.  A shard costs its index (its last bytes), then the wanted inner chunks
    in ranges of whole chunks, at most 16 MiB each (AWS advises 8-16 MB), fetched concurrently; the
    small per-token arrays' objects are fetched whole, in one request.

    Object sizes come from one listing per array and process (the first read of the array asks for
    it); an object the listing lacks is asked for alone (`size`), so a deleted one is a clear 404.
    """

    def __init__(self, objects: ObjectStore, chunks_per_shard: int, small_arrays: tuple[str, ...],
                 max_nbytes: Mapping[str, int] | None = None) -> None:
        super().__init__(objects, chunks_per_shard, max_nbytes)
        self.small_arrays = small_arrays

    def _fetch(self, key: str, inner: range, whole: bool, fresh: bool) -> FetchedObject:
        n = shard_index_nbytes(self.chunks_per_shard)
        if key.split("/", 1)[0] in self.small_arrays:
            data = self.objects.get(key)
            return FetchedObject(len(data), data[-n:], [(0, data)])
        size, most = self._size(key), self._max_nbytes(key)
        if most is not None and size > most:  # a listing's claim: refused before any byte is fetched
            raise DamagedObject(self.where(key), f"is {size} bytes, more than an object of its array can take ({most})")
        if not self.chunks_per_shard:  # format 1: the object is one chunk
            return FetchedObject(size, b"", self._pieces(key, [(0, size)]))
        if size < n:
            raise DamagedObject(self.where(key), f"shard of {size} bytes is too short for its index")
        tail = self._pieces(key, [(size - n, size)])[0][1]
        try:
            index = decode_shard_index(tail, self.chunks_per_shard, size)
        except ValueError as exc:
            raise DamagedObject(self.where(key), str(exc)) from None
        wanted = index[inner.start : inner.stop]
        spans = [(int(offset), int(offset + length)) for offset, length in wanted if offset != EMPTY]
        return FetchedObject(size, tail, self._pieces(key, coalesce(sorted(spans))))

    def _pieces(self, key: str, ranges: list[Range]) -> list[tuple[int, Buffer]]:
        """(start, bytes) of each range, all fetched at once; a range longer than the limit as concurrent
        parts, joined (a copy: only for chunks of more than 16 MiB)."""
        requests = [[(start + a, start + b) for a, b in part_ranges(stop - start)] if stop - start > MAX_RANGE_BYTES
                    else [(start, stop)] for start, stop in ranges]
        fetched = iter(self.objects.get_ranges(key, [r for parts in requests for r in parts]))
        pieces = []
        for (start, _), parts in zip(ranges, requests):
            data = [next(fetched) for _ in parts]
            pieces.append((start, data[0] if len(data) == 1 else b"".join(data)))
        return pieces

    def _size(self, key: str) -> int:
        array = key.split("/", 1)[0]
        sizes = self._sizes().get(array)
        if sizes is None:
            with self._sizes_lock():
                sizes = self._sizes().get(array)
                if sizes is None:
                    sizes = self._sizes()[array] = self.objects.list(f"{array}/")
        return sizes[key] if key in sizes else self.objects.size(key)

    def _sizes(self) -> dict[str, dict[str, int]]:
        return self.__dict__.setdefault("_sizes_listed", {})  # immutable once complete: a fork may keep them

    def _sizes_lock(self) -> threading.Lock:
        if self.__dict__.get("_sizes_lock_pid") != os.getpid():
            self._sizes_lock_made, self._sizes_lock_pid = threading.Lock(), os.getpid()
        return self._sizes_lock_made


# --- a bucket, through the node cache --------------------------------------------------------------------


class CachedView(MappedObject):
    """A cached object's local file, mapped, held under the cache's shared lock until closed."""

    def __init__(self, cached: CachedObject, populate: bool, max_nbytes: int | None = None) -> None:
        self._cached = cached
        try:
            super().__init__(cached.fileno(), cached.url, populate, max_nbytes)
        except BaseException:
            cached.close()
            raise

    def close(self) -> None:
        super().close()
        self._cached.close()


class _Opened:
    """A cached object opened ahead (downloaded if it had to be, pages asked for); mapped when read."""

    def __init__(self, cached: CachedObject) -> None:
        self.cached = cached
        os.posix_fadvise(cached.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self.cached.close()


class CachedSource(_FetchingSource):
    """Objects read from the node cache (`h5feed.io.NodeCache`); the first process that needs one downloads it
    whole, and it enters the cache only when every inner chunk passes its checksum (format 2)."""

    objects: CachedStore

    def __init__(self, objects: CachedStore, chunks_per_shard: int, max_nbytes: Mapping[str, int] | None = None) -> None:
        super().__init__(objects, chunks_per_shard, max_nbytes)
        if chunks_per_shard:  # format 2: the store's own checksums say what a sound download is
            objects.verify = functools.partial(check_shard, chunks_per_shard)

    def _fetch(self, key: str, inner: range, whole: bool, fresh: bool) -> _Opened:
        """The cached copy, opened; `fresh`: a new download in place of the copy unless this open made it."""
        cached = self.objects.open_cached(key)
        if fresh and not cached.downloaded:
            cached = self.objects.replace_cached(cached, key)
        return _Opened(cached)

    @contextlib.contextmanager
    def open(self, key: str, inner: range, whole: bool, fresh: bool = False,
             deadline: Deadline | None = None) -> Iterator[ObjectView]:
        opened = self._get(key, inner, True, fresh, deadline)
        view = CachedView(opened.cached, populate=whole or not self.chunks_per_shard, max_nbytes=self._max_nbytes(key))
        try:
            yield view
        finally:
            view.close()

    def will_need(self, key: str, inner: range, whole: bool, nbytes: int) -> None:
        self._prefetcher().want(key, inner, True, 0)  # files, not memory: only the object count bounds them


# --- the metadata and index, for zarr -------------------------------------------------------------------


def zarr_store(objects: ObjectStore, known: dict[str, bytes], prefixes: tuple[str, ...]) -> Any:
    """A read-only zarr store of the objects' metadata and small arrays, fetched through `objects`.

    Every object under `prefixes` is fetched at once (one listing, concurrent gets); any other
    key zarr asks for is fetched when asked.  zarr decodes and checks them as from any store.
    """
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import MemoryStore

    def as_buffer(data: bytes) -> Any:
        return default_buffer_prototype().buffer.from_bytes(data)

    class ObjectsZarrStore(MemoryStore):
        def __init__(self, store_dict: Any = None, *, read_only: bool = True) -> None:
            super().__init__(store_dict, read_only=True)

        def with_read_only(self, read_only: bool = False) -> ObjectsZarrStore:
            return self

        async def _fetch(self, key: str) -> None:
            if key not in self._store_dict:
                try:
                    self._store_dict[key] = as_buffer(await asyncio.to_thread(objects.get, key))
                except ObjectNotFound:
                    pass

        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            await self._fetch(key)
            return await super().get(key, prototype, byte_range)

        async def exists(self, key: str) -> bool:
            await self._fetch(key)
            return key in self._store_dict

    found = dict(known)
    keys = [key for prefix in prefixes for key in objects.list(prefix)  # s3fs may list the prefix itself
            if key.startswith(prefix) and key != prefix and key not in found]
    with ThreadPoolExecutor(8, thread_name_prefix="h5feed-index") as pool:
        found.update(zip(keys, pool.map(objects.get, keys)))
    return ObjectsZarrStore({key: as_buffer(data) for key, data in found.items()})


def fingerprint(store: Any) -> str:
    """A digest of everything fetched into a `zarr_store` (metadata and index): it changes when the store is rewritten."""
    digest = hashlib.sha256()
    for key in sorted(store._store_dict):
        digest.update(key.encode() + b"\0" + store._store_dict[key].to_bytes())
    return digest.hexdigest()[:16]
