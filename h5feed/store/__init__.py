"""The h5feed store: its on-disk layout, the reader of one sample, and decode buffers."""

from h5feed.store.reader import *  # noqa: F403
from h5feed.store.reader import _storage_torch_dtype  # noqa: F401
