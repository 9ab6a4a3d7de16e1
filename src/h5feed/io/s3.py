"""s3:// stores: s3fs for everything, and obstore (Rust object_store) for the reads, where it is safe.

obstore fetched the same concurrent 8 MiB ranges from the loopback S3 server up to 2x faster than
s3fs, at less CPU per byte (bench/remote/remote_bench.py), so reads go through it when

- the storage options are ones it can honour exactly (credentials, endpoint, region, profile,
  anonymous); any other option (requester pays, SSE, botocore config, ...) keeps every read on s3fs;
- this process may use it: obstore's runtime is process-wide, starts with the first request, and
  hangs in a child forked after that.  Such a child reads with s3fs instead and says so once in
  the log.  DataLoader workers started with spawn or forkserver use obstore, and so do forked ones
  as long as the parent made no range read before the fork (opening a store reads its metadata
  with `get`, which stays on s3fs).

Both clients connect with one `S3Settings`, resolved when the store is opened and pickled with it: the
endpoint, region and credentials in the storage options, else the environment's (AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION, the profile).  obstore reads the environment itself and
lets AWS_ENDPOINT_URL_S3 override the endpoint it is given, so every setting is passed to it explicitly.
Credentials not in the storage options come from botocore's chain (environment, ~/.aws files, profiles,
instance roles), exactly as s3fs takes them.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from h5feed.io.fsspec_store import FsspecStore
from h5feed.io.objects import Buffer, Range, check_length
from h5feed.io.retry import DEFAULT_RETRY, RetryPolicy

log = logging.getLogger("h5feed")

_SETTINGS_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "profile"}  # what S3Settings resolves
_SETTINGS_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_OBSTORE_OPTIONS = _SETTINGS_OPTIONS | {"client_kwargs"}

_obstore_used_by: list[int] = []  # the pid that started obstore's runtime (inherited by a fork, hence the pid)


def obstore_usable() -> bool:
    """False in a process forked from one that had used obstore: its runtime's threads are gone there."""
    return not _obstore_used_by or _obstore_used_by[0] == os.getpid()


@dataclass(frozen=True)
class S3Settings:
    """Where, and as whom, every client of one s3:// store connects.

    Resolved once, when the store is opened, and pickled with it, so that s3fs, obstore, the node cache's
    fetcher and every worker process send each request to the same server, signed the same way.
    """

    endpoint_url: str | None = None  # None: AWS's own endpoints
    region: str | None = None  # None: the bucket's, asked when a client needs it
    key: str | None = None  # None (and not anon): botocore's credential chain, with `profile`
    secret: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    profile: str | None = None
    anon: bool = False

    @classmethod
    def resolve(cls, url: str, options: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> S3Settings:
        """The storage options' settings, and for what they leave open `environ`'s, then the profile's in the
        AWS config file (an endpoint in its `services` section, a region), as botocore finds them; a setting
        given in both, differently, is said once in the log (the storage options win)."""
        import botocore.session

        client_kwargs = options.get("client_kwargs", {})
        profile = options.get("profile")  # else botocore takes AWS_PROFILE itself, in every client alike
        _explicit_or_environment(url, "profile", profile, environ, ("AWS_PROFILE",))
        session = botocore.session.Session(profile=profile)
        explicit_endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
        endpoint = _explicit_or_environment(url, "endpoint_url", explicit_endpoint, environ,
                                            ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
        if not explicit_endpoint and session.get_config_variable("ignore_configured_endpoint_urls"):
            endpoint = None
        elif endpoint is None:
            endpoint = _config_file_endpoint(session)
        region = _explicit_or_environment(url, "client_kwargs.region_name", client_kwargs.get("region_name"),
                                          environ, ("AWS_REGION", "AWS_DEFAULT_REGION"))
        region = region or session.get_config_variable("region")
        if options.get("key") and environ.get("AWS_ACCESS_KEY_ID"):
            _say_once(f"{url}: storage_options' key and secret win over AWS_ACCESS_KEY_ID from the environment")
        return cls(endpoint_url=endpoint, region=region or ("us-east-1" if endpoint else None),
                   key=options.get("key"), secret=options.get("secret"), token=options.get("token"),
                   profile=profile, anon=bool(options.get("anon")))

    def s3fs_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The user's storage options with these settings in place of theirs (and of the environment's)."""
        merged = {k: v for k, v in options.items() if k not in _SETTINGS_OPTIONS}
        client_kwargs = {k: v for k, v in options.get("client_kwargs", {}).items() if k not in _SETTINGS_CLIENT_KWARGS}
        if self.region:
            client_kwargs["region_name"] = self.region
        if client_kwargs:
            merged["client_kwargs"] = client_kwargs
        named = {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret, "token": self.token,
                 "profile": self.profile}
        merged.update({k: v for k, v in named.items() if v is not None})
        if self.anon:
            merged["anon"] = True
        return merged


def _explicit_or_environment(url: str, option: str, explicit: str | None, environ: Mapping[str, str],
                             variables: tuple[str, ...]) -> str | None:
    """The explicit setting, else the first of the environment's `variables` that is set; both, and different,
    is said once in the log."""
    found = next(((name, environ[name]) for name in variables if environ.get(name)), None)
    if explicit and found and found[1] != explicit:
        _say_once(f"{url}: storage_options' {option} {explicit} wins over {found[0]}={found[1]} from the "
                  "environment; unset one of them to silence this")
    return explicit or (found[1] if found else None)


def _config_file_endpoint(session: Any) -> str | None:
    """The S3 endpoint the profile's config names (its `services` section's, else its own), as botocore reads it."""
    import botocore.exceptions

    try:
        scoped = session.get_scoped_config()
    except botocore.exceptions.ProfileNotFound:  # s3fs says so, naming the profile, on its first request
        return None
    services = session.full_config.get("services", {}).get(scoped.get("services", ""), {})
    return services.get("s3", {}).get("endpoint_url") or scoped.get("endpoint_url")


_said: set[str] = set()


def _say_once(message: str) -> None:
    """A warning once per process, and only in the process that opened the store: its worker processes
    inherit both settings and resolve them the same way."""
    if message not in _said and multiprocessing.parent_process() is None:
        _said.add(message)
        log.warning(message)


class S3Store(FsspecStore):
    """An FsspecStore for s3:// whose range reads (`get_ranges`, `get_large`) go through obstore when it can.

    A whole-object `get` (metadata, one small request) stays on s3fs, so that a trainer's main
    process can open a store without starting obstore, and its forked DataLoader workers read with it.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 16,
                 retry: RetryPolicy = DEFAULT_RETRY, use_obstore: bool = True) -> None:
        self.settings = S3Settings.resolve(url.rstrip("/"), storage_options or {})
        super().__init__(url, self.settings.s3fs_options(storage_options or {}), concurrency=concurrency, retry=retry)
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
        """An obstore client with every setting explicit: none of them taken from the environment by obstore."""
        from obstore.store import S3Store as ObstoreS3Store

        settings = self.settings
        bucket, _, prefix = self.url.split("://", 1)[1].partition("/")
        self._client_obstore_prefix = prefix.rstrip("/")
        config: dict[str, Any] = {"skip_signature": settings.anon}
        if settings.endpoint_url:  # AWS_ENDPOINT_URL_S3 in the environment would override `endpoint` alone
            config.update(endpoint=settings.endpoint_url, aws_endpoint_url_s3=settings.endpoint_url)
        if not settings.anon:  # a provider, so that no key, secret or session token comes from the environment
            config["credential_provider"] = (_StaticCredentials(settings) if settings.key
                                             else _BotocoreCredentials(settings.profile))
        endpoint, timeout = settings.endpoint_url, timedelta(seconds=self.retry.timeout)
        return ObstoreS3Store(
            bucket, region=settings.region or self._bucket_region(bucket),
            client_options={"allow_http": bool(endpoint and endpoint.startswith("http://")),
                            "pool_max_idle_per_host": str(self.concurrency),
                            "connect_timeout": timeout, "read_timeout": timeout},  # no answer: fails in `timeout`
            retry_config={"max_retries": 0, "retry_timeout": timedelta(minutes=3), "backoff": {  # ours retry, counted
                "init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2.0}},
            **config,
        )

    def _bucket_region(self, bucket: str) -> str:
        """The bucket's region, asked through s3fs (which finds it the way boto does) when none is configured."""
        head = self._call("", "call_s3", "head_bucket", Bucket=bucket)
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
    return set(options) <= _OBSTORE_OPTIONS and set(options.get("client_kwargs", {})) <= _SETTINGS_CLIENT_KWARGS


class _StaticCredentials:
    """obstore's credential provider for the key and secret in the storage options (they never expire)."""

    def __init__(self, settings: S3Settings) -> None:
        self._credential = {"access_key_id": settings.key, "secret_access_key": settings.secret,
                            "token": settings.token, "expires_at": None}

    def __call__(self) -> dict[str, Any]:
        return self._credential


class _BotocoreCredentials:
    """obstore's credential provider fed by botocore's chain (what s3fs uses), refreshed as botocore refreshes."""

    def __init__(self, profile: str | None) -> None:
        import botocore.session

        self._credentials = botocore.session.Session(profile=profile).get_credentials()

    def __call__(self) -> dict[str, Any]:
        if self._credentials is None:
            raise PermissionError("no AWS credentials found (environment, ~/.aws files, profile or instance role); "
                                  "pass key/secret in storage_options, or anon=True for a public bucket")
        frozen = self._credentials.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5)}
