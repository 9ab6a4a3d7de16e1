"""What a conversion's plan file holds: every sample's place in the store, decided before the first is converted.

Why a plan: the workers finish samples in any order, and a run may be killed at any moment.  Fixing
the sample order, each sample's first row and the settings before anything is converted means that
a resumed run writes exactly the bytes an uninterrupted one would, and that `h5feed repair` knows,
from the plan and the journal alone, where each sample's rows are and which file they came from.
How a plan is made is `h5feed.conversion.planning`; how an append extends it, `h5feed.conversion.append`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h5feed.io.local import write_atomically
from h5feed.store.attributes import SkippedFile
from h5feed.store.layout import LastStateNorm, Precision
from h5feed.store.writer_state import PLAN_FILE


@dataclass(frozen=True)
class PlannedSample:
    """One sample file's place in the store: its first row, fixed when it was planned."""

    relpath: str
    sample_index: int
    num_tokens: int
    start: int
    size: int | None = None  # the file's size and mtime when planned (None in plans written before appending)
    mtime_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        """As the plan file records it: an entry of a plan written before appending stays without size and mtime."""
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


@dataclass(frozen=True)
class PlanOptions:
    """What a store is converted with, as its plan records them: a resume or an append must ask for the same."""

    format: str
    codec: str
    chunk_tokens: int
    shard_tokens: int | None  # None: the default, from the longest sample
    last_state_norm: LastStateNorm | None = None  # recorded only where the user stated it
    precision: Precision = "exact"  # recorded only when FP8 (plans written before it have none)

    def to_json(self) -> dict[str, Any]:
        options: dict[str, Any] = {"format": self.format, "codec": self.codec, "chunk_tokens": self.chunk_tokens,
                                   "shard_tokens": self.shard_tokens}
        if self.last_state_norm is not None:
            options["last_state_norm"] = self.last_state_norm
        if self.precision != "exact":
            options["precision"] = self.precision
        return options


@dataclass(frozen=True)
class Plan:
    """What the plan file (`PLAN_FILE`) holds: every sample's place, decided before the first one is converted."""

    options: PlanOptions
    samples: tuple[PlannedSample, ...]  # in plan order: a sample's journal records name its position here
    skipped: tuple[SkippedFile, ...]  # the files planning skipped
    total_rows: int  # the token arrays' rows, to the last sample's last shard
    append_from: int | None = None  # once an append extended the plan: the positions a finished run had published
    unfinished: tuple[SkippedFile, ...] = ()  # skipped while their writer wrote them: the next run tries them again
    retried: tuple[int, ...] = ()  # positions skipped while converting whose files --retry-skipped planned again
    # The store's attributes as planned (before any sample was published): what `h5feed repair` writes a damaged
    # zarr.json again from.  None in plans written before it was kept.
    store: dict[str, Any] | None = None

    @classmethod
    def read(cls, dst: Path) -> Plan:
        """The plan of the store `dst`; raises OSError, or ValueError, KeyError or TypeError for one not a plan."""
        plan = json.loads((dst / PLAN_FILE).read_text())
        return cls(PlanOptions(**plan["options"]), tuple(PlannedSample(**s) for s in plan["samples"]),
                   tuple(map(SkippedFile.from_json, plan["skipped"])), plan["total_rows"], plan.get("append_from"),
                   tuple(map(SkippedFile.from_json, plan.get("unfinished", ()))), tuple(plan.get("retried", ())),
                   plan.get("store"))

    def write(self, dst: Path, durable: bool) -> None:
        plan = {"options": self.options.to_json(), "samples": [s.to_json() for s in self.samples],
                "skipped": [s.to_json() for s in self.skipped], "total_rows": self.total_rows}
        if self.store is not None:
            plan["store"] = self.store
        if self.append_from is not None:
            plan["append_from"] = self.append_from
        if self.unfinished:
            plan["unfinished"] = [s.to_json() for s in self.unfinished]
        if self.retried:
            plan["retried"] = list(self.retried)
        write_atomically(dst / PLAN_FILE, json.dumps(plan).encode(), durable=durable)

    @property
    def published(self) -> int:
        """The plan positions a finished run published: all of them, until an append extends the plan."""
        return len(self.samples) if self.append_from is None else self.append_from

    def known(self) -> set[str]:
        """The files the plan has seen: planned or skipped (but not those skipped unfinished)."""
        return {s.relpath for s in self.samples} | {s.path for s in self.skipped}


def planned_format(dst: Path) -> str | None:
    """The format the plan of `dst` converts (a resume reads what the plan read); None without a readable plan."""
    try:
        return Plan.read(dst).options.format
    except (OSError, ValueError, KeyError, TypeError):
        return None
