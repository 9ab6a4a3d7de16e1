"""Names from untrusted places turned into local paths, and files opened only when they are plain files.

A bucket's listing, a store's index (`source_path`) and its companion records are written by whoever
controls the bucket or hands over the store.  Every such name becomes a path through `contained_path`,
one rule for all of them: a name that would lead outside its folder (`..`, an absolute path, a symbolic
link out of the folder) is refused, and so is one that is not the single spelling of its path (an empty
segment as in `a//b`, a `.` segment, a NUL byte), since two keys of one path would overwrite each other.
A FIFO, socket or device is refused before anything opens it (`regular_file`): opening a FIFO blocks
until some writer comes, which may be never.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from h5feed.errors import H5feedError, SourceError


class UnsafeName(H5feedError):
    """A name that `contained_path` refuses: `str(err)` names it, its folder and why."""

    def __init__(self, name: str, root: str | Path, problem: str) -> None:
        self.name, self.root, self.problem = name, str(root), problem
        super().__init__(f"{name!r} {problem}: refused as a path inside {root}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # crosses process boundaries intact
        return type(self), (self.name, self.root, self.problem)


def contained_path(root: str | os.PathLike[str], name: str) -> Path:
    """`root / name` for a '/'-separated relative name read from a bucket or a store, or `UnsafeName`.

    The name itself is checked first (so nothing is created to check it), then the path is resolved
    and must stay inside the resolved root: a symbolic link on the way that leads out is refused."""
    root = Path(root)
    problem = _name_problem(name)
    if problem is None:
        real_root, real = os.path.realpath(root), os.path.realpath(root / name)
        if os.path.commonpath([real_root, real]) != real_root:
            problem = f"leads through a symbolic link to {real}"
    if problem is not None:
        raise UnsafeName(name, root, problem)
    return root / name


def is_folder_marker(key: str, size: int) -> bool:
    """An empty object named like a folder (`runs/`, or the listed prefix itself): what S3 consoles create for
    "Create folder".  It names no file, so it is passed over rather than refused."""
    return size == 0 and (key == "" or key.endswith("/"))


def _name_problem(name: str) -> str | None:
    if "\0" in name:
        return "holds a NUL byte"
    if name.startswith("/"):
        return "is an absolute path"
    segments = name.split("/")
    if "" in segments:
        return "has an empty segment (// or a / at an end)"
    if ".." in segments:
        return "has a '..' segment"
    if "." in segments:
        return "has a '.' segment"
    return None


_SPECIAL_FILES = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                  stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}


def regular_file(path: str | os.PathLike[str]) -> Path:
    """`path`, unless it is (or links to) a FIFO, socket, device or folder: then a SourceError, and it is never
    opened.  A path that does not exist passes: opening it says so in the reader's own words."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    if not stat.S_ISREG(mode):
        kind = _SPECIAL_FILES.get(stat.S_IFMT(mode), "a special file")
        raise SourceError(path, f"is {kind}, not a regular file: refused without opening it")
    return path
