"""Objects under any fsspec URL: s3://, gs://, az://, https:// (read-only), chained URLs, ...

Credentials and endpoints come the way each fsspec backend takes them (environment, config
files) plus `storage_options` (for s3://, as `S3Settings` resolves them).  Requests run as coroutines
on fsspec's I/O loop for async backends (s3fs, gcsfs, adlfs, http), where the retry policy's timeout
cancels a try that gets no answer, or from a thread pool for the others, `concurrency` at a time.
Every write is checked: on S3 by the server (Content-MD5) and the ETag it answers, elsewhere read back.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import partial
from typing import Any

from h5feed.io.objects import (
    Buffer,
    ObjectError,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    Range,
    TransferMismatch,
    check_length,
)
from h5feed.io.retry import DEFAULT_RETRY, RetryPolicy

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
        silent retries off (every retry is ours, and counted), its timeouts the retry policy's, one GET per
        whole-object read (`get_large` splits large ones itself), and no listings cache (another process
        may have written)."""
        options = dict(self.storage_options)
        if self.protocol in ("s3", "s3a"):
            config = {"max_pool_connections": self.concurrency, "retries": {"total_max_attempts": 1},
                      "connect_timeout": self.retry.timeout, "read_timeout": self.retry.timeout}
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

    def _call(self, key: str, method: str, *args: Any, check: Callable[[Any], Any] = lambda result: result,
              nbytes: Callable[[Any], int] = lambda _: 0, size: int = 0, **kwargs: Any) -> Any:
        """`fs.<method>(*args, **kwargs)` as one request with retries, counted.  `check` sees each answer and
        raises TransferMismatch for one that went wrong on the way (retried); `size` is what the request moves
        (a range's length, a PUT's body).  On an async backend the attempts run on its I/O loop, where the
        retry policy cancels one that outlasts its deadline."""
        fs = self._client()[0]
        if getattr(fs, "async_impl", False) and hasattr(fs, f"_{method}"):
            from fsspec.asyn import sync

            return sync(fs.loop, self._call_async, fs, key, method, args, kwargs, check, nbytes, size)
        stats = self.stats

        def attempt() -> Any:
            t0 = time.perf_counter()
            result = check(getattr(fs, method)(*args, **kwargs))
            stats.add_request(nbytes(result), time.perf_counter() - t0)
            return result

        return self.retry.call(attempt, self.key_url(key), stats)

    async def _call_async(self, fs: Any, key: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                          check: Callable[[Any], Any], nbytes: Callable[[Any], int], size: int = 0) -> Any:
        stats = self.stats

        async def attempt() -> Any:
            t0 = time.perf_counter()
            result = check(await getattr(fs, f"_{method}")(*args, **kwargs))
            stats.add_request(nbytes(result), time.perf_counter() - t0)
            return result

        async with self._client_slots:
            return await self.retry.call_async(attempt, self.key_url(key), stats, size)

    # --- reads -------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self._call(key, "cat_file", self._path(key), nbytes=len)

    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        fs, path, url = self._client()[0], self._path(key), self.key_url(key)
        wanted = [(start, stop) for start, stop in ranges if start != stop]
        if getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            async def fetch_all() -> list[Buffer]:
                return list(await asyncio.gather(*(
                    self._call_async(fs, key, "cat_file", (path,), {"start": start, "end": stop},
                                     partial(check_length, url, start, stop), len, stop - start)
                    for start, stop in wanted)))

            fetched = iter(sync(fs.loop, fetch_all))
        else:
            fetched = iter(self._client_pool.map(lambda r: self._call(
                key, "cat_file", path, start=r[0], end=r[1], check=partial(check_length, url, *r), nbytes=len,
                size=r[1] - r[0]), wanted))
        return [b"" if start == stop else next(fetched) for start, stop in ranges]

    def size(self, key: str) -> int:
        return self.info(key).size

    def list(self, prefix: str = "") -> dict[str, int]:
        return {key: info.size for key, info in self.list_info(prefix).items()}

    def list_info(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """Every object under the folder `prefix`, with its size, ETag and modification time, in key order."""
        fs, root = self._client()
        top = self._path(prefix)
        fs.invalidate_cache(top)
        try:
            found = self._call(prefix, "find", top, detail=True)
        except ObjectNotFound:
            return {}
        return {p[len(root) + 1:] if root else p: _object_info(info) for p, info in sorted(found.items())}

    def info(self, key: str) -> ObjectInfo:
        """The object's size, ETag and modification time (one HEAD); ObjectNotFound when there is none."""
        fs, path = self._client()[0], self._path(key)
        fs.invalidate_cache(path)
        found = self._call(key, "info", path)
        if found.get("type") == "directory":
            raise ObjectNotFound(self.key_url(key), "a folder (prefix), not an object")
        return _object_info(found)

    # --- writes ------------------------------------------------------------------------------
    def put_atomic(self, key: str, data: bytes | memoryview) -> None:
        """The object written whole and checked: on S3 by the server (Content-MD5) and its ETag, elsewhere
        read back; bytes that arrive otherwise are sent again, then an error naming the object."""
        self._check_writable(key)
        data = bytes(data) if isinstance(data, memoryview) else data
        if self.protocol in ("s3", "s3a"):
            self._put_object(key, data, {})
        else:
            self.retry.call(lambda: self._put_and_read_back(key, data), self.key_url(key), self.stats)

    def _put_and_read_back(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.protocol in _OBJECT_STORE_PROTOCOLS:
            self._call(key, "pipe_file", path, data, size=len(data))
        else:
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.h5feed-tmp"
            self._call(key, "pipe_file", tmp, data, size=len(data))
            self._call(key, "mv", tmp, path)
        if self.get(key) != data:
            raise TransferMismatch(self.key_url(key), f"reads back other bytes than the {len(data)} written; "
                                                      "check the storage service and the network between")

    def _put_object(self, key: str, data: bytes, condition: dict[str, str]) -> str:
        """One S3 PUT, checked twice: Content-MD5 has the server refuse a body changed on the way (BadDigest,
        retried), and the ETag it answers, the MD5 of what it stored, must be the MD5 of the bytes sent (where
        it is one: not under SSE-KMS or SSE-C).  Returns the ETag."""
        from fsspec.asyn import sync

        fs, path, url = self._client()[0], self._path(key), self.key_url(key)
        bucket, object_key, _ = fs.split_path(path)
        md5 = hashlib.md5(data)
        request = {"Bucket": bucket, "Key": object_key, "Body": data,
                   "ContentMD5": base64.b64encode(md5.digest()).decode(), **condition}

        def stored(response: dict[str, Any]) -> str:
            etag = str(response.get("ETag", ""))
            if _etag_is_md5(response) and etag.strip('"') != md5.hexdigest():
                if condition:  # our write went in, garbled: the next try replaces exactly it (each try reads `request`)
                    request.pop("IfNoneMatch", None)
                    request["IfMatch"] = etag
                raise TransferMismatch(url, f"the server stored other bytes than the {len(data)} sent (its ETag "
                                            f"{etag}, their MD5 {md5.hexdigest()}); check the endpoint and the network "
                                            "between")
            return etag

        return sync(fs.loop, self._call_async, fs, key, "call_s3", ("put_object",), request, stored, lambda _: 0,
                    len(data))

    def put_if(self, key: str, data: bytes, etag: str | None) -> str | None:
        """A conditional PUT: create the object only if there is none (`etag` None: If-None-Match: *), or
        replace it only if it still has `etag` (If-Match).  Returns the new object's ETag, or None when the
        condition failed (someone else wrote first).  S3 honours both conditions atomically; on other
        backends this is a check, then a write (another writer can slip in between), said once in the log."""
        self._check_writable(key)
        if self.protocol not in ("s3", "s3a"):
            if not _warned_unconditional:
                _warned_unconditional.append(self.protocol)
                log.warning("%s: %s has no conditional writes here: a lock or commit is checked, then written, so "
                            "one writer at a time is safe; two committing in the same instant could both go, one's "
                            "commit lost", self.url, self.protocol)
            try:
                current = self.info(key).etag
            except ObjectNotFound:
                current = None
            if current != etag:
                return None
            self.put_atomic(key, data)
            return self.info(key).etag
        try:
            return self._put_object(key, data, {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"})
        except ObjectNotFound:
            if etag is not None:
                return None  # deleted by someone else meanwhile
            raise
        except ObjectError as exc:
            if _precondition_failed(exc):
                return None  # written by someone else meanwhile
            raise

    def server_time_ns(self) -> int | None:
        """The bucket's time now, on its own clock (what Last-Modified is on): S3's `Date` header of a one-key
        listing (read-only credentials do); elsewhere the Last-Modified of a probe object put under
        `h5feed-writers/` and deleted.  None when neither answers.  Why: a lock's age is its Last-Modified
        against this, never against this machine's clock, which may be minutes off the bucket's."""
        from email.utils import parsedate_to_datetime

        try:
            if self.protocol in ("s3", "s3a"):
                from fsspec.asyn import sync

                fs, path = self._client()[0], self._path("")
                bucket, prefix, _ = fs.split_path(path)
                answer = sync(fs.loop, self._call_async, fs, "", "call_s3", ("list_objects_v2",),
                              {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1}, lambda result: result,
                              lambda _: 0)
                date = answer["ResponseMetadata"]["HTTPHeaders"]["date"]
                return round(parsedate_to_datetime(date).timestamp() * 1e9)
            if self.read_only:
                return None
            probe = f"h5feed-writers/clock-probe-{uuid.uuid4().hex}"
            self.put_atomic(probe, b"")
            try:
                return self.info(probe).modified_ns
            finally:
                self.delete(probe)
        except (ObjectError, KeyError, TypeError, ValueError) as exc:
            log.warning("%s: could not read the bucket's clock (%s): only a lock whose holder is known dead is "
                        "taken over", self.url, exc)
            return None

    def delete(self, key: str) -> None:
        self._check_writable(key)
        try:
            self._call(key, "rm_file", self._path(key))
        except ObjectNotFound:
            pass


_warned_unconditional: list[str] = []


def _etag_is_md5(response: dict[str, Any]) -> bool:
    """Whether a single-part PUT's ETag is the MD5 of the object: not under SSE-KMS or SSE-C, and not absent
    (a server without ETags is trusted to have checked the Content-MD5 it was sent)."""
    encrypted = str(response.get("ServerSideEncryption", "")).startswith("aws:kms") or "SSECustomerAlgorithm" in response
    return bool(response.get("ETag")) and not encrypted


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
