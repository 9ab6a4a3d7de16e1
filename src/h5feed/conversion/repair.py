"""`h5feed repair`: a damaged store mended in place from its source files, without converting it again.

One flipped byte damages one sample, and converting a terabyte again to mend it takes hours.  Repair runs
`h5feed verify`'s checks, then converts each damaged sample again from its source file with the converter's own
`convert_one`, at the rows the plan gave it, into the same chunk layout with the same codec: the bytes that
`h5feed convert` wrote.

Crash safety.  A damaged sample is first written whole into a staging folder inside the store (`STAGING_DIR`: on
the same file system, so that a rename moves a file in), each file fsynced, and its checksums compared with those
the index recorded.  Only then is each of its shard files that differs from the store's renamed over it, and the
folder fsynced.  A kill at any moment leaves every shard file as it was or repaired; the next repair empties the
staging folder, finds what is still damaged and finishes the job.  Repair holds the store's writer lock, as
`h5feed convert` does, so no writer runs meanwhile.

Trust.  The source file must still be the one converted: the size and mtime the plan recorded, and rows whose
checksums are those of the index.  A sample whose file changed or is gone is reported unrecoverable and left as
it is.  A store that `open_writer` wrote has no source files, and one converted from a bucket has no folder to
read them from: both are refused, saying so.

Array metadata (`<array>/zarr.json`) that zarr cannot open, or that disagrees with the store's attributes, is
written again as conversion creates it (`create_arrays`), with the rows the other arrays hold (or the plan's).
A damaged companion copy is copied again from the source folder when the file there is the one recorded.

The store's own `zarr.json` (its attributes) and the sample index are the conversion's publication of its plan and
journal, which stay in the store: where the attributes cannot be read or differ from those the plan recorded, they
are written again from the plan's copy; where the index fails to open or differs from the journal, it is published
again from the journal (`publish_journal`), as the converter's last step writes it.  Both are checked before any
sample is: the samples are found through them.

Dropping.  With `drop_unrecoverable`, a sample that cannot be repaired (its source file gone or changed) is dropped
from the index: its journal record becomes a skip that says why, and the index and attributes are published again
from the journal, so the store's `skipped` (`h5feed inspect`) names it, loaders no longer see it and the samples
after it move up by one.  A later `h5feed convert SRC DST` leaves it skipped; `--retry-skipped` converts its file
again if it is back.  The journal is rewritten atomically first and the index published from it: a kill anywhere
leaves a journal that the next repair (or convert) publishes again.  A dropped sample's shards stay in the arrays,
unused.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from h5feed.conversion.append import what_changed
from h5feed.conversion.finalize import journaled_rows, publish_journal, published_skips
from h5feed.conversion.lock import WriterLock
from h5feed.conversion.plan import Plan, PlannedSample
from h5feed.conversion.samples import index_columns, published_columns
from h5feed.conversion.tasks import convert_one
from h5feed.errors import SourceError, StoreError
from h5feed.formats import SampleShape, SourceFile, SourceFormat
from h5feed.io import is_remote
from h5feed.io.local import fsync_dir, write_atomically
from h5feed.io.paths import UnsafeName, contained_path, regular_file
from h5feed.store import Store
from h5feed.store.damage import damaged_arrays
from h5feed.store.layout import StoreInfo, create_arrays, crc32c, read_info, write_info
from h5feed.store.journal import JOURNAL_FILE, JournalRecord, read_journal
from h5feed.store.writer_state import PLAN_FILE, WRITER_API, WRITER_SOURCE
from h5feed.verify import Mismatch, check_sample, verify_store

log = logging.getLogger(__name__)

STAGING_DIR = "h5feed-repair"  # in the store: where repaired files are written before they are renamed in
PUBLISHED = ("status", "num_samples", "num_tokens", "skipped")  # the attributes a publication sets, not the plan
DROPPED = "dropped by `h5feed repair --drop-unrecoverable`"  # how a dropped sample's skip record begins


@dataclass
class RepairReport:
    """What a repair did: the samples it re-encoded (store indices), the shard files it replaced, the metadata and
    companion files it wrote again, and what it could not repair, each with why (left as it was)."""

    store: Path
    samples_checked: int = 0
    repaired: list[int] = field(default_factory=list)
    shards_replaced: int = 0
    rebuilt: list[str] = field(default_factory=list)  # files written again, as paths in the store
    unrecoverable: list[Mismatch] = field(default_factory=list)
    dropped: list[Mismatch] = field(default_factory=list)  # with drop_unrecoverable: store index then, and why

    @property
    def ok(self) -> bool:
        """Whether the store is sound now."""
        return not self.unrecoverable


def repair(
    store: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *, progress: bool = True,
    durable: bool = True, drop_unrecoverable: bool = False,
) -> RepairReport:
    """Find the damage `h5feed verify` finds in the local store `store` and mend it in place from the source files
    and the conversion's plan and journal (see the module docstring): each damaged sample re-encoded bit for bit as
    `h5feed convert` wrote it, damaged metadata, attributes and index written again.

    Args:
        source: the folder the store was converted from (default: the one it recorded), moved or mounted elsewhere.
        durable: fsync each repaired file before it is renamed in, and the folder after (`--no-fsync` turns it off).
        drop_unrecoverable: drop each sample that cannot be repaired from the index, recorded as skipped (why
            included), instead of leaving it as it was.
    """
    if is_remote(os.fspath(store)):
        raise StoreError(store, "is in a bucket: `h5feed repair` mends a local store; copy the store to a local "
                         "folder, repair it there, and upload it again")
    dst = Path(store)
    _plan_of(dst)  # before the lock is taken: a folder that is no converted store is refused, saying why
    report = RepairReport(dst)
    with WriterLock.acquire(dst):
        plan = _plan_of(dst)  # as it is now that no converter can append
        shutil.rmtree(dst / STAGING_DIR, ignore_errors=True)  # what a killed repair left: redone below
        done = read_journal(dst)
        unfinished = len(plan.samples) - sum(i in done for i in range(len(plan.samples)))
        info = _sound_attributes(dst, plan, done, unfinished, report, durable)
        report.rebuilt += _rebuild_metadata(dst, info, plan, durable)
        _republish_if_damaged(dst, info, plan, done, unfinished, report, durable)
        found = verify_store(dst, progress=progress)
        report.samples_checked = found.samples_checked
        damaged = sorted({m.sample for m in found.mismatches if m.sample >= 0})
        others = [m for m in found.mismatches if m.sample < 0]
        if damaged or others:
            src = _source_folder(source, info)
            positions = _repair_samples(dst, src, info, plan, damaged, report, progress, durable)
            for mismatch in others:
                _repair_store_file(dst, src, info, mismatch, report, durable)
            if drop_unrecoverable:
                _drop(dst, plan, done, unfinished, positions, report, durable)
        shutil.rmtree(dst / STAGING_DIR, ignore_errors=True)
    return report


def _plan_of(dst: Path) -> Plan:
    """The conversion's plan; a store without one is refused, saying why (written by open_writer, unfinished, or
    converted by an h5feed that left none)."""
    try:
        return Plan.read(dst)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        plan_problem = exc
    try:
        info: StoreInfo | None = read_info(dst)
    except StoreError:
        if not (dst / PLAN_FILE).exists():
            raise  # no store here at all: says so
        info = None  # the plan is there but damaged, and so are the attributes: said below
    if info is not None and info.source_root == WRITER_SOURCE:
        raise StoreError(dst, f"was written by {WRITER_API}, from no source files: it cannot be repaired from them; "
                         f"`h5feed verify {dst}` lists the damaged samples, which only the program that wrote them "
                         "can write again")
    if info is not None:
        _refuse_unfinished(dst, info)
    raise StoreError(dst, f"has no readable plan ({PLAN_FILE}: {type(plan_problem).__name__}), which says where each "
                     "sample's rows and source file are: it cannot be repaired; convert it again "
                     "(`h5feed convert SRC DST --overwrite`)") from plan_problem


def _refuse_unfinished(dst: Path, info: StoreInfo) -> None:
    if info.status != "complete":
        raise StoreError(dst, "has not finished converting: run the same `h5feed convert` command again to resume it "
                         "(repair mends complete stores)")


def _expected_info(plan: Plan, done: dict[int, JournalRecord]) -> StoreInfo | None:
    """The attributes a conversion that ended with this plan and journal published (None: the plan, written
    before it kept them, has no copy)."""
    if plan.store is None:
        return None
    rows = journaled_rows(plan.samples, done)
    skipped = [s.to_json() for s in published_skips(plan, done)]
    return StoreInfo.from_json({**plan.store, "status": "complete", "num_samples": len(rows),
                                "num_tokens": sum(r.num_tokens for r in rows), "skipped": skipped})


def _sound_attributes(dst: Path, plan: Plan, done: dict[int, JournalRecord], unfinished: int, report: RepairReport,
                      durable: bool) -> StoreInfo:
    """The store's attributes, written again from the plan's copy where they cannot be read or differ from what the
    conversion planned (what its publication sets is left to `_republish_if_damaged`)."""
    try:
        info: StoreInfo | None = read_info(dst)
    except StoreError:
        info = None
        problem = "is missing" if not (dst / "zarr.json").is_file() else "does not hold readable h5feed attributes"
    if info is not None:
        _refuse_unfinished(dst, info)
        planned = {k: v for k, v in (plan.store or {}).items() if k not in PUBLISHED}
        differ = sorted(k for k, v in planned.items() if info.to_json().get(k) != v)
        if not differ:
            return info
        problem = f"holds attributes that differ from those its conversion planned ({', '.join(differ)})"
    expected = _expected_info(plan, done)
    if expected is None:
        raise StoreError(dst, f"zarr.json (the store's attributes) {problem}, and its plan ({PLAN_FILE}) was written "
                         "by an h5feed that kept no copy of them, so repair cannot write them again: convert the "
                         "store again (`h5feed convert SRC DST --overwrite`)")
    if unfinished:
        raise StoreError(dst, f"zarr.json (the store's attributes) {problem}, and its journal lacks {unfinished} of "
                         "the plan's samples (a conversion or append that did not finish): convert the store again "
                         "(`h5feed convert SRC DST --overwrite`)")
    log.warning("%s: zarr.json %s: writing it again from the plan", dst, problem)
    scratch = dst / STAGING_DIR / "attributes"
    create_arrays(scratch, expected, plan.total_rows)  # the group's document as conversion creates it
    write_atomically(dst / "zarr.json", (scratch / "zarr.json").read_bytes(), durable=durable)
    write_info(dst, expected, durable=durable)  # as the publication writes it
    shutil.rmtree(scratch)
    report.rebuilt.append("zarr.json")
    return expected


def _index_problem(dst: Path, info: StoreInfo, plan: Plan, done: dict[int, JournalRecord],
                   unfinished: int) -> str | None:
    """What is wrong with the published samples (the index and the attributes' count of it) against the journal,
    or None.  With an append unfinished the journal holds samples not published yet: the index must only open."""
    try:
        Store(dst)
    except StoreError as exc:
        return exc.problem
    if unfinished:
        return None
    expected = _expected_info(plan, done)
    published = (info.num_samples, info.num_tokens, info.skipped)
    rows = journaled_rows(plan.samples, done)
    if expected is not None and published != (expected.num_samples, expected.num_tokens, expected.skipped):
        return f"its attributes publish {info.num_samples} samples, its journal {expected.num_samples}"
    want = index_columns(rows, len(info.array_names))
    have = published_columns(dst)
    for name, column in want.items():
        if not np.array_equal(have[name], column):
            return f"index/{name} differs from what the conversion's journal ({JOURNAL_FILE}) holds"
    return None


def _republish_if_damaged(dst: Path, info: StoreInfo, plan: Plan, done: dict[int, JournalRecord], unfinished: int,
                          report: RepairReport, durable: bool) -> None:
    """Publish the index again from the journal where it fails to open or disagrees with it."""
    problem = _index_problem(dst, info, plan, done, unfinished)
    if problem is None:
        return
    if unfinished:
        raise StoreError(dst, f"{problem}; its journal lacks {unfinished} of the plan's samples (an append that did "
                         "not finish, or a damaged journal): run the same `h5feed convert SRC DST` again, which "
                         "finishes an append and rebuilds the index")
    log.warning("%s: %s: publishing the index again from the journal", dst, problem)
    publish_journal(dst, plan, done, durable)
    Store(dst)  # the published index must open
    report.rebuilt.append("index")


def what_to_run(store: Path | str) -> str:
    """What `h5feed verify` tells the user to run on a store it found damaged."""
    if is_remote(str(store)):
        return f"`h5feed repair` mends a local store: copy {store} to a local folder and repair it there"
    try:
        written = read_info(Path(store)).source_root == WRITER_SOURCE
    except StoreError:
        written = False
    if written:
        return (f"it was written by {WRITER_API}, from no source files: the program that wrote the damaged samples "
                "must write them again")
    return f"run `h5feed repair {store}` to re-encode the damaged samples from their source files"


def _source_folder(source: str | os.PathLike[str] | None, info: StoreInfo) -> Path:
    if source is None and is_remote(info.source_root):
        raise SourceError(info.source_root, "is a bucket: `h5feed repair` reads the source files from a folder, and "
                          "the plan recorded the bucket's sizes and times, not a copy's; convert the store again")
    folder = Path(source if source is not None else info.source_root)
    if not folder.is_dir():
        raise SourceError(folder, "is not a folder: pass --from the folder the store was converted from "
                          f"({info.source_root}), wherever it is now")
    return folder


def _rebuild_metadata(dst: Path, info: StoreInfo, plan: Plan, durable: bool) -> list[str]:
    """Write again, as conversion created it, the metadata of each token array that zarr cannot open or that
    disagrees with the attributes: it holds nothing but what the attributes say, and the rows."""
    import zarr

    damaged = damaged_arrays(dst, info)
    if not damaged:
        return []
    if not info.sharded:
        raise StoreError(dst, f"{'; '.join(damaged.values())}; the store is in an older format (unsharded) whose "
                         "metadata repair cannot rebuild: convert it again")
    sound = [zarr.open_array(dst / name, mode="r").shape[0] for name in info.array_names if name not in damaged]
    scratch = dst / STAGING_DIR / "metadata"
    create_arrays(scratch, info, min(sound) if sound else plan.total_rows)
    rebuilt = []
    for name, problem in damaged.items():
        log.warning("%s: %s: writing it again", dst, problem)
        (dst / name).mkdir(exist_ok=True)
        write_atomically(dst / name / "zarr.json", (scratch / name / "zarr.json").read_bytes(), durable=durable)
        rebuilt.append(f"{name}/zarr.json")
    shutil.rmtree(scratch)
    return rebuilt


def _repair_samples(dst: Path, src: Path, info: StoreInfo, plan: Plan, damaged: list[int], report: RepairReport,
                    progress: bool, durable: bool) -> dict[int, int]:
    """Re-encode each damaged sample, then check it as verify does; the plan position of each damaged sample
    (by store index) that the plan has."""
    store = Store(dst)
    by_start = {s.start: k for k, s in enumerate(plan.samples)}
    positions: dict[int, int] = {}
    for i in tqdm(damaged, desc="repairing", unit="sample", disable=not progress):
        relpath = store.source_paths[i]
        position = by_start.get(int(store.sample_starts[i]))
        planned = None if position is None else plan.samples[position]
        if planned is None or (planned.relpath, planned.sample_index) != (relpath, int(store.source_indices[i])):
            report.unrecoverable.append(Mismatch(i, relpath, f"the plan ({PLAN_FILE}) has no sample at its rows: the "
                                                 "store was edited; convert it again"))
            continue
        positions[i] = position
        try:
            report.shards_replaced += _repair_sample(dst, src, info, plan, planned, store, i, durable)
        except (SourceError, UnsafeName) as exc:
            report.unrecoverable.append(Mismatch(i, relpath, f"{exc.problem}: left as it was"))
            continue
        report.repaired.append(i)
    fresh = Store(dst)  # the repaired files, not those mapped before
    for i in list(report.repaired):
        still = check_sample(fresh, i)
        if still:
            report.repaired.remove(i)
            report.unrecoverable += [Mismatch(i, m.source_path, f"still damaged after repair: {m.problem}")
                                     for m in still]
    return positions


def _drop(dst: Path, plan: Plan, done: dict[int, JournalRecord], unfinished: int, positions: dict[int, int],
          report: RepairReport, durable: bool) -> None:
    """Drop each unrepaired sample the plan places from the index: its journal record becomes a skip saying why it
    could not be repaired, and the index is published again from the journal."""
    why: dict[int, list[str]] = {}
    for mismatch in report.unrecoverable:
        if mismatch.sample in positions:
            why.setdefault(mismatch.sample, []).append(mismatch.problem.removesuffix(": left as it was"))
    if not why:
        return
    if unfinished:
        raise StoreError(dst, f"cannot drop samples: its journal lacks {unfinished} of the plan's samples (an append "
                         "that did not finish, or a damaged journal): run the same `h5feed convert SRC DST` again "
                         "first")
    for i, problems in why.items():
        reason = f"{DROPPED}: its stored rows fail their checks, and repair could not convert it again " \
                 f"({'; '.join(problems)})"
        done[positions[i]] = JournalRecord.skip(positions[i], reason)
        report.dropped.append(Mismatch(i, plan.samples[positions[i]].relpath, reason))
    log.warning("%s: dropping %d sample(s) from the index", dst, len(why))
    publish_journal(dst, plan, done, durable)
    report.unrecoverable = [m for m in report.unrecoverable if m.sample not in why]


def _repair_sample(dst: Path, src: Path, info: StoreInfo, plan: Plan, planned: PlannedSample, store: Store, i: int,
                   durable: bool) -> int:
    """Convert sample `i` again into the staging folder, check it gives the recorded rows, and rename each of its
    shard files that differs into the store; the files replaced.  A source that changed raises SourceError."""
    path = contained_path(src, planned.relpath)
    try:
        stat = SourceFormat.file_of(path).stat()
    except FileNotFoundError:
        raise SourceError(SourceFormat.file_of(path), "is gone: the sample cannot be converted again") from None
    if planned.size is not None and planned.mtime_ns is not None and \
            (stat.st_size, stat.st_mtime_ns) != (planned.size, planned.mtime_ns):
        raise SourceError(path, what_changed(planned.size, planned.mtime_ns, stat))
    staging = dst / STAGING_DIR / "sample"
    shape = SampleShape(planned.num_tokens, info.hidden_size, info.num_aux_layers, info.source_dtype)
    record = convert_one(plan.options.format, str(staging), SourceFile(path, planned.sample_index, planned.relpath),
                         planned.start, shape, info, durable)
    recorded = [int(c) for c in store.checksums[i]]
    if (list(record.checksum), record.has_loss_mask) != (recorded, bool(store.has_loss_mask[i])):
        shutil.rmtree(staging)
        raise SourceError(path, "gives other rows than it did when it was converted (its size and mtime are the "
                          "same)")
    replaced = _move_in(staging, dst, durable)
    shutil.rmtree(staging)
    return replaced


def _move_in(staging: Path, dst: Path, durable: bool) -> int:
    """Rename each file of `staging` over its counterpart in `dst` where their bytes differ (an atomic rename:
    the old file or the new, never a part); the files moved."""
    moved = 0
    for staged in sorted(p for p in staging.rglob("*") if p.is_file()):
        target = dst / staged.relative_to(staging)
        if target.is_file() and target.read_bytes() == staged.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)  # a shard folder removed with its shards
        os.replace(staged, target)
        if durable:
            fsync_dir(target.parent)
            fsync_dir(target.parent.parent)
        moved += 1
    return moved


def _repair_store_file(dst: Path, src: Path, info: StoreInfo, mismatch: Mismatch, report: RepairReport,
                       durable: bool) -> None:
    """A damaged companion copy copied again from the source folder, if the file there is the one recorded;
    anything else is reported."""
    record = next((r for r in info.companions.values() if r.copy == mismatch.source_path), None)
    if record is None or record.copy is None:
        report.unrecoverable.append(Mismatch(-1, mismatch.source_path, f"{mismatch.problem}; repair cannot rebuild it"))
        return
    try:
        data = regular_file(contained_path(src, record.source)).read_bytes()
    except (UnsafeName, SourceError) as exc:
        problem = exc.problem
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    else:
        if (len(data), crc32c(data)) == (record.nbytes, record.crc32c):
            write_atomically(contained_path(dst, record.copy), data, durable=durable)
            report.rebuilt.append(record.copy)
            return
        problem = "differs from the file recorded at conversion"
    report.unrecoverable.append(Mismatch(-1, record.copy, f"its source {record.source} {problem}: left as it was"))
