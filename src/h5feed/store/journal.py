"""A store's journals: one line per sample written, the record that a sample's shards are in the store.

Why a journal: a sample's shards are written (atomically, fsynced) before anything says they are there,
and the index that readers trust is published only now and then.  The journal line written after the
shards, fsynced, is what makes a written sample kept: a kill loses only the samples not yet journaled,
a resumed run skips those journaled, and `h5feed repair` rebuilds an index from the journal.

`h5feed convert` journals each sample by its plan position (`JOURNAL_FILE`, rewritten in plan order when
the conversion finishes: `rewrite_journal`); an `h5feed.open_writer` writer journals its own samples in its
own file (`h5feed.store.writer_state.WriterFiles.journal`), with their place and a note of the sample it
begins (so a resume can say which one a kill lost).  Both write `JournalRecord`s, as JSON lines, through
`JournalWriter`; a line cut short by a kill is ignored on reading (its sample is redone or lost, never
half-read).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from h5feed.io.local import write_atomically

JOURNAL_FILE = "h5feed-journal.jsonl"  # `h5feed convert`'s journal (and the unnamed writer's): by plan position


@dataclass(frozen=True)
class JournalRecord:
    """One journal line.  The fields are in the order a line holds them, and a line holds only those set:

    - a converted sample: `i` (its plan position, or its number among a writer's samples), the crc32c of
      each array's rows (`checksum`, in the store's array order), whether it had a loss mask, the bytes
      written (and, by `h5feed convert`, read); a writer's also its `name`, its rows (`start`, `num_tokens`,
      the end of the block they are in) and its `source_index`;
    - a sample skipped while converting (or dropped by `h5feed repair`): `i` and why (`skipped`);
    - a writer's note of the sample it begins (`begun`: its number), before its shards are written."""

    begun: int | None = None
    i: int | None = None
    name: str | None = None
    start: int | None = None
    num_tokens: int | None = None
    block_end: int | None = None
    source_index: int | None = None
    checksum: tuple[int, ...] | None = None
    has_loss_mask: bool | None = None
    bytes_out: int | None = None
    bytes_in: int | None = None
    skipped: str | None = None

    @property
    def converted(self) -> bool:
        """Whether the line records a sample in the store (not a skip, not a note of one begun)."""
        return self.checksum is not None

    @classmethod
    def skip(cls, i: int, problem: str) -> JournalRecord:
        """The line of the sample at `i`, skipped (or dropped) for `problem`."""
        return cls(i=i, skipped=problem)

    def to_json(self) -> dict[str, Any]:
        """The line as JSON holds it: the fields set, in order (the bytes every h5feed wrote)."""
        line = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                line[f.name] = list(value) if f.name == "checksum" else value
        return line

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> JournalRecord:
        """A parsed line; keys no h5feed writes are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {key: value for key, value in line.items() if key in known}
        if isinstance(fields.get("checksum"), list):
            fields["checksum"] = tuple(fields["checksum"])
        return cls(**fields)


def journal_records(journal: Path) -> list[JournalRecord]:
    """A journal's records in the order written; a line cut short by a kill is ignored."""
    try:
        lines = journal.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(JournalRecord.from_json(record))
    return records


def read_journal(store: Path, journal: Path | None = None) -> dict[int, JournalRecord]:
    """Finished samples by plan (or writer's) position, from the store's journal or `journal`; a line cut short
    by a kill is ignored (its sample is redone), and so is a writer's note of a sample it began."""
    records = journal_records(journal or store / JOURNAL_FILE)
    return {record.i: record for record in records if record.i is not None}


class JournalWriter:
    """Appends records to one journal, each line flushed as written and fsynced when asked (after the sample's
    shards are: a journaled sample survives a power loss).

    `end_cut_line`: a line a kill cut short is ended first, or the next record would be lost with it (what
    `h5feed convert` does; an `open_writer` writer appends as it always has)."""

    def __init__(self, path: Path, *, end_cut_line: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)  # a bucket's writer: no lock made its folder
        self.path = path
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 (for the writer's life: close() closes it)
        if end_cut_line and self._file.tell() and not path.read_text().endswith("\n"):
            self._file.write("\n")

    def append(self, record: JournalRecord, *, sync: bool) -> None:
        self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_journal(path: Path, records: dict[int, JournalRecord], durable: bool) -> None:
    """Write the journal anew, in position order, in one atomic rename: the same bytes however the run went."""
    lines = "".join(json.dumps(dataclasses.replace(records[i], i=i).to_json()) + "\n" for i in sorted(records))
    write_atomically(path, lines.encode(), durable=durable)
