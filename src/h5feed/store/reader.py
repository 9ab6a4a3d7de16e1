"""Reading a finished store: open it (its index checked), and decode a sample's rows, checked, into given memory.

zarr-python describes the store and reads its small index; the hot path finds
the shard (or chunk) objects itself, through an object source (`sources`: mapped
local files, or bytes fetched from a bucket, directly or through the node cache),
checks every inner chunk's crc32c and decodes it with numcodecs straight into the
caller's buffer.  No byte that fails its checksum is ever decoded into a tensor a
trainer sees.  Bytes that fail are read once more, fresh (they may have been damaged
on their way: a new request, a new download into the node cache, the file mapped
again); when those fail too, the read raises `CorruptSampleError` naming the sample,
its source file and the object.  A read from a bucket gives up at its deadline
(`read_deadline`) with an `ObjectUnavailable` that says so.

The parts: `opening` (the location, the attributes, the object source), `index` (the
sample index, read and checked), `chunks` (one object's chunks checked and decoded),
`damage` (damaged metadata in words), `read_results` (what a read returns and costs);
this module is the `Store` that joins them, sample by sample.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h5feed.errors import CorruptSampleError, StoreError
from h5feed.io import IOCounters, ObjectStore, is_remote, open_url
from h5feed.store.buffers import Allocator, plain_allocator
from h5feed.store.chunks import ChunkDecoder
from h5feed.store.damage import sizes_claimed
from h5feed.store.format import HIDDEN_SCALES, TOKEN_ARRAYS
from h5feed.store.index import SampleIndex
from h5feed.store.layout import (
    Commit,
    IndexDigest,
    crc32c,
    edited_hint,
    object_key,
    read_info,
)
from h5feed.store.opening import local_path, object_source, read_local_info, unfinished_hint
from h5feed.store.read_results import RawSample, ReadStats
from h5feed.store.sources import DamagedObject, Deadline, zarr_store

log = logging.getLogger(__name__)
READ_DEADLINE = 300.0  # seconds a sample's read from a bucket may take, retries included, before it is given up


class Store:
    """A finished h5feed store, opened for reading (format 2, or format 1 with per-sample checksums).

    `location` is a local path or an fsspec URL (s3://, gs://, az://, https://, file://, chained);
    `storage_options` reach the URL's fsspec backend (credentials, endpoint, ...), and with
    `cache_dir` a remote store's objects go through the node-local cache there (`cache_limit`
    bytes, least recently used evicted); local stores are read in place and need neither.

    Cheap to pickle (only the location, options and number of samples travel), so DataLoader
    workers under fork, spawn or forkserver each open their own files or clients lazily.
    `checked=False` skips the checksum checks: only for measuring what they cost, never for training.
    `read_deadline` bounds the seconds one read of a sample from a bucket may take, all its requests,
    retries and cache downloads included (None: no bound).

    The index is read once, here: the `num_samples` the store's attributes publish (or the first
    `num_samples`, a snapshot).  A store can grow while it is open (`h5feed convert` appends new
    samples after the last), and this object, and its pickled copies, keep the samples they saw.
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        checked: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        num_samples: int | None = None,
        read_deadline: float | None = READ_DEADLINE,
    ) -> None:
        self.checked = checked
        self.read_deadline = read_deadline
        self.storage_options = dict(storage_options or {})
        self.cache_dir, self.cache_limit = cache_dir, cache_limit
        self.remote = is_remote(location)
        self._objects: ObjectStore | None = None
        if self.remote:
            self.path: Path | str = os.fspath(location).rstrip("/")
            self._objects = open_url(self.path, self.storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
            self.info = read_info(self._objects)
        else:
            self.path = local_path(location)
            self.info = read_local_info(self.path)
        if self.info.status != "complete":
            raise StoreError(self.path, f"conversion has not finished (status {self.info.status!r}); "
                             + unfinished_hint(self.path, self.info, self._objects))
        if num_samples is not None and not 0 <= num_samples <= self.info.num_samples:
            raise StoreError(self.path, f"holds {self.info.num_samples} samples, not the {num_samples} asked for")
        self._open_index(self.info.num_samples if num_samples is None else num_samples)
        self._source = object_source(self.info, self._objects, self.path, self.__dict__.get("_zarr_store"))
        self._chunks = ChunkDecoder(self.info, self._source, checked)
        if len(self) and not self.remote:  # in a bucket it would cost requests at every open; reads check sizes
            self._check_stored_width(int(np.argmax(self.sample_lengths)))
        self._warned_unchecked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"location": self.path, "checked": self.checked, "storage_options": self.storage_options,
                "cache_dir": self.cache_dir, "cache_limit": self.cache_limit, "num_samples": len(self),
                "read_deadline": self.read_deadline}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("location"), **state)  # type: ignore[misc]

    @property
    def io_stats(self) -> IOCounters | None:
        """Where this process counts the store's network requests, retries and cache hits (None: local)."""
        return self._objects.stats if self._objects is not None else None

    @io_stats.setter
    def io_stats(self, counters: IOCounters) -> None:
        if self._objects is not None:
            self._objects.stats = counters

    # --- the index -----------------------------------------------------------------------------
    def zarr_group(self) -> Any:
        """The store as a zarr-python group (read-only): a remote one fetched through h5feed's own clients."""
        import zarr

        if self._objects is None:
            return zarr.open_group(self.path, mode="r")
        if "_zarr_store" not in self.__dict__:  # the index the root names fetched at once, with that root
            root = self._objects.get("zarr.json")
            index = Commit.of_root(json.loads(root)).index
            self._zarr_store = zarr_store(self._objects, {"zarr.json": root}, (f"{index}/",))
        return zarr.open_group(self._zarr_store, mode="r", zarr_format=3)

    def _open_index(self, n: int) -> None:
        """Read the first n rows of the index and check them (`SampleIndex`): nothing is read of a sample before."""
        self.index = SampleIndex.read(self.zarr_group, self.info, self.path, n)
        self.index.check(self.path, self.info.object_tokens)
        self.index.check_digest(self.path, self.info.num_samples)

    @property
    def sample_starts(self) -> np.ndarray:
        """Each sample's first row in the arrays (int64)."""
        return self.index.sample_starts

    @property
    def sample_lengths(self) -> np.ndarray:
        """Each sample's tokens (int64)."""
        return self.index.sample_lengths

    @property
    def source_paths(self) -> list[str]:
        """The file each sample was converted from."""
        return self.index.source_paths

    @property
    def source_indices(self) -> np.ndarray:
        """Each sample's place in its source file (int64)."""
        return self.index.source_indices

    @property
    def checksums(self) -> np.ndarray:
        """Each sample's crc32c of each array (uint32 [n, arrays]), as recorded at conversion."""
        return self.index.checksums

    @property
    def has_loss_mask(self) -> np.ndarray:
        """Whether each sample's source had a loss mask (bool)."""
        return self.index.has_loss_mask

    @property
    def total_rows(self) -> int:
        """The rows every array holds: no sample ends past them."""
        return self.index.total_rows

    def _check_stored(self, i: int) -> None:
        """In a local store, the file holding sample i's last row exists: checked before buffers are sized from
        the sample's length, which the arrays' metadata alone could inflate (one stat; in a bucket, a missing
        object fails its read, and the buffers are sized then)."""
        last_row = int(self.sample_starts[i]) + int(self.sample_lengths[i]) - 1
        key = object_key(self.info, "aux_hidden_states", last_row // self.info.object_tokens)
        if self._objects is None and not Path(self.path, key).is_file():
            raise self._corrupt(i, self._source.where(key), f"the index gives it {int(self.sample_lengths[i])} "
                                "tokens, but the file that would hold its last row does not exist")

    def _check_stored_width(self, i: int) -> None:
        """Sample i's first chunk of aux_hidden_states holds `chunk_tokens` rows of the width the attributes give
        (its Blosc header's size, or its bytes): hidden_size is bound to the files, not only to the metadata.
        A chunk that fails its own checks (or a shard kept only in a bucket, as a staging copy's) is left for
        its read to report."""
        name = "aux_hidden_states"
        expected = self.info.chunk_tokens * self.info.row_nbytes(name)
        try:
            with contextlib.closing(self._frames(i, name, range(1), ReadStats(), self._deadline(i))) as frames:
                _, frame = next(frames)
                stored = self._chunks.decoded_nbytes(frame)
        except (ValueError, OSError, struct.error):
            return
        if stored != expected:
            where = self._source.where(object_key(self.info, name, int(self.sample_starts[i]) // self.info.object_tokens))
            raise StoreError(self.path, f"the store's attributes ({sizes_claimed(self.info)}) give {name} chunks "
                             f"of {expected} bytes, but the first chunk in {where} holds {stored}; "
                             f"{edited_hint(self.path)}")

    def _check_length(self, i: int, name: str, rows: torch.Tensor) -> None:
        """A token array read whole against its crc32c recorded at conversion, which covers exactly the
        sample's `sample_length` rows: a rewritten length or start fails here, whatever the chunks' own
        checksums say.  8 bytes a token: nothing beside the hidden states."""
        if not (self.checked and self.info.sharded and name in TOKEN_ARRAYS):
            return  # format 1 checks every whole sample's arrays in `_read_rows`
        got = crc32c(rows.numpy())
        want = int(self.checksums[i][self.info.array_names.index(name)])
        if got != want:
            raise self._corrupt(i, self._source.where("index"), f"its {name} of the {int(self.sample_lengths[i])} "
                                f"tokens the index gives it fail the checksum recorded at conversion (crc32c "
                                f"{got:#010x}, recorded {want:#010x}): the index does not describe the stored data")

    def __len__(self) -> int:
        return len(self.sample_lengths)

    def reload(self) -> int:
        """Take up the samples a writer published since the store was opened (`h5feed.open_writer`, or
        `h5feed convert` appending); returns the count now.  Earlier samples stay as they were: the index
        only grows, and a store whose first rows are no longer the ones read (removed, replaced or rewritten
        under its reader) is refused, never read on from another store's rows.  In a bucket, the root is fetched
        again, and the index with it once the root publishes more: shards are never rewritten once a published
        sample is in them, so what was cached stays good."""
        try:
            info = read_info(self._objects if self._objects is not None else self.path)
        except StoreError as exc:
            raise self._replaced(f"its root no longer reads as an h5feed store ({exc.problem})") from None
        if info.num_samples < len(self):
            raise self._replaced(f"it publishes {info.num_samples} samples, fewer than the {len(self)} read")
        if info.status != "complete" or info.num_samples == len(self):
            return len(self)
        sizes = ("hidden_size", "num_aux_layers", "dtype", "chunk_tokens", "shard_tokens", "codec", "precision")
        changed = [name for name in sizes if getattr(info, name) != getattr(self.info, name)]
        if changed:
            raise self._replaced(f"its {', '.join(changed)} changed")
        read = IndexDigest.of(self.index.columns())
        self.info = info
        self.__dict__.pop("_zarr_store", None)  # a bucket's: the index objects as fetched then
        index = SampleIndex.read(self.zarr_group, info, self.path, info.num_samples)
        if IndexDigest.of(index.columns(read.rows)) != read:
            raise self._replaced(f"the first {read.rows} rows of its index are no longer the ones read")
        self.index = index
        index.check(self.path, info.object_tokens)
        index.check_digest(self.path, info.num_samples)
        return len(self)

    def _replaced(self, what: str) -> StoreError:
        return StoreError(self.path, f"was replaced or rewritten while it was read: {what}; its samples read so far "
                          "belong to another store than those that would come next. Open it again (a stream: start "
                          "over, not from a saved position)")

    @property
    def max_sample_tokens(self) -> int:
        """The longest sample's tokens: what a loader sizes its buffers from (never the attributes, which a
        damaged store can inflate).  Checked against the arrays' rows at open and, in a local store, against
        the file that would hold its last row here (`CorruptSampleError` if there is none)."""
        if not len(self):
            return 0
        i = int(np.argmax(self.sample_lengths))
        self._check_stored(i)
        return int(self.sample_lengths[i])

    @property
    def hidden_size(self) -> int:
        """The hidden size, checked at open against the arrays' metadata."""
        return self.info.hidden_size

    @property
    def num_aux_layers(self) -> int:
        return self.info.num_aux_layers

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's tensors (aux, last, input_id, loss-mask value, extras), uncompressed."""
        return sum(self.info.row_nbytes(name) for name in self.info.array_names)

    def _arrays_to_read(self, extras: Collection[str] | None) -> tuple[str, ...]:
        """The core arrays, and the optional ones named in `extras` (None: all of them)."""
        if extras is not None:
            unknown = sorted(set(extras) - set(self.info.extra_arrays))
            if unknown:
                raise ValueError(f"{self.path} holds no optional array {', '.join(map(repr, unknown))} "
                                 f"(it holds: {', '.join(self.info.extra_arrays) or 'none'})")
        return tuple(n for n in self.info.array_names
                     if n not in self.info.extra_arrays or extras is None or n in extras)

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
        extras: Collection[str] | None = None,
    ) -> RawSample:
        """The first `max_tokens` tokens (all when None) of sample i, checked, touching only their chunks.

        `read_ahead=False` when the caller already asked for them (`will_need`), as the stream does.
        `extras` names the optional arrays to read (None: all the store has; () none).
        Buffers are rounded up to whole chunks, so every chunk decodes in place (no scratch copy).
        """
        self._check_sample(i)
        self._check_stored(i)
        stats = stats if stats is not None else ReadStats()
        names = self._arrays_to_read(extras)
        t = self._tokens_to_read(i, max_tokens)
        if read_ahead:
            self.will_need(i, max_tokens, extras=extras)
        rows = min(-(-t // self.info.chunk_tokens) * self.info.chunk_tokens, self._padded_length(i))
        deadline = self._deadline(i)
        arrays = {}
        for name in names:
            width = self.info.width(name)
            buffer = allocate((rows, width) if self.info.is_matrix(name) else (rows,), self.info.storage_dtype(name))
            self._read_rows(i, name, 0, rows, buffer, stats, delivered=t, deadline=deadline)
            arrays[name] = buffer[:t].view(self.info.logical_dtype(name))
            if t == int(self.sample_lengths[i]):
                self._check_length(i, name, arrays[name])
        last = arrays.pop("last_hidden_states", None)
        scales = arrays.pop(HIDDEN_SCALES, None)
        return RawSample(
            input_ids=arrays.pop("input_ids"),
            loss_mask=arrays.pop("loss_mask"),
            aux_hidden_states=arrays.pop("aux_hidden_states"),
            last_hidden_state=last,
            num_tokens=int(self.sample_lengths[i]),
            has_loss_mask=bool(self.has_loss_mask[i]),
            extras=arrays,
            hidden_scales=scales,
        )

    def read_rows_into(
        self, i: int, array: str, start: int, stop: int, out: torch.Tensor, stats: ReadStats | None = None
    ) -> None:
        """Decode rows [start, stop) of sample i's `array` into `out`, checked.

        `out` is contiguous, of shape [stop - start, width] (hidden arrays and wide optional arrays, in the
        storage dtype: uint16 bits for bf16) or [stop - start] (int64 ids and masks): for example a sample's
        place in a collated batch.  Whole chunks decode straight into `out`; a chunk cut by `start` or `stop`
        decodes into a scratch buffer first.
        """
        self._check_sample(i)
        if array not in self.info.array_names:
            raise ValueError(f"unknown array {array!r}: one of {', '.join(self.info.array_names)}")
        if not 0 <= start <= stop <= int(self.sample_lengths[i]):
            raise IndexError(f"rows [{start}, {stop}) out of range for sample {i} of {int(self.sample_lengths[i])} tokens")
        dtype = self.info.storage_dtype(array)
        shape = (stop - start, self.info.width(array)) if self.info.is_matrix(array) else (stop - start,)
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape}, not {out.dtype} {tuple(out.shape)}")
        self._read_rows(i, array, start, stop, out, stats if stats is not None else ReadStats(), delivered=stop - start,
                        deadline=self._deadline(i))
        if start == 0 and stop == int(self.sample_lengths[i]):
            self._check_length(i, array, out)

    def copy_frames_into(
        self, i: int, array: str, stop: int, out: np.ndarray, stats: ReadStats | None = None
    ) -> list[tuple[int, int, int]]:
        """Copy the still-compressed frames of the chunks holding rows [0, stop) of sample i's `array`,
        each checked against its crc32c, back to back into the byte buffer `out`, for decoding
        elsewhere (on the GPU: `h5feed.gpu`).  Returns (chunk, offset in `out`, length) of each.

        Raises `CorruptSampleError` like the reads that decode, and ValueError when `out` is too small.
        An FP8 store's hidden states decode to their FP8 bytes: the numbers are those bytes times their tokens'
        scales (`HIDDEN_SCALES`, copied the same way; `h5feed.store.fp8.dequantize_into`).
        """
        self._check_sample(i)
        if not 0 < stop <= int(self.sample_lengths[i]):
            raise IndexError(f"rows [0, {stop}) out of range for sample {i} of {int(self.sample_lengths[i])} tokens")
        stats = stats if stats is not None else ReadStats()
        placed, position = [], 0
        try:
            for chunk, frame in self._frames(i, array, range(-(-stop // self.info.chunk_tokens)), stats, self._deadline(i)):
                end = position + len(frame)
                if end > out.nbytes:
                    raise _TooSmall(f"out holds {out.nbytes} bytes, the frames need more than {end}")
                out[position:end] = np.frombuffer(frame, dtype=np.uint8)
                placed.append((chunk, position, len(frame)))
                position = end
        except _TooSmall as exc:
            raise ValueError(str(exc)) from None
        except (ValueError, RuntimeError, OSError) as exc:
            raise self._corrupt(i, exc.where if isinstance(exc, DamagedObject) else self.path, str(exc)) from exc
        return placed

    def will_need(self, i: int, max_tokens: int | None = None, *, extras: Collection[str] | None = None) -> None:
        """Start getting sample i's objects now, without waiting for them (`extras` as in `read_sample`).

        A local store asks the kernel to read the files ahead: from a cold cache the disk works
        on later objects (or on the next sample) while this thread decodes; on cached files it
        costs microseconds.  A remote one starts fetching them, concurrently, in this process.
        """
        c = self.info.chunk_tokens
        chunks = range(-(-self._tokens_to_read(i, max_tokens) // c))
        for name in self._arrays_to_read(extras):
            nbytes = c * self.info.row_nbytes(name)
            for key, inner, whole in self._objects_of(i, name, chunks):
                self._source.will_need(key, inner, whole, len(inner) * nbytes)

    def sample_object(self, i: int) -> str:
        """The file or URL of the object that holds the start of sample i's aux hidden states: where a
        reader of the sample spends its time, so a stall report names what to look at."""
        self._check_sample(i)
        key, _, _ = self._objects_of(i, "aux_hidden_states", range(1))[0]
        return str(self._source.where(key))

    def stored_nbytes(self) -> int:
        """Bytes of the arrays' objects (shards, or chunks in format 1) as stored."""
        names = self.info.array_names
        if self._objects is None:
            return sum(f.stat().st_size for name in names for f in (Path(self.path) / name).rglob("*") if f.is_file())
        return sum(size for name in names for size in self._objects.list(f"{name}/").values())

    # --- internals -----------------------------------------------------------------------------
    def _check_sample(self, i: int) -> None:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")

    def _padded_length(self, i: int) -> int:
        c = self.info.chunk_tokens
        return -(-int(self.sample_lengths[i]) // c) * c

    def _objects_of(self, i: int, name: str, chunks: range) -> list[tuple[str, range, bool]]:
        """(key, inner chunks wanted, all its chunks wanted?) of each object holding `chunks` of sample i's `name`."""
        info = self.info
        per_object = info.chunks_per_shard if info.sharded else 1
        first_object = int(self.sample_starts[i]) // info.object_tokens
        present = self._padded_length(i) // info.chunk_tokens  # chunks that hold rows of the sample
        found = []
        for j in range(chunks.start // per_object, -(-chunks.stop // per_object)):
            inner = range(max(chunks.start, j * per_object) - j * per_object,
                          min(chunks.stop, (j + 1) * per_object) - j * per_object)
            whole = len(inner) == min(per_object, present - j * per_object)
            found.append((object_key(info, name, first_object + j), inner, whole))
        return found

    def _deadline(self, i: int) -> Deadline | None:
        """When a read of sample i must be done by (a bucket's; local files have none)."""
        return Deadline.after(i, self.read_deadline) if self.remote and self.read_deadline is not None else None

    def _read_rows(
        self, i: int, name: str, start: int, stop: int, out: torch.Tensor, stats: ReadStats, delivered: int,
        deadline: Deadline | None,
    ) -> None:
        row_nbytes = self.info.row_nbytes(name)
        if not out.is_contiguous() or out.numel() * out.element_size() != (stop - start) * row_nbytes:
            raise ValueError(f"out must be a contiguous buffer of {stop - start} rows of {name}")
        if stop == start:
            return
        dest = out.view(torch.uint8).numpy().reshape(stop - start, row_nbytes)
        c = self.info.chunk_tokens
        whole = start == 0 and delivered == int(self.sample_lengths[i])
        try:
            for chunk, frame in self._frames(i, name, range(start // c, -(-stop // c)), stats, deadline):
                t0 = time.perf_counter()
                lo, hi = max(start, chunk * c), min(stop, (chunk + 1) * c)
                if lo == chunk * c and hi == (chunk + 1) * c:  # the whole chunk: decode in place
                    self._chunks.decode(frame, dest[lo - start : hi - start].reshape(-1))
                else:
                    scratch = self._chunks.scratch(c * row_nbytes)
                    self._chunks.decode(frame, scratch)
                    rows = scratch.reshape(c, row_nbytes)
                    dest[lo - start : hi - start] = rows[lo - chunk * c : hi - chunk * c]
                stats.add_decode(time.perf_counter() - t0)
        except CorruptSampleError:
            raise
        except (ValueError, RuntimeError, OSError) as exc:  # numcodecs and checksums raise these on bad bytes
            raise self._corrupt(i, exc.where if isinstance(exc, DamagedObject) else self.path, str(exc)) from exc
        if not self.info.sharded and whole and self.checked:
            self._check_sample_checksum(i, name, dest, delivered)
        elif not self.info.sharded and not self._warned_unchecked:
            self._warned_unchecked = True
            log.warning("%s: a format-1 store can only check whole samples; reads of part of a sample are "
                        "unchecked (reconvert it with `h5feed convert` to format 2)", self.path)
        stats.add_delivered(delivered * row_nbytes)

    def _frames(
        self, i: int, name: str, chunks: range, stats: ReadStats, deadline: Deadline | None
    ) -> Iterator[tuple[int, memoryview]]:
        """(chunk of the sample, its encoded bytes without the checksum) for each chunk, checked.

        An object whose bytes fail a check is opened once more, fresh (a new request, a new download into
        the node cache, the file mapped again), from the chunk that failed: bytes damaged on their way are
        not damage in the store.  Only when the fresh bytes fail too does the ValueError go on.
        A frame is a view of a mapped file or of fetched bytes, valid until the next one is yielded."""
        if isinstance(stats, IOCounters):  # a loader's counters: the network's figures go there too
            self.io_stats = stats
        per_object = self.info.chunks_per_shard if self.info.sharded else 1
        for j, (key, inner, whole) in enumerate(self._objects_of(i, name, chunks)):
            first = (chunks.start // per_object + j) * per_object  # the sample's chunk number of inner chunk 0
            todo = inner
            for fresh in (False, True):
                try:
                    for k, frame in self._chunks.object_frames(key, todo, whole and todo == inner, stats, fresh, deadline):
                        yield first + k, frame
                        todo = range(k + 1, inner.stop)
                    break
                except ValueError as exc:
                    where = exc.where if isinstance(exc, DamagedObject) else self._source.where(key)
                    if fresh:
                        raise DamagedObject(where, f"{exc}, and again when read afresh") from None
                    log.warning("%s: %s; reading it again", where, exc)
                    if self.io_stats is not None:
                        self.io_stats.add_retry()

    def _check_sample_checksum(self, i: int, name: str, dest: np.ndarray, tokens: int) -> None:
        """Format 1: crc32c of the sample's decoded rows against the one recorded at conversion."""
        got = crc32c(dest[:tokens])
        want = int(self.checksums[i][self.info.array_names.index(name)])
        if got != want:
            raise self._corrupt(i, self._source.where(name), f"{name} fails its checksum (crc32c {got:#010x}, recorded {want:#010x})")

    def _corrupt(self, i: int, path: Path | str, problem: str) -> CorruptSampleError:
        return CorruptSampleError(path, f"{problem}; the store is damaged: run `h5feed verify {self.path}`", i,
                                  self.source_paths[i])


class _TooSmall(Exception):
    """The caller's buffer, not the store, is at fault."""
