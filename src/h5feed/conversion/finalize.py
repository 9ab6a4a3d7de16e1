"""The last step of `h5feed convert`: the journal rewritten in plan order, then the samples it holds published.

Why the journal is rewritten: workers finish samples in any order, so the journal a run appended to
depends on how the run went (and on how often it was killed); rewritten in plan order, the store's
bytes are the same however the run went.  Then the index is written and the status flipped to
"complete" (`h5feed.conversion.samples.publish_samples`).  `h5feed repair` publishes a journal it
mended (a sample dropped, an index rebuilt) with the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from h5feed.conversion.plan import Plan, PlannedSample
from h5feed.conversion.samples import IndexRow, publish_samples
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store.attributes import SkippedFile
from h5feed.store.journal import JOURNAL_FILE, JournalRecord, rewrite_journal


def published_skips(plan: Plan, done: dict[int, JournalRecord]) -> list[SkippedFile]:
    """The store's `skipped`: what planning skipped, then the files still being written, then the files that failed
    to convert (or that `h5feed repair` dropped), in plan order."""
    return list(plan.skipped) + list(plan.unfinished) + [
        SkippedFile(plan.samples[i].relpath, r.skipped) for i, r in sorted(done.items())
        if r.skipped is not None and i not in plan.retried
    ]


def journaled_rows(samples: Sequence[PlannedSample], done: dict[int, JournalRecord]) -> list[IndexRow]:
    """The index rows of the samples the journal holds converted, in plan order: what the index publishes."""
    return [IndexRow(samples[i].start, samples[i].num_tokens, samples[i].sample_index, samples[i].relpath,
                     done[i].checksum, done[i].has_loss_mask)
            for i in range(len(samples)) if i in done and done[i].converted]


def publish_journal(dst: Path, plan: Plan, done: dict[int, JournalRecord], durable: bool) -> None:
    """Publish the samples the journal `done` holds, the index written anew: `h5feed repair`'s rebuild of a
    damaged index, and its publication of the samples it drops (recorded in `done` as skipped)."""
    finalize(dst, plan.samples, done, published_skips(plan, done), durable, rebuild=True)


def finalize(
    dst: Path, samples: Sequence[PlannedSample], done: dict[int, JournalRecord], skipped: list[SkippedFile],
    durable: bool, rebuild: bool = False,
) -> None:
    """Rewrite the journal in plan order, then publish the samples it holds (index, then status)."""
    rewrite_journal(dst / JOURNAL_FILE, done, durable)  # the same bytes however the run went
    publish_samples(dst, journaled_rows(samples, done), skipped, durable, rebuild)


def remove_partial_writes(dst: Path) -> None:
    """Shards (and zarr's own files) are written as NAME.<id>.partial and renamed: a kill can leave one behind."""
    for path in dst.rglob(f"*{PARTIAL_SUFFIX}"):
        path.unlink()
