"""Reading a finished store: open it (its index checked), and decode a sample's rows, checked, into given memory.

zarr-python describes the store and reads its small index; the hot path finds
the shard (or chunk) files itself, maps them, checks every inner chunk's crc32c
and decodes it with numcodecs straight into the caller's buffer.  No byte that
fails its checksum is ever decoded into a tensor a trainer sees: the read
raises `CorruptSampleError` naming the sample, its source file and the object.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numcodecs import blosc

from h5feed.errors import CorruptSampleError, StoreError
from h5feed.store.buffers import Allocator, plain_allocator
from h5feed.store.layout import (
    CHECKSUMMED,
    CRC_BYTES,
    EMPTY,
    HIDDEN_ARRAYS,
    check_crc32c,
    crc32c,
    decode_shard_index,
    object_key,
    read_info,
    shard_index_nbytes,
)

log = logging.getLogger(__name__)

# Read a mapped file's pages in one go (Linux), rather than one page fault at a time.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


@dataclass
class RawSample:
    """One sample's tensors as stored: hidden states in their logical dtype, views of one buffer each."""

    input_ids: torch.Tensor  # int64 [t]
    loss_mask: torch.Tensor  # int64 [t]
    aux_hidden_states: torch.Tensor  # [t, K*H]
    last_hidden_state: torch.Tensor  # [t, H]
    num_tokens: int  # tokens of the whole sample (t may be fewer when truncated)
    has_loss_mask: bool


@dataclass
class ReadStats:
    """What reads cost: bytes from storage, bytes delivered, seconds in I/O and in checking + decoding.

    `Store` reports through the three `add_*` methods, which `metrics.WorkerCounters`
    implements too (in shared memory, thread-safe).
    """

    bytes_read: int = 0
    bytes_delivered: int = 0
    read_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add_read(self, nbytes: int, seconds: float) -> None:
        self.bytes_read += nbytes
        self.read_seconds += seconds

    def add_decode(self, seconds: float) -> None:
        self.decode_seconds += seconds

    def add_delivered(self, nbytes: int) -> None:
        self.bytes_delivered += nbytes


class Store:
    """A finished h5feed store, opened for reading (format 2, or format 1 with per-sample checksums).

    Cheap to pickle (only the path and the number of samples travel), so DataLoader
    workers under fork, spawn or forkserver each open their own files lazily.
    `checked=False` skips the checksum checks: only for measuring what they cost,
    never for training.

    The index is read once, here: the `num_samples` the store's attributes publish
    (or the first `num_samples`, a snapshot).  A store can grow while it is open
    (`h5feed convert` appends new samples after the last), and this object, and its
    pickled copies, keep the samples they saw at opening.
    """

    def __init__(self, path: str | os.PathLike[str], *, checked: bool = True, num_samples: int | None = None) -> None:
        self.path = Path(path)
        self.checked = checked
        self.info = read_info(self.path)
        if self.info.status != "complete":
            raise StoreError(
                self.path,
                "conversion has not finished (status "
                f"{self.info.status!r}); run the same `h5feed convert` command again to resume it",
            )
        if num_samples is not None and not 0 <= num_samples <= self.info.num_samples:
            raise StoreError(self.path, f"holds {self.info.num_samples} samples, not the {num_samples} asked for")
        self._load_index(self.info.num_samples if num_samples is None else num_samples)
        self._check_index()
        self._compressed = self.info.codec.get("name") != "none"
        self._scratch = threading.local()
        self._warned_unchecked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "checked": self.checked, "num_samples": len(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], checked=state["checked"], num_samples=state.get("num_samples"))  # type: ignore[misc]

    # --- the index -----------------------------------------------------------------------------
    def _load_index(self, n: int) -> None:
        """The first n rows of each index column: the columns may already hold an append's rows that
        the attributes, read before them, do not publish yet."""
        import zarr

        try:
            group = zarr.open_group(self.path, mode="r")
            index = group["index"]
            self.sample_starts = np.asarray(index["sample_start"][:n], dtype=np.int64)
            self.sample_lengths = np.asarray(index["sample_length"][:n], dtype=np.int64)
            self.source_paths: list[str] = [str(p) for p in index["source_path"][:n]]
            self.source_indices = np.asarray(index["source_index"][:n], dtype=np.int64)
            self.checksums = np.asarray(index["checksum"][:n], dtype=np.uint32)
            self.has_loss_mask = np.asarray(index["has_loss_mask"][:n], dtype=bool)
            self.total_rows = int(group["aux_hidden_states"].shape[0])
        except Exception as exc:  # missing arrays, failed checksums, unreadable metadata
            raise StoreError(self.path, f"the sample index is missing or damaged ({exc!r}); {_REBUILD_HINT}") from exc
        if len(self.sample_lengths) != n:
            raise StoreError(self.path, f"the sample index is damaged: it holds {len(self.sample_lengths)} samples, "
                             f"fewer than the {n} the store's attributes publish; {_REBUILD_HINT}")

    def _check_index(self) -> None:
        """Refuse an index that could hand out another sample's rows: starts aligned and increasing,
        lengths positive, no two samples overlapping, all inside the arrays."""
        n = len(self.sample_lengths)
        columns = (self.sample_starts, self.source_paths, self.source_indices, self.checksums, self.has_loss_mask)
        if any(len(c) != n for c in columns):
            raise StoreError(self.path, f"the sample index is damaged: its columns differ in length; {_REBUILD_HINT}")
        align = self.info.object_tokens
        ends = self.sample_starts + -(-self.sample_lengths // align) * align
        problems = (
            (self.sample_lengths <= 0, "has no tokens"),
            (self.sample_starts % align != 0, f"does not start on a multiple of {align} rows"),
            (self.sample_starts < 0, "starts before the first row"),
            (ends > self.total_rows, f"ends past the arrays' {self.total_rows} rows"),
            (np.r_[False, self.sample_starts[1:] < ends[:-1]], "overlaps the sample before it"),
        )
        for bad, what in problems:
            if bad.any():
                i = int(np.argmax(bad))
                raise StoreError(
                    self.path, f"the sample index is damaged: sample {i} (start {int(self.sample_starts[i])}, "
                    f"{int(self.sample_lengths[i])} tokens) {what}; {_REBUILD_HINT}"
                )

    def __len__(self) -> int:
        return len(self.sample_lengths)

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def num_aux_layers(self) -> int:
        return self.info.num_aux_layers

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's tensors (aux, last, input_id, loss-mask value), uncompressed."""
        return sum(self.info.row_nbytes(name) for name in CHECKSUMMED)

    def _tokens_to_read(self, i: int, max_tokens: int | None) -> int:
        n = int(self.sample_lengths[i])
        return n if max_tokens is None else min(n, max_tokens)

    # --- reading -------------------------------------------------------------------------------
    def read_sample(
        self,
        i: int,
        max_tokens: int | None = None,
        *,
        allocate: Allocator = plain_allocator,
        stats: ReadStats | None = None,
        read_ahead: bool = True,
    ) -> RawSample:
        """The first `max_tokens` tokens (all when None) of sample i, checked, touching only their chunks.

        `read_ahead=False` when the caller already asked for them (`will_need`), as the stream does.
        Buffers are rounded up to whole chunks, so every chunk decodes in place (no scratch copy).
        """
        self._check_sample(i)
        stats = stats if stats is not None else ReadStats()
        t = self._tokens_to_read(i, max_tokens)
        if read_ahead:
            self.will_need(i, max_tokens)
        rows = min(-(-t // self.info.chunk_tokens) * self.info.chunk_tokens, self._padded_length(i))
        arrays = {}
        for name in CHECKSUMMED:
            width = self.info.width(name)
            buffer = allocate((rows, width) if name in HIDDEN_ARRAYS else (rows,), self.info.storage_dtype(name))
            self._read_rows(i, name, 0, rows, buffer, stats, delivered=t)
            arrays[name] = buffer[:t]
        dtype = self.info.torch_dtype
        return RawSample(
            input_ids=arrays["input_ids"],
            loss_mask=arrays["loss_mask"],
            aux_hidden_states=arrays["aux_hidden_states"].view(dtype),
            last_hidden_state=arrays["last_hidden_states"].view(dtype),
            num_tokens=int(self.sample_lengths[i]),
            has_loss_mask=bool(self.has_loss_mask[i]),
        )

    def read_rows_into(
        self, i: int, array: str, start: int, stop: int, out: torch.Tensor, stats: ReadStats | None = None
    ) -> None:
        """Decode rows [start, stop) of sample i's `array` into `out`, checked.

        `out` is contiguous, of shape [stop - start, width] (hidden arrays, in the storage dtype: uint16
        bits for bf16) or [stop - start] (int64 ids and masks): for example a sample's place in a
        collated batch.  Whole chunks decode straight into `out`; a chunk cut by `start` or `stop`
        decodes into a scratch buffer first.
        """
        self._check_sample(i)
        if array not in CHECKSUMMED:
            raise ValueError(f"unknown array {array!r}: one of {', '.join(CHECKSUMMED)}")
        if not 0 <= start <= stop <= int(self.sample_lengths[i]):
            raise IndexError(f"rows [{start}, {stop}) out of range for sample {i} of {int(self.sample_lengths[i])} tokens")
        self._read_rows(i, array, start, stop, out, stats if stats is not None else ReadStats(), delivered=stop - start)

    def will_need(self, i: int, max_tokens: int | None = None) -> None:
        """Ask the kernel to start reading sample i's objects now, without waiting for them.

        From a cold cache this lets the disk work on later objects (or on the next
        sample) while this thread decodes; on cached files it costs microseconds.
        """
        rows = self._tokens_to_read(i, max_tokens)
        for name in CHECKSUMMED:
            for block in self._blocks(i, 0, rows):
                read_ahead(self.path / object_key(self.info, name, block))

    # --- internals -----------------------------------------------------------------------------
    def _check_sample(self, i: int) -> None:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")

    def _padded_length(self, i: int) -> int:
        c = self.info.chunk_tokens
        return -(-int(self.sample_lengths[i]) // c) * c

    def _blocks(self, i: int, start: int, stop: int) -> range:
        """The objects (shards in format 2, chunks in format 1) holding rows [start, stop) of sample i."""
        size = self.info.object_tokens
        first = int(self.sample_starts[i]) // size
        return range(first + start // size, first + max(1, math.ceil(stop / size)))

    def _read_rows(
        self, i: int, name: str, start: int, stop: int, out: torch.Tensor, stats: ReadStats, delivered: int
    ) -> None:
        row_nbytes = self.info.row_nbytes(name)
        if not out.is_contiguous() or out.numel() * out.element_size() != (stop - start) * row_nbytes:
            raise ValueError(f"out must be a contiguous buffer of {stop - start} rows of {name}")
        dest = out.view(torch.uint8).numpy().reshape(stop - start, row_nbytes) if stop > start else None
        c = self.info.chunk_tokens
        whole = start == 0 and delivered == int(self.sample_lengths[i])
        try:
            for chunk, frame in self._frames(i, name, range(start // c, -(-stop // c)), stats):
                t0 = time.perf_counter()
                lo, hi = max(start, chunk * c), min(stop, (chunk + 1) * c)
                if lo == chunk * c and hi == (chunk + 1) * c:  # the whole chunk: decode in place
                    self._decode(frame, dest[lo - start : hi - start].reshape(-1))
                else:
                    scratch = self._scratch_buffer(c * row_nbytes)
                    self._decode(frame, scratch)
                    rows = scratch.reshape(c, row_nbytes)
                    dest[lo - start : hi - start] = rows[lo - chunk * c : hi - chunk * c]
                stats.add_decode(time.perf_counter() - t0)
        except CorruptSampleError:
            raise
        except (ValueError, RuntimeError, OSError) as exc:  # numcodecs and checksums raise these on bad bytes
            raise self._corrupt(i, getattr(exc, "object_path", self.path), str(exc)) from exc
        if not self.info.sharded and whole and self.checked:
            self._check_sample_checksum(i, name, dest, delivered)
        elif not self.info.sharded and not self._warned_unchecked:
            self._warned_unchecked = True
            log.warning("%s: a format-1 store can only check whole samples; reads of part of a sample are "
                        "unchecked (reconvert it with `h5feed convert` to format 2)", self.path)
        stats.add_delivered(delivered * row_nbytes)

    def _frames(self, i: int, name: str, chunks: range, stats: ReadStats) -> Iterator[tuple[int, memoryview]]:
        """(chunk of the sample, its encoded bytes without the checksum) for each chunk, checked.

        A frame is a view of a mapped file, valid until the next one is yielded."""
        info = self.info
        per_object = info.chunks_per_shard if info.sharded else 1
        first_object = int(self.sample_starts[i]) // info.object_tokens
        present = self._padded_length(i) // info.chunk_tokens  # chunks that hold rows of the sample
        for j in range(chunks.start // per_object, -(-chunks.stop // per_object)):
            path = self.path / object_key(info, name, first_object + j)
            wanted = [k for k in chunks if k // per_object == j]
            t0 = time.perf_counter()
            with _mapped(path, populate=len(wanted) == min(per_object, present - j * per_object)) as view:
                if not info.sharded:
                    stats.add_read(len(view), time.perf_counter() - t0)
                    yield wanted[0], view
                    continue
                index = self._shard_index(view, path)
                stats.add_read(shard_index_nbytes(per_object), time.perf_counter() - t0)
                for k in wanted:
                    offset, length = (int(x) for x in index[k % per_object])
                    if offset == EMPTY:
                        raise _object_error(path, f"inner chunk {k % per_object} is missing from the shard")
                    stats.add_read(length, 0.0)
                    with view[offset : offset + length] as encoded, encoded[:-CRC_BYTES] as frame:
                        if self.checked:
                            t1 = time.perf_counter()
                            try:
                                check_crc32c(frame, bytes(encoded[-CRC_BYTES:]), f"inner chunk {k % per_object}")
                            except ValueError as exc:
                                raise _object_error(path, str(exc)) from None
                            stats.add_decode(time.perf_counter() - t1)
                        yield k, frame

    def _shard_index(self, view: memoryview, path: Path) -> np.ndarray:
        n = self.info.chunks_per_shard
        size = len(view)
        tail = bytes(view[max(0, size - shard_index_nbytes(n)) :])  # small: a copy keeps no view of the map
        try:
            return decode_shard_index(tail, n, size)
        except ValueError as exc:
            raise _object_error(path, str(exc)) from None

    def _decode(self, frame: memoryview, out: np.ndarray) -> None:
        """Decode one chunk's frame into `out` (its bytes), refusing a frame of another size."""
        if not self._compressed:
            if len(frame) != out.nbytes:
                raise ValueError(f"chunk holds {len(frame)} bytes, expected {out.nbytes}")
            out[:] = np.frombuffer(frame, dtype=np.uint8)
            return
        if len(frame) < _BLOSC_HEADER.size:
            raise ValueError(f"chunk of {len(frame)} bytes is too short for a Blosc frame")
        _, _, _, _, nbytes, _, cbytes = _BLOSC_HEADER.unpack_from(frame)
        if nbytes != out.nbytes or cbytes != len(frame):
            raise ValueError(f"Blosc frame of {cbytes} bytes decoding to {nbytes}, expected {len(frame)} and {out.nbytes}")
        blosc.decompress(frame, out)

    def _scratch_buffer(self, nbytes: int) -> np.ndarray:
        """A per-thread buffer for chunks only partly wanted (reused: fresh pages cost page faults)."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]

    def _check_sample_checksum(self, i: int, name: str, dest: np.ndarray, tokens: int) -> None:
        """Format 1: crc32c of the sample's decoded rows against the one recorded at conversion."""
        got = crc32c(dest[:tokens])
        want = int(self.checksums[i][CHECKSUMMED.index(name)])
        if got != want:
            raise self._corrupt(i, self.path / name, f"{name} fails its checksum (crc32c {got:#010x}, recorded {want:#010x})")

    def _corrupt(self, i: int, path: Path, problem: str) -> CorruptSampleError:
        return CorruptSampleError(path, f"{problem}; the store is damaged: run `h5feed verify {self.path}`", i,
                                  self.source_paths[i])


_REBUILD_HINT = "run the `h5feed convert` command that made the store again to rebuild the index"


def _object_error(path: Path, problem: str) -> ValueError:
    exc = ValueError(problem)
    exc.object_path = path  # type: ignore[attr-defined]
    return exc


@contextlib.contextmanager
def _mapped(path: Path, populate: bool) -> Iterator[memoryview]:
    """A read-only view of a whole file, mapped (populated in one go when all of it is wanted)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _object_error(path, "is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise _object_error(path, "is empty")
        data = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        with memoryview(data) as view:
            yield view
    finally:
        try:
            data.close()
        except BufferError:  # a traceback still holds a view of it: the map closes when that is collected
            pass


def read_ahead(path: Path) -> None:
    """Ask the kernel to start reading `path` into the page cache, without waiting for it.
    A missing file is left to the read that follows to report."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
