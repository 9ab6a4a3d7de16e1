"""What a reader can learn of a store's writers: who holds it now, and how far its conversion is.

A store whose conversion has not finished is refused by every reader.  What the user should do
then depends on whether a writer still runs: wait for it, or run the same `h5feed convert` again
to resume.  The writers' files live in the store (their locks, plan and journals; see
`h5feed.conversion`, and `h5feed.store.journal` for the journals' lines), and they are read here,
below the conversion code, so that `Store`, `h5feed inspect`, `h5feed verify` and a follower tell
the cases apart the same way.

`h5feed convert` holds `LOCK_FILE` exclusively.  `h5feed.open_writer` writers, several at once,
hold it shared (so a converter and writers exclude each other), and each holds its own lock in
`WRITERS_DIR`, with who it is inside: the store is being written while any lock is held.  A clean
close removes the writer's lock; a crash leaves it behind, held by nobody (in a bucket: no longer
renewed, or naming a process of this host that no longer runs), so a follower tells a writer that
went away without closing (`WriterLocks.departed`) from one that finished.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h5feed.store.journal import JOURNAL_FILE, read_journal

if TYPE_CHECKING:
    from h5feed.io import FsspecStore

LOCK_FILE = "h5feed-writer.lock"  # flock'd by `h5feed convert` (host, pid, start time inside), or shared by writers
PLAN_FILE = "h5feed-plan.json"  # every sample's place, decided before the first is converted
CONVERTER = "`h5feed convert`"  # the writers, as messages name them (the lock records which holds it)
WRITER_API = "`h5feed.open_writer`"
WRITER_SOURCE = "h5feed.open_writer"  # the source_root of a store open_writer made: its samples came from no folder
WRITERS_DIR = "h5feed-writers"  # open_writer's writers: each one's lock, a named one's journal, the locks they share
ROWS_LOCK = "rows.lock"  # in WRITERS_DIR: held while a writer reserves rows (and grows the arrays)
PUBLISH_LOCK = "publish.lock"  # in WRITERS_DIR: held while a writer adds its samples to the index
WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a writer's id: part of its files' names
_DEFAULT_WRITER_LOCK = "default.lock"
STALE_AFTER_S = 300.0  # a lock object in a bucket not renewed for this long is its holder's no longer


@dataclass(frozen=True)
class WriterFiles:
    """Where one `open_writer` writer keeps its lock and its journal.  `writer=None` is a store's unnamed
    writer, whose journal is `JOURNAL_FILE` at the store's top, as a store written by one process always had:
    such a store resumes unchanged.  A named writer's files are its own, so each id resumes its own samples."""

    store: Path
    writer: str | None

    @property
    def journal(self) -> Path:
        return self.store / (JOURNAL_FILE if self.writer is None else f"{WRITERS_DIR}/id-{self.writer}.jsonl")

    @property
    def lock(self) -> Path:
        return self.store / WRITERS_DIR / (_DEFAULT_WRITER_LOCK if self.writer is None else f"id-{self.writer}.lock")

    @property
    def name(self) -> str:
        """The writer as messages name it."""
        return writer_name(self.writer)


def writer_name(writer: str | None) -> str:
    """A writer id as messages name it."""
    return "the unnamed writer (writer=None)" if writer is None else f"writer {writer!r}"


@dataclass(frozen=True)
class DepartedWriter:
    """An `open_writer` writer that went away without closing: its lock is left behind, and nobody holds it."""

    holder: dict[str, Any]  # as its lock describes it: "writer" id, host, pid, started_at
    lock: str  # the lock's name in `WRITERS_DIR`
    why: str  # how it is known to be gone
    last_heard_ns: int | None  # when its lock was last written (a bucket lock's last heartbeat), Unix ns

    @property
    def writer(self) -> str | None:
        return self.holder.get("writer")

    def describe(self) -> str:
        """"writer 'w0' (host h, pid 12, started at ...)": the writer as messages name it, with its process."""
        return f"{writer_name(self.writer)} ({_describe_one(self.holder)})"


@dataclass(frozen=True)
class WriterLocks:
    """The `open_writer` writers a store's locks in `WRITERS_DIR` name: those holding it now (`live`, each as its
    lock describes it), and those that went away without closing (`departed`), whose samples not yet published
    wait for the same id to be opened again."""

    live: list[dict[str, Any]]
    departed: list[DepartedWriter]


def current_writer(store: Path) -> dict[str, Any] | None:
    """Who writes a local store now (by, host, pid, started_at), or None when nobody does.  Several
    `open_writer` writers are one holder: the first one's fields, and all of them under "writers".

    Probed with shared locks let go at once: a writer taking its lock in that instant waits for it."""
    converter = _exclusive_holder(store / LOCK_FILE)
    if converter is not None:
        return converter
    return as_one_holder(live_writers(store))


def as_one_holder(writers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several writers as one holder, as messages name them: the first one's fields, all of them under "writers"."""
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else {**writers[0], "writers": writers}


def is_writer_lock(name: str) -> bool:
    """Whether a file (or object) name in `WRITERS_DIR` is one writer's own lock (not a lock its writers share)."""
    return name == _DEFAULT_WRITER_LOCK or (name.startswith("id-") and name.endswith(".lock"))


def live_writers(store: Path) -> list[dict[str, Any]]:
    """The `open_writer` writers that hold the store now, each as its lock describes it (with its "writer" id)."""
    return writer_locks(store).live


def writer_locks(store: Path) -> WriterLocks:
    """The `open_writer` writers of a local store, by their lock files: held (live), or left behind by a process
    that died without closing (departed: the kernel let its flock go, nobody removed the file).  A lock file still
    empty is one being taken this instant, not a writer gone."""
    folder = store / WRITERS_DIR
    try:
        locks = sorted(p for p in folder.iterdir() if is_writer_lock(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return WriterLocks([], [])
    live, departed = [], []
    for lock in locks:
        probe = _probe_lock(lock)
        if probe is None:
            continue
        held, holder = probe
        if held:
            live.append(holder)
        elif holder:
            departed.append(DepartedWriter(holder, lock.name, "its lock file is left and no process holds it",
                                           _mtime_ns(lock)))
    return WriterLocks(live, departed)


def _exclusive_holder(lock: Path) -> dict[str, Any] | None:
    """The description of the process holding `lock` exclusively, or None when none does."""
    probe = _probe_lock(lock)
    return probe[1] if probe is not None and probe[0] else None


def _probe_lock(lock: Path) -> tuple[bool, dict[str, Any]] | None:
    """(whether a process holds `lock` exclusively, its description), or None where there is no lock file: none,
    or one its holder removed (a clean close) while it was looked at."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, read_holder(fd)
        try:  # a holder removes its file before it unlocks: the file still there was left behind
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                return None
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            holder = None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, holder if isinstance(holder, dict) else {}
    finally:
        os.close(fd)


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def read_holder(fd: int) -> dict[str, Any]:
    """The lock file's description of its holder; one being written this instant may be empty: ask again briefly."""
    for _ in range(20):
        try:
            return json.loads(os.pread(fd, 1 << 16, 0) or b"null") or {}
        except json.JSONDecodeError:
            time.sleep(0.01)
    return {}


def describe_writer(holder: dict[str, Any]) -> str:
    """The lock holder (or the several writers `current_writer` found) as errors name it."""
    writers = holder.get("writers")
    if writers:
        return f"{len(writers)} writers: " + ", ".join(f"{w.get('writer') or 'unnamed'} ({_describe_one(w)})"
                                                       for w in writers)
    named = f"writer {holder['writer']!r}, " if holder.get("writer") else ""
    return named + _describe_one(holder)


def _describe_one(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started at {holder.get('started_at', '?')}"


def writer_journals(store: Path) -> list[Path]:
    """The journals of every `open_writer` writer a store had: the unnamed one's, then the named ones'."""
    named = sorted((store / WRITERS_DIR).glob("id-*.jsonl")) if (store / WRITERS_DIR).is_dir() else []
    return [*([store / JOURNAL_FILE] if (store / JOURNAL_FILE).exists() else []), *named]


def holds_no_samples(folder: Path) -> bool:
    """Nothing in `folder` but writers' bookkeeping (their lock files; no store, no journaled sample): what an
    `open_writer` that appended nothing leaves, which a converter may take and a follower calls empty."""
    return (not (folder / "zarr.json").exists() and not writer_journals(folder)
            and all(p.name in (LOCK_FILE, WRITERS_DIR) for p in folder.iterdir()))


def being_converted(store: str | os.PathLike[str]) -> str | None:
    """What the writer holding this local store is at ("it is being written now by `h5feed convert` (...): 12 of
    40 samples done; wait for it to finish"), or None when no writer holds it."""
    path = Path(store)
    writer = current_writer(path)
    if writer is None:
        return None
    who = describe_writer(writer)
    try:
        total = len(json.loads((path / PLAN_FILE).read_text())["samples"])
        progress = f": {len(read_journal(path))} of {total} samples done"
    except (OSError, ValueError, KeyError, TypeError):  # still planning, or writers that have no plan
        written = sum(len(read_journal(path, journal)) for journal in writer_journals(path))
        idle = ": planning" if writer.get("by", CONVERTER) == CONVERTER else ": no sample written yet"
        progress = f": {written} samples written so far" if written else idle
    return f"it is being written now by {writer.get('by', CONVERTER)} ({who}){progress}; wait for it to finish"


def why_lock_is_free(holder: dict[str, Any], age_s: float | None, stale_after_s: float) -> str | None:
    """Why a lock object in a bucket may be taken over (its holder is gone or silent: no heartbeat for
    `stale_after_s`), or None while it is held.  `age_s`: the seconds since it was last written, on the
    bucket's own clock (`lock_age_s`), never this machine's against the bucket's: a client clock minutes off
    (S3 accepts 15) would take over live locks, or keep dead ones."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return "that process no longer runs"
        except PermissionError:
            pass  # it runs, as another user
    if age_s is not None and age_s > stale_after_s:
        return f"its last heartbeat is {age_s:.0f} s old"
    if not holder:
        return "it is unreadable"
    return None


def lock_age_s(modified_ns: int | None, server_now_ns: int | None) -> float | None:
    """A lock object's age: its Last-Modified against the bucket's time now (`FsspecStore.server_time_ns`), both
    the server's clock; None when either is unknown (then only a holder known dead frees a lock)."""
    if modified_ns is None or server_now_ns is None:
        return None
    return (server_now_ns - modified_ns) / 1e9


def bucket_writers(objects: FsspecStore) -> list[dict[str, Any]]:
    """The `open_writer` writers that hold a store in a bucket now, each as its lock object describes it (with
    its "writer" id): every writer's lock in `WRITERS_DIR` that is not stale (see `why_lock_is_free`)."""
    return bucket_writer_locks(objects).live


def bucket_writer_locks(objects: FsspecStore) -> WriterLocks:
    """The `open_writer` writers of a store in a bucket, by their lock objects: held (live), or left behind by a
    writer that went away without closing (departed: free to take over, as `why_lock_is_free` judges it)."""
    from h5feed.io import ObjectError

    live, departed = [], []
    listed = objects.list_info(WRITERS_DIR)
    now_ns = objects.server_time_ns() if listed else None
    for key, info in listed.items():
        name = key.rsplit("/", 1)[-1]
        if not is_writer_lock(name):
            continue
        try:
            holder = json.loads(objects.get(key))
        except (ObjectError, ValueError):  # released meanwhile, or cut: not a writer to wait for
            continue
        if not isinstance(holder, dict):
            continue
        why = why_lock_is_free(holder, lock_age_s(info.modified_ns, now_ns), STALE_AFTER_S)
        if why is None:
            live.append(holder)
        elif holder:
            departed.append(DepartedWriter(holder, name, f"its lock object is left: {why}", info.modified_ns))
    return WriterLocks(live, departed)


def bucket_being_written(objects: FsspecStore) -> str | None:
    """What `being_converted` says of a local store, for a store in a bucket: the `open_writer` writers that hold
    it now ("it is being written now by `h5feed.open_writer` (writer 'rank0', ...); wait for it to finish"), or
    None when none does."""
    holder = as_one_holder(bucket_writers(objects))
    if holder is None:
        return None
    return f"it is being written now by {WRITER_API} ({describe_writer(holder)}); wait for it to finish"
