"""The h5feed store: its format (`format`), its on-disk layout, the checked reader of one sample, and decode buffers."""

from h5feed.store.attributes import ChunkCodec, KeptCompanion, SkippedFile
from h5feed.store.buffers import Allocator, BufferPool, plain_allocator, shared_allocator
from h5feed.store.format import ATTRS_KEY, CHECKSUMMED, HIDDEN_ARRAYS, HIDDEN_SCALES, STORE_FORMAT_VERSION, TOKEN_ARRAYS
from h5feed.store.layout import (
    DEFAULT_CHUNK_TOKENS,
    LastStateNorm,
    StoreInfo,
    checksums,
    chunk_codec,
    chunk_encoder,
    crc32c,
    object_key,
    read_info,
    storage_dtype,
)
from h5feed.store.read_results import RawSample, ReadStats
from h5feed.store.reader import Store
from h5feed.store.sources import read_ahead

__all__ = [
    "ATTRS_KEY",
    "CHECKSUMMED",
    "DEFAULT_CHUNK_TOKENS",
    "HIDDEN_ARRAYS",
    "HIDDEN_SCALES",
    "STORE_FORMAT_VERSION",
    "TOKEN_ARRAYS",
    "Allocator",
    "BufferPool",
    "ChunkCodec",
    "KeptCompanion",
    "LastStateNorm",
    "RawSample",
    "ReadStats",
    "SkippedFile",
    "Store",
    "StoreInfo",
    "checksums",
    "chunk_codec",
    "chunk_encoder",
    "crc32c",
    "object_key",
    "plain_allocator",
    "read_ahead",
    "read_info",
    "shared_allocator",
    "storage_dtype",
]
