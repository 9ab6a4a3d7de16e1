"""`h5feed.open_writer`: extraction code appends samples straight into a store, with no file per sample.

Why: pipelines write one `.pt` file per sample (hundreds of GB to TB) and only then convert them,
a full second copy of the data on disk and a second pass over it.  A writer takes each sample as
the pipeline would have saved it (the dict of its format: `input_ids`, `hidden_states`, ...),
checks it as `h5feed convert` checks a file, and writes it with the same code (the same bytes).

Crash safety is the converter's: each sample's shards are written atomically, then a journal line
(fsynced after the shards) records it with its place; the index and the status "complete" are
published every `publish_every` samples and at close, so a trainer can open the store, and reopen
it to see more, while extraction goes on.  A kill loses only the samples not yet journaled: the
next `open_writer` on the store resumes after the last journaled one and says which that was.

Several writers (the ranks of a parallel extraction, several servers) append to one store at once, each
under its own id (`writer="rank3"`), with no lock held while samples are written: each writes its own
shards and its own journal.  Rows are reserved in blocks of whole shards (a sample starts on a shard
boundary) in a short shared step, in which the arrays are grown to cover them: the arrays' row count is
where the next block starts.  A step is a commit (`WriterSite.commit`): under a flock on a local store,
by compare-and-swap in a bucket, where its body may run again on a fresh state; so a body only computes
from the store's state, and the writer takes what it returns once the commit returned.  A writer alone
in the store extends its block, so its samples lie back to back, as one process's always did.
Publishing is another short step: the published index gains this writer's journaled rows that it lacks
(a sample's first row is its identity: no two share one), in one atomic write of the attributes.  A
writer restarted with the same id resumes its own journal; rows a killed writer reserved but never
journaled are holes that no index row points at.  The unnamed writer (`writer=None`) journals where a
store written by one process always had its journal, so such a store resumes as it is.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from h5feed.conversion.bucket_sources import naming
from h5feed.conversion.options import BucketOptions, StoreSettings, WriteOptions
from h5feed.conversion.samples import (
    IndexRow,
    array_rows,
    check_same_shape,
    differing_settings,
    fsync_tree,
    grow_arrays,
    index_columns,
    new_store_info,
    publish_columns,
    published_columns,
    quantizes,
    rows_taken,
    with_fp8_scales,
    write_sample,
)
from h5feed.conversion.writer_sites import WriterSite, open_site
from h5feed.errors import DiskFullError, SourceError, StoreError
from h5feed.formats import FORMATS, SampleShape, SourceSample
from h5feed.formats.checks import check_token_values, refuse_unbacked_tensors
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store.journal import JournalRecord, JournalWriter, journal_records
from h5feed.store.layout import (
    MAX_DEFAULT_SHARD_TOKENS,
    LastStateNorm,
    StoreInfo,
    create_arrays,
    object_key,
    read_info,
)
from h5feed.store.writer_state import (
    PLAN_FILE,
    PUBLISH_LOCK,
    ROWS_LOCK,
    WRITER_ID,
    WRITER_SOURCE,
    WriterFiles,
)

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

log = logging.getLogger(__name__)

UNIQUE_SOURCE_INDEX = "unique_source_index"  # in a store's source_info: at most one sample per source index


@dataclass(frozen=True)
class WriterReport:
    """What a writer has done: its samples kept in the store (published or not yet), tokens, bytes written."""

    store: str  # its folder or URL
    samples: int
    published: int
    tokens: int
    bytes_out: int
    seconds: float  # spent in append(): the time the writer added to the extraction loop
    writer: str | None = None  # its id (None: the store's unnamed writer)
    left_out: int = 0  # kept, but left out of the index: another writer published their source index first


def open_writer(
    store: str | os.PathLike[str],
    *,
    writer: str | None = None,
    format: str = "speculators-legacy-pt",
    settings: StoreSettings | None = None,
    writing: WriteOptions | None = None,
    unique_source_index: bool = False,
    bucket: BucketOptions | None = None,
) -> StoreWriter:
    """A writer that appends samples to the store `store` (made at the first sample, or resumed): a local
    folder, or a URL in a bucket (`s3://bucket/hs.zarr`, gs://, az://, anything fsspec writes).

    `with h5feed.open_writer("hs.zarr") as w: w.append(input_ids=ids, hidden_states=[...], loss_mask=mask)`

    Args:
        writer: this writer's id, for several processes appending to one store at once (`"rank3"`: letters,
            digits, `_.-`): each id at most one process at a time, and a writer restarted with its id resumes
            its own samples.  None (the default): the store's unnamed writer, as one process needs.
        format: the source format whose dict each sample is given as (its keys and their meaning):
            speculators-legacy-pt (default: `hidden_states` a list of K+1 [T, H] tensors, the last pre-norm),
            speculators-v0-pt, specforge-ckpt, modelopt-pt or angelslim-ckpt.
        settings: what the store is written with, as `h5feed convert`'s (`StoreSettings`: chunk and shard
            tokens, codec, precision, and `last_state_norm`, "pre" or "post", for formats whose dicts do not
            say it: modelopt-pt, angelslim-ckpt).  Every writer of a store gives the same (and the same format);
            another is refused.
        writing: how the writer writes (`WriteOptions`): fsyncs, samples written behind `append` on a thread of
            its own, samples between publications of the index, shards reserved at a time.
        unique_source_index: each sample is appended with its `source_index=` (the dataset row or file index it is
            the hidden states of), and the store's index holds at most one sample of each: a sample whose source
            index the index already holds when it is published (another writer's, which published first) is left
            out of it, its rows unused, as a killed writer's are.  Why: several writers that may each produce the
            same row (the DataLoader workers of a trainer that taps the samples it receives) can then append
            without agreeing first, and a reader pairs each row with one sample.  Recorded in the store: every
            writer of a store gives the same.
        bucket: for a store in a bucket, fsspec's options and the local folder this writer works in
            (`BucketOptions`; a second writer given a staging folder in use is refused).  A sample is journaled
            once its shards are in the bucket, and the index is published there by one conditional PUT of the
            store's root.
    """
    bucket = bucket or BucketOptions()
    site = open_site(store, writer, bucket.storage_options, bucket.staging_dir)
    return StoreWriter(site, writer=writer, format=format, settings=settings, writing=writing,
                       unique_source_index=unique_source_index)


class StoreWriter:
    """Appends samples to one store, beside the store's other writers; see `open_writer`."""

    def __init__(self, site: WriterSite, *, writer: str | None, format: str, settings: StoreSettings | None = None,
                 writing: WriteOptions | None = None, unique_source_index: bool = False) -> None:
        settings, writing = settings or StoreSettings(), writing or WriteOptions()
        chunk_tokens = settings.chunk_tokens
        shard_tokens = MAX_DEFAULT_SHARD_TOKENS if settings.shard_tokens is None else settings.shard_tokens
        publish_every, block_shards, write_behind = writing.publish_every, writing.block_shards, writing.write_behind
        fmt = FORMATS.get(format)  # type: ignore[call-overload]
        if not isinstance(fmt, TorchDictFormat):
            writable = ", ".join(name for name, f in FORMATS.items() if isinstance(f, TorchDictFormat))
            raise ValueError(f"open_writer(format={format!r}): samples are given as the dict of one of {writable}")
        if shard_tokens <= 0 or chunk_tokens <= 0 or shard_tokens % chunk_tokens:
            raise ValueError(f"shard_tokens ({shard_tokens}) must be a positive multiple of chunk_tokens ({chunk_tokens})")
        if publish_every < 1 or block_shards < 1:
            raise ValueError(f"publish_every ({publish_every}) and block_shards ({block_shards}) must be >= 1")
        if write_behind < 0:
            raise ValueError(f"write_behind must be >= 0, not {write_behind}")
        if writer is not None and not WRITER_ID.fullmatch(writer):
            raise ValueError(f"open_writer(writer={writer!r}): an id is 1 to 64 letters, digits, '_', '.' or '-', "
                             "starting with a letter or digit")
        self.site, self.path, self.location = site, site.staging, site.location  # works in path, names location
        self.format, self.files = fmt, WriterFiles(site.staging, writer)
        self.chunk_tokens, self.shard_tokens, self.codec = chunk_tokens, shard_tokens, settings.codec
        self.last_state_norm, self.precision = settings.last_state_norm, settings.precision
        self.publish_every, self.block_rows, self.durable = publish_every, block_shards * shard_tokens, writing.durable
        self.unique_source_index = unique_source_index
        self.info: StoreInfo | None = None
        self._reference: SampleShape | None = None
        self._rows: list[IndexRow] = []  # this writer's journaled samples, in its order
        self._bytes_out, self._seconds = 0, 0.0
        self._published = 0  # of its samples, those a publication has handled (put into the index, or left out)
        self._left_out = 0
        self._next_row: int | None = None  # where its next sample goes; None: no rows reserved
        self._block_end = 0  # the end of the rows it reserved
        self._journal: JournalWriter | None = None
        self._appended = 0  # samples given to append() (with write_behind, some may not be written yet)
        self._behind = _WriteBehind(write_behind) if write_behind else None
        self._locks = ExitStack()
        try:
            self._locks.enter_context(self.site.hold(self.files))
            with self._named():
                self._resume()
        except BaseException:
            self._locks.close()
            raise

    # --- opening -------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Take up the samples this writer (this id) journaled before: a kill loses only those not journaled."""
        if not (self.path / "zarr.json").exists():
            return  # made at the first sample
        self._adopt(read_info(self.path))
        records = journal_records(self.files.journal)
        for record in records:
            if record.i is not None:
                source_index = record.i if record.source_index is None else record.source_index
                self._rows.append(IndexRow(record.start, record.num_tokens, source_index, record.name, record.checksum,
                                           record.has_loss_mask))
                self._next_row = record.start + rows_taken(record.num_tokens, self.shard_tokens)
                end = record.block_end
                self._block_end = self._next_row if end is None else end  # an earlier h5feed noted no blocks
        self._appended = len(self._rows)
        self.site.remove_partial_writes(self.files.writer, self._own_partial_writes)
        begun = [r for r in records if r.begun == len(self._rows)]  # the one being written when it stopped
        if self._rows or begun:
            who = "" if self.files.writer is None else f" writer {self.files.writer!r}"
            kept = f"{len(self._rows)} samples kept, the last one {self._rows[-1].source_path!r}" if self._rows \
                else "no sample kept"
            lost = (f"{begun[-1].name!r}, being appended when the writer stopped, was lost: append it again"
                    if begun else "samples appended after it were lost")
            log.info("%s: resuming%s: %s; %s", self.location, who, kept, lost)
        self._publish()

    def _adopt(self, info: StoreInfo) -> None:
        """Write into an existing store: one open_writer made, with this writer's settings."""
        self.info = self._checked_settings(info)
        self._reference = _reference_of(info)

    def _checked_settings(self, info: StoreInfo) -> StoreInfo:
        """`info`, once it is the store of an open_writer, with this writer's settings; else StoreError."""
        if (self.path / PLAN_FILE).exists() or info.source_root != WRITER_SOURCE:
            raise StoreError(self.location, "was made by `h5feed convert`, not by open_writer: append files to it with "
                             "`h5feed convert`, or write into another store")
        asked = {"format": self.format.name, "codec": self.codec, "chunk_tokens": self.chunk_tokens,
                 "shard_tokens": self.shard_tokens, "last_state_norm": self.last_state_norm,
                 "precision": self.precision}
        differ = differing_settings(info, asked)
        if differ is None and bool(info.source_info.get(UNIQUE_SOURCE_INDEX)) != self.unique_source_index:
            differ = tuple(f"unique_source_index={flag}" for flag in (not self.unique_source_index,
                                                                      self.unique_source_index))
        if differ is not None:
            raise StoreError(self.location, f"was written with {differ[0]}, not {differ[1]}: open every writer of a "
                             "store with its settings, or write into another store")
        return info

    def _own_partial_writes(self) -> list[Path]:
        """The partial files a kill mid-write left in the rows this writer reserved (and has not used yet)."""
        if self.info is None or self._next_row is None:
            return []
        shards = range(self._next_row // self.shard_tokens, self._block_end // self.shard_tokens)
        return [p for shard in shards for name in self.info.array_names
                for p in (self.path / object_key(self.info, name, shard)).parent.glob(f"*{PARTIAL_SUFFIX}")]

    def _norm(self) -> LastStateNorm | None:
        fmt = self.format
        if fmt.last_state_norm is not None:
            if self.last_state_norm not in (None, fmt.last_state_norm):
                raise ValueError(f"{fmt.name} samples hold the {fmt.last_state_norm}-norm last hidden state; "
                                 f"last_state_norm={self.last_state_norm!r} contradicts them")
            return fmt.last_state_norm
        if self.last_state_norm not in ("pre", "post"):
            raise ValueError(f"{fmt.name} samples do not say whether their last hidden state is taken before or after "
                             "the verifier's final norm: pass last_state_norm='pre' or 'post'")
        return self.last_state_norm

    def _named(self) -> AbstractContextManager[None]:
        """Errors that name a file of the staging folder name the store's place instead (a bucket's URL)."""
        return naming((SourceError, StoreError), {str(self.path): self.location})

    # --- appending -----------------------------------------------------------------------------
    def append(self, sample: Mapping[str, Any] | None = None, /, *, name: str | None = None,
               source_index: int | None = None, **keys: Any) -> int:
        """Add one sample, given as its format's dict (`append(d)`) or as keywords (`append(input_ids=...,
        hidden_states=[...])`); CUDA tensors are copied to the host.  Its number among this writer's samples
        is returned: its index in the store when one writer writes it.  A sample that does not fit the store
        (other H, K or dtype than the first) raises SourceError naming it.  `source_index`: the row it is the
        hidden states of, the store's `source_indices` entry (default: the number returned); a writer opened
        with `unique_source_index` needs it."""
        with self._named():
            return self._append({**(sample or {}), **keys}, name, source_index)

    def _append(self, sample: dict[str, Any], name: str | None, source_index: int | None) -> int:
        t0 = time.perf_counter()
        index = self._appended
        if source_index is None and self.unique_source_index:
            raise ValueError("this writer keeps one sample per source index (unique_source_index=True): give each "
                             "sample's append(..., source_index=ROW)")
        if source_index is not None and (isinstance(source_index, bool) or not isinstance(source_index, int)
                                         or source_index < 0):
            raise ValueError(f"source_index must be an int >= 0, not {source_index!r}")
        writer = self.files.writer
        label = name if name is not None else f"sample {index}" if writer is None else f"{writer}/sample {index}"
        where = self.path / label
        copy = self._behind is not None  # written later: the caller may reuse its buffers meanwhile
        refuse_unbacked_tensors(where, sample)  # before the copies below would allocate what a view claims
        d = {key: _to_host(value, copy) for key, value in sample.items()}
        loaded = self.format.sample_from(d, where)
        check_token_values(where, loaded)
        if quantizes(self.precision, loaded.shape.dtype):
            loaded = with_fp8_scales(where, loaded)  # a sample it refuses takes no rows
        shape = loaded.shape
        if self._behind is not None:
            self._behind.raise_failure()  # before rows are reserved for a sample that would not be written
        taken = rows_taken(shape.num_tokens, self.shard_tokens)
        if self.info is None or self._next_row is None or self._next_row + taken > self._block_end:
            self._reserve(shape, taken)
        assert self.info is not None and self._reference is not None and self._next_row is not None
        check_same_shape(where, shape, self._reference, "the store's samples")
        if {e.name: e for e in shape.extras} != self.info.extra_arrays:
            raise SourceError(where, f"holds the optional arrays {[e.name for e in shape.extras]}, the store's samples "
                              f"{list(self.info.extra_arrays)}")
        planned = _PlannedSample(index, label, loaded, self._next_row, self._block_end,
                                 index if source_index is None else source_index)
        if self._behind is None:
            self._write(planned)  # a failure before its journal line (a full disk) takes neither its number nor rows
        self._next_row += taken
        self._appended += 1
        if self._behind is None:
            self._publish_due(planned.label)
        else:
            self._behind.submit(lambda: (self._write(planned), self._publish_due(planned.label)))
        self._seconds += time.perf_counter() - t0
        return index

    def _write(self, planned: _PlannedSample) -> None:
        """The sample's shards, then its journal line (with write_behind, on the writer's own thread, one sample
        at a time, in append order)."""
        assert self.info is not None
        try:
            self._write_journal(JournalRecord(begun=planned.index, name=planned.label, start=planned.start), sync=False)
            record = write_sample(self.path, self.info, planned.sample, planned.start, self.durable)
            num_tokens = planned.sample.shape.num_tokens
            self.site.sample_written(self.info, planned.start, num_tokens)  # in the store before it is journaled
            record = dataclasses.replace(record, i=planned.index, name=planned.label, start=planned.start,
                                         num_tokens=num_tokens, block_end=planned.block_end,
                                         source_index=planned.source_index)
            self._write_journal(record, sync=self.durable)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # the folder the writer works in: the store, or a bucket's staging folder
                raise DiskFullError(self.path, f"disk full while writing {planned.label!r} ({os.strerror(exc.errno)}): "
                                    "free space, then append it again (the samples appended before it are kept)"
                                    ) from exc
            raise
        self._rows.append(IndexRow(planned.start, num_tokens, planned.source_index, planned.label,
                                   record.checksum, record.has_loss_mask))
        self._bytes_out += record.bytes_out

    def _publish_due(self, label: str) -> None:
        """Publish when `publish_every` samples are due.  A publication that fails leaves them kept (journaled,
        published by the next publication): the error says so, so that a caller does not append the sample
        `label` again, which would store it twice."""
        if len(self._rows) - self._published < self.publish_every:
            return
        try:
            self._publish()
        except Exception as exc:
            raise StoreError(self.location, f"{label!r} is appended and kept (do not append it again), but "
                             f"publishing it failed: {exc}; publish() or close() tries again") from exc

    def _reserve(self, shape: SampleShape, taken: int) -> None:
        """Rows for a sample of `taken` rows, made this writer's once the step committed."""
        reserved = self.site.commit(ROWS_LOCK, lambda: self._rows_for(shape, taken))
        self.info, self._reference = reserved.info, reserved.reference
        self._next_row, self._block_end = reserved.start, reserved.end

    def _rows_for(self, shape: SampleShape, taken: int) -> _Reservation:
        """The rows step's body: this writer's block extended when no other reserved rows since (its samples
        stay back to back), else a new block where the arrays end (what its old one has left is a hole).  The
        store is made here by the first writer of all, from its first sample.  Only the staging folder is
        changed: the writer takes the rows once they are committed."""
        info = self.info
        if info is None and (self.path / "zarr.json").exists():
            info = self._checked_settings(read_info(self.path))  # another writer made it
        if info is None:
            info = self._new_info(shape)
            end = max(taken, self.block_rows)
            create_arrays(self.path, info, total_rows=end)
            if self.durable:
                fsync_tree(self.path)
            return _Reservation(info, shape, 0, end)
        high = array_rows(self.path)  # the end of every block reserved so far
        start = self._next_row if self._next_row is not None and self._block_end == high else high
        end = max(start + taken, high + self.block_rows)
        grow_arrays(self.path, end, self.durable)
        return _Reservation(info, self._reference or _reference_of(info), start, end)

    def _new_info(self, shape: SampleShape) -> StoreInfo:
        return new_store_info(self.format, shape, codec=self.codec, chunk_tokens=self.chunk_tokens,
                              shard_tokens=self.shard_tokens, source_root=WRITER_SOURCE, precision=self.precision,
                              last_state_norm=self._norm(),
                              source_info={UNIQUE_SOURCE_INDEX: True} if self.unique_source_index else {})

    def _write_journal(self, record: JournalRecord, sync: bool) -> None:
        if self._journal is None:  # opened at the first sample, for the writer's life: close() closes it
            self._journal = JournalWriter(self.files.journal, end_cut_line=False)
        self._journal.append(record, sync=sync)  # after the shards' fsync: a journaled sample survives a power loss

    def publish(self) -> None:
        """Publish every sample appended so far (with write_behind, once written): a reader opening the store
        from here on sees them."""
        with self._named():
            if self._behind is not None:
                self._behind.drain()
            self._publish()

    def _publish(self) -> None:
        """Add this writer's journaled samples that the published index lacks to it, after the others'.  When
        it raises, they are not published (a reader does not see them) and are still kept: the next
        publication publishes them."""
        if self.info is None or self._published == len(self._rows):
            return
        rows, arrays = list(self._rows), len(self.info.array_names)

        def add_mine() -> int:  # the step's body, on the index as the store holds it now; returns the rows left out
            published = published_columns(self.path)
            mine = index_columns(rows, arrays)
            unpublished = ~np.isin(mine["sample_start"], published["sample_start"])
            new = unpublished.copy()
            if self.unique_source_index:  # a row another writer published first keeps that writer's sample
                first_of_each = np.zeros(len(rows), dtype=bool)
                first_of_each[np.unique(mine["source_index"], return_index=True)[1]] = True
                new &= first_of_each & ~np.isin(mine["source_index"], published["source_index"])
            if new.any():
                publish_columns(self.path, {k: np.concatenate([published[k], mine[k][new]]) for k in published},
                                [], self.durable)
            return int((unpublished & ~new).sum())

        left_out = self.site.commit(PUBLISH_LOCK, add_mine)
        if left_out > self._left_out:
            log.info("%s: %d of %s's samples left out of the index: their source index was published by another "
                     "writer first (unique_source_index)", self.location, left_out - self._left_out, self.files.name)
        self._published, self._left_out = len(rows), left_out

    # --- closing -------------------------------------------------------------------------------
    @property
    def report(self) -> WriterReport:
        return WriterReport(self.location, len(self._rows), self._published - self._left_out,
                            sum(r.num_tokens for r in self._rows), self._bytes_out, self._seconds, self.files.writer,
                            self._left_out)

    def close(self) -> WriterReport:
        """Write what is still behind, publish what is journaled and let the store go (when no other writer
        holds it, a converter may take it, and followers stop once they have read every sample).  An error
        while writing behind is raised here, after the samples journaled before it are published."""
        with self._named():
            try:
                if self._behind is not None:
                    self._behind.close()
            finally:
                self._publish_and_let_go()
        report = self.report
        log.info("%s: %d samples, %d tokens, %.1f MB written in %.1f s of append()", self.location, report.samples,
                 report.tokens, report.bytes_out / 1e6, report.seconds)
        return report

    def _publish_and_let_go(self) -> None:
        try:
            self._publish()
        finally:
            if self._journal is not None:
                self._journal.close()
            self._locks.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        try:  # on an error too: the journaled samples are sound, and published
            self.close()
        except Exception:  # a write behind that failed too: said, but the error in the with-block is the one raised
            log.exception("%s: writing behind failed as well", self.location)


def _to_host(value: Any, copy: bool) -> Any:
    """CUDA tensors (and lists of them) copied to host memory, host ones too with `copy`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value.clone() if copy else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v, copy) for v in value)
    return value


def _reference_of(info: StoreInfo) -> SampleShape:
    """The shape every sample of an existing store must have (its length aside)."""
    return SampleShape(0, info.hidden_size, info.num_aux_layers, info.source_dtype)


@dataclass(frozen=True)
class _Reservation:
    """What a rows step committed: the store (made, or as found), its samples' shape, the rows [start, end)."""

    info: StoreInfo
    reference: SampleShape
    start: int
    end: int


@dataclass(frozen=True)
class _PlannedSample:
    """A checked sample and the rows reserved for it: what is left to write."""

    index: int  # its number among this writer's samples
    label: str
    sample: SourceSample
    start: int  # its first row
    block_end: int  # the end of the block its rows are in (journaled: a resume takes the block up again)
    source_index: int  # the store's source_indices entry: the row it is of (by default its number)


class _WriteBehind:
    """One thread that runs writes in the order given, at most `depth` of them pending.

    Why one thread: samples are journaled in append order, so a kill leaves a prefix of them (a resume
    continues after the last one) and publications keep the order.  The first failure stops the rest: the
    writes queued after it do nothing (their rows stay unused), and every later call raises it."""

    def __init__(self, depth: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5feed-write-behind")
        self._pending: deque[Future[None]] = deque()
        self._depth = depth
        self._failure: BaseException | None = None  # the first write that failed; kept: the writer is broken

    def submit(self, write: Callable[[], None]) -> None:
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()  # never raises: a failure is kept in _failure
        self.raise_failure()
        self._pending.append(self._pool.submit(self._unless_failed, write))

    def _unless_failed(self, write: Callable[[], None]) -> None:
        if self._failure is None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread by its next call)
                self._failure = exc

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def drain(self) -> None:
        """Wait for every pending write; raise the first failure."""
        while self._pending:
            self._pending.popleft().result()
        self.raise_failure()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

