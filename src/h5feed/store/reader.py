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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import torch
from numcodecs import blosc

from h5feed.errors import CorruptSampleError, StoreError
from h5feed.io import CachedStore, FsspecStore, IOCounters, ObjectError, ObjectStore, is_remote, open_url
from h5feed.store.buffers import Allocator, plain_allocator
from h5feed.store.format import CRC_BYTES, EMPTY, HIDDEN_SCALES, INDEX_COLUMNS, TOKEN_ARRAYS
from h5feed.store.layout import (
    Commit,
    IndexDigest,
    StoreInfo,
    crc32c,
    decode_shard_index,
    edited_hint,
    index_digest,
    object_key,
    read_info,
    shard_index_nbytes,
)
from h5feed.store.sources import (
    CachedSource,
    Deadline,
    LocalSource,
    ObjectSource,
    RemoteSource,
    check_inner_chunk,
    fingerprint,
    object_error,
    read_ahead,
    zarr_store,
)
from h5feed.store.writer_state import WRITER_API, WRITER_SOURCE, being_converted, bucket_being_written

log = logging.getLogger(__name__)
_BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
READ_DEADLINE = 300.0  # seconds a sample's read from a bucket may take, retries included, before it is given up


@dataclass
class RawSample:
    """One sample's tensors as stored: hidden states in their logical dtype (an FP8 store's: float8_e4m3fn, with
    their scales; `h5feed.store.fp8.dequantized` gives them as read), views of one buffer each."""

    input_ids: torch.Tensor  # int64 [t]
    loss_mask: torch.Tensor  # int64 [t]
    aux_hidden_states: torch.Tensor  # [t, K*H]
    last_hidden_state: torch.Tensor | None  # [t, H]; None when the store holds none (`info.has_last_state`)
    num_tokens: int  # tokens of the whole sample (t may be fewer when truncated)
    has_loss_mask: bool
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the optional arrays read, [t, width] or [t]
    hidden_scales: torch.Tensor | None = None  # an FP8 store's: float32 [t], each token's (`h5feed.store.fp8`)


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


def local_path(location: str | os.PathLike[str]) -> Path:
    """A local store's folder, given as a path or a file:// URL."""
    text = os.fspath(location)
    return Path(unquote(text.split("://", 1)[1]) if text.startswith("file://") else text)


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
            self.info = self._read_local_info()
        if self.info.status != "complete":
            running = self._being_written_in_bucket() if self.remote else being_converted(self.path)
            raise StoreError(self.path, f"conversion has not finished (status {self.info.status!r}); "
                             + (running or self._resume_hint()))
        if num_samples is not None and not 0 <= num_samples <= self.info.num_samples:
            raise StoreError(self.path, f"holds {self.info.num_samples} samples, not the {num_samples} asked for")
        self._load_index(self.info.num_samples if num_samples is None else num_samples)
        self._check_index()
        self._check_index_digest()
        self._max_chunk_nbytes = max(self.info.max_chunk_nbytes(name) for name in self.info.array_names)
        self._source = self._make_source()
        self._compressed = self.info.codec.get("name") != "none"
        if len(self) and not self.remote:  # in a bucket it would cost requests at every open; reads check sizes
            self._check_stored_width(int(np.argmax(self.sample_lengths)))
        self._scratch = threading.local()
        self._warned_unchecked = False

    def _read_local_info(self) -> StoreInfo:
        """The attributes of a local store; one a writer holds before its first sample has none yet: say so."""
        try:
            return read_info(self.path)
        except StoreError:
            running = being_converted(self.path)
            if running is None or (Path(self.path) / "zarr.json").is_file():
                raise
            raise StoreError(self.path, f"has no sample yet; {running}") from None

    def _being_written_in_bucket(self) -> str | None:
        objects = self._objects.inner if isinstance(self._objects, CachedStore) else self._objects
        return bucket_being_written(objects) if isinstance(objects, FsspecStore) else None

    def _resume_hint(self) -> str:
        """What to do with an unfinished store no writer holds: resume the writer that made it."""
        if self.info.source_root == WRITER_SOURCE:
            return (f"its writer ({WRITER_API}) let it go before publishing a sample: open_writer on it again "
                    "appends after the samples it journaled")
        return "run the same `h5feed convert` command again to resume it"

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

    def _load_index(self, n: int) -> None:
        """The first n rows of each index column: the columns may already hold an append's rows that
        the attributes, read before them, do not publish yet.

        Nothing is read or allocated for n rows before the arrays' metadata agrees with the attributes
        and every column's stored chunks hold n rows: a store claiming 2^26 samples is refused at once."""
        try:
            group = self.zarr_group()
            index = group[Commit.of_root({"attributes": group.attrs.asdict()}).index]
            self._recorded_digest = IndexDigest.from_attributes(index.attrs)  # before the rows it may cover
            self.total_rows = self._check_arrays(group)
            self._check_columns(index, n)
            self.sample_starts = np.asarray(index["sample_start"][:n], dtype=np.int64)
            self.sample_lengths = np.asarray(index["sample_length"][:n], dtype=np.int64)
            self.source_paths: list[str] = [str(p) for p in index["source_path"][:n]]
            self.source_indices = np.asarray(index["source_index"][:n], dtype=np.int64)
            self.checksums = np.asarray(index["checksum"][:n], dtype=np.uint32)
            self.has_loss_mask = np.asarray(index["has_loss_mask"][:n], dtype=bool)
        except (ObjectError, StoreError):  # the bucket said no (its error names the object), or a check above
            raise
        except Exception as exc:  # missing arrays, failed checksums, unreadable metadata
            raise StoreError(self.path, f"the sample index is missing or damaged ({exc!r}); {_REBUILD_HINT}") from exc
        if len(self.sample_lengths) != n:
            raise StoreError(self.path, f"the sample index is damaged: it holds {len(self.sample_lengths)} samples, "
                             f"fewer than the {n} the store's attributes publish; {_REBUILD_HINT}")

    def _check_arrays(self, group: Any) -> int:
        """The rows every array holds, once each array's metadata agrees with the attributes (width, dtype,
        shards and chunks).  An array whose metadata zarr cannot parse is left to `h5feed verify`
        (reads do not use it, and check every chunk's decoded size against the attributes)."""
        rows = {}
        for name in self.info.array_names:
            try:
                array = group[name]
            except Exception as exc:
                if name == "aux_hidden_states":  # its rows bound the index: it must open
                    raise StoreError(self.path, f"{damaged_metadata(name, exc)}; {repair_hint(self.path)}") from exc
                continue
            problem = metadata_disagreement(self.info, name, array)
            if problem is not None:
                raise StoreError(self.path, f"{problem}; {edited_hint(self.path)}")
            rows[name] = array.shape[0]
        return min(rows.values())  # a writer grows the arrays one after another: the smallest bounds the samples

    def _check_columns(self, index: Any, n: int) -> None:
        """Every index column holds n rows, and `sample_length`'s stored chunks do (zarr stores no chunk of fill
        values, so a column of zeros may have none, but lengths are positive: a missing chunk would read as
        zeros), and `checksum` has one column per array: from metadata and a listing, before any row is read."""
        lengths = index["sample_length"]
        stored = lengths.nchunks_initialized * lengths.chunks[0]
        for name, held in [("sample_length", min(lengths.shape[0], stored)),
                           *((name, index[name].shape[0]) for name in INDEX_COLUMNS if name != "sample_length")]:
            if held < n:
                raise StoreError(self.path, f"the store's attributes say {n} samples, but index/{name} holds {held}; "
                                 f"{edited_hint(self.path)}")
        width = index["checksum"].shape[1:]
        if width != (len(self.info.array_names),):
            raise StoreError(self.path, f"index/checksum has {_plain(width)} columns, not one for each of the "
                             f"{len(self.info.array_names)} arrays; {edited_hint(self.path)}")

    def _make_source(self) -> ObjectSource:
        max_nbytes = {name: self.info.max_object_nbytes(name) for name in self.info.array_names}
        if self._objects is None:
            return LocalSource(Path(self.path), max_nbytes)
        per_shard = self.info.chunks_per_shard if self.info.sharded else 0
        if isinstance(self._objects, CachedStore):
            self._objects.namespace = fingerprint(self._zarr_store)  # a store rewritten at this URL is cached anew
            return CachedSource(self._objects, per_shard, max_nbytes)
        small = (*TOKEN_ARRAYS, HIDDEN_SCALES)  # fetched whole
        return RemoteSource(self._objects, per_shard, small_arrays=small, max_nbytes=max_nbytes)

    def _check_index(self) -> None:
        """Refuse an index that could hand out another sample's rows: starts aligned, lengths positive, no two
        samples overlapping, all inside the arrays.  Starts increase in a store one process wrote; writers
        appending together publish in turn, each its own rows, so the index's order need not be the rows'."""
        n = len(self.sample_lengths)
        columns = (self.sample_starts, self.source_paths, self.source_indices, self.checksums, self.has_loss_mask)
        if any(len(c) != n for c in columns):
            raise StoreError(self.path, f"the sample index is damaged: its columns differ in length; {_REBUILD_HINT}")
        align = self.info.object_tokens
        ends = self.sample_starts + -(-self.sample_lengths // align) * align
        by_start = np.argsort(self.sample_starts, kind="stable")
        overlapping = np.zeros(n, dtype=bool)  # a sample whose rows begin inside the sample before it on disk
        overlapping[by_start[1:]] = self.sample_starts[by_start[1:]] < ends[by_start[:-1]]
        problems = (
            (self.sample_lengths <= 0, lambda i: "has no tokens"),
            (self.sample_starts % align != 0, lambda i: f"does not start on a multiple of {align} rows"),
            (self.sample_starts < 0, lambda i: "starts before the first row"),
            (ends > self.total_rows, lambda i: f"ends past the arrays' {self.total_rows} rows"),
            (overlapping, lambda i: f"overlaps sample {self._sample_on_disk_before(i, by_start)}"),
        )
        for bad, what in problems:
            if bad.any():
                i = int(np.argmax(bad))
                raise StoreError(
                    self.path, f"the sample index is damaged: sample {i} (start {int(self.sample_starts[i])}, "
                    f"{int(self.sample_lengths[i])} tokens) {what(i)}; {_REBUILD_HINT}"
                )

    @staticmethod
    def _sample_on_disk_before(i: int, by_start: np.ndarray) -> int:
        return int(by_start[int(np.flatnonzero(by_start == i)[0]) - 1])

    def _check_index_digest(self) -> None:
        """The index rows against the digest recorded at conversion: a rewritten length, start or source path
        is refused here (with the per-sample checksums, which bind each row to its data, on read).  Checked when
        the digest covers exactly the published samples: an append in flight, a snapshot of fewer samples (its
        opener checked) and a store converted before digests are not."""
        recorded = self._recorded_digest
        if recorded is None or recorded.rows != len(self) or len(self) != self.info.num_samples:
            return
        got = index_digest(self._index_columns())
        if got != recorded.crc32c:
            raise StoreError(self.path, f"the sample index fails the checksum recorded at conversion (crc32c "
                             f"{got:#010x}, recorded {recorded.crc32c:#010x}): its rows were changed; "
                             f"{edited_hint(self.path)}")

    def _index_columns(self, rows: int | None = None) -> dict[str, Any]:
        """The index rows read (the first `rows` of them), as `index_digest` takes them."""
        return {"sample_start": self.sample_starts[:rows], "sample_length": self.sample_lengths[:rows],
                "source_path": self.source_paths[:rows], "source_index": self.source_indices[:rows],
                "checksum": self.checksums[:rows], "has_loss_mask": self.has_loss_mask[:rows]}

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
                stored = _BLOSC_HEADER.unpack_from(frame)[4] if self._compressed else len(frame)
        except (ValueError, OSError, struct.error):
            return
        if stored != expected:
            where = self._source.where(object_key(self.info, name, int(self.sample_starts[i]) // self.info.object_tokens))
            raise StoreError(self.path, f"the store's attributes ({_sizes_claimed(self.info)}) give {name} chunks "
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
        read = IndexDigest.of(self._index_columns())
        self.info = info
        self.__dict__.pop("_zarr_store", None)  # a bucket's: the index objects as fetched then
        self._load_index(info.num_samples)
        if IndexDigest.of(self._index_columns(read.rows)) != read:
            raise self._replaced(f"the first {read.rows} rows of its index are no longer the ones read")
        self._check_index()
        self._check_index_digest()
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
            raise self._corrupt(i, getattr(exc, "object_path", self.path), str(exc)) from exc
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
                    for k, frame in self._object_frames(key, todo, whole and todo == inner, stats, fresh, deadline):
                        yield first + k, frame
                        todo = range(k + 1, inner.stop)
                    break
                except ValueError as exc:
                    where = getattr(exc, "object_path", self._source.where(key))
                    if fresh:
                        raise object_error(where, f"{exc}, and again when read afresh") from None
                    log.warning("%s: %s; reading it again", where, exc)
                    if self.io_stats is not None:
                        self.io_stats.add_retry()

    def _object_frames(
        self, key: str, inner: range, whole: bool, stats: ReadStats, fresh: bool, deadline: Deadline | None
    ) -> Iterator[tuple[int, memoryview]]:
        """(inner chunk, its frame) of one object, each checked; ValueError for bytes that fail."""
        where = self._source.where(key)
        t0 = time.perf_counter()
        with self._source.open(key, inner, whole, fresh, deadline) as view:
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
                    raise object_error(where, f"inner chunk {k} is missing from the shard")
                stats.add_read(length, 0.0)
                with view.span(offset, length) as encoded, encoded[:-CRC_BYTES] as frame:
                    if self.checked:
                        t1 = time.perf_counter()
                        try:
                            check_inner_chunk(encoded, k)
                        except ValueError as exc:
                            raise object_error(where, str(exc)) from None
                        stats.add_decode(time.perf_counter() - t1)
                    yield k, frame

    def _shard_index(self, tail: bytes, size: int, where: str | Path) -> np.ndarray:
        try:
            return decode_shard_index(tail, self.info.chunks_per_shard, size, self._max_chunk_nbytes)
        except ValueError as exc:
            raise object_error(where, str(exc)) from None

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
        want = int(self.checksums[i][self.info.array_names.index(name)])
        if got != want:
            raise self._corrupt(i, self._source.where(name), f"{name} fails its checksum (crc32c {got:#010x}, recorded {want:#010x})")

    def _corrupt(self, i: int, path: Path | str, problem: str) -> CorruptSampleError:
        return CorruptSampleError(path, f"{problem}; the store is damaged: run `h5feed verify {self.path}`", i,
                                  self.source_paths[i])


class _TooSmall(Exception):
    """The caller's buffer, not the store, is at fault."""


_REBUILD_HINT = "run the `h5feed convert` command that made the store again to rebuild the index"


def metadata_disagreement(info: StoreInfo, name: str, array: Any) -> str | None:
    """Where the zarr array `name` (opened) disagrees with the store's attributes (row width, dtype, chunk and
    shard shape), or None: the reader refuses such a store, and `h5feed repair` writes the metadata again."""
    width = (info.width(name),) if info.is_matrix(name) else ()
    claimed = {"row width": width, "dtype": str(info.storage_dtype(name)).removeprefix("torch."),
               "chunk shape": (info.chunk_tokens, *width),
               "shard shape": (info.shard_tokens, *width) if info.sharded else None}
    stored = {"row width": tuple(array.shape)[1:], "dtype": str(array.dtype), "chunk shape": tuple(array.chunks),
              "shard shape": tuple(array.shards) if array.shards else None}
    for what, value in claimed.items():
        if value != stored[what]:
            return (f"the store's attributes ({_sizes_claimed(info)}) give {name} {what} {_plain(value)}, but {name}/zarr.json "
                    f"says {_plain(stored[what])}")
    return None


def _sizes_claimed(info: StoreInfo) -> str:
    return (f"hidden_size {info.hidden_size}, num_aux_layers {info.num_aux_layers}, chunk_tokens "
            f"{info.chunk_tokens}, shard_tokens {info.shard_tokens}")


def damaged_metadata(name: str, exc: BaseException) -> str:
    """What is wrong with an array whose metadata zarr cannot open, in one short line: the exception's own text
    may quote the whole damaged document."""
    return f"{name}/zarr.json is damaged or missing (zarr cannot open it: {type(exc).__name__})"


def repair_hint(path: Path | str) -> str:
    """What to run on a store whose arrays are damaged."""
    return f"run `h5feed repair {path}` to rebuild it and re-encode damaged samples from their source files"


def _plain(value: Any) -> str:
    """A shape or figure as a user reads it: (96,) as 96, (16, 96) as 16 x 96."""
    if isinstance(value, tuple):
        return " x ".join(map(_plain, value)) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)

__all__ = ["RawSample", "ReadStats", "Store", "read_ahead"]


def damaged_arrays(path: Path, info: StoreInfo) -> dict[str, str]:
    """The token arrays of the local store `path` whose metadata (`<array>/zarr.json`) zarr cannot open, or which
    disagrees with the store's attributes, each with what is wrong: what `h5feed repair` writes again."""
    import zarr

    problems = {}
    for name in info.array_names:
        try:
            array = zarr.open_array(path / name, mode="r", zarr_format=3)
        except Exception as exc:  # whatever zarr raises on damaged or missing metadata
            problems[name] = damaged_metadata(name, exc)
            continue
        problem = metadata_disagreement(info, name, array)
        if problem is not None:
            problems[name] = problem
    return problems
