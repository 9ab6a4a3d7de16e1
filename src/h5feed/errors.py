"""The errors h5feed raises on purpose: each names the file or store and the problem."""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable
from pathlib import Path


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> str:
    """"unknown KIND 'NAME': did you mean 'X'? (one of: ...)": what a lookup of a mistyped name says."""
    known = list(choices)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {kind} {name!r}: {hint}(one of: {', '.join(known)})"


class H5feedError(Exception):
    """Base of every error h5feed raises on purpose."""


class PathError(H5feedError):
    """Base of the errors about one thing a path or URL names (a source file, a store, one of its objects, a
    worker's store): `path` names it, `problem` says what is wrong and what to do, and `str(err)` is
    "PATH: PROBLEM".  Catch it to handle any of them alike; it crosses process boundaries intact (a DataLoader
    worker's error reaches the trainer as it was raised)."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses process boundaries intact
        return type(self), (self.path, self.problem)


class SourceError(PathError):
    """A source file that cannot be converted; names the file and the problem."""


class StoreError(PathError):
    """A store that cannot be opened or read: unfinished, corrupt or of another layout."""


class NotAStoreError(StoreError):
    """A location that holds no h5feed store: missing, or a folder (or bucket prefix) without a store's zarr.json.

    The store says so, and how to create one; what else the folder holds is for whoever was given it to say: the
    loaders and the CLI name a folder of sample files and the `h5feed convert` that makes a store of them
    (`h5feed.loading.sample_folder`)."""


class DiskFullError(StoreError, OSError):
    """A store's disk filled up (ENOSPC), said as a StoreError naming what was being written and what to do; still
    an OSError with errno ENOSPC, for code that handles a full disk as the system reports it."""

    def __new__(cls, path: str | Path, problem: str) -> DiskFullError:
        return super().__new__(cls, errno.ENOSPC, problem)  # OSError's own fields: its errno and message

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(path, problem)
        self.errno, self.strerror = errno.ENOSPC, f"{path}: {problem}"

    def __str__(self) -> str:
        return self.strerror


class CorruptSampleError(StoreError):
    """A sample whose stored bytes fail their checks: it is never handed to the trainer.

    `path` is the damaged object (chunk or shard), `sample` the store index of the sample and
    `source_path` the file it was converted from, so the damage can be traced and repaired.
    """

    def __init__(self, path: str | Path, problem: str, sample: int = -1, source_path: str = "") -> None:
        self.sample = sample
        self.source_path = source_path
        where = f"sample {sample} (converted from {source_path}): " if sample >= 0 else ""
        super().__init__(path, where + problem)
        self.problem = problem

    def __reduce__(self) -> tuple[type, tuple[str, str, int, str]]:
        return type(self), (self.path, self.problem, self.sample, self.source_path)


class WorkerDiedError(PathError):
    """A DataLoader worker that died (killed, or crashed) while it read a store for the trainer.

    `path` is the store, `worker` the worker's id, `pid` its process id and `sample` the store
    index of the sample it was reading (-1 when it was between samples).
    """

    def __init__(self, path: str | Path, problem: str, worker: int, pid: int, sample: int = -1) -> None:
        self.worker, self.pid, self.sample = worker, pid, sample
        super().__init__(path, problem)

    def __reduce__(self) -> tuple[type, tuple[str, str, int, int, int]]:
        return type(self), (self.path, self.problem, self.worker, self.pid, self.sample)
