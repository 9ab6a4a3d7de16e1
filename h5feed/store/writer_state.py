"""What a reader can learn of a store's writer: who holds it now, and how far its conversion is.

A store whose conversion has not finished is refused by every reader.  What the user should do
then depends on whether a writer still runs: wait for it, or run the same `h5feed convert` again
to resume.  The writer's files live in the store (its lock, plan and journal; see
`h5feed.conversion`), and they are read here, below the conversion code, so that `Store`, `h5feed
inspect` and `h5feed verify` tell the two cases apart the same way.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

LOCK_FILE = "h5feed-writer.lock"  # held with flock by the one writer (host, pid, start time inside)
PLAN_FILE = "h5feed-plan.json"  # every sample's place, decided before the first is converted
JOURNAL_FILE = "h5feed-journal.jsonl"  # one line per finished sample, by plan position
CONVERTER = "`h5feed convert`"  # the writers, as messages name them (the lock records which holds it)
WRITER_API = "`h5feed.open_writer`"
WRITER_SOURCE = "h5feed.open_writer"  # the source_root of a store open_writer made: its samples came from no folder


def current_writer(store: Path) -> dict[str, Any] | None:
    """Who holds a local store's writer lock now (host, pid, started_at), or None when nobody does.

    Probed with a shared lock that is let go at once: a writer starting in that instant is refused,
    as a second writer would be, and can be started again."""
    try:
        fd = os.open(store / LOCK_FILE, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def read_holder(fd: int) -> dict[str, Any]:
    """The lock file's description of its holder; one being written this instant may be empty: ask again briefly."""
    for _ in range(20):
        try:
            return json.loads(os.pread(fd, 1 << 16, 0) or b"null") or {}
        except json.JSONDecodeError:
            time.sleep(0.01)
    return {}


def describe_writer(holder: dict[str, Any]) -> str:
    """The lock holder as errors name it."""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started at {holder.get('started_at', '?')}"


def read_journal(store: Path) -> dict[int, dict[str, Any]]:
    """Finished samples by plan position; a line cut short by a kill is ignored (its sample is redone)."""
    done: dict[int, dict[str, Any]] = {}
    try:
        lines = (store / JOURNAL_FILE).read_text().splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[record.pop("i")] = record
    return done


def being_converted(store: str | os.PathLike[str]) -> str | None:
    """What the writer holding this local store is at ("it is being written now by `h5feed convert` (...): 12 of
    40 samples done; wait for it to finish"), or None when no writer holds it."""
    path = Path(store)
    writer = current_writer(path)
    if writer is None:
        return None
    who = describe_writer(writer)
    try:
        total = len(json.loads((path / PLAN_FILE).read_text())["samples"])
        progress = f": {len(read_journal(path))} of {total} samples done"
    except (OSError, ValueError, KeyError, TypeError):  # still planning, or a writer that has no plan
        written = len(read_journal(path))
        progress = f": {written} samples written so far" if written else ": planning"
    return f"it is being written now by {writer.get('by', CONVERTER)} ({who}){progress}; wait for it to finish"
