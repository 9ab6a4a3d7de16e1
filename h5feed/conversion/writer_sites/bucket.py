"""A store in a bucket (s3://, gs://, az://, ...): each writer works in a staging folder of its own.

The writer writes a sample's shards in its staging folder, uploads them (atomic PUTs, each checked) and
deletes them, then journals the sample there: the staging folder holds the journal and the samples in
flight, never the store.  The shared steps are lock objects in the bucket's `h5feed-writers/` (created
with If-None-Match, renewed by a heartbeat while held, taken over once their holder is gone: the
converter's `BucketLock`).  A step fetches the store's root, arrays' metadata and index into the
staging folder, runs as it would on a local store, and uploads what it changed, the root last: the
index and the arrays' shapes a reader finds through the root are in the bucket before it.  The root
is the one object a publication's readers see change, in one atomic PUT.

A writer restarted on the same machine resumes from its staging folder's journal (a sample is journaled
once its shards are in the bucket).  One restarted elsewhere (or after its staging folder was removed)
starts a new block: the samples it published are kept, those it journaled but had not published are not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from h5feed.conversion.lock import BucketLock
from h5feed.conversion.publish import DESTINATION_FILE, BucketMirror, default_staging_dir, is_shard
from h5feed.conversion.writer_sites.base import WriterSite
from h5feed.errors import StoreError
from h5feed.io import FsspecStore, ObjectNotFound
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.io.paths import is_folder_marker
from h5feed.store.layout import StoreInfo, object_key, read_info
from h5feed.store.writer_state import (
    JOURNAL_FILE,
    LOCK_FILE,
    WRITER_API,
    WRITERS_DIR,
    WriterFiles,
    describe_writer,
)

log = logging.getLogger(__name__)

STEP_HEARTBEAT_S = 5.0  # a shared step's lock is renewed this often while held (a step takes well under it)
STEP_STALE_AFTER_S = 60.0  # and taken over when not renewed for this long: its holder died in the step


class BucketSite(WriterSite):
    def __init__(self, objects: FsspecStore, staging_dir: str | os.PathLike[str] | None, writer: str | None) -> None:
        root = Path(staging_dir or default_staging_dir(f"{objects.url}#writer={writer or ''}")).absolute()
        super().__init__(root / "store", objects.url)
        self.objects, self.root = objects, root
        self._mirror: BucketMirror | None = None

    @contextmanager
    def hold(self, files: WriterFiles) -> Iterator[None]:
        destination = self.root / DESTINATION_FILE
        if destination.exists() and destination.read_text() != self.location:
            raise StoreError(self.root, f"is the staging folder of {destination.read_text()}, not of {self.location}: "
                             "give each writer of each store its own staging_dir")
        try:
            lock = BucketLock.acquire(self.objects, f"{WRITERS_DIR}/{files.lock.name}", by=WRITER_API,
                                      who={"writer": files.writer}, refusal=lambda holder: (
                                          f"another {WRITER_API} ({holder}) is writing this store as {files.name}: "
                                          "give each writer that appends at the same time an id of its own "
                                          "(open_writer(store, writer=\"rank0\"), ...), or wait for that one to "
                                          "finish"))
        except ObjectNotFound as exc:
            raise StoreError(self.location, "the bucket does not exist: create it first (e.g. `aws s3 mb "
                             "s3://BUCKET`), or check the URL and storage_options' endpoint_url") from exc
        with lock:
            self._refuse_a_converter()
            self.staging.mkdir(parents=True, exist_ok=True)
            destination.write_text(self.location)
            self._mirror = BucketMirror(self.objects, self.root, lock, local_only=_stays_local, journaled=False)
            try:
                self._fetch()
                yield
            finally:
                self._mirror.close()

    def _refuse_a_converter(self) -> None:
        try:
            holder = self.objects.get(LOCK_FILE)
        except ObjectNotFound:
            return
        try:
            described = describe_writer(json.loads(holder) or {})
        except (ValueError, AttributeError):  # damaged: still a converter's lock, which `h5feed convert` takes over
            described = "its lock object is unreadable"
        raise StoreError(self.location, f"another `h5feed convert` ({described}) is writing this store; wait for it "
                         "to finish, or write into another store")

    @contextmanager
    def step(self, lock: str) -> Iterator[None]:
        assert self._mirror is not None, "hold() first"
        with BucketLock.acquire(self.objects, f"{WRITERS_DIR}/{lock}", by=WRITER_API, wait=True,
                                heartbeat_s=STEP_HEARTBEAT_S, stale_after_s=STEP_STALE_AFTER_S) as held:
            self._fetch()
            yield
            held.check()  # not taken over meanwhile: what it changed is still the store's next state
            self._mirror.upload_all()

    def remove_partial_writes(self, writer: str | None, own: Callable[[], list[Path]]) -> None:
        for partial in list(self.staging.rglob(f"*{PARTIAL_SUFFIX}")):  # the staging folder is this writer's alone
            partial.unlink()

    def sample_written(self, info: StoreInfo, start: int, rows: int) -> None:
        assert self._mirror is not None
        mirror = self._mirror
        shards = range(start // info.shard_tokens, math.ceil((start + rows) / info.shard_tokens))
        keys = [object_key(info, name, shard) for name in info.array_names for shard in shards]
        mirror.run_all(lambda key: mirror.upload(key, remove=True), [k for k in keys if (self.staging / k).exists()])

    def _fetch(self) -> None:
        """The store's root, arrays' metadata and index into the staging folder as the bucket holds them now
        (index files it no longer lists removed: a step that failed may have left some)."""
        assert self._mirror is not None
        try:
            self._mirror.fetch(["zarr.json"])
        except ObjectNotFound:
            others = [key for key in self.objects.list("") if not key.startswith(f"{WRITERS_DIR}/")]
            if others:
                raise StoreError(self.location, f"exists and is not an h5feed store ({len(others)} objects, no "
                                 "zarr.json); choose another place") from None
            shutil.rmtree(self.staging)  # what it holds is of a store once here, and gone: its journal too
            self.staging.mkdir()
            return
        info = read_info(self.staging)
        index = [key for key, found in self.objects.list_info("index").items()  # s3fs may list the prefix itself
                 if key.startswith("index/") and not is_folder_marker(key, found.size)]
        for path in (self.staging / "index").rglob("*"):
            if path.is_file() and path.relative_to(self.staging).as_posix() not in index:
                path.unlink()
        self._mirror.fetch([f"{name}/zarr.json" for name in info.array_names] + index)


def _stays_local(key: str) -> bool:
    """A writer's staging files that a step does not upload: its journal and locks, and shards (a sample's are
    uploaded by `sample_written`, before its journal line)."""
    return key in (LOCK_FILE, JOURNAL_FILE) or key.startswith(f"{WRITERS_DIR}/") or is_shard(key)
