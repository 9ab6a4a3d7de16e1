"""From what a user types (a path, a URL, `--storage-option KEY=VALUE`) to an ObjectStore."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from h5feed.io.cache import CachedStore, NodeCache
from h5feed.io.fsspec_store import FsspecStore, protocol_of
from h5feed.io.local import LocalStore
from h5feed.io.objects import ObjectStore
from h5feed.io.retry import DEFAULT_RETRY, RetryPolicy
from h5feed.io.s3 import S3Store


def is_remote(url: str | os.PathLike[str]) -> bool:
    """True for anything but a local path or a file:// URL."""
    return protocol_of(os.fspath(url)) not in ("file", "local")


def open_url(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    concurrency: int = 16,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> ObjectStore:
    """The objects under `url`, keyed relative to it.

    A local path or file:// URL is a LocalStore (the POSIX fast path; `storage_options` do not apply);
    s3:// an S3Store (s3fs, reads through obstore where it can); anything else fsspec reaches
    (gs://, az://, https:// read-only, chained URLs) an FsspecStore.  `concurrency` bounds the
    requests one call keeps in flight and sizes the connection pool.  With `cache_dir`, reads go
    through the node-local cache there (`cache_limit` bytes, LRU); without it nothing is written locally.
    """
    text = os.fspath(url)
    protocol = protocol_of(text)
    store: ObjectStore
    if protocol in ("file", "local"):
        store = LocalStore(unquote(text.split("://", 1)[1]) if "://" in text else text)
    elif protocol in ("s3", "s3a"):
        store = S3Store(text, storage_options, concurrency=concurrency, retry=retry)
    else:
        store = FsspecStore(text, storage_options, concurrency=concurrency, retry=retry)
    if cache_dir is not None:
        store = CachedStore(store, NodeCache(cache_dir, cache_limit))
    return store


def parse_storage_options(pairs: Iterable[str]) -> dict[str, Any]:
    """`--storage-option KEY=VALUE` pairs as fsspec storage options: VALUE is JSON when it parses
    (true, 3, "x", {...}) and a string otherwise; a dotted KEY nests (client_kwargs.region_name=...)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = options
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return options
