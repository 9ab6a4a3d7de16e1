"""Opening a store from its location: the local folder a path or file:// URL names, its attributes, what to say of
one whose writing has not finished, and the object source its reads go through.

Why apart from the reader: what a store is opened from (a folder, a bucket directly or through the node cache) and
what a user is told when it cannot be read yet (a writer still at it, or one to resume) is decided once, when it
is opened; the reader then only reads samples through the source chosen here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from h5feed.errors import StoreError
from h5feed.io import CachedStore, FsspecStore, ObjectStore
from h5feed.store.format import HIDDEN_SCALES, TOKEN_ARRAYS
from h5feed.store.layout import StoreInfo, read_info
from h5feed.store.sources import CachedSource, LocalSource, ObjectSource, RemoteSource, fingerprint
from h5feed.store.writer_state import WRITER_API, WRITER_SOURCE, being_converted, bucket_being_written


def local_path(location: str | os.PathLike[str]) -> Path:
    """A local store's folder, given as a path or a file:// URL."""
    text = os.fspath(location)
    return Path(unquote(text.split("://", 1)[1]) if text.startswith("file://") else text)


def read_local_info(path: Path) -> StoreInfo:
    """The attributes of a local store; one a writer holds before its first sample has none yet: say so."""
    try:
        return read_info(path)
    except StoreError:
        running = being_converted(path)
        if running is None or (path / "zarr.json").is_file():
            raise
        raise StoreError(path, f"has no sample yet; {running}") from None


def unfinished_hint(path: Path | str, info: StoreInfo, objects: ObjectStore | None) -> str:
    """What to say of a store whose writing has not finished: the writer at it now (a local one's, or a bucket
    store's, `objects`), or else how to resume the writer that made it."""
    if objects is None:
        running = being_converted(Path(path))
    else:
        inner = objects.inner if isinstance(objects, CachedStore) else objects
        running = bucket_being_written(inner) if isinstance(inner, FsspecStore) else None
    if running:
        return running
    if info.source_root == WRITER_SOURCE:
        return (f"its writer ({WRITER_API}) let it go before publishing a sample: open_writer on it again "
                "appends after the samples it journaled")
    return "run the same `h5feed convert` command again to resume it"


def object_source(info: StoreInfo, objects: ObjectStore | None, path: Path | str, zarr_store: Any) -> ObjectSource:
    """Where the reads of the store at `path` get its objects: its files (`objects` None), the node cache, or the
    bucket (`zarr_store`: the store's root and index as fetched, which fingerprint a cached store's objects)."""
    max_nbytes = {name: info.max_object_nbytes(name) for name in info.array_names}
    if objects is None:
        return LocalSource(Path(path), max_nbytes)
    per_shard = info.chunks_per_shard if info.sharded else 0
    if isinstance(objects, CachedStore):
        objects.namespace = fingerprint(zarr_store)  # a store rewritten at this URL is cached anew
        return CachedSource(objects, per_shard, max_nbytes)
    small = (*TOKEN_ARRAYS, HIDDEN_SCALES)  # fetched whole
    return RemoteSource(objects, per_shard, small_arrays=small, max_nbytes=max_nbytes)
