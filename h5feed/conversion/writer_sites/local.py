"""A store in a local folder: the writer works in the store itself, and its writers share flocks there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from h5feed.conversion.lock import WriterLock, held_briefly
from h5feed.conversion.writer_sites.base import WriterSite
from h5feed.errors import StoreError
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store.writer_state import LOCK_FILE, ROWS_LOCK, WRITERS_DIR, WriterFiles, live_writers


class LocalSite(WriterSite):
    def __init__(self, path: Path) -> None:
        super().__init__(path, str(path))

    @contextmanager
    def hold(self, files: WriterFiles) -> Iterator[None]:
        path = self.staging
        if path.is_dir() and not (path / "zarr.json").exists() and \
                any(p.name not in (LOCK_FILE, WRITERS_DIR) for p in path.iterdir()):
            raise StoreError(path, "exists and is not an h5feed store; choose another folder")
        with ExitStack() as locks:  # its id first, then the store: a probe that finds the store held finds who holds it
            locks.enter_context(WriterLock.of_writer(files))
            locks.enter_context(WriterLock.share(path))
            yield

    def step(self, lock: str) -> AbstractContextManager[None]:
        return held_briefly(self.staging / WRITERS_DIR / lock)

    def remove_partial_writes(self, writer: str | None, own: Callable[[], list[Path]]) -> None:
        with self.step(ROWS_LOCK):  # no writer starts writing meanwhile
            alone = all(w.get("writer") == writer for w in live_writers(self.staging))
            for partial in list(self.staging.rglob(f"*{PARTIAL_SUFFIX}")) if alone else own():
                partial.unlink(missing_ok=True)
