"""One converter at a time: the lock `h5feed convert` holds on its store (and open_writer's writers share).

The lock is a file inside the store, `h5feed-writer.lock`, held with `flock`
for the writer's lifetime and holding who the writer is (host, pid, start
time).  `h5feed.open_writer` writers hold the same file with a shared `flock`,
several at once, so that a converter and writers exclude each other; each one
also holds a lock of its own id (`WriterLock.of_writer`).  The kernel drops a
`flock` when its process dies, however it dies, so a lock left by a killed
converter is free to the next one with no guess about pids (a pid can be
reused; a flock cannot outlive its holder), and no second writer can take it
while the first lives.  The writer also records the named
POSIX semaphores its process pool created, so that the next writer can remove
the ones a SIGKILL left in /dev/shm: only those, and only when no process maps
them any more (`h5feed.conversion.pool`, beside the workers' start that makes
them die with the converter).

A store in a bucket has no flock: `BucketLock` is an object at the same key,
created with a conditional PUT (If-None-Match: *, so of two writers starting
together exactly one creates it) and rewritten by its holder every
`HEARTBEAT_S` seconds (If-Match on its own ETag, so a holder whose lock was
taken over learns it).  A lock whose last heartbeat is older than
`STALE_AFTER_S`, or whose holder is a process of this host that no longer
runs (a converter killed with SIGKILL), is taken over, saying whose it was.
Its age is judged on one clock, the bucket's: its Last-Modified against the
server's time now (`FsspecStore.server_time_ns`), never against this machine's
clock, which may be minutes off the bucket's.  Such locks are kept only where
nothing else will do: a converter's, and each `open_writer` writer's own id
(what tells a follower that a writer is alive).  Writers of one bucket store
share no lock: they commit by compare-and-swap (`writer_sites.bucket`).

`held_briefly` is the short step local writers share (a flock); a writer that
waits for one says every `WAIT_LOG_S` who holds it and how long it has waited.
A writer's staging folder is its own while it runs (`WriterLock.of_staging`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h5feed.conversion.pool import mapped_semaphores, remove_orphaned_semaphores
from h5feed.errors import StoreError
from h5feed.io.objects import ObjectNotFound
from h5feed.store.writer_state import (
    CONVERTER,
    LOCK_FILE,
    STALE_AFTER_S,
    WRITER_API,
    WriterFiles,
    current_writer,
    describe_writer,
    lock_age_s,
    read_holder,
    why_lock_is_free,
)

if TYPE_CHECKING:
    from h5feed.io import FsspecStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # how often a bucket lock's holder rewrites it
PATIENCE_S = 1.0  # how long a writer asks for a local lock again before naming its holder
WAIT_LOG_S = 30.0  # how often a writer waiting for a shared step says who holds it
STAGING_LOCK = "h5feed-staging.lock"  # in a bucket writer's staging folder: whose folder it is


class WriterLock:
    """Held by the process that writes a store; `release()` (or process death) frees it.

    `acquire`: `h5feed convert`'s, exclusive.  `share`: an `open_writer` writer's hold on the same file, shared
    with the other writers of the store and excluding a converter.  `of_writer`: a writer's own lock, exclusive
    for its id, with who holds it inside."""

    def __init__(self, path: Path, fd: int, shared: bool = False) -> None:
        self.path = path
        self._fd = fd
        self._shared = shared
        self._info: dict[str, Any] = {}

    @classmethod
    def acquire(cls, store: Path) -> WriterLock:
        """Take the store's lock for `h5feed convert`, or raise StoreError naming the writer(s) that hold it."""
        store.mkdir(parents=True, exist_ok=True)
        def refusal(fd: int) -> StoreError:
            return _refusal(store, current_writer(store) or read_holder(fd))

        fd = _take(store / LOCK_FILE, fcntl.LOCK_EX, refusal, patience_s=0.0)  # a second converter: refused at once
        lock = cls(store / LOCK_FILE, fd)
        remove_orphaned_semaphores(read_holder(fd).get("semaphores", []))  # a killed writer's leftovers
        lock._write({"by": CONVERTER, **_this_process()})
        return lock

    @classmethod
    def share(cls, store: Path) -> WriterLock:
        """Hold the store's lock with the store's other `open_writer` writers, or raise StoreError naming the
        `h5feed convert` that holds it."""
        store.mkdir(parents=True, exist_ok=True)
        fd = _take(store / LOCK_FILE, fcntl.LOCK_SH, lambda fd: _refusal(store, read_holder(fd)), patience_s=PATIENCE_S)
        return cls(store / LOCK_FILE, fd, shared=True)

    @classmethod
    def of_writer(cls, files: WriterFiles) -> WriterLock:
        """Take the lock of one writer id, or raise StoreError naming the process that writes as that id."""
        files.lock.parent.mkdir(parents=True, exist_ok=True)

        def refusal(fd: int) -> StoreError:
            holder = read_holder(fd)
            return StoreError(files.store, f"another {WRITER_API} ({describe_writer(holder)}) is writing this store as "
                              f"{files.name}: give each writer that appends at the same time an id of its own "
                              "(open_writer(store, writer=\"rank0\"), ...), or wait for that one to finish")

        lock = cls(files.lock, _take(files.lock, fcntl.LOCK_EX, refusal, patience_s=PATIENCE_S))
        lock._write({"by": WRITER_API, "writer": files.writer, **_this_process()})
        return lock

    @classmethod
    def of_staging(cls, folder: Path, files: WriterFiles) -> WriterLock:
        """Claim a bucket writer's staging folder for this process, or raise StoreError naming the writer that
        works in it now.  Why: two writers in one folder would upload each other's shards and index as their
        own, and both report success over a damaged store."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / STAGING_LOCK

        def refusal(fd: int) -> StoreError:
            holder = read_holder(fd)
            named = WriterFiles(folder, holder.get("writer")).name if holder else "another writer"
            return StoreError(folder, f"is the staging folder of {named} ({describe_writer({**holder, 'writer': None})}"
                              "), which is writing now: give each writer its own staging_dir")

        lock = cls(path, _take(path, fcntl.LOCK_EX, refusal, patience_s=PATIENCE_S))
        lock._write({"by": WRITER_API, "writer": files.writer, **_this_process()})
        return lock

    def record_semaphores(self) -> None:
        """Note the named semaphores this process maps now (its process pool's), for a later cleanup."""
        self._write({**self._info, "semaphores": mapped_semaphores(os.getpid())})

    def release(self) -> None:
        """Unlock and remove the file (a store finished or abandoned cleanly has no lock file).  A shared
        lock's file is removed by the last of its holders, the one that can take it exclusively."""
        if self._fd < 0:
            return
        try:
            if not self._shared or _last_holder(self._fd):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = -1

    def _write(self, info: dict[str, Any]) -> None:
        self._info = info
        data = json.dumps(info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def held_briefly(path: Path, holder: dict[str, Any]) -> Iterator[None]:
    """A short critical section among a store's writers (reserving rows, publishing): waits for its turn,
    saying every `WAIT_LOG_S` who holds it (`holder`, written into the file while held, describes this one).
    The file stays (removing it would let two writers lock two files of one name)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        said, pause = started, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - said >= WAIT_LOG_S:
                    said = time.monotonic()
                    log.warning("%s: waiting %.0f s for %s, held by %s", path.parent.parent, said - started,
                                path.name, describe_writer(read_holder(fd)) if os.fstat(fd).st_size else "a writer")
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**holder, **_this_process()}).encode(), 0)
        yield
    finally:
        os.close(fd)


def _take(path: Path, mode: int, refusal: Callable[[int], StoreError], patience_s: float) -> int:
    """An fd of `path` flock'd in `mode`, or raise `refusal(fd)` while another holds it.  Asked again for
    `patience_s`: a reader's probe, or a writer letting the store go, holds a lock for an instant only."""
    deadline = time.monotonic() + patience_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() < deadline:
                os.close(fd)
                time.sleep(0.01)
                continue
            try:
                raise refusal(fd) from None
            finally:
                os.close(fd)
        if _same_file(fd, path):
            return fd
        os.close(fd)  # locked a file its holder removed on release: lock the one now at `path`


def _last_holder(fd: int) -> bool:
    """Whether no other process shares the lock on `fd` (then it is this one's, exclusively).  A failed
    conversion gives up the shared lock too (Linux), so a second try finds two holders leaving together."""
    for _ in range(2):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False


def _refusal(store: Path, holder: dict[str, Any]) -> StoreError:
    return StoreError(store, f"another {holder.get('by', CONVERTER)} ({describe_writer(holder)}) is writing this "
                      "store; wait for it to finish, or stop it and run this command again")


def _this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "semaphores": []}


class BucketLock:
    """A lock object in a bucket (see the module docstring); `release()` deletes it.

    `acquire()` is `h5feed convert`'s, at `LOCK_FILE`.  An `open_writer` writer of a bucket store holds one at
    its own id's key for its lifetime (a second process with its id is refused; a follower sees it alive)."""

    def __init__(self, objects: FsspecStore, key: str, etag: str, info: dict[str, Any]) -> None:
        self.objects, self.key, self._etag, self.info = objects, key, etag, info
        self.lost: str | None = None  # why the lock is no longer ours, once the heartbeat found out
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="h5feed-lock-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, objects: FsspecStore, key: str = LOCK_FILE, *, by: str = CONVERTER,
                who: dict[str, Any] | None = None, refusal: Callable[[str], str] | None = None) -> BucketLock:
        """Create the lock object, or take over a stale one (see the module docstring); else raise StoreError
        naming its holder (`refusal` says what to do, given the holder as words).  `by` and `who` go into the
        object (who holds it, for messages)."""
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        info = {"by": by, **(who or {}), "host": socket.gethostname(), "pid": os.getpid(), "started_at": now,
                "token": uuid.uuid4().hex}
        body = json.dumps(info).encode()
        made = lambda etag: cls(objects, key, etag, info)
        while True:
            etag = objects.put_if(key, body, None)
            if etag is not None:
                return made(etag)
            try:  # its ETag first: the holder read is the one of that ETag or a later one (then put_if fails)
                held = objects.info(key)
                raw = objects.get(key)
            except ObjectNotFound:
                continue  # released meanwhile: try to create it again
            try:
                holder = json.loads(raw)
            except ValueError:
                holder = None
            if not isinstance(holder, dict):
                holder = {}  # damaged: taken over (`why_lock_is_free`)
            if holder.get("token") == info["token"]:  # our own PUT went through, its answer was lost
                return made(held.etag or "")
            why = why_lock_is_free(holder, lock_age_s(held.modified_ns, objects.server_time_ns()), STALE_AFTER_S)
            if why is None:
                described = _describe(holder, held.modified_ns)
                raise StoreError(objects.url, refusal(described) if refusal is not None else (
                    f"another {holder.get('by', CONVERTER)} ({described}) is writing this store; wait for it to "
                    f"finish, or stop it and run this command again (a lock not renewed for {STALE_AFTER_S:.0f} s "
                    "is taken over)"))
            etag = objects.put_if(key, body, held.etag)
            if etag is not None:
                log.warning("%s: taking over the lock %s of %s: %s", objects.url, key,
                            _describe(holder, held.modified_ns), why)
                return made(etag)

    def check(self) -> None:
        """Raise if another process took the lock over (this one's heartbeat stalled too long)."""
        if self.lost is not None:
            raise StoreError(self.objects.url, self.lost)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._guard:
                if self._stop.is_set():
                    return
                try:
                    etag = self.objects.put_if(self.key, json.dumps(self.info).encode(), self._etag)
                except Exception as exc:  # noqa: BLE001 (the next beat tries again; the lock may go stale)
                    log.warning("%s: could not renew the lock %s: %s", self.objects.url, self.key, exc)
                    continue
                if etag is None:
                    self.lost = (f"another {self.info['by']} took over this store's lock {self.key} (this one did "
                                 f"not renew it for {STALE_AFTER_S:.0f} s): stop this one; the other goes on")
                    return
                self._etag = etag

    def release(self) -> None:
        """Stop the heartbeat and delete the lock object, if it is still ours."""
        if self._stop.is_set():
            return
        with self._guard:
            self._stop.set()
        if self.lost is None:
            try:
                if self.objects.info(self.key).etag == self._etag:
                    self.objects.delete(self.key)
            except Exception as exc:  # noqa: BLE001 (a lock left behind is taken over as stale later)
                log.warning("%s: could not delete the lock %s: %s", self.objects.url, self.key, exc)

    def __enter__(self) -> BucketLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(holder: dict[str, Any], modified_ns: int | None) -> str:
    beat = "?" if modified_ns is None else datetime.fromtimestamp(modified_ns / 1e9, timezone.utc).isoformat(
        timespec="seconds")
    return f"{describe_writer(holder)}, last heartbeat {beat}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
