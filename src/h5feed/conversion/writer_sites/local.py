"""A store in a local folder: the writer works in the store itself, and its writers share flocks there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

from h5feed.conversion.lock import WriterLock, held_briefly
from h5feed.conversion.writer_sites.base import WriterSite
from h5feed.errors import StoreError
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store.writer_state import LOCK_FILE, ROWS_LOCK, WRITER_API, WRITERS_DIR, WriterFiles, live_writers


T = TypeVar("T")


class LocalSite(WriterSite):
    def __init__(self, path: Path) -> None:
        super().__init__(path, str(path))
        self._holder: dict[str, object] = {"by": WRITER_API}  # who takes a step, as a waiting writer names it

    @contextmanager
    def hold(self, files: WriterFiles) -> Iterator[None]:
        path = self.staging
        if path.is_dir() and not (path / "zarr.json").exists() and \
                any(p.name not in (LOCK_FILE, WRITERS_DIR) for p in path.iterdir()):
            raise StoreError(path, "exists and is not an h5feed store; choose another folder")
        with ExitStack() as locks:  # its id first, then the store: a probe that finds the store held finds who holds it
            self._holder = {"by": WRITER_API, "writer": files.writer}
            locks.enter_context(WriterLock.of_writer(files))
            locks.enter_context(WriterLock.share(path))
            yield

    def commit(self, step: str, body: Callable[[], T]) -> T:
        """One body at a time (a flock per step): the store is written in place, each file atomically."""
        with held_briefly(self.staging / WRITERS_DIR / step, self._holder):
            return body()

    def remove_partial_writes(self, writer: str | None, own: Callable[[], list[Path]]) -> None:
        with held_briefly(self.staging / WRITERS_DIR / ROWS_LOCK, self._holder):  # no writer starts writing meanwhile
            alone = all(w.get("writer") == writer for w in live_writers(self.staging))
            for partial in list(self.staging.rglob(f"*{PARTIAL_SUFFIX}")) if alone else own():
                partial.unlink(missing_ok=True)
