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
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from h5feed.conversion.converter import Plan, PlannedSample, convert_one, what_changed
from h5feed.conversion.lock import WriterLock
from h5feed.errors import SourceError, StoreError
from h5feed.formats import SampleShape, SourceFile, SourceFormat
from h5feed.io import is_remote
from h5feed.io.local import fsync_dir, write_atomically
from h5feed.io.paths import UnsafeName, contained_path, regular_file
from h5feed.store import Store
from h5feed.store.layout import StoreInfo, create_arrays, crc32c, read_info
from h5feed.store.reader import damaged_arrays
from h5feed.store.writer_state import PLAN_FILE, WRITER_API, WRITER_SOURCE
from h5feed.verify import Mismatch, check_sample, verify_store

log = logging.getLogger(__name__)

STAGING_DIR = "h5feed-repair"  # in the store: where repaired files are written before they are renamed in


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

    @property
    def ok(self) -> bool:
        """Whether the store is sound now."""
        return not self.unrecoverable


def repair(
    store: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *, progress: bool = True,
    durable: bool = True,
) -> RepairReport:
    """Find the damage `h5feed verify` finds in the local store `store` and mend it in place from the source files
    (see the module docstring): each damaged sample re-encoded bit for bit as `h5feed convert` wrote it.

    Args:
        source: the folder the store was converted from (default: the one it recorded), moved or mounted elsewhere.
        durable: fsync each repaired file before it is renamed in, and the folder after (`--no-fsync` turns it off).
    """
    if is_remote(os.fspath(store)):
        raise StoreError(store, "is in a bucket: `h5feed repair` mends a local store; copy the store to a local "
                         "folder, repair it there, and upload it again")
    dst = Path(store)
    info = read_info(dst)
    if info.source_root == WRITER_SOURCE:
        raise StoreError(dst, f"was written by {WRITER_API}, from no source files: it cannot be repaired from them; "
                         f"`h5feed verify {dst}` lists the damaged samples, which only the program that wrote them "
                         "can write again")
    if info.status != "complete":
        raise StoreError(dst, "has not finished converting: run the same `h5feed convert` command again to resume it "
                         "(repair mends complete stores)")
    try:
        plan = Plan.read(dst)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(dst, f"has no readable plan ({PLAN_FILE}: {type(exc).__name__}), which says where each "
                         "sample's rows and source file are: it cannot be repaired; convert it again "
                         "(`h5feed convert SRC DST --overwrite`)") from exc
    report = RepairReport(dst)
    with WriterLock.acquire(dst):
        shutil.rmtree(dst / STAGING_DIR, ignore_errors=True)  # what a killed repair left: redone below
        report.rebuilt += _rebuild_metadata(dst, info, plan, durable)
        found = verify_store(dst, progress=progress)
        report.samples_checked = found.samples_checked
        damaged = sorted({m.sample for m in found.mismatches if m.sample >= 0})
        others = [m for m in found.mismatches if m.sample < 0]
        if damaged or others:
            src = _source_folder(source, info)
            _repair_samples(dst, src, info, plan, damaged, report, progress, durable)
            for mismatch in others:
                _repair_store_file(dst, src, info, mismatch, report, durable)
        shutil.rmtree(dst / STAGING_DIR, ignore_errors=True)
    return report


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
                    progress: bool, durable: bool) -> None:
    """Re-encode each damaged sample, then check it as verify does."""
    store = Store(dst)
    by_start = {s.start: s for s in plan.samples}
    for i in tqdm(damaged, desc="repairing", unit="sample", disable=not progress):
        relpath = store.source_paths[i]
        planned = by_start.get(int(store.sample_starts[i]))
        if planned is None or (planned.relpath, planned.sample_index) != (relpath, int(store.source_indices[i])):
            report.unrecoverable.append(Mismatch(i, relpath, f"the plan ({PLAN_FILE}) has no sample at its rows: the "
                                                 "store was edited; convert it again"))
            continue
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
    if (record["checksum"], record["has_loss_mask"]) != (recorded, bool(store.has_loss_mask[i])):
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
    record: dict[str, Any] | None = next((r for r in info.companions.values() if r.get("copy") == mismatch.source_path),
                                         None)
    if record is None:
        report.unrecoverable.append(Mismatch(-1, mismatch.source_path, f"{mismatch.problem}; repair cannot rebuild it"))
        return
    try:
        data = regular_file(contained_path(src, record["source"])).read_bytes()
    except (UnsafeName, SourceError) as exc:
        problem = exc.problem
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    else:
        if (len(data), crc32c(data)) == (record["bytes"], record["crc32c"]):
            write_atomically(contained_path(dst, record["copy"]), data, durable=durable)
            report.rebuilt.append(record["copy"])
            return
        problem = "differs from the file recorded at conversion"
    report.unrecoverable.append(Mismatch(-1, record["copy"],
                                         f"its source {record['source']} {problem}: left as it was"))
