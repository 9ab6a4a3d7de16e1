"""A rerun of `h5feed convert` on a complete store: what it has to do, and the plan an append extends.

The same command on a complete store whose SRC has new files appends them: the plan grows by the new
samples (rows after the last one), which the convert step then converts into new shards.  Existing
samples keep their index and their shard files, untouched.  Files already in the plan are recognised
by their path; one whose size or mtime changed since it was converted is refused (or, with
--skip-bad, recorded as skipped), never silently converted again.  With --retry-skipped the files
skipped before are planned again.  The status stays "complete" all along, so readers keep working.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from h5feed.conversion.finalize import published_skips
from h5feed.conversion.job import Job, Listing
from h5feed.conversion.plan import Plan, PlanOptions
from h5feed.conversion.planning import lay_out, probe
from h5feed.conversion.pool import TaskPool
from h5feed.conversion.samples import differing_settings
from h5feed.errors import SourceError, StoreError
from h5feed.formats import SampleShape, SourceFile, SourceFormat
from h5feed.store.attributes import SkippedFile
from h5feed.store.journal import JOURNAL_FILE, JournalRecord, read_journal
from h5feed.store.layout import StoreInfo
from h5feed.store.writer_state import PLAN_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Append:
    """What an append adds to the plan: files SRC has that the plan has not seen, and skips to record."""

    new: list[SourceFile]
    skipped: list[SkippedFile]
    published: int  # plan positions that a finished run published (an unfinished append's stay after it)
    unfinished: list[SkippedFile]  # what this run found still being written (replaces the plan's)
    retried: list[int] = field(default_factory=list)  # positions whose conversion-time skip `new` supersedes


def check_complete_matches(dst: Path, info: StoreInfo, options: PlanOptions) -> None:
    """A rerun on a complete store asking for another codec, chunk size or format must not pass as done."""
    differ = differing_settings(info, {**options.to_json(), "shard_tokens": options.shard_tokens or info.shard_tokens})
    if differ is not None:
        raise StoreError(dst, f"is complete but was converted with {differ[0]}, not {differ[1]}: run the command "
                         "with the store's settings to append to it, or choose another DST or pass --overwrite")


def plan_of_complete(job: Job, info: StoreInfo, listing: Listing) -> tuple[Plan, Append | None] | None:
    """What a rerun on a complete store has to do: None if nothing; else its plan, and what to append
    when SRC has files the plan has not seen (None: an append was killed before it finished).

    A converted file that changed since (size or mtime) is an error naming it, or with skip_bad a
    recorded skip: its samples in the store stay what they were."""
    src, dst, source_root = job.src, job.dst, job.source_root
    if not (dst / PLAN_FILE).exists():
        return None  # a store without a plan can only be checked (or converted again with --overwrite)
    plan = Plan.read(dst)
    if source_root != info.source_root:
        raise StoreError(dst, f"was converted from {info.source_root}, not {source_root}: run the command with that SRC "
                         "(new files there are appended), or convert into another DST")
    samples = plan.samples
    done = read_journal(dst)
    published = plan.published
    journal_sound = all(i in done for i in range(published))
    kept = sum(r.converted for r in done.values())
    finished = len(done) == len(samples) and (info.num_samples, info.skipped) == (kept, published_skips(plan, done))
    out_of_store = _failed_while_converting(plan, done)  # skipped while converting, or dropped by `h5feed repair`
    failed = out_of_store if job.request.skips.retry_skipped else {}
    gone: list[SkippedFile] = []  # the records of the files skipped before that are no longer there
    if job.request.skips.retry_skipped and (plan.skipped or failed):
        retried = [s for s in plan.skipped if s.path not in {p.relpath for p in samples}]
        log.info("%s: trying the %d file(s) skipped before again", dst, len(retried) + len(failed))
        plan = dataclasses.replace(plan, skipped=tuple(s for s in plan.skipped if s not in retried))
        present = {f.relpath for f in listing.files} | {s.path for s in listing.unreadable + listing.unfinished}
        gone = [_gone(s.path, s.problem) for s in retried if s.path not in present] + \
            [_gone(relpath, done[found[0]].skipped) for relpath, found in failed.items() if relpath not in present]
        for record in gone:
            log.warning("%s: %s %s", dst, record.path, record.problem)
    known = plan.known() - set(failed)
    new_skips = [s for s in listing.unreadable if s.path not in known] + gone
    for changed, problem in _changed_since_planned(src, plan):
        if changed in out_of_store:
            continue  # none of its samples is in the store: nothing to keep; --retry-skipped plans it again below
        if not job.request.skips.skip_bad:
            raise SourceError(src / changed, f"{problem}; convert into another DST to take the new content, or pass "
                              "--skip-bad to record it as skipped and keep the samples converted before")
        record = SkippedFile(changed, f"{problem}; the store keeps the samples converted before")
        if record not in plan.skipped and record not in new_skips:
            log.warning("skipping %s: %s", src / changed, record.problem)
            new_skips.append(record)
    new = [s for s in listing.files if s.relpath not in known]
    unfinished_changed = listing.unfinished != list(plan.unfinished)
    if new or new_skips or unfinished_changed:
        if not journal_sound:
            raise StoreError(dst, f"cannot append: its journal ({JOURNAL_FILE}) lacks samples converted before, and "
                             "an append rewrites the index from it; convert into another DST, or pass --overwrite")
        log.info("%s: appending %d new sample file(s) after its %d samples", dst, len(new), info.num_samples)
        superseded = {f.relpath for f in new} | {record.path for record in gone}  # planned again, or gone
        retried_positions = sorted(i for relpath in failed for i in failed[relpath] if relpath in superseded)
        return plan, Append(new, new_skips, len(samples) if finished else published, listing.unfinished,
                            retried_positions)
    if finished or not journal_sound:
        return None  # done, or a damaged journal: the index is checked (and rebuilt from the journal if need be)
    return plan, None  # an append killed before it published its index: finish it


def _gone(relpath: str, problem: str) -> SkippedFile:
    """The skipped record of a file skipped before (for `problem`) that --retry-skipped no longer finds in SRC."""
    if problem.startswith("is gone: "):
        return SkippedFile(relpath, problem)  # gone at an earlier retry already
    return SkippedFile(relpath, f"is gone: it was skipped ({problem}); --retry-skipped found no file to try again")


def _failed_while_converting(plan: Plan, done: dict[int, JournalRecord]) -> dict[str, list[int]]:
    """The files none of whose samples converted (each skipped while converting, not while planning), with
    their plan positions: planned again after the last sample, they can be retried whole."""
    positions: dict[str, list[int]] = {}
    for i, sample in enumerate(plan.samples):
        positions.setdefault(sample.relpath, []).append(i)
    return {relpath: found for relpath, found in positions.items()
            if all(i not in plan.retried and i in done and done[i].skipped is not None for i in found)}


def _changed_since_planned(src: Path, plan: Plan) -> list[tuple[str, str]]:
    """(relpath, what changed) of the planned files whose size or mtime differ now; a file gone is left alone
    (its samples are in the store), as is one planned before plans recorded them."""
    changed = []
    for relpath, (size, mtime_ns) in {s.relpath: (s.size, s.mtime_ns) for s in plan.samples}.items():
        if size is None or mtime_ns is None:
            continue
        try:
            stat = SourceFormat.file_of(src / relpath).stat()
        except FileNotFoundError:
            continue
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            changed.append((relpath, what_changed(size, mtime_ns, stat)))
    return changed


def what_changed(size: int, mtime_ns: int, stat: os.stat_result) -> str:
    """How a file planned with `size` and `mtime_ns` differs now, as messages say it (shared with `h5feed repair`)."""
    def when(ns: int) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns % 10**9:09d}"

    return (f"changed since it was converted (size {size} -> {stat.st_size} bytes, "
            f"modified {when(mtime_ns)} -> {when(stat.st_mtime_ns)})")


def extend_plan(job: Job, pool: TaskPool, plan: Plan, append: Append, info: StoreInfo) -> Plan:
    """Probe the new files and plan them after the last row (a sample longer than a shard spans several)."""
    reference = SampleShape(0, info.hidden_size, info.num_aux_layers, info.source_dtype)
    probed, skipped = probe(job, pool, append.new, reference)
    planned, row = lay_out(probed, plan.total_rows, info.shard_tokens)
    plan = dataclasses.replace(plan, samples=plan.samples + tuple(planned),
                               skipped=plan.skipped + tuple(append.skipped + skipped), total_rows=row,
                               append_from=append.published, unfinished=tuple(append.unfinished),
                               retried=plan.retried + tuple(append.retried))
    plan.write(job.dst, job.request.run.durable)  # from here a rerun resumes it
    return plan
