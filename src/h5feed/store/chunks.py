"""One object's chunks, checked and decoded: a shard's index, every inner chunk's crc32c, each Blosc frame's sizes.

Why apart from the reader: this is what the reader does to the bytes of one object, whichever sample they belong
to and wherever they came from (`sources`); the reader decides which objects and chunks a sample needs, what to
retry and whom to blame.  Every check of an object's bytes raises `DamagedObject` naming the object (a frame that
decodes to another size than its chunk, a plain ValueError the reader names the store for); no byte that fails is
ever decoded into the caller's buffer.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numcodecs import blosc

from h5feed.store.layout import CRC_BYTES, EMPTY, StoreInfo, decode_shard_index, shard_index_nbytes
from h5feed.store.read_results import ReadStats
from h5feed.store.sources import DamagedObject, Deadline, ObjectSource, check_inner_chunk

BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


class ChunkDecoder:
    """The chunks of a store's objects, from `source`, checked (unless `checked` is False) and decoded."""

    def __init__(self, info: StoreInfo, source: ObjectSource, checked: bool) -> None:
        self.info, self.source, self.checked = info, source, checked
        self.max_chunk_nbytes = max(info.max_chunk_nbytes(name) for name in info.array_names)
        self.compressed = info.codec.compressed
        self._scratch = threading.local()

    def object_frames(
        self, key: str, inner: range, whole: bool, stats: ReadStats, fresh: bool, deadline: Deadline | None
    ) -> Iterator[tuple[int, memoryview]]:
        """(inner chunk, its frame without the checksum) of one object, each checked; ValueError for bytes that
        fail.  A frame is a view of a mapped file or of fetched bytes, valid until the next one is yielded."""
        where = self.source.where(key)
        t0 = time.perf_counter()
        with self.source.open(key, inner, whole, fresh, deadline) as view:
            if not self.info.sharded:
                stats.add_read(view.size, time.perf_counter() - t0)
                with view.span(0, view.size) as frame:
                    yield 0, frame
                return
            per_object = self.info.chunks_per_shard
            index = self._shard_index(view.tail(shard_index_nbytes(per_object)), view.size, where)
            stats.add_read(shard_index_nbytes(per_object), time.perf_counter() - t0)
            for k in inner:
                offset, length = (int(x) for x in index[k])
                if offset == EMPTY:
                    raise DamagedObject(where, f"inner chunk {k} is missing from the shard")
                stats.add_read(length, 0.0)
                with view.span(offset, length) as encoded, encoded[:-CRC_BYTES] as frame:
                    if self.checked:
                        t1 = time.perf_counter()
                        try:
                            check_inner_chunk(encoded, k)
                        except ValueError as exc:
                            raise DamagedObject(where, str(exc)) from None
                        stats.add_decode(time.perf_counter() - t1)
                    yield k, frame

    def _shard_index(self, tail: bytes, size: int, where: str | Path) -> np.ndarray:
        try:
            return decode_shard_index(tail, self.info.chunks_per_shard, size, self.max_chunk_nbytes)
        except ValueError as exc:
            raise DamagedObject(where, str(exc)) from None

    def decoded_nbytes(self, frame: memoryview) -> int:
        """The bytes a frame says it decodes to (its Blosc header's; a frame stored as it is: its own size);
        struct.error for a frame too short to say."""
        return BLOSC_HEADER.unpack_from(frame)[4] if self.compressed else len(frame)

    def decode(self, frame: memoryview, out: np.ndarray) -> None:
        """Decode one chunk's frame into `out` (its bytes), refusing a frame of another size."""
        if not self.compressed:
            if len(frame) != out.nbytes:
                raise ValueError(f"chunk holds {len(frame)} bytes, expected {out.nbytes}")
            out[:] = np.frombuffer(frame, dtype=np.uint8)
            return
        if len(frame) < BLOSC_HEADER.size:
            raise ValueError(f"chunk of {len(frame)} bytes is too short for a Blosc frame")
        _, _, _, _, nbytes, _, cbytes = BLOSC_HEADER.unpack_from(frame)
        if nbytes != out.nbytes or cbytes != len(frame):
            raise ValueError(f"Blosc frame of {cbytes} bytes decoding to {nbytes}, expected {len(frame)} and {out.nbytes}")
        blosc.decompress(frame, out)

    def scratch(self, nbytes: int) -> np.ndarray:
        """A per-thread buffer for chunks only partly wanted (reused: fresh pages cost page faults)."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]
