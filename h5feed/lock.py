"""One writer at a time: the lock `h5feed convert` holds on its store.

The lock is a file inside the store, `h5feed-writer.lock`, held with `flock`
for the writer's lifetime and holding who the writer is (host, pid, start
time).  The kernel drops a `flock` when its process dies, however it dies, so
a lock left by a killed converter is free to the next one with no guess about
pids (a pid can be reused; a flock cannot outlive its holder), and no second
writer can take it while the first lives.  The writer also records the named
POSIX semaphores its process pool created, so that the next writer can remove
the ones a SIGKILL left in /dev/shm: only those, and only when no process maps
them any more.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h5feed.errors import StoreError

LOCK_FILE = "h5feed-writer.lock"
_SHM = Path("/dev/shm")


class WriterLock:
    """Held by the process that writes a store; `release()` (or process death) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._info: dict[str, Any] = {}

    @classmethod
    def acquire(cls, store: Path) -> WriterLock:
        """Take the store's lock or raise StoreError naming the writer that holds it."""
        store.mkdir(parents=True, exist_ok=True)
        path = store / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
                       f"started at {holder.get('started_at', '?')}")
                raise StoreError(
                    store, f"another `h5feed convert` ({who}) is writing this store; wait for it to finish, "
                    "or stop it and run this command again"
                ) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # locked a file its holder removed on release: lock the one now at `path`
        lock = cls(path, fd)
        remove_orphaned_semaphores(_read(fd).get("semaphores", []))  # a killed writer's leftovers
        lock._write({"host": socket.gethostname(), "pid": os.getpid(),
                     "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "semaphores": []})
        return lock

    def record_semaphores(self) -> None:
        """Note the named semaphores this process maps now (its process pool's), for a later cleanup."""
        self._write({**self._info, "semaphores": _mapped_semaphores(os.getpid())})

    def release(self) -> None:
        """Unlock and remove the file (a store finished or abandoned cleanly has no lock file)."""
        if self._fd < 0:
            return
        try:
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


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read(fd: int) -> dict[str, Any]:
    """The holder's description; a file being written this instant may be empty: ask again briefly."""
    for _ in range(20):
        try:
            return json.loads(os.pread(fd, 1 << 16, 0) or b"null") or {}
        except json.JSONDecodeError:
            time.sleep(0.01)
    return {}


def _mapped_shm_inodes(pid: int | str) -> set[int]:
    """Inodes of the /dev/shm files a process maps.  A named POSIX semaphore is such a file, mapped
    under the temporary name glibc created it with (since deleted): only its inode tells which it is."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in maps.splitlines() if " /dev/shm/" in line}


def _semaphores_by_inode() -> dict[int, str]:
    found = {}
    for name in os.listdir(_SHM):
        if name.startswith("sem."):
            try:
                found[os.stat(_SHM / name).st_ino] = name
            except FileNotFoundError:
                continue
    return found


def _mapped_semaphores(pid: int | str) -> list[list[str | int]]:
    """[name, inode] of the named semaphores a process maps now."""
    mapped = _mapped_shm_inodes(pid)
    return [[name, inode] for inode, name in _semaphores_by_inode().items() if inode in mapped]


def remove_orphaned_semaphores(recorded: list[list[str | int]]) -> list[str]:
    """Remove the recorded semaphores that still exist (same name, same inode) and that no living
    process maps; return their names."""
    present = _semaphores_by_inode()
    candidates = {int(inode): str(name) for name, inode in recorded if present.get(int(inode)) == name}
    if not candidates:
        return []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for inode in _mapped_shm_inodes(pid) & candidates.keys():
            del candidates[inode]
    for name in candidates.values():
        (_SHM / name).unlink(missing_ok=True)
    return sorted(candidates.values())
