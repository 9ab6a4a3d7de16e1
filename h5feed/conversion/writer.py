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
One writer at a time holds the store (the converter's lock).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch

from h5feed.conversion.lock import WriterLock
from h5feed.conversion.samples import (
    IndexRow,
    array_rows,
    check_same_shape,
    fsync_tree,
    grow_arrays,
    new_store_info,
    publish_samples,
    rows_taken,
    write_sample,
)
from h5feed.errors import SourceError, StoreError
from h5feed.formats import FORMATS, SampleShape
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store.layout import (
    DEFAULT_CHUNK_TOKENS,
    MAX_DEFAULT_SHARD_TOKENS,
    LastStateNorm,
    Precision,
    StoreInfo,
    create_arrays,
    read_info,
)
from h5feed.store.writer_state import JOURNAL_FILE, PLAN_FILE, WRITER_API, WRITER_SOURCE, read_journal

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class WriterReport:
    """What a writer has done: samples kept in the store (published or not yet), tokens, bytes written."""

    store: Path
    samples: int
    published: int
    tokens: int
    bytes_out: int
    seconds: float  # spent in append(): the time the writer added to the extraction loop


def open_writer(
    store: str | os.PathLike[str],
    *,
    format: str = "speculators-legacy-pt",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    shard_tokens: int = MAX_DEFAULT_SHARD_TOKENS,
    codec: str = "zstd",
    last_state_norm: LastStateNorm | None = None,
    precision: Precision = "exact",
    publish_every: int = 16,
    durable: bool = True,
) -> StoreWriter:
    """A writer that appends samples to the local store `store` (made at the first sample, or resumed).

    `with h5feed.open_writer("hs.zarr") as w: w.append(input_ids=ids, hidden_states=[...], loss_mask=mask)`

    Args:
        format: the source format whose dict each sample is given as (its keys and their meaning):
            speculators-legacy-pt (default: `hidden_states` a list of K+1 [T, H] tensors, the last pre-norm),
            speculators-v0-pt, specforge-ckpt, modelopt-pt or angelslim-ckpt.
        chunk_tokens, shard_tokens: rows per inner chunk and per shard (as `h5feed convert`'s options;
            a sample starts on a shard boundary, and a longer one spans several shards).
        last_state_norm: "pre" or "post", for formats whose dicts do not say it (modelopt-pt, angelslim-ckpt).
        precision: "fp8" quantizes the hidden states as `h5feed convert --precision fp8` does.
        publish_every: samples between publications of the index (readers opening the store see the
            samples published so far); close() publishes the rest.
        durable: fsync each sample's shards before its journal line (a power loss keeps every journaled one).
    """
    return StoreWriter(Path(store), format=format, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens, codec=codec,
                       last_state_norm=last_state_norm, precision=precision, publish_every=publish_every,
                       durable=durable)


class StoreWriter:
    """Appends samples to one store; see `open_writer`."""

    def __init__(self, path: Path, *, format: str, chunk_tokens: int, shard_tokens: int, codec: str,
                 last_state_norm: LastStateNorm | None, precision: Precision, publish_every: int,
                 durable: bool) -> None:
        fmt = FORMATS.get(format)  # type: ignore[call-overload]
        if not isinstance(fmt, TorchDictFormat):
            writable = ", ".join(name for name, f in FORMATS.items() if isinstance(f, TorchDictFormat))
            raise ValueError(f"open_writer(format={format!r}): samples are given as the dict of one of {writable}")
        if shard_tokens <= 0 or chunk_tokens <= 0 or shard_tokens % chunk_tokens:
            raise ValueError(f"shard_tokens ({shard_tokens}) must be a positive multiple of chunk_tokens ({chunk_tokens})")
        if publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, not {publish_every}")
        self.path, self.format = path, fmt
        self.chunk_tokens, self.shard_tokens, self.codec = chunk_tokens, shard_tokens, codec
        self.last_state_norm, self.precision = last_state_norm, precision
        self.publish_every, self.durable = publish_every, durable
        self._lock = WriterLock.acquire(path, by=WRITER_API)
        try:
            self.info: StoreInfo | None = None
            self._rows: list[IndexRow] = []
            self._bytes_out, self._seconds = 0, 0.0
            self._published = 0
            self._reference: SampleShape | None = None
            self._next_row = 0
            self._array_rows = 0  # the token arrays' rows now
            self._resume()
        except BaseException:
            self._lock.release()
            raise

    # --- opening -------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Take up a store this writer made before (a kill loses only samples not journaled)."""
        if not (self.path / "zarr.json").exists():
            if any(p.name != self._lock.path.name for p in self.path.iterdir()):
                raise StoreError(self.path, "exists and is not an h5feed store; choose another folder")
            return
        info = read_info(self.path)
        if (self.path / PLAN_FILE).exists() or info.source_root != WRITER_SOURCE:
            raise StoreError(self.path, "was made by `h5feed convert`, not by open_writer: append files to it with "
                             "`h5feed convert`, or write into another store")
        for partial in self.path.rglob(f"*{PARTIAL_SUFFIX}"):
            partial.unlink()  # what a kill mid-write left
        self.info = info
        self._array_rows = array_rows(self.path)
        self._reference = SampleShape(0, info.hidden_size, info.num_aux_layers, info.source_dtype)
        for i, record in sorted(read_journal(self.path).items()):
            self._rows.append(IndexRow(record["start"], record["num_tokens"], i, record["name"], record["checksum"],
                                       record["has_loss_mask"]))
            self._next_row = record["start"] + rows_taken(record["num_tokens"], self.shard_tokens)
        if self._rows:
            log.info("%s: resuming: %d samples kept, the last one %r; samples appended after it were lost", self.path,
                     len(self._rows), self._rows[-1].source_path)
        self._publish()

    def _create(self, shape: SampleShape) -> StoreInfo:
        info = new_store_info(self.format, shape, codec=self.codec, chunk_tokens=self.chunk_tokens,
                              shard_tokens=self.shard_tokens, source_root=WRITER_SOURCE, precision=self.precision,
                              last_state_norm=self._norm(), source_info={})
        create_arrays(self.path, info, total_rows=self.shard_tokens)
        self._array_rows = self.shard_tokens
        if self.durable:
            fsync_tree(self.path)
        return info

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

    # --- appending -----------------------------------------------------------------------------
    def append(self, sample: Mapping[str, Any] | None = None, /, *, name: str | None = None, **keys: Any) -> int:
        """Add one sample, given as its format's dict (`append(d)`) or as keywords (`append(input_ids=...,
        hidden_states=[...])`); CUDA tensors are copied to the host.  Its index in the store is returned.
        A sample that does not fit the store (other H, K or dtype than the first) raises SourceError naming it."""
        t0 = time.perf_counter()
        index = len(self._rows)
        label = name if name is not None else f"sample {index}"
        where = self.path / label
        d = {key: _to_host(value) for key, value in {**(sample or {}), **keys}.items()}
        loaded = self.format.sample_from(d, where)
        shape = loaded.shape
        if self._reference is None:
            self.info, self._reference = self._create(shape), shape
        assert self.info is not None
        check_same_shape(where, shape, self._reference, "the store's samples")
        if {e.name: e.record() for e in shape.extras} != self.info.extra_arrays:
            raise SourceError(where, f"holds the optional arrays {[e.name for e in shape.extras]}, the store's samples "
                              f"{list(self.info.extra_arrays)}")
        start = self._next_row
        taken = rows_taken(shape.num_tokens, self.shard_tokens)
        if start + taken > self._array_rows:  # doubled when outgrown: appends resize the arrays rarely
            self._array_rows = max(start + taken, 2 * self._array_rows)
            grow_arrays(self.path, self._array_rows, self.durable)
        record = write_sample(self.path, self.info, loaded, start, self.durable)
        journaled = {"i": index, "name": label, "start": start, "num_tokens": shape.num_tokens, **record}
        self._journal(journaled)
        self._rows.append(IndexRow(start, shape.num_tokens, index, label, record["checksum"], record["has_loss_mask"]))
        self._next_row = start + taken
        self._bytes_out += record["bytes_out"]
        if len(self._rows) - self._published >= self.publish_every:
            self._publish()
        self._seconds += time.perf_counter() - t0
        return index

    def _journal(self, record: dict[str, Any]) -> None:
        with open(self.path / JOURNAL_FILE, "a") as journal:
            journal.write(json.dumps(record) + "\n")
            journal.flush()
            if self.durable:  # after the shards' fsync: a journaled sample survives a power loss
                os.fsync(journal.fileno())

    def publish(self) -> None:
        """Publish every journaled sample now: a reader opening the store from here on sees them."""
        self._publish()

    def _publish(self) -> None:
        if self.info is None or self._published == len(self._rows):
            return
        publish_samples(self.path, self._rows, [], self.durable)
        self._published = len(self._rows)

    # --- closing -------------------------------------------------------------------------------
    @property
    def report(self) -> WriterReport:
        return WriterReport(self.path, len(self._rows), self._published, sum(r.num_tokens for r in self._rows),
                            self._bytes_out, self._seconds)

    def close(self) -> WriterReport:
        """Publish what is journaled and let the store go (another writer may take it then)."""
        try:
            self._publish()
        finally:
            self._lock.release()
        report = self.report
        log.info("%s: %d samples, %d tokens, %.1f MB written in %.1f s of append()", self.path, report.samples,
                 report.tokens, report.bytes_out / 1e6, report.seconds)
        return report

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()  # on an error too: the journaled samples are sound, and published


def _to_host(value: Any) -> Any:
    """CUDA tensors (and lists of them) copied to host memory; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value

