"""A store in a bucket (s3://, gs://, az://, ...): each writer works in a staging folder of its own.

The writer writes a sample's shards in its staging folder, uploads them (atomic PUTs, each checked) and
deletes them, then journals the sample there: the staging folder holds the journal and the samples in
flight, never the store.  Shards lie under names no other writer uses (each writer's rows are its own).

The shared steps (reserving rows, publishing) commit by compare-and-swap, as transactional table and
array formats commit on object stores; no lock is shared, so nothing a paused writer or a client clock
minutes off the bucket's can break.  A step reads the root (`zarr.json`, with its ETag), the arrays'
metadata and the index the root names into the staging folder, runs as on a local store, then:

1. grows the arrays' metadata it grew, each by a conditional PUT on the ETag just read of the largest of
   the shape there and the one wanted (shapes only grow: a stale writer can never shrink one);
2. uploads an index it changed under a fresh prefix, `index-v/<number>-<writer>-<token>/` (its number one
   more than the index it adds to), that no other writer or commit uses: an index is never rewritten in
   place, where a writer that loses the race could otherwise overwrite the winner's rows;
3. puts the root, naming that index and the commit's number (`Commit`), with If-Match on the ETag read
   at the step's start: the single commit point.  On 412 Precondition Failed another writer committed
   first: the step runs again on the fresh state.  So rows are reserved once (the commit's number
   changes the root at every commit), and a publication adds to the index the last commit published.

A writer that cannot commit raises; it never reports a sample published that the root does not name.
Index versions superseded long ago (judged by the bucket's Last-Modified of later versions, never this
machine's clock) are deleted after a publication; a reader opening the store meanwhile reads the one its
root names.  Where a backend has no conditional PUT (`FsspecStore.put_if` checks, then writes), one writer
at a time is safe; several may lose a commit's race unseen (said once in the log).

A writer restarted on the same machine resumes from its staging folder's journal (a sample is journaled
once its shards are in the bucket).  One restarted elsewhere (or after its staging folder was removed)
starts a new block: the samples it published are kept, those it journaled but had not published are not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from h5feed.conversion.lock import WAIT_LOG_S, BucketLock, WriterLock
from h5feed.conversion.publish import DESTINATION_FILE, BucketMirror, default_staging_dir
from h5feed.conversion.writer_sites.base import WriterSite
from h5feed.errors import StoreError
from h5feed.io import FsspecStore, ObjectNotFound
from h5feed.io.local import PARTIAL_SUFFIX, write_atomically
from h5feed.io.paths import is_folder_marker
from h5feed.store.format import DEFAULT_INDEX
from h5feed.store.layout import Commit, StoreInfo, object_key, read_info
from h5feed.store.writer_state import (
    LOCK_FILE,
    PUBLISH_LOCK,
    WRITER_API,
    WRITERS_DIR,
    WriterFiles,
    describe_writer,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
INDEX_VERSIONS = "index-v"  # each publication's index, under a prefix of its own
OLD_INDEX_AFTER_S = 600.0  # an index version is deleted once superseded for at least this long (bucket's clock)


@dataclass
class _Fetched:
    """The store's state a step started from: the root's ETag (None: no store yet) and commit, the arrays'
    row counts, and the digests of the index files as fetched (what tells whether the step changed it)."""

    root_etag: str | None
    commit: Commit
    rows: dict[str, int] = field(default_factory=dict)
    index: dict[str, str] = field(default_factory=dict)


class BucketSite(WriterSite):
    def __init__(self, objects: FsspecStore, staging_dir: str | os.PathLike[str] | None, writer: str | None) -> None:
        root = Path(staging_dir or default_staging_dir(f"{objects.url}#writer={writer or ''}")).absolute()
        super().__init__(root / "store", objects.url)
        self.objects, self.root, self.writer = objects, root, writer
        self._mirror: BucketMirror | None = None
        self._index: tuple[str, dict[str, str]] | None = None  # the index version in staging, and its files' digests

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
        with ExitStack() as held:
            held.enter_context(lock)
            held.enter_context(WriterLock.of_staging(self.root, files))
            self._refuse_a_converter()
            self.staging.mkdir(parents=True, exist_ok=True)
            destination.write_text(self.location)
            self._mirror = BucketMirror(self.objects, self.root, lock, journaled=False)
            try:
                self._fetch(with_index=True)
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

    def commit(self, step: str, body: Callable[[], T]) -> T:
        """Run `body` on the store's state now and commit what it changed (see the module docstring), again on
        a fresh state while other writers commit first; says every `WAIT_LOG_S` how long it has been losing."""
        started = said = time.monotonic()
        lost = 0
        while True:
            fetched = self._fetch(with_index=step == PUBLISH_LOCK)
            result = body()
            winner = self._commit(fetched)
            if winner is None:
                return result
            lost += 1
            if time.monotonic() - said >= WAIT_LOG_S:
                said = time.monotonic()
                log.warning("%s: other writers committed first %d times in %.0f s (the last: %s); trying again",
                            self.location, lost, said - started, winner)
            time.sleep(random.uniform(0.0, min(0.5, 0.01 * 2 ** min(lost, 6))))  # writers racing spread out

    def remove_partial_writes(self, writer: str | None, own: Callable[[], list[Path]]) -> None:
        for partial in list(self.staging.rglob(f"*{PARTIAL_SUFFIX}")):  # the staging folder is this writer's alone
            partial.unlink()

    def sample_written(self, info: StoreInfo, start: int, rows: int) -> None:
        assert self._mirror is not None
        mirror = self._mirror
        shards = range(start // info.shard_tokens, math.ceil((start + rows) / info.shard_tokens))
        keys = [object_key(info, name, shard) for name in info.array_names for shard in shards]
        mirror.run_all(lambda key: mirror.upload(key, remove=True), [k for k in keys if (self.staging / k).exists()])

    # --- a step's state ------------------------------------------------------------------------
    def _fetch(self, with_index: bool) -> _Fetched:
        """The store's root (its ETag read first: the root read is that one or a later one, whose commit then
        fails), arrays' metadata and, `with_index`, the index the root names, into the staging folder as
        `index/` (files it no longer holds removed)."""
        assert self._mirror is not None
        try:
            etag = self.objects.info("zarr.json").etag
            self._mirror.fetch(["zarr.json"])
        except ObjectNotFound:
            others = [key for key in self.objects.list("") if not key.startswith(f"{WRITERS_DIR}/")]
            if others:
                raise StoreError(self.location, f"exists and is not an h5feed store ({len(others)} objects, no "
                                 "zarr.json); choose another place") from None
            shutil.rmtree(self.staging)  # what it holds is of a store once here, and gone: its journal too
            self.staging.mkdir()
            self._index = None
            return _Fetched(None, Commit())
        commit = Commit.of_root(json.loads((self.staging / "zarr.json").read_bytes()))
        info = read_info(self.staging)
        metadata = [f"{name}/zarr.json" for name in info.array_names]
        self._mirror.fetch(metadata)
        rows = {key: _rows(self.staging / key) for key in metadata}
        if with_index:
            self._fetch_index(commit.index)
        return _Fetched(etag, commit, rows, dict(self._index[1]) if self._index else {})

    def _fetch_index(self, prefix: str) -> None:
        assert self._mirror is not None
        here = self.staging / DEFAULT_INDEX
        if self._index is not None and self._index[0] == prefix and prefix != DEFAULT_INDEX and \
                _digests(here) == self._index[1]:
            return  # an index version never changes: the copy here is it
        listed = [key for key, found in self.objects.list_info(prefix).items()  # s3fs may list the prefix itself
                  if key.startswith(f"{prefix}/") and not is_folder_marker(key, found.size)]
        local = [DEFAULT_INDEX + key[len(prefix):] for key in listed]
        if here.exists():
            shutil.rmtree(here)
        self._mirror.fetch(listed, as_keys=local)
        self._index = (prefix, _digests(here))

    # --- committing ----------------------------------------------------------------------------
    def _commit(self, fetched: _Fetched) -> str | None:
        """Make what the step changed in staging the store's: None once committed, else who committed first."""
        assert self._mirror is not None
        mirror = self._mirror
        for key in [f"{name}/zarr.json" for name in read_info(self.staging).array_names]:
            wanted = _rows(self.staging / key)
            if wanted > fetched.rows.get(key, -1):
                self._grow(key, wanted)
        token = uuid.uuid4().hex[:12]
        index = fetched.commit.index
        digests = _digests(self.staging / DEFAULT_INDEX)
        if digests and digests != fetched.index:
            if fetched.root_etag is not None and self.objects.info("zarr.json").etag != fetched.root_etag:
                return self._last_committer()  # lost already: a HEAD spares uploading an index no root will name
            number = _version_number(fetched.commit.index) + 1
            index = f"{INDEX_VERSIONS}/{number:010d}-{self.writer or 'unnamed'}-{token}"
            mirror.run_all(lambda key: self.objects.put_atomic(f"{index}{key[len(DEFAULT_INDEX):]}",
                                                               (self.staging / key).read_bytes()), list(digests))
        root = json.loads((self.staging / "zarr.json").read_bytes())
        commit = Commit(fetched.commit.seq + 1, index, self.writer, token)
        root["attributes"].update(commit.to_attributes())
        body = json.dumps(root, indent=2).encode()
        if self.objects.put_if("zarr.json", body, fetched.root_etag) is None and not self._went_in(commit):
            return self._last_committer()
        write_atomically(self.staging / "zarr.json", body, durable=False)
        if index != fetched.commit.index:
            self._index = (index, digests)
            self._delete_old_indexes(index)
        return None

    def _grow(self, key: str, rows: int) -> None:
        """An array's metadata grown to at least `rows`: a conditional PUT of the largest of its shape in the bucket
        and `rows`, on the ETag just read (the first writer creates it), again on a conflict."""
        while True:
            try:
                etag = self.objects.info(key).etag
                meta = json.loads(self.objects.get(key))
            except ObjectNotFound:
                etag, meta = None, json.loads((self.staging / key).read_bytes())
            if etag is not None and meta["shape"][0] >= rows:
                return
            meta["shape"][0] = max(rows, meta["shape"][0])
            if self.objects.put_if(key, json.dumps(meta, indent=2).encode(), etag) is not None:
                return

    def _went_in(self, commit: Commit) -> bool:
        """Whether the root holds `commit` after all: a retried PUT whose first try went in (its answer lost)
        is refused as a conflict with itself."""
        try:
            return Commit.of_root(json.loads(self.objects.get("zarr.json"))).token == commit.token
        except (ObjectNotFound, ValueError):
            return False

    def _last_committer(self) -> str:
        try:
            by = Commit.of_root(json.loads(self.objects.get("zarr.json"))).by
        except (ObjectNotFound, ValueError):
            return "another writer"
        return "the unnamed writer" if by is None else f"writer {by!r}"

    def _delete_old_indexes(self, current: str) -> None:
        """Delete the index versions superseded for `OLD_INDEX_AFTER_S` (best effort).  Version n+2 (any writer's,
        committed or not) was made from a root naming version n+1, so after version n was superseded: version n
        goes once one numbered n+2 or more is that old, by the bucket's Last-Modified of both (`current` was
        written just now), and no reader still reads it."""
        try:
            listed = self.objects.list_info(INDEX_VERSIONS)
            versions: dict[str, list[str]] = {}
            for key in listed:
                versions.setdefault("/".join(key.split("/")[:2]), []).append(key)
            now = max((listed[key].modified_ns or 0 for key in versions.get(current, [])), default=0)
            old = [_version_number(v) for v, keys in versions.items()
                   if max(listed[k].modified_ns or now for k in keys) <= now - OLD_INDEX_AFTER_S * 1e9]
            if not now or not old:
                return
            gone = [key for v, keys in versions.items() if v != current and _version_number(v) <= max(old) - 2
                    for key in keys]
            assert self._mirror is not None
            self._mirror.run_all(self.objects.delete, gone)
        except Exception as exc:  # noqa: BLE001 (left for a later publication)
            log.info("%s: could not delete old index versions: %s", self.location, exc)


def _rows(metadata: Path) -> int:
    return int(json.loads(metadata.read_bytes())["shape"][0])


def _version_number(version: str) -> int:
    """An index version's number: one more than the one its publication added to (-1: `index/`)."""
    try:
        return int(version.split("/")[1].split("-")[0])
    except (IndexError, ValueError):
        return -1


def _digests(folder: Path) -> dict[str, str]:
    """The staging index's files (keys relative to the store) and a digest of each."""
    top = folder.parent
    return {path.relative_to(top).as_posix(): hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.name.endswith(PARTIAL_SUFFIX)}
