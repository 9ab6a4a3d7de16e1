"""Objects as files under a local (or network-mounted POSIX) folder: the fast path, no client at all."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

from h5feed.io.objects import Buffer, ObjectError, ObjectNotFound, ObjectStore, Range, check_length

PARTIAL_SUFFIX = ".partial"  # a file being written under a temporary name; never listed


class LocalStore(ObjectStore):
    """Reads are `pread`s of the files (the page cache does the rest); writes go to a temporary
    name in the same folder, are fsynced, and renamed into place."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        super().__init__(self.root.as_uri())

    def local_path(self, key: str) -> Path:
        return self.root / key

    def _open(self, key: str) -> int:
        try:
            fd = os.open(self.root / key, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(self.key_url(key), "no such file; check the path") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ObjectNotFound(self.key_url(key), "a folder, not a file")
        return fd

    def get(self, key: str) -> bytes:
        fd = self._open(key)
        try:
            return self._read(fd, key, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        fd = self._open(key)
        try:
            return [self._read(fd, key, start, stop) for start, stop in ranges]
        finally:
            os.close(fd)

    def _read(self, fd: int, key: str, start: int, stop: int) -> bytes:
        return check_length(self.key_url(key), start, stop, os.pread(fd, stop - start, start))

    def size(self, key: str) -> int:
        path = self.root / key
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(self.key_url(key), "no such file; check the path") from None
        if not path.is_file():
            raise ObjectNotFound(self.key_url(key), "a folder, not a file")
        return st.st_size

    def list(self, prefix: str = "") -> dict[str, int]:
        top = self.root / prefix
        found = {}
        for folder, _, names in os.walk(top):
            for name in names:
                if not name.endswith(PARTIAL_SUFFIX):
                    path = Path(folder, name)
                    found[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return dict(sorted(found.items()))

    def put_atomic(self, key: str, data: bytes | memoryview) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(path, data, durable=True)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ObjectError(self.key_url(key), "disk full; free space and run the same command again") from exc
            raise

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)


def write_atomically(path: Path, data: bytes | memoryview, *, durable: bool) -> None:
    """Write under a temporary name, then rename: readers see the old bytes or the new, never a part.
    `durable` also survives power loss: the bytes are flushed before the rename, the rename after.
    The temporary name is unique (NAME.<id>.partial): two writers of the same file (a task Dask retried
    while the first try still runs, on this machine or another) never share one; a failed write
    removes it, a killed one leaves it for the next run to clean."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
