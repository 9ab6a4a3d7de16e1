"""Objects under any fsspec URL: s3://, gs://, az://, https:// (read-only), chained URLs, ...

Credentials and endpoints come the way each fsspec backend takes them (environment, config
files) plus `storage_options`.  Ranges are fetched as coroutines on fsspec's I/O loop for async
backends (s3fs, gcsfs, adlfs, http), or from a thread pool for the others, `concurrency` at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

from h5feed.io.objects import Buffer, ObjectInfo, ObjectNotFound, ObjectStore, Range, check_length
from h5feed.io.retry import DEFAULT_RETRY, RetryPolicy

T = TypeVar("T")
log = logging.getLogger("h5feed")

# Where a single PUT is atomic (the object appears whole on completion); elsewhere write, then move.
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
_READ_ONLY_PROTOCOLS = {"http", "https"}


def protocol_of(url: str) -> str:
    """The outermost backend of a (possibly chained) URL: "s3" for s3://..., "simplecache" for simplecache::s3://..."""
    head = url.split("::", 1)[0]
    return head.split("://", 1)[0] if "://" in head else head if "::" in url else "file"


class FsspecStore(ObjectStore):
    """An ObjectStore over an fsspec filesystem, made lazily in each process (never inherited over fork)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 16,
                 retry: RetryPolicy = DEFAULT_RETRY) -> None:
        super().__init__(url)
        self.storage_options = dict(storage_options or {})
        self.concurrency = concurrency
        self.retry = retry
        self.protocol = protocol_of(url)
        self.read_only = self.protocol in _READ_ONLY_PROTOCOLS

    def _filesystem_options(self) -> dict[str, Any]:
        """The user's options, plus for S3: a connection pool as large as the concurrency, botocore's
        silent retries off (every retry is ours, and counted), one GET per whole-object read
        (`get_large` splits large ones itself), and no listings cache (another process may have written)."""
        options = dict(self.storage_options)
        if self.protocol in ("s3", "s3a"):
            config = {"max_pool_connections": self.concurrency, "retries": {"total_max_attempts": 1}}
            options["config_kwargs"] = {**config, **options.get("config_kwargs", {})}
            options.setdefault("max_concurrency", 1)
            options.setdefault("use_listings_cache", False)
            options["skip_instance_cache"] = True  # our own instance: its retries are set below
        return options

    def _client(self) -> tuple[Any, str]:
        """(filesystem, root path) of this process; made on first use and again after a fork."""
        if self.__dict__.get("_client_pid") != os.getpid():
            import fsspec

            fs, root = fsspec.core.url_to_fs(self.url, **self._filesystem_options())
            if self.protocol in ("s3", "s3a"):
                fs.retries = 1  # s3fs's own retry loop (a class attribute), off: ours counts
            self._client_fs, self._client_root = fs, root.rstrip("/")
            self._client_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="h5feed-io")
            self._client_slots = asyncio.Semaphore(self.concurrency)  # bound to fs.loop on first use
            self._client_pid = os.getpid()  # last: another thread's first call may make its own, never a half one
        return self._client_fs, self._client_root

    def _path(self, key: str) -> str:
        root = self._client()[1]
        return "/".join(part for part in (root, key) if part)

    def _call(self, key: str, fn: Callable[[], T], nbytes: Callable[[T], int] = lambda _: 0) -> T:
        """One request with retries, counted."""

        def attempt() -> T:
            t0 = time.perf_counter()
            result = fn()
            self.stats.add_request(nbytes(result), time.perf_counter() - t0)
            return result

        return self.retry.call(attempt, self.key_url(key), self.stats)

    # --- reads -------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        fs, path = self._client()[0], self._path(key)
        return self._call(key, lambda: fs.cat_file(path), len)

    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        fs, path = self._client()[0], self._path(key)
        if getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            return sync(fs.loop, self._get_ranges_async, fs, key, path, list(ranges))
        return list(self._client_pool.map(lambda r: self._get_range_sync(fs, key, path, *r), ranges))

    def _get_range_sync(self, fs: Any, key: str, path: str, start: int, stop: int) -> bytes:
        if start == stop:
            return b""
        url = self.key_url(key)
        return self._call(key, lambda: check_length(url, start, stop, fs.cat_file(path, start=start, end=stop)), len)

    async def _get_ranges_async(self, fs: Any, key: str, path: str, ranges: list[Range]) -> list[Buffer]:
        url, stats, slots = self.key_url(key), self.stats, self._client_slots

        async def attempt(start: int, stop: int) -> bytes:
            t0 = time.perf_counter()
            data = check_length(url, start, stop, await fs._cat_file(path, start=start, end=stop))
            stats.add_request(len(data), time.perf_counter() - t0)
            return data

        async def one(start: int, stop: int) -> bytes:
            if start == stop:
                return b""
            async with slots:
                return await self.retry.call_async(lambda: attempt(start, stop), url, stats)

        return list(await asyncio.gather(*(one(start, stop) for start, stop in ranges)))

    def size(self, key: str) -> int:
        fs, path = self._client()[0], self._path(key)
        fs.invalidate_cache(path)
        info = self._call(key, lambda: fs.info(path))
        if info.get("type") == "directory":
            raise ObjectNotFound(self.key_url(key), "a folder (prefix), not an object")
        return int(info["size"])

    def list(self, prefix: str = "") -> dict[str, int]:
        return {key: info.size for key, info in self.list_info(prefix).items()}

    def list_info(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """Every object under the folder `prefix`, with its size, ETag and modification time, in key order."""
        fs, root = self._client()
        top = self._path(prefix)
        fs.invalidate_cache(top)
        try:
            found = self._call(prefix, lambda: fs.find(top, detail=True))
        except ObjectNotFound:
            return {}
        return {p[len(root) + 1:] if root else p: _object_info(info) for p, info in sorted(found.items())}

    def info(self, key: str) -> ObjectInfo:
        """The object's size, ETag and modification time (one HEAD); ObjectNotFound when there is none."""
        fs, path = self._client()[0], self._path(key)
        fs.invalidate_cache(path)
        found = self._call(key, lambda: fs.info(path))
        if found.get("type") == "directory":
            raise ObjectNotFound(self.key_url(key), "a folder (prefix), not an object")
        return _object_info(found)

    # --- writes ------------------------------------------------------------------------------
    def put_atomic(self, key: str, data: bytes | memoryview) -> None:
        self._check_writable(key)
        fs, path = self._client()[0], self._path(key)
        data = bytes(data) if isinstance(data, memoryview) else data
        if self.protocol in _OBJECT_STORE_PROTOCOLS:
            self._call(key, lambda: fs.pipe_file(path, data))
            return
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.h5feed-tmp"
        self._call(key, lambda: fs.pipe_file(tmp, data))
        self._call(key, lambda: fs.mv(tmp, path))

    def put_if(self, key: str, data: bytes, etag: str | None) -> str | None:
        """A conditional PUT: create the object only if there is none (`etag` None: If-None-Match: *), or
        replace it only if it still has `etag` (If-Match).  Returns the new object's ETag, or None when the
        condition failed (someone else wrote first).  S3 honours both conditions atomically; on other
        backends this is a check, then a write (another writer can slip in between), said once in the log."""
        self._check_writable(key)
        fs, path = self._client()[0], self._path(key)
        if self.protocol not in ("s3", "s3a"):
            if not _warned_unconditional:
                _warned_unconditional.append(self.protocol)
                log.warning("%s: %s has no conditional writes here: the writer's lock is checked, then written, "
                            "so two writers starting the same instant could both proceed", self.url, self.protocol)
            try:
                current = self.info(key).etag
            except ObjectNotFound:
                current = None
            if current != etag:
                return None
            self.put_atomic(key, data)
            return self.info(key).etag
        bucket, object_key, _ = fs.split_path(path)
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}

        def put() -> str | None:
            try:
                return fs.call_s3("put_object", Bucket=bucket, Key=object_key, Body=data, **condition)["ETag"]
            except OSError as exc:
                if _precondition_failed(exc) or (etag is not None and isinstance(exc, FileNotFoundError)):
                    return None  # written (or, for If-Match, deleted) by someone else meanwhile
                raise

        return self._call(key, put)

    def delete(self, key: str) -> None:
        self._check_writable(key)
        fs, path = self._client()[0], self._path(key)
        try:
            self._call(key, lambda: fs.rm_file(path))
        except ObjectNotFound:
            pass


_warned_unconditional: list[str] = []


def _precondition_failed(exc: BaseException) -> bool:
    """Whether S3 answered 412 Precondition Failed (s3fs raises it as FileExistsError or as an OSError)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError):
            return True
        if getattr(seen, "response", {}).get("Error", {}).get("Code") == "PreconditionFailed":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _object_info(found: dict[str, Any]) -> ObjectInfo:
    """fsspec's `info` of an object as an ObjectInfo, whichever backend's keys it uses."""
    etag = found.get("ETag") or found.get("etag") or found.get("md5Hash")
    modified = next((found[k] for k in ("LastModified", "last_modified", "mtime", "updated") if found.get(k)), None)
    if isinstance(modified, str):
        modified = datetime.fromisoformat(modified.replace("Z", "+00:00"))
    if isinstance(modified, datetime):
        modified = modified.timestamp()
    return ObjectInfo(int(found["size"]), str(etag) if etag else None,
                      None if modified is None else round(float(modified) * 1e9))
