"""A node-local cache of whole objects, shared by every process of the node (DataLoader workers, ranks).

The first read of an object downloads it (concurrent ranges, written in place into a temporary
file), later reads are local.  Under `cache_dir`:

    objects/<digest>                  complete objects, named by a digest of their URL
    locks/<digest>                    one lock file per object (flock): shared while a process reads
                                      the object, exclusive while one downloads or evicts it
    partial/<digest>.<pid>.<random>   downloads in flight (or left by a killed process)
    counters                          hits, misses, bytes downloaded, evictions (all processes)
    limit                             the size limit last given, for `cache_state`

So one process downloads a given object while the others wait on its lock; a download becomes
visible only by a rename after fsync, and only once it passes the caller's check (`verify`, the
reader's checksums), so bytes damaged in transit never enter the cache; eviction (least recently
used first: every read sets the file's mtime) takes an object's lock without waiting and skips
objects in use; and a process that starts cleans what killed ones left (partial files whose lock
nobody holds, lock files of absent objects): flock locks die with their process, so no lock is
ever stale.  A cached copy that fails a reader's check is `replace`d by a fresh, checked download
renamed over it, under the shared lock: its readers keep their copy, no reader waits, and a new
one sees the old copy or the new, never none.

fsspec's simplecache/filecache are not used: concurrent readers of one key got corrupt bytes, and
their metadata races between processes.  flock needs a local filesystem: keep `cache_dir` on the
node's own disk, not on NFS.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h5feed.io.local import fsync_dir
from h5feed.io.objects import Buffer, IOCounters, ObjectError, ObjectStore, Range, check_length, part_ranges

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

Verifier = Callable[[str, memoryview], None]  # checks an object's bytes (its URL, its bytes): ValueError if damaged

_COUNTERS = struct.Struct("<4q")  # hits, misses, downloaded bytes, evictions
_cleaned: set[tuple[int, str]] = set()  # (pid, cache root) already cleaned by this process


@dataclass(frozen=True)
class CacheState:
    """What `h5feed inspect` reports about a cache directory."""

    path: str
    objects: int
    bytes: int
    limit_bytes: int | None
    hits: int
    misses: int
    downloaded_bytes: int
    evictions: int
    partial: int  # downloads in flight, or left by killed processes (cleaned by the next one to start)

    def summary(self) -> str:
        limit = "no limit" if self.limit_bytes is None else f"limit {self.limit_bytes / 1e9:.2f} GB"
        reads = self.hits + self.misses
        rate = f"{100 * self.hits / reads:.0f}% hits" if reads else "no reads yet"
        return (f"cache {self.path}: {self.objects} objects, {self.bytes / 1e9:.2f} GB ({limit}); {rate} "
                f"({self.hits} hits, {self.misses} misses, {self.downloaded_bytes / 1e9:.2f} GB downloaded, "
                f"{self.evictions} evicted)")


class CachedObject:
    """One cached object held open under a shared lock: eviction skips it until `close()`.

    Its file may be mapped (`fileno()`) for as long as the object is open.  `downloaded`: this open
    downloaded it (so its bytes are as fresh as they come).
    """

    def __init__(self, url: str, path: Path, fd: int, lock_fd: int, downloaded: bool = False) -> None:
        self.url, self.path, self._fd, self._lock_fd = url, path, fd, lock_fd
        self.downloaded = downloaded
        self.size = os.fstat(fd).st_size

    def fileno(self) -> int:
        return self._fd

    def read(self) -> bytes:
        return self.read_ranges([(0, self.size)])[0]

    def read_ranges(self, ranges: Sequence[Range]) -> list[Buffer]:
        return [check_length(self.url, start, stop, os.pread(self._fd, stop - start, start)) for start, stop in ranges]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock_fd)  # releases the shared lock
            self._fd = self._lock_fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NodeCache:
    """The cache in `root`, with an optional size limit in bytes (a target: objects in use and
    downloads in flight are never evicted, so the cache can exceed it while they last)."""

    def __init__(self, root: str | os.PathLike[str], limit_bytes: int | None = None) -> None:
        self.root = Path(root).absolute()
        self.limit_bytes = limit_bytes
        for sub in ("objects", "locks", "partial"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if limit_bytes is not None:
            _write_atomic(self.root / "limit", str(limit_bytes).encode())
        if (os.getpid(), str(self.root)) not in _cleaned:
            self.clean_leftovers()
            _cleaned.add((os.getpid(), str(self.root)))

    def __repr__(self) -> str:
        return f"NodeCache({str(self.root)!r}, limit_bytes={self.limit_bytes})"

    def __reduce__(self) -> tuple[Any, ...]:  # no open files travel; the child cleans on first use
        return type(self), (self.root, self.limit_bytes)

    # --- reading -------------------------------------------------------------------------------
    def open(self, store: ObjectStore, key: str, namespace: str = "", stats: IOCounters | None = None,
             verify: Verifier | None = None) -> CachedObject:
        """The object `key` of `store`, downloaded first if no process of the node has it yet.

        A download enters the cache only once `verify` accepts its bytes; else its ValueError is raised
        and nothing is kept (the next open downloads again)."""
        digest = self._digest(store, key, namespace)
        stats = stats if stats is not None else store.stats
        downloaded = False
        while True:
            lock_fd = self._lock(digest, fcntl.LOCK_SH)
            try:
                fd = os.open(self._object_path(digest), os.O_RDONLY)
            except FileNotFoundError:
                os.close(lock_fd)
            else:
                obj = CachedObject(store.key_url(key), self._object_path(digest), fd, lock_fd, downloaded)
                now = time.time_ns()  # the clock's ns, not the filesystem's coarser tick: LRU order is exact
                os.utime(fd, ns=(now, now))
                stats.add_cache(not downloaded, obj.size)
                self._count(hits=int(not downloaded), misses=int(downloaded))
                return obj
            lock_fd = self._lock(digest, fcntl.LOCK_EX)  # waits while another process downloads it
            try:
                if not self._object_path(digest).exists():
                    self._download(store, key, digest, verify)
                    downloaded = True
            finally:
                os.close(lock_fd)

    def replace(self, obj: CachedObject, store: ObjectStore, key: str, namespace: str = "",
                stats: IOCounters | None = None, verify: Verifier | None = None) -> CachedObject:
        """Put a fresh download of `obj` (a copy that failed a check) in its place, and open it; `obj` is closed.

        `obj`'s shared lock is held meanwhile: no other process downloads or evicts the object, while its
        readers go on reading their copy.  Two processes replacing one copy at once both download (each
        checked); a copy another process already replaced is not downloaded again."""
        digest = self._digest(store, key, namespace)
        try:
            if os.stat(obj.path).st_ino == os.fstat(obj.fileno()).st_ino:
                self._download(store, key, digest, verify, replacing=True)
        except FileNotFoundError:  # evicted meanwhile: the open below downloads it
            pass
        finally:
            obj.close()
        return self.open(store, key, namespace, stats, verify)

    def discard(self, store: ObjectStore, key: str, namespace: str = "") -> None:
        """Forget the object (it was rewritten), once no process reads it."""
        digest = self._digest(store, key, namespace)
        lock_fd = self._lock(digest, fcntl.LOCK_EX)
        try:
            self._object_path(digest).unlink(missing_ok=True)
        finally:
            os.close(lock_fd)

    @staticmethod
    def _digest(store: ObjectStore, key: str, namespace: str) -> str:
        return hashlib.sha256(f"{namespace}\0{store.key_url(key)}".encode()).hexdigest()[:40]

    def _download(self, store: ObjectStore, key: str, digest: str, verify: Verifier | None,
                  replacing: bool = False) -> None:
        """Fetch the object as concurrent ranges into a partial file, fsync, check it, rename it into place
        (under the exclusive lock, or the shared one when `replacing` a damaged copy: others' partial files
        are then left alone)."""
        if not replacing:
            for leftover in (self.root / "partial").glob(f"{digest}.*"):  # a killed download of this object
                leftover.unlink(missing_ok=True)
        size = store.size(key)
        if not replacing:  # a replacement takes the place of a copy of the same size
            self._make_room(size)
        partial = self.root / "partial" / f"{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            parts = part_ranges(size)
            window = max(1, getattr(store, "concurrency", 8))  # bounds the memory: window x 8 MiB
            for i in range(0, len(parts), window):
                batch = parts[i:i + window]
                for (start, _), data in zip(batch, store.get_ranges(key, batch)):
                    _pwrite_all(fd, data, start)
            os.fsync(fd)
            if os.fstat(fd).st_size != size:
                raise ObjectError(store.key_url(key), f"downloaded {os.fstat(fd).st_size} bytes, expected {size}")
            if verify is not None and size:
                _verify_file(verify, store.key_url(key), fd, size)
        except BaseException as exc:
            os.close(fd)
            partial.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise ObjectError(str(self.root), "the cache's disk is full; give the cache a smaller limit "
                                                  "(cache_limit=) or another cache_dir") from exc
            raise
        os.close(fd)
        os.rename(partial, self._object_path(digest))
        fsync_dir(self.root / "objects")
        self._count(downloaded=size)

    # --- size limit ------------------------------------------------------------------------------
    def _make_room(self, need: int) -> None:
        """Evict least recently used objects nobody is reading until `need` more bytes fit under the limit."""
        if self.limit_bytes is None:
            return
        entries = []
        for entry in os.scandir(self.root / "objects"):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, entry.name))
        total = sum(size for _, size, _ in entries)
        for _, size, digest in sorted(entries):
            if total + need <= self.limit_bytes:
                return
            lock_fd = self._lock(digest, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if lock_fd is None:
                continue  # in use (or being replaced): never evicted
            try:
                self._object_path(digest).unlink(missing_ok=True)
                (self.root / "locks" / digest).unlink(missing_ok=True)
            finally:
                os.close(lock_fd)
            total -= size
            self._count(evictions=1)

    # --- locks, leftovers, counters --------------------------------------------------------------
    def _object_path(self, digest: str) -> Path:
        return self.root / "objects" / digest

    def _lock(self, digest: str, operation: int) -> int | None:
        """An fd of the object's lock file holding `operation`; None if LOCK_NB and it is taken.

        An evictor removes the lock file under its exclusive lock, so a lock taken on a file that
        is no longer at the path is worthless: take the new one."""
        path = self.root / "locks" / digest
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, operation)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def clean_leftovers(self) -> None:
        """Remove partial downloads of killed processes, and lock files of objects that are absent."""
        for partial in (self.root / "partial").iterdir():
            digest = partial.name.split(".", 1)[0]
            lock_fd = self._lock(digest, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if lock_fd is not None:  # nobody is downloading it
                partial.unlink(missing_ok=True)
                os.close(lock_fd)
        for lock in (self.root / "locks").iterdir():
            if self._object_path(lock.name).exists():
                continue
            lock_fd = self._lock(lock.name, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if lock_fd is not None:
                if not self._object_path(lock.name).exists():
                    lock.unlink(missing_ok=True)
                os.close(lock_fd)

    def _count(self, hits: int = 0, misses: int = 0, downloaded: int = 0, evictions: int = 0) -> None:
        fd = os.open(self.root / "counters", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            old = _read_counters(fd)
            os.pwrite(fd, _COUNTERS.pack(old[0] + hits, old[1] + misses, old[2] + downloaded, old[3] + evictions), 0)
        finally:
            os.close(fd)

    def state(self) -> CacheState:
        return cache_state(self.root)


def cache_state(cache_dir: str | os.PathLike[str]) -> CacheState:
    """Objects, bytes, limit and the node-wide hit, miss, download and eviction counts of a cache directory."""
    root = Path(cache_dir).absolute()
    sizes = []
    for entry in os.scandir(root / "objects") if (root / "objects").is_dir() else []:
        try:
            sizes.append(entry.stat().st_size)
        except FileNotFoundError:
            continue
    counters = (0, 0, 0, 0)
    if (root / "counters").exists():
        fd = os.open(root / "counters", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            counters = _read_counters(fd)
        finally:
            os.close(fd)
    limit = int((root / "limit").read_text()) if (root / "limit").exists() else None
    partial = len(os.listdir(root / "partial")) if (root / "partial").is_dir() else 0
    return CacheState(str(root), len(sizes), sum(sizes), limit, *counters, partial=partial)


class CachedStore(ObjectStore):
    """An ObjectStore whose data reads (`get_ranges`, `get_large`, `open_cached`) go through a
    NodeCache; everything else, `get` included (metadata such as `zarr.json`, which changes while a
    store converts), goes to `inner` uncached.

    Cached objects are taken to be immutable once written, as a finished store's are: give a
    `namespace` that changes when a store is rewritten at the same URL (e.g. its conversion id),
    so that old copies are never served.
    """

    def __init__(self, inner: ObjectStore, cache: NodeCache, namespace: str = "", verify: Verifier | None = None) -> None:
        super().__init__(inner.url)
        self.inner, self.cache, self.namespace = inner, cache, namespace
        self.verify = verify  # what a download must pass to enter the cache (the reader's checksums)
        self.read_only = inner.read_only

    @property
    def stats(self) -> IOCounters:
        return self.inner.stats

    @stats.setter
    def stats(self, counters: IOCounters | None) -> None:
        self.inner.stats = counters

    def open_cached(self, key: str) -> CachedObject:
        """The object's local copy, held until closed (map it, read ranges); downloaded first on a miss."""
        return self.cache.open(self.inner, key, self.namespace, verify=self.verify)

    def replace_cached(self, obj: CachedObject, key: str) -> CachedObject:
        """A fresh, checked download of `key` in place of `obj`, a local copy that failed a check; `obj` is closed."""
        return self.cache.replace(obj, self.inner, key, self.namespace, verify=self.verify)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        with self.open_cached(key) as obj:
            return obj.read_ranges(ranges)

    def get_large(self, key: str, size: int | None = None) -> bytes:
        with self.open_cached(key) as obj:
            return obj.read()

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> dict[str, int]:
        return self.inner.list(prefix)

    def put_atomic(self, key: str, data: bytes | memoryview) -> None:
        self.inner.put_atomic(key, data)
        self.cache.discard(self.inner, key, self.namespace)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        self.cache.discard(self.inner, key, self.namespace)


def _read_counters(fd: int) -> tuple[int, int, int, int]:
    data = os.pread(fd, _COUNTERS.size, 0)
    return _COUNTERS.unpack(data) if len(data) == _COUNTERS.size else (0, 0, 0, 0)


def _verify_file(verify: Verifier, url: str, fd: int, size: int) -> None:
    """`verify` on the file's bytes, mapped (no copy)."""
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    view = memoryview(mapped)
    try:
        verify(url, view)
    finally:
        try:
            view.release()
            mapped.close()
        except BufferError:  # the verifier's traceback still holds a view: the map closes when that is collected
            pass


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
