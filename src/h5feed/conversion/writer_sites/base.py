"""What an `open_writer` writer needs from the place its store lives: one interface, one module per place.

A writer always works in a local folder, `staging`: the store itself on a filesystem, or, for a store in
a bucket, a copy of its metadata and index that also holds the writer's own journal and the shards it
is writing.  Its writers share two short steps (reserving rows, publishing), each a commit
(`WriterSite.commit`): the step's body runs on `staging` holding the store's metadata and index as they
are now, and what it changed there is the store's once the commit returns.  A local folder runs one
body at a time (a flock); a bucket runs them side by side and commits by compare-and-swap, running a
body again on the fresh state when another writer committed first.  So a body computes from `staging`
only, and the writer applies what it returns once the commit returned.  Outside the steps each writer
writes only its own shards, so the hot path takes no shared lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from h5feed.store.layout import StoreInfo
from h5feed.store.writer_state import WriterFiles

T = TypeVar("T")


class WriterSite(ABC):
    """Where one writer's store lives (a local folder, a bucket), and how its writers share it."""

    def __init__(self, staging: Path, location: str) -> None:
        self.staging = staging  # the local folder the writer works in
        self.location = location  # the store, as messages name it (its folder or URL)

    @abstractmethod
    def hold(self, files: WriterFiles) -> AbstractContextManager[object]:
        """For the writer's life: its own id's lock (a second process with that id is refused, naming the
        first) and its share of the store (a converter is refused, and refuses it); the store's metadata is in
        `staging` once it is held.  A place that holds something other than a store is refused."""

    @abstractmethod
    def commit(self, step: str, body: Callable[[], T]) -> T:
        """One shared step (`ROWS_LOCK`, `PUBLISH_LOCK`): `body()` run on the store's state now, what it changed
        in `staging` made the store's, and its result returned.  `body` may run more than once (each time on
        a fresh state): it changes nothing but `staging`.  Raises when the commit cannot be made."""

    @abstractmethod
    def remove_partial_writes(self, writer: str | None, own: Callable[[], list[Path]]) -> None:
        """Remove the partial files a kill mid-write left in `staging`: every one where no writer with another
        id can be writing into it now, else only `own()`, those in the rows writer `writer` reserved."""

    def sample_written(self, info: StoreInfo, start: int, rows: int) -> None:
        """The shards of the sample at rows [start, start + rows) are in `staging`; make them the store's before
        its journal line is written."""
