"""A store's sample index, read and checked before any sample is: where each sample's rows are, and what binds them.

Why apart from the reader: the index is the one part of a store whose damage could hand a trainer another sample's
rows without any chunk failing its checksum (a rewritten start or length, two samples overlapping).  So it is read
only once the arrays' metadata agrees with the attributes and every column holds the rows asked for (a store
claiming 2^26 samples is refused before anything is allocated for them), then checked as a whole: starts aligned,
lengths positive, no overlap, all inside the arrays, and the rows against the digest recorded at conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from h5feed.errors import StoreError
from h5feed.io import ObjectError
from h5feed.store.damage import REBUILD_HINT, damaged_metadata, metadata_disagreement, plain_figure, repair_hint
from h5feed.store.layout import INDEX_COLUMNS, Commit, IndexDigest, StoreInfo, edited_hint, index_digest


@dataclass(frozen=True)
class SampleIndex:
    """The first rows of a store's index columns, one a sample, with the rows every array holds."""

    sample_starts: np.ndarray  # int64: the sample's first row in the arrays
    sample_lengths: np.ndarray  # int64: its tokens
    source_paths: list[str]  # the file it was converted from
    source_indices: np.ndarray  # int64: its place in that file
    checksums: np.ndarray  # uint32 [n, arrays]: crc32c of each array's rows (format 1) or of its token arrays
    has_loss_mask: np.ndarray  # bool
    total_rows: int  # rows every array holds: no sample may end past them
    recorded_digest: IndexDigest | None  # the digest recorded at conversion, or None (a store from before digests)

    @classmethod
    def read(cls, open_group: Callable[[], Any], info: StoreInfo, path: Path | str, n: int) -> SampleIndex:
        """The first n rows of each index column of the zarr group `open_group()` opens: the columns may already
        hold an append's rows that the attributes, read before them, do not publish yet.

        Nothing is read or allocated for n rows before the arrays' metadata agrees with the attributes and every
        column's stored chunks hold n rows."""
        try:
            group = open_group()
            index = group[Commit.of_root({"attributes": group.attrs.asdict()}).index]
            recorded = IndexDigest.from_attributes(index.attrs)  # before the rows it may cover
            total_rows = _rows_of_arrays(group, info, path)
            _check_columns(index, info, path, n)
            read = cls(
                sample_starts=np.asarray(index["sample_start"][:n], dtype=np.int64),
                sample_lengths=np.asarray(index["sample_length"][:n], dtype=np.int64),
                source_paths=[str(p) for p in index["source_path"][:n]],
                source_indices=np.asarray(index["source_index"][:n], dtype=np.int64),
                checksums=np.asarray(index["checksum"][:n], dtype=np.uint32),
                has_loss_mask=np.asarray(index["has_loss_mask"][:n], dtype=bool),
                total_rows=total_rows,
                recorded_digest=recorded,
            )
        except (ObjectError, StoreError):  # the bucket said no (its error names the object), or a check above
            raise
        except Exception as exc:  # missing arrays, failed checksums, unreadable metadata
            raise StoreError(path, f"the sample index is missing or damaged ({exc!r}); {REBUILD_HINT}") from exc
        if len(read.sample_lengths) != n:
            raise StoreError(path, f"the sample index is damaged: it holds {len(read.sample_lengths)} samples, "
                             f"fewer than the {n} the store's attributes publish; {REBUILD_HINT}")
        return read

    def __len__(self) -> int:
        return len(self.sample_lengths)

    def check(self, path: Path | str, object_tokens: int) -> None:
        """Refuse an index that could hand out another sample's rows: starts aligned (to `object_tokens`), lengths
        positive, no two samples overlapping, all inside the arrays.  Starts increase in a store one process wrote;
        writers appending together publish in turn, each its own rows, so the index's order need not be the rows'."""
        n = len(self.sample_lengths)
        columns = (self.sample_starts, self.source_paths, self.source_indices, self.checksums, self.has_loss_mask)
        if any(len(c) != n for c in columns):
            raise StoreError(path, f"the sample index is damaged: its columns differ in length; {REBUILD_HINT}")
        starts, align = self.sample_starts, object_tokens
        ends = starts + -(-self.sample_lengths // align) * align
        by_start = np.argsort(starts, kind="stable")
        overlapping = np.zeros(n, dtype=bool)  # a sample whose rows begin inside the sample before it on disk
        overlapping[by_start[1:]] = starts[by_start[1:]] < ends[by_start[:-1]]
        problems = (
            (self.sample_lengths <= 0, lambda i: "has no tokens"),
            (starts % align != 0, lambda i: f"does not start on a multiple of {align} rows"),
            (starts < 0, lambda i: "starts before the first row"),
            (ends > self.total_rows, lambda i: f"ends past the arrays' {self.total_rows} rows"),
            (overlapping, lambda i: f"overlaps sample {_sample_on_disk_before(i, by_start)}"),
        )
        for bad, what in problems:
            if bad.any():
                i = int(np.argmax(bad))
                raise StoreError(
                    path, f"the sample index is damaged: sample {i} (start {int(starts[i])}, "
                    f"{int(self.sample_lengths[i])} tokens) {what(i)}; {REBUILD_HINT}"
                )

    def check_digest(self, path: Path | str, published: int) -> None:
        """The rows against the digest recorded at conversion: a rewritten length, start or source path is refused
        here (with the per-sample checksums, which bind each row to its data, on read).  Checked when the digest
        covers exactly the `published` samples and these rows are all of them: an append in flight, a snapshot of
        fewer samples (its opener checked) and a store converted before digests are not."""
        recorded = self.recorded_digest
        if recorded is None or recorded.rows != len(self) or len(self) != published:
            return
        got = index_digest(self.columns())
        if got != recorded.crc32c:
            raise StoreError(path, f"the sample index fails the checksum recorded at conversion (crc32c "
                             f"{got:#010x}, recorded {recorded.crc32c:#010x}): its rows were changed; "
                             f"{edited_hint(path)}")

    def columns(self, rows: int | None = None) -> dict[str, Any]:
        """The index rows read (the first `rows` of them), as `index_digest` takes them."""
        return {"sample_start": self.sample_starts[:rows], "sample_length": self.sample_lengths[:rows],
                "source_path": self.source_paths[:rows], "source_index": self.source_indices[:rows],
                "checksum": self.checksums[:rows], "has_loss_mask": self.has_loss_mask[:rows]}


def _rows_of_arrays(group: Any, info: StoreInfo, path: Path | str) -> int:
    """The rows every array holds, once each array's metadata agrees with the attributes (width, dtype, shards and
    chunks).  An array whose metadata zarr cannot parse is left to `h5feed verify` (reads do not use it, and check
    every chunk's decoded size against the attributes)."""
    rows = {}
    for name in info.array_names:
        try:
            array = group[name]
        except Exception as exc:
            if name == "aux_hidden_states":  # its rows bound the index: it must open
                raise StoreError(path, f"{damaged_metadata(name, exc)}; {repair_hint(path)}") from exc
            continue
        problem = metadata_disagreement(info, name, array)
        if problem is not None:
            raise StoreError(path, f"{problem}; {edited_hint(path)}")
        rows[name] = array.shape[0]
    return min(rows.values())  # a writer grows the arrays one after another: the smallest bounds the samples


def _check_columns(index: Any, info: StoreInfo, path: Path | str, n: int) -> None:
    """Every index column holds n rows, and `sample_length`'s stored chunks do (zarr stores no chunk of fill values,
    so a column of zeros may have none, but lengths are positive: a missing chunk would read as zeros), and
    `checksum` has one column per array: from metadata and a listing, before any row is read."""
    lengths = index["sample_length"]
    stored = lengths.nchunks_initialized * lengths.chunks[0]
    for name, held in [("sample_length", min(lengths.shape[0], stored)),
                       *((name, index[name].shape[0]) for name in INDEX_COLUMNS if name != "sample_length")]:
        if held < n:
            raise StoreError(path, f"the store's attributes say {n} samples, but index/{name} holds {held}; "
                             f"{edited_hint(path)}")
    width = index["checksum"].shape[1:]
    if width != (len(info.array_names),):
        raise StoreError(path, f"index/checksum has {plain_figure(width)} columns, not one for each of the "
                         f"{len(info.array_names)} arrays; {edited_hint(path)}")


def _sample_on_disk_before(i: int, by_start: np.ndarray) -> int:
    return int(by_start[int(np.flatnonzero(by_start == i)[0]) - 1])
