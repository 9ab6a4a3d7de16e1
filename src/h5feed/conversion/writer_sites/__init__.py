"""Where an `open_writer` writer's store can live: a local folder or a bucket (`WriterSite`, one module each)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from h5feed.conversion.writer_sites.base import WriterSite
from h5feed.conversion.writer_sites.bucket import BucketSite
from h5feed.conversion.writer_sites.local import LocalSite
from h5feed.errors import StoreError
from h5feed.io import FsspecStore, is_remote, open_url
from h5feed.store.opening import local_path

__all__ = ["BucketSite", "LocalSite", "WriterSite", "open_site"]


def open_site(location: str | os.PathLike[str], writer: str | None, storage_options: Mapping[str, Any] | None,
              staging_dir: str | os.PathLike[str] | None) -> WriterSite:
    """The site of the store at `location`: a local path, or a URL fsspec writes to (s3://, gs://, ...)."""
    if not is_remote(location):
        return LocalSite(local_path(location))
    objects = open_url(os.fspath(location).rstrip("/"), storage_options)
    if not isinstance(objects, FsspecStore) or objects.read_only:
        raise StoreError(location, "cannot be written: a writer's store is a local folder or a bucket (s3://, gs://, "
                         "az://, ...)")
    return BucketSite(objects, staging_dir, writer)
