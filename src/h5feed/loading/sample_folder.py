"""A folder of sample files given where their store was meant: the loaders and the CLI say what it holds, and the
`h5feed convert` that makes a store of it.

Why here and not in the store: a loader pointed at what `h5feed convert` reads (the folder an extraction wrote) is
the commonest way to miss the store, and the fix is one command.  Naming the folder's format takes the input
formats (`h5feed.formats`), which build on the store's layout; the store knows only stores, so it raises
`NotAStoreError`, and whoever was handed the folder explains it here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from h5feed.errors import NotAStoreError, SourceError, StoreError
from h5feed.formats import detect_format
from h5feed.store import Store


def explained(error: NotAStoreError) -> StoreError:
    """`error`, or, when the local folder it names holds sample files of a known format, the error that names them
    and the command that converts them into a store."""
    location = Path(error.path)
    if not location.is_dir():  # missing, or a bucket's URL
        return error
    try:
        source = detect_format(location)
    except (SourceError, OSError):  # no sample files of a known format either
        return error
    return NotAStoreError(location, f"a folder of {source.name} sample files ({source.what}), not an h5feed store: "
                                    f"convert them into one with `h5feed convert {location} DST`, then read DST")


def open_or_explain(location: str | os.PathLike[str], **store_options: Any) -> Store:
    """`Store(location, **store_options)`, a folder of sample files named for what it is (`explained`)."""
    try:
        return Store(location, **store_options)
    except NotAStoreError as exc:
        raise explained(exc) from None
