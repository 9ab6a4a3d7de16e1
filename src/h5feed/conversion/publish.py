"""`h5feed convert` into a bucket: convert in a local staging folder, publish object by object.

The conversion itself is the local one (plan, journal, shards, index, status flip:
`h5feed.convert`), run in `<staging>/store`.  Its files go to the bucket through
`h5feed.io`'s atomic PUTs, in an order that keeps the crash-safety promise there:

1. after planning, the root `zarr.json` while it says "converting" (so a reader of the
   bucket is refused with "conversion has not finished" from the first object on), then
   the arrays' metadata, the plan and the companions;
2. each sample's shards as soon as the sample is journaled (a few uploads in flight, then
   the local copy is deleted: the staging folder holds the samples being converted or
   uploaded, not the whole store);
3. at the end, what is left (the journal, rewritten in plan order), then the index, then
   the root `zarr.json` with status "complete": the bucket's completion marker goes last.

Every upload is journaled in `<staging>/uploads.jsonl` with the size and BLAKE2b digest of
the bytes sent; a resumed run skips a file whose size and digest are in that journal and
whose object the bucket lists with that size, and uploads the rest again (a PUT of the
same bytes is harmless).  A staging folder that is missing (another machine, a cleaned
cache) is rebuilt from the bucket: every object but the token arrays' shards is fetched,
so a complete store can be checked or appended to; an unfinished one is converted again
(its journal is published only at the end).  One writer: `h5feed.conversion.lock.BucketLock`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from h5feed.conversion.lock import BucketLock
from h5feed.errors import StoreError
from h5feed.io import FsspecStore, ObjectInfo, ObjectNotFound, open_url
from h5feed.io.local import PARTIAL_SUFFIX, write_atomically
from h5feed.io.paths import UnsafeName, contained_path, is_folder_marker
from h5feed.store.layout import StoreInfo, object_key, read_info
from h5feed.store.writer_state import LOCK_FILE, WRITER_API, as_one_holder, bucket_writers, describe_writer

log = logging.getLogger(__name__)

UPLOADS_FILE = "uploads.jsonl"
DESTINATION_FILE = "destination"  # the URL a staging folder belongs to
UPLOADS_IN_FLIGHT = 8  # shards uploaded at once (each read whole into memory)


def default_staging_dir(url: str) -> Path:
    """`$XDG_CACHE_HOME/h5feed/staging/<digest of the URL>`: the same folder for the same DST, so a rerun resumes."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "h5feed" / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def is_shard(key: str) -> bool:
    """A token array's shard (`aux_hidden_states/c/3/0`), as opposed to metadata, index, plan or journal."""
    parts = key.split("/")
    return len(parts) > 2 and parts[1] == "c" and parts[0] != "index"


class BucketMirror:
    """A local staging copy of one store in a bucket: its files go up as objects (each only when the bucket does
    not hold those bytes already), its metadata and index come down into it.  `h5feed convert` publishes
    through one (`BucketPublisher`), and so does an `open_writer` writer of a bucket store (its shards up, the
    store's state down; its commits are its own, `writer_sites.bucket`).

    `journaled`: what the bucket holds is noted in `<root>/uploads.jsonl` too, for a later run (a converter
    resumes from it; a writer fetches what it needs at every step)."""

    def __init__(self, objects: FsspecStore, root: Path, lock: BucketLock, journaled: bool = True) -> None:
        self.objects, self.root, self.lock = objects, root, lock
        self.journaled = journaled
        self.store = root / "store"
        self._uploaded: dict[str, tuple[int, str]] = {}  # key -> (size, digest) of what the bucket holds
        self._journal_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="h5feed-upload")
        self.uploads = 0  # objects put by this run

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def fetch(self, keys: list[str], as_keys: list[str] | None = None) -> None:
        """Fetch the objects `keys` into the staging folder (at `as_keys`, one for each, when given), each checked
        first to be a path inside it, and note that the bucket holds their bytes there."""
        paths = {key: self._staging_path(key) for key in (keys if as_keys is None else as_keys)}
        held = {}
        for (key, path), data in zip(paths.items(), self._pool.map(self.objects.get_large, keys)):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data, durable=False)
            held[key] = (len(data), _digest(data))
        with self._journal_lock:
            self._note_held(held)

    def _note_held(self, held: dict[str, tuple[int, str]]) -> None:
        """The bucket holds these (size, digest) at these keys: uploading them again is skipped (under
        `_journal_lock`: uploads finish on several threads)."""
        self._uploaded.update(held)
        if self.journaled:
            with open(self.root / UPLOADS_FILE, "a") as journal:
                journal.write("".join(json.dumps({"key": key, "size": size, "blake2b": digest}) + "\n"
                                      for key, (size, digest) in held.items()))

    def _staging_path(self, key: str) -> Path:
        try:
            return contained_path(self.store, key)
        except UnsafeName as exc:
            raise StoreError(self.objects.key_url(key), f"its key {exc.problem}, so it is not an object of the store "
                             f"{self.objects.url}: delete that object from the bucket, or pass --overwrite to convert "
                             "the store again from scratch") from exc

    def upload(self, key: str, remove: bool = False) -> None:
        """Put the staging file `key` unless the bucket already holds these bytes; journal it; with `remove`,
        delete the local copy once journaled (a shard: nothing local reads it again)."""
        self.lock.check()
        path = self.store / key
        data = path.read_bytes()
        sent = (len(data), _digest(data))
        if self._uploaded.get(key) != sent:
            self.objects.put_atomic(key, data)
            with self._journal_lock:
                self._note_held({key: sent})
                self.uploads += 1
        if remove:
            path.unlink()

    def run_all(self, fn: Callable[[str], object], keys: list[str]) -> None:
        """`fn(key)` for every key, concurrently; the first error is raised once all are done."""
        for future in [self._pool.submit(fn, key) for key in keys]:
            future.result()

    def local_keys(self) -> list[str]:
        """The staging folder's files that belong in the bucket (not a partial write, not the lock)."""
        keys = []
        for path in sorted(self.store.rglob("*")):
            key = path.relative_to(self.store).as_posix()
            if path.is_file() and key != LOCK_FILE and not key.endswith(PARTIAL_SUFFIX):
                keys.append(key)
        return keys

    def upload_body(self, keys: list[str]) -> None:
        """Every file of `keys` but the root and the index (shards removed locally once sent)."""
        body = [k for k in keys if k != "zarr.json" and not k.startswith("index/")]
        self.run_all(lambda key: self.upload(key, remove=is_shard(key)), body)

    def upload_all(self) -> None:
        """What the bucket lacks of the staging folder: the body, then the index, then the root, which a reader
        reads first: it never names an index or arrays the bucket does not hold yet."""
        keys = self.local_keys()
        self.upload_body(keys)
        self.run_all(self.upload, [k for k in keys if k.startswith("index/")])
        if "zarr.json" in keys:
            self.upload("zarr.json")


class BucketPublisher(BucketMirror):
    """The staging store of one bucket DST and its uploads; made by `open`, which holds the bucket's lock."""

    def __init__(self, objects: FsspecStore, root: Path, lock: BucketLock) -> None:
        super().__init__(objects, root, lock)
        self._in_flight: set[Future[None]] = set()
        self._slots = threading.BoundedSemaphore(2 * UPLOADS_IN_FLIGHT)  # shards waiting or uploading

    @classmethod
    @contextlib.contextmanager
    def open(cls, url: str, storage_options: dict[str, Any] | None, staging_dir: str | os.PathLike[str] | None,
             overwrite: bool) -> Iterator[BucketPublisher]:
        """Take the bucket's lock, and make the staging folder ready to resume (or to start over)."""
        objects = open_url(url, storage_options)
        if not isinstance(objects, FsspecStore) or objects.read_only:
            raise StoreError(url, "cannot be written: DST must be a local folder or a bucket (s3://, gs://, az://, ...)")
        try:
            lock = BucketLock.acquire(objects)
        except ObjectNotFound as exc:
            raise StoreError(url, "the bucket does not exist: create it first (e.g. `aws s3 mb s3://BUCKET`), or check "
                             "the URL and --storage-option endpoint_url") from exc
        with lock:
            publisher = cls(objects, Path(staging_dir or default_staging_dir(url)).absolute(), lock)
            try:
                publisher._prepare(overwrite)
                yield publisher
            finally:
                publisher.close()

    # --- before converting ---------------------------------------------------------------------
    def _prepare(self, overwrite: bool) -> None:
        destination = self.root / DESTINATION_FILE
        if destination.exists() and destination.read_text() != self.objects.url:
            raise StoreError(self.root, f"is the staging folder of {destination.read_text()}, not of "
                             f"{self.objects.url}: give each DST its own --staging-dir")
        holder = as_one_holder(bucket_writers(self.objects))
        if holder is not None:
            raise StoreError(self.objects.url, f"another {WRITER_API} ({describe_writer(holder)}) is writing this "
                             "store; wait for it to finish, or stop it and run this command again")
        listed = {k: v for k, v in self.objects.list_info("").items() if k != LOCK_FILE}
        if overwrite:
            self.run_all(self.objects.delete, list(listed))
            listed = {}
            shutil.rmtree(self.root, ignore_errors=True)
        self.store.mkdir(parents=True, exist_ok=True)
        destination.write_text(self.objects.url)
        if not (self.store / "zarr.json").exists():
            if "zarr.json" in listed:
                self._rebuild_staging(listed)
            elif listed:
                raise StoreError(self.objects.url, f"exists and is not an h5feed store ({len(listed)} objects, no "
                                 "zarr.json); choose another DST or pass --overwrite")
        self._uploaded = self._read_uploads(listed)

    def _rebuild_staging(self, listed: dict[str, ObjectInfo]) -> None:
        """Fetch every object of the store in the bucket but the shards into an empty staging folder."""
        keys = [key for key, info in listed.items() if not is_shard(key) and not is_folder_marker(key, info.size)]
        log.info("%s: no staging folder at %s: fetching the store's %d metadata and index objects from the bucket",
                 self.objects.url, self.root, len(keys))
        (self.root / UPLOADS_FILE).unlink(missing_ok=True)
        self.fetch(keys)

    def _read_uploads(self, listed: dict[str, ObjectInfo]) -> dict[str, tuple[int, str]]:
        """The journal's uploads whose objects the bucket still lists at the size sent (a line cut by a kill is ignored)."""
        uploaded: dict[str, tuple[int, int]] = {}
        path = self.root / UPLOADS_FILE
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["key"] in listed and listed[record["key"]].size == record["size"]:
                uploaded[record["key"]] = (record["size"], record.get("blake2b"))
        return uploaded

    # --- uploads -------------------------------------------------------------------------------
    def publish_start(self) -> None:
        """After planning: the "converting" root first (unless the store is complete: an append), then every
        file but the index (metadata, plan, companions, shards a killed run left)."""
        if read_info(self.store).status != "complete":
            self.upload("zarr.json")
        self.upload_body(self.local_keys())

    def sample_done(self, start: int, num_tokens: int, info: StoreInfo) -> None:
        """A sample was journaled: upload its shards in the background (blocking while too many are in flight)."""
        first, stop = start // info.shard_tokens, math.ceil((start + num_tokens) / info.shard_tokens)
        for name in info.array_names:
            for shard in range(first, stop):
                self._raise_failed()
                self._slots.acquire()
                future = self._pool.submit(self.upload, object_key(info, name, shard), True)
                self._in_flight.add(future)
                future.add_done_callback(lambda _: self._slots.release())

    def _raise_failed(self) -> None:
        for future in [f for f in self._in_flight if f.done()]:
            self._in_flight.discard(future)
            future.result()

    def publish_end(self) -> None:
        """After the local store is complete: the rest, then the index, then the root's status flip."""
        wait(self._in_flight)
        self._raise_failed()
        self.upload_all()


def _digest(data: bytes) -> str:
    """What says the bucket already holds these bytes.  Not crc32c: every zarr chunk and shard ends with its own
    crc32c, and the crc32c of such bytes is one constant, so two chunks of one size would look the same."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()
