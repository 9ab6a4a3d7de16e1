"""`h5feed convert`: per-sample source files to one store, in parallel, resumable, verified, appendable.

Conversion runs in three steps, each safe to kill, each in a module of its own:

1. *Plan* (`planning`, the plan's contents in `plan`): probe every source file (shape only), fix the
   sample order and each sample's first row, and write the plan into the store, with each file's size
   and mtime.  Nothing is decided later, so a resumed run writes exactly the bytes an uninterrupted one
   would.
2. *Convert* (`tasks`): workers write samples; each sample owns whole shards, so workers never touch the
   same file, and each shard is written atomically (temporary name, fsync, rename).  The main process
   (the driver) appends each finished sample to a journal (fsynced after the sample's shards are).  The
   workers are a local process pool (`pool`), or the processes of a Dask cluster (`cluster`).
3. *Finalize* (`finalize`): write the sample index, then flip the store's status to "complete" (one
   atomic, fsynced write).  Readers refuse a store before that.

Running the same command again skips the samples in the journal.  The plan and the journal stay in
the store: a damaged index is rebuilt from them.  One writer at a time: the driver holds the store's
`WriterLock` from start to end.  The same command on a complete store whose SRC has new files appends
them (`append`); see `h5feed.conversion.samples.publish_index` for why a reader opening the store in
the middle of an append sees the samples before it, consistently.

This module is the driver: it checks the caller's choices, sets up a bucket SRC or DST, takes the
lock, and runs the steps in order (`Job`, `Request` and the report are `job`'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from h5feed.conversion.append import Append, check_complete_matches, extend_plan, plan_of_complete
from h5feed.conversion.bucket_sources import BucketSources, naming
from h5feed.conversion.finalize import finalize, published_skips, remove_partial_writes
from h5feed.conversion.job import ConvertReport, Job, Listing, Request
from h5feed.conversion.lock import WriterLock
from h5feed.conversion.options import BucketOptions, RunOptions, SkipPolicy, StoreSettings
from h5feed.conversion.plan import Plan, PlanOptions, planned_format
from h5feed.conversion.planning import make_plan, read_plan
from h5feed.conversion.pool import PoolMaker
from h5feed.conversion.publish import BucketPublisher
from h5feed.conversion.samples import grow_arrays
from h5feed.conversion.tasks import convert_pending
from h5feed.errors import H5feedError, SourceError, StoreError
from h5feed.formats import FORMATS, SourceFile, detect_format
from h5feed.io import ObjectError, is_remote
from h5feed.io.paths import contained_path
from h5feed.store import Store
from h5feed.store.attributes import SkippedFile
from h5feed.store.journal import JOURNAL_FILE, read_journal
from h5feed.store.layout import StoreInfo, chunk_codec, read_info
from h5feed.store.damage import damaged_arrays, repair_hint
from h5feed.store.writer_state import LOCK_FILE, PLAN_FILE, WRITER_API, WRITER_SOURCE, holds_no_samples

__all__ = ["ConvertReport", "convert"]

log = logging.getLogger(__name__)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    settings: StoreSettings | None = None,
    run: RunOptions | None = None,
    skips: SkipPolicy | None = None,
    bucket: BucketOptions | None = None,
) -> ConvertReport:
    """Convert every sample file under `src` into the store `dst`, or append the new ones (see the module docstring).

    `src` and `dst` may be folders or URLs (s3://, gs://, az://, ...): a bucket's sample files are read
    by the workers (`h5feed.conversion.bucket_sources`); a store in a bucket is converted in a local staging folder
    and published object by object, its completion marker last (`h5feed.conversion.publish`).

    Args:
        format: the source format (default: detected; a resume reads what the plan read).
        workers: worker processes (default: the machine's cores); 0 converts in this process.
        overwrite: delete `dst` first.
        settings: what the store is written with (codec, chunking, precision, the last state's norm): see
            `StoreSettings` (None: its defaults); a resume or an append must give the same.
        run: where the tasks run (a Dask scheduler) and whether the conversion fsyncs: see `RunOptions`.
        skips: what a file that cannot be converted does (an error, or a recorded skip), and what a rerun retries:
            see `SkipPolicy`.
        bucket: how a bucket SRC or DST is reached, and where its work is staged: see `BucketOptions`.
    """
    settings, run, skips, bucket = settings or StoreSettings(), run or RunOptions(), skips or SkipPolicy(), \
        bucket or BucketOptions()
    s, scheduler = settings, run.scheduler
    _refuse_a_worker_rerun()
    if scheduler is not None and scheduler != "local" and workers is not None:
        raise ValueError(f"workers sets the size of the local pool or of scheduler='local'; the cluster at "
                         f"{scheduler} has the workers it has")
    if scheduler is not None and workers == 0:
        raise ValueError("workers=0 converts in this process; with a scheduler, give 1 or more")
    if scheduler is not None:
        from h5feed.conversion.cluster import require_distributed

        require_distributed()  # before anything is read or written
    workers = os.cpu_count() or 1 if workers is None else workers
    if s.chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    if s.shard_tokens is not None and (s.shard_tokens < s.chunk_tokens or s.shard_tokens % s.chunk_tokens):
        raise ValueError(f"shard_tokens must be a multiple of chunk_tokens ({s.chunk_tokens}), not {s.shard_tokens}")
    chunk_codec(s.codec)  # validates the name before anything is written
    if s.last_state_norm not in (None, "pre", "post"):
        raise ValueError(f"last_state_norm must be 'pre' or 'post', not {s.last_state_norm!r}")
    if s.precision not in ("exact", "fp8"):
        raise ValueError(f"precision must be 'exact' or 'fp8', not {s.precision!r}")
    if not skips.lock_timeout >= 0:
        raise ValueError(f"lock_timeout must be 0 or more seconds, not {skips.lock_timeout!r}")
    request = Request(format, workers, overwrite, progress, settings, run, skips)
    try:
        return _convert_anywhere(src, dst, request, dict(bucket.storage_options or {}), bucket.staging_dir)
    except ObjectError as exc:  # a bucket that failed mid-run: what was converted and published is kept
        raise type(exc)(exc.path, f"{exc.problem}; then run the same command again to resume") from exc


def _refuse_a_worker_rerun() -> None:
    """Refuse a call made by the top level of a script that a worker process is running again as it starts.

    Worker processes are spawned: each runs the main script's top level again (as `__mp_main__`) before its
    first task.  An unguarded `h5feed.convert(...)` there would convert again from every worker, and finds the
    store locked by the converter that started them: the error would blame "another h5feed convert"."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise H5feedError(
                f"{frame.f_code.co_filename}: calls h5feed.convert at its top level, which every worker process "
                "of the conversion runs again as it starts; put the call under `if __name__ == \"__main__\":`")
        frame = frame.f_back


def _convert_anywhere(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    request: Request,
    options: dict[str, Any],
    staging_dir: str | os.PathLike[str] | None,
) -> ConvertReport:
    """A bucket SRC mirrored into a shadow folder, a bucket DST converted in its staging folder, then published."""
    with contextlib.ExitStack() as stack:
        publisher: BucketPublisher | None = None
        if is_remote(dst):
            publisher = stack.enter_context(BucketPublisher.open(os.fspath(dst).rstrip("/"), options, staging_dir,
                                                                 request.overwrite))
            stack.enter_context(naming(StoreError, {str(publisher.store): publisher.objects.url}))
            dst, staging_dir = publisher.store, publisher.root
            request = dataclasses.replace(request, overwrite=False)  # the publisher started over
        sources: BucketSources | None = None
        if is_remote(src):
            sources = stack.enter_context(BucketSources.open(os.fspath(src), options, staging_dir,
                                                             request.skips.skip_bad))
        report = _convert_locally(sources.shadow if sources else Path(src).resolve(), Path(dst), sources, publisher,
                                  request)
        if publisher is not None:
            publisher.publish_end()
            report.store = publisher.objects.url
        return report


def _convert_locally(
    src_path: Path,
    dst_path: Path,
    sources: BucketSources | None,
    publisher: BucketPublisher | None,
    r: Request,
) -> ConvertReport:
    """The conversion into a local folder (a bucket DST's staging store); SRC local or a bucket's shadow."""
    format = r.format or (None if r.overwrite else planned_format(dst_path))  # a resume reads what the plan read
    if sources is not None and not format:
        sources.materialize_first()  # detection reads the keys of a file
    fmt = FORMATS[format] if format else detect_format(src_path, r.skips.skip_bad)  # type: ignore[index]
    if sources is not None:
        sources.check_format(fmt)
    found = fmt.scan(src_path, r.skips.skip_bad, r.skips.lock_timeout)  # with skip_bad, unreadable entries: skips
    for entry in found.skipped:
        log.warning("skipping %s: %s", entry.path, entry.problem)
    s = r.settings
    options = PlanOptions(fmt.name, s.codec, s.chunk_tokens, s.shard_tokens, s.last_state_norm, s.precision)
    if dst_path.exists() and not r.overwrite and not holds_no_samples(dst_path) and \
            not (dst_path / "zarr.json").exists():  # an open_writer that appended nothing leaves only its locks
        raise StoreError(dst_path, "exists and is not an h5feed store; choose another DST or pass --overwrite")
    job = Job(src_path, sources.url if sources else str(src_path), dst_path, fmt, options, r,
              sources.fetcher if sources else None, publisher)
    created = not dst_path.exists()
    listing = Listing(found.files, [*(sources.skipped if sources else []),  # bad keys, bad files
                                    *(SkippedFile(e.relpath, e.problem) for e in found.skipped if not e.unfinished)],
                      [SkippedFile(e.relpath, e.problem) for e in found.skipped if e.unfinished])
    try:
        with WriterLock.acquire(dst_path) as lock, PoolMaker(r.workers, r.run.scheduler, lock.record_semaphores) as pool:
            return _convert(job, pool, listing)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreError(dst_path, "disk full: free space and run the same command to resume") from exc
        raise
    finally:
        if created:  # a run that failed before writing anything leaves no folder behind
            with contextlib.suppress(OSError):
                dst_path.rmdir()


def _convert(job: Job, pool: PoolMaker, listing: Listing) -> ConvertReport:
    """Plan (or resume, or extend the plan of an append), convert what the journal lacks, finalize."""
    started = time.perf_counter()
    dst_path, durable = job.dst, job.request.run.durable
    if job.request.overwrite:
        _clear(dst_path)
    info = read_info(dst_path) if (dst_path / "zarr.json").exists() else None
    if info is not None and info.status != "complete" and not (dst_path / PLAN_FILE).exists():
        _clear(dst_path)  # killed while planning: nothing was converted yet
        info = None
    plan: Plan | None = None
    append: Append | None = None
    if info is not None and info.source_root == WRITER_SOURCE:
        raise StoreError(dst_path, f"was written by {WRITER_API}, not converted: append to it with open_writer, or "
                         "convert into another DST")
    if info is not None and info.status == "complete":
        check_complete_matches(dst_path, info, job.options)
        rerun = plan_of_complete(job, info, listing)
        if rerun is None:  # nothing new, nothing unfinished
            return _check_or_rebuild_index(dst_path, info, durable)
        plan, append = rerun
    elif info is not None:
        plan = read_plan(job, listing.files)

    if plan is None:
        plan = make_plan(job, pool(), listing)
    elif append is not None and info is not None:
        plan = extend_plan(job, pool(), plan, append, info)
    remove_partial_writes(dst_path)
    grow_arrays(dst_path, plan.total_rows, durable)  # an append's new rows (a no-op otherwise)
    if job.publisher is not None:
        job.publisher.publish_start()
    samples = plan.samples
    done = read_journal(dst_path)
    pending = [i for i in range(len(samples)) if i not in done]
    if info is not None and info.status != "complete":
        log.info("%s: resuming an unfinished conversion: %d of %d samples were done by an earlier run; %d to go",
                 dst_path, len(done), len(samples), len(pending))
    report = ConvertReport(dst_path, 0, 0, 0, sum(r.converted for r in done.values()))
    if pending:
        # from the plan, not the listing: a file gone since planning fails to load (and --skip-bad skips it)
        by_relpath = {s.relpath: SourceFile(contained_path(job.src, s.relpath), s.sample_index, s.relpath)
                      for s in samples}
        t0 = time.perf_counter()
        convert_pending(job, pool(), samples, pending, by_relpath, report)
        report.seconds_converting = time.perf_counter() - t0
        done = read_journal(dst_path)
    skipped = published_skips(plan, done)
    if not any(r.converted for r in done.values()):
        raise SourceError(job.src, f"no sample could be converted: all {len(skipped)} were skipped "
                          f"(first: {'; '.join(s.path + ': ' + s.problem for s in skipped[:3])})")
    remove_partial_writes(dst_path)  # what a worker killed mid-write left (its sample was redone elsewhere)
    finalize(dst_path, samples, done, skipped, durable, rebuild=info is not None and _damaged(dst_path))
    info = read_info(dst_path)
    report.num_samples, report.num_tokens, report.skipped = info.num_samples, info.num_tokens, skipped
    report.seconds = time.perf_counter() - started
    return report


def _clear(dst: Path) -> None:
    """Remove everything in the store but the writer's lock."""
    for path in dst.iterdir():
        if path.name != LOCK_FILE:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _check_or_rebuild_index(dst: Path, info: StoreInfo, durable: bool) -> ConvertReport:
    """A complete store: nothing to do if its index is sound; a damaged one is rebuilt from the plan and
    journal the conversion left in the store, or reported with what to run."""
    try:
        Store(dst)
        skipped = len(info.skipped)
        hint = (f"; {skipped} file(s) were skipped: once repaired, --retry-skipped converts them (appended)"
                if skipped else "")
        log.info("%s is already complete: nothing to do%s (its samples were not read: `h5feed verify %s` checks "
                 "every chunk, and `h5feed repair %s` re-encodes damaged samples from their source files)",
                 dst, hint, dst, dst)
    except StoreError as exc:
        damaged = damaged_arrays(dst, info)
        if damaged:  # not the index: rebuilding it would not help
            problems = "; ".join(damaged.values())
            raise StoreError(dst, f"is complete but damaged: {problems}; {repair_hint(dst)}") from exc
        if not ((dst / PLAN_FILE).exists() and (dst / JOURNAL_FILE).exists()):
            raise StoreError(dst, f"is complete but damaged ({exc.problem}), and has no plan and journal to rebuild "
                             "its index from: pass --overwrite to convert again") from exc
        log.warning("%s: rebuilding the damaged sample index from the plan and journal (%s)", dst, exc.problem)
        finalize(dst, Plan.read(dst).samples, read_journal(dst), info.skipped, durable, rebuild=True)
        Store(dst)  # the rebuilt index must open
        info = read_info(dst)
    return ConvertReport(dst, info.num_samples, info.num_tokens, 0, info.num_samples, info.skipped)


def _damaged(dst: Path) -> bool:
    """Whether a complete store's index fails to open (an append then writes it anew)."""
    if read_info(dst).status != "complete":
        return False
    try:
        Store(dst)
    except StoreError:
        return True
    return False
