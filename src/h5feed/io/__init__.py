"""Object I/O for stores and sources anywhere: local folders, s3://, gs://, az://, https://, chained URLs.

One small interface (`ObjectStore`), three backends (`LocalStore`, `FsspecStore`, `S3Store`), a
node-local cache (`CachedStore` over a `NodeCache`), retries that count, and errors that name the
object.  `open_url` picks the backend from the URL.
"""

from h5feed.io.cache import CachedObject, CachedStore, CacheState, NodeCache, cache_state
from h5feed.io.fsspec_store import FsspecStore
from h5feed.io.local import LocalStore
from h5feed.io.objects import (
    PART_BYTES,
    AccessDenied,
    Buffer,
    IOCounters,
    IOStats,
    ObjectError,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectUnavailable,
    Range,
    TransferMismatch,
    part_ranges,
    process_stats,
)
from h5feed.io.retry import RetryPolicy
from h5feed.io.s3 import S3Settings, S3Store
from h5feed.io.urls import is_remote, open_url, parse_storage_options

__all__ = [
    "PART_BYTES", "AccessDenied", "Buffer", "CacheState", "CachedObject", "CachedStore", "FsspecStore", "IOCounters",
    "IOStats", "LocalStore", "NodeCache", "ObjectError", "ObjectInfo", "ObjectNotFound", "ObjectStore", "ObjectUnavailable",
    "Range", "RetryPolicy", "S3Settings", "S3Store", "TransferMismatch", "cache_state", "is_remote", "open_url",
    "parse_storage_options", "part_ranges", "process_stats",
]
