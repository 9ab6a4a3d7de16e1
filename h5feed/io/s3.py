"""s3:// stores: s3fs for everything, and obstore (Rust object_store) for the reads, where it is safe.

obstore fetched the same concurrent 8 MiB ranges from the loopback S3 server up to 2x faster than
s3fs, at less CPU per byte (bench/remote_bench.py), so reads go through it when

- the storage options are ones it can honour exactly (credentials, endpoint, region, profile,
  anonymous); any other option (requester pays, SSE, botocore config, ...) keeps every read on s3fs;
- this process may use it: obstore's runtime is process-wide, starts with the first request, and
  hangs in a child forked after that.  Such a child reads with s3fs instead and says so once in
  the log.  DataLoader workers started with spawn or forkserver use obstore, and so do forked ones
  as long as the parent made no range read before the fork (opening a store reads its metadata
  with `get`, which stays on s3fs).

Credentials come from botocore's chain (environment, ~/.aws files, profiles, instance roles),
exactly as s3fs takes them, unless given in the storage options.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from h5feed.io.fsspec_store import FsspecStore
from h5feed.io.objects import Buffer, Range, check_length
from h5feed.io.retry import DEFAULT_RETRY, RetryPolicy

log = logging.getLogger("h5feed")

_OBSTORE_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "profile", "client_kwargs"}
_OBSTORE_CLIENT_KWARGS = {"endpoint_url", "region_name"}

_obstore_used_by: list[int] = []  # the pid that started obstore's runtime (inherited by a fork, hence the pid)


def obstore_usable() -> bool:
    """False in a process forked from one that had used obstore: its runtime's threads are gone there."""
    return not _obstore_used_by or _obstore_used_by[0] == os.getpid()


class S3Store(FsspecStore):
    """An FsspecStore for s3:// whose range reads (`get_ranges`, `get_large`) go through obstore when it can.

    A whole-object `get` (metadata, one small request) stays on s3fs, so that a trainer's main
    process can open a store without starting obstore, and its forked DataLoader workers read with it.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 16,
                 retry: RetryPolicy = DEFAULT_RETRY, use_obstore: bool = True) -> None:
        super().__init__(url, storage_options, concurrency=concurrency, retry=retry)
        self.use_obstore = use_obstore and _obstore_can_honour(self.storage_options)

    @property
    def reader(self) -> str:
        """Which client reads in this process: "obstore" or "s3fs"."""
        return "obstore" if self._obstore() is not None else "s3fs"

    def _obstore(self) -> Any | None:
        """This process's obstore client, or None where s3fs reads."""
        if not self.use_obstore:
            return None
        if self.__dict__.get("_client_obstore_pid") != os.getpid():
            client = None
            if not obstore_usable():
                log.warning("%s: this process was forked after its parent read through obstore, which cannot run in "
                            "it; reading with s3fs instead (slower). Start DataLoader workers with "
                            "multiprocessing_context='spawn' or 'forkserver' to read with obstore.", self.url)
            elif importlib.util.find_spec("obstore") is not None:
                client = self._make_obstore()
                self._client_obstore_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="h5feed-s3")
            self._client_obstore = client
            self._client_obstore_pid = os.getpid()  # last, as in FsspecStore._client
        return self._client_obstore

    def _make_obstore(self) -> Any:
        from obstore.store import S3Store as ObstoreS3Store

        opts = self.storage_options
        client_kwargs = opts.get("client_kwargs", {})
        endpoint = (opts.get("endpoint_url") or client_kwargs.get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        bucket, _, prefix = self.url.split("://", 1)[1].partition("/")
        self._client_obstore_prefix = prefix.rstrip("/")
        config: dict[str, Any] = {}
        botocore_chain = _BotocoreCredentials(opts.get("profile"))
        if opts.get("anon"):
            config["skip_signature"] = True
        elif opts.get("key"):
            config.update(access_key_id=opts["key"], secret_access_key=opts.get("secret"))
            if opts.get("token"):
                config["token"] = opts["token"]
        else:
            config["credential_provider"] = botocore_chain
        # A region as boto finds it; else any for another S3 service (as botocore signs), else AWS's answer.
        region = client_kwargs.get("region_name") or botocore_chain.region
        region = region or ("us-east-1" if endpoint else self._bucket_region(bucket))
        return ObstoreS3Store(
            bucket, endpoint=endpoint, region=region,
            client_options={"allow_http": bool(endpoint and endpoint.startswith("http://")),
                            "pool_max_idle_per_host": str(self.concurrency)},
            retry_config={"max_retries": 0, "retry_timeout": timedelta(minutes=3), "backoff": {  # ours retry, counted
                "init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2.0}},
            **config,
        )

    def _bucket_region(self, bucket: str) -> str:
        """The bucket's region, asked through s3fs (which finds it the way boto does) when none is configured."""
        fs = self._client()[0]
        head = self._call("", lambda: fs.call_s3("head_bucket", Bucket=bucket))
        return head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region", "us-east-1")

    def _obstore_path(self, key: str) -> str:
        return "/".join(part for part in (self._client_obstore_prefix, key) if part)

    def get_ranges(self, key: str, ranges: Sequence[Range]) -> list[Buffer]:
        client = self._obstore()
        if client is None:
            return super().get_ranges(key, ranges)
        import obstore

        if not _obstore_used_by:  # its runtime starts with the first request (making a client starts nothing)
            _obstore_used_by.append(os.getpid())
        path, url, stats = self._obstore_path(key), self.key_url(key), self.stats

        def attempt(start: int, stop: int) -> Buffer:
            t0 = time.perf_counter()
            data = check_length(url, start, stop, memoryview(obstore.get_range(client, path, start=start, end=stop)))
            stats.add_request(len(data), time.perf_counter() - t0)
            return data

        def one(r: Range) -> Buffer:
            return b"" if r[0] == r[1] else self.retry.call(lambda: attempt(*r), url, stats)

        return list(self._client_obstore_pool.map(one, ranges))


def _obstore_can_honour(options: Mapping[str, Any]) -> bool:
    return set(options) <= _OBSTORE_OPTIONS and set(options.get("client_kwargs", {})) <= _OBSTORE_CLIENT_KWARGS


class _BotocoreCredentials:
    """obstore's credential provider fed by botocore's chain (what s3fs uses), refreshed as botocore refreshes."""

    def __init__(self, profile: str | None) -> None:
        import botocore.session

        session = botocore.session.Session(profile=profile)
        self.region: str | None = session.get_config_variable("region")
        self._credentials = session.get_credentials()

    def __call__(self) -> dict[str, Any]:
        if self._credentials is None:
            raise PermissionError("no AWS credentials found (environment, ~/.aws files, profile or instance role); "
                                  "pass key/secret in storage_options, or anon=True for a public bucket")
        frozen = self._credentials.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5)}
