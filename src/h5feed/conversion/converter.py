"""`h5feed convert`: per-sample source files to one store, in parallel, resumable, verified, appendable.

Conversion runs in three steps, each safe to kill:

1. *Plan*: probe every source file (shape only), fix the sample order and each
   sample's first row, and write the plan into the store, with each file's size
   and mtime.  Nothing is decided later, so a resumed run writes exactly the
   bytes an uninterrupted one would.
2. *Convert*: workers write samples; each sample owns whole shards, so workers
   never touch the same file, and each shard is written atomically (temporary
   name, fsync, rename).  The main process (the driver) appends each finished
   sample to a journal (fsynced after the sample's shards are).  The workers are
   a local process pool, or the processes of a Dask cluster (`h5feed.conversion.cluster`).
3. *Finalize*: write the sample index, then flip the store's status to
   "complete" (one atomic, fsynced write).  Readers refuse a store before that.

Running the same command again skips the samples in the journal.  The plan and
the journal stay in the store: a damaged index is rebuilt from them.  One writer
at a time: the driver holds the store's `WriterLock` from start to end.

Appending.  The same command on a complete store whose SRC has new files
appends them: the plan grows by the new samples (rows after the last one), the
token arrays are resized (zarr rewrites their metadata atomically), the new
samples are converted into new shards and journaled, and the index is published
again.  Existing samples keep their index and their shard files, untouched.
Files already in the plan are recognised by their path; one whose size or mtime
changed since it was converted is refused (or, with --skip-bad, recorded as
skipped), never silently converted again.  The status stays "complete" all
along, so readers keep working; see `h5feed.conversion.samples.publish_index` for why a reader opening
the store in the middle of an append sees the samples before it, consistently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import io
import json
import logging
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from multiprocessing.context import SpawnContext, SpawnProcess, set_spawning_popen
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from h5feed.conversion.bucket_sources import BucketSources, SourceFetcher, naming
from h5feed.conversion.lock import WriterLock
from h5feed.conversion.publish import BucketPublisher
from h5feed.conversion.samples import (
    IndexRow,
    check_same_shape,
    differing_settings,
    fsync_tree,
    grow_arrays,
    new_store_info,
    publish_samples,
    rows_taken,
    settings_difference,
    with_fp8_scales,
    write_sample,
)
from h5feed.errors import H5feedError, SourceError, StoreError
from h5feed.formats import (
    DEFAULT_LOCK_TIMEOUT_S,
    FORMATS,
    SampleShape,
    SourceFile,
    SourceFormat,
    detect_format,
    last_state_norm_of,
)
from h5feed.formats.checks import check_token_values
from h5feed.io import ObjectError, is_remote
from h5feed.io.local import PARTIAL_SUFFIX, write_atomically
from h5feed.io.paths import contained_path
from h5feed.store import Store, read_ahead
from h5feed.store.damage import damaged_arrays, repair_hint
from h5feed.store.layout import (
    COMPANIONS_DIR,
    DEFAULT_CHUNK_TOKENS,
    MAX_DEFAULT_SHARD_TOKENS,
    LastStateNorm,
    Precision,
    StoreInfo,
    chunk_codec,
    crc32c,
    create_arrays,
    read_info,
)
from h5feed.store.writer_state import (
    JOURNAL_FILE,
    LOCK_FILE,
    PLAN_FILE,
    WRITER_API,
    WRITER_SOURCE,
    holds_no_samples,
    read_journal,
)

log = logging.getLogger(__name__)



@dataclass
class WorkerStats:
    """What one worker did: samples converted, bytes read and written, seconds spent on them."""

    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


@dataclass
class ConvertReport:
    """What a conversion did, for the CLI and for tests."""

    store: Path | str  # a folder, or a bucket's URL
    num_samples: int
    num_tokens: int
    converted_now: int
    resumed: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    seconds_converting: float = 0.0  # the convert step alone (not planning, not finalizing)
    workers: dict[str, WorkerStats] = field(default_factory=dict)  # by worker: host:pid, or a Dask worker's address


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
class _Options:
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

    options: _Options
    samples: tuple[PlannedSample, ...]  # in plan order: a sample's journal records name its position here
    skipped: tuple[dict[str, str], ...]  # the files planning skipped: {"path": relpath, "problem": why}
    total_rows: int  # the token arrays' rows, to the last sample's last shard
    append_from: int | None = None  # once an append extended the plan: the positions a finished run had published
    unfinished: tuple[dict[str, str], ...] = ()  # skipped while their writer wrote them: the next run tries them again
    retried: tuple[int, ...] = ()  # positions skipped while converting whose files --retry-skipped planned again
    # The store's attributes as planned (before any sample was published): what `h5feed repair` writes a damaged
    # zarr.json again from.  None in plans written before it was kept.
    store: dict[str, Any] | None = None

    @classmethod
    def read(cls, dst: Path) -> Plan:
        """The plan of the store `dst`; raises OSError, or ValueError, KeyError or TypeError for one not a plan."""
        plan = json.loads((dst / PLAN_FILE).read_text())
        return cls(_Options(**plan["options"]), tuple(PlannedSample(**s) for s in plan["samples"]),
                   tuple(plan["skipped"]), plan["total_rows"], plan.get("append_from"), tuple(plan.get("unfinished", ())),
                   tuple(plan.get("retried", ())), plan.get("store"))

    def write(self, dst: Path, durable: bool) -> None:
        plan = {"options": self.options.to_json(), "samples": [s.to_json() for s in self.samples],
                "skipped": list(self.skipped), "total_rows": self.total_rows}
        if self.store is not None:
            plan["store"] = self.store
        if self.append_from is not None:
            plan["append_from"] = self.append_from
        if self.unfinished:
            plan["unfinished"] = list(self.unfinished)
        if self.retried:
            plan["retried"] = list(self.retried)
        write_atomically(dst / PLAN_FILE, json.dumps(plan).encode(), durable=durable)

    @property
    def published(self) -> int:
        """The plan positions a finished run published: all of them, until an append extends the plan."""
        return len(self.samples) if self.append_from is None else self.append_from

    def known(self) -> set[str]:
        """The files the plan has seen: planned or skipped (but not those skipped unfinished)."""
        return {s.relpath for s in self.samples} | {s["path"] for s in self.skipped}


class TaskPool(Protocol):
    """Where the per-sample tasks run: a local process pool, this process, or a Dask cluster."""

    shares_page_cache: bool  # whether the workers read files through this machine's page cache

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]: ...
    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], chunksize: int = 1) -> Iterable[Any]: ...
    def slots(self) -> int: ...  # tasks it runs at once
    def __enter__(self) -> TaskPool: ...
    def __exit__(self, *exc: object) -> Any: ...


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    codec: str = "zstd",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    shard_tokens: int | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    durable: bool = True,
    last_state_norm: LastStateNorm | None = None,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    precision: Precision = "exact",
    retry_skipped: bool = False,
) -> ConvertReport:
    """Convert every sample file under `src` into the store `dst`, or append the new ones (see the module docstring).

    `src` and `dst` may be folders or URLs (s3://, gs://, az://, ...): a bucket's sample files are read
    by the workers (`h5feed.conversion.bucket_sources`); a store in a bucket is converted in a local staging folder
    and published object by object, its completion marker last (`h5feed.conversion.publish`).

    Args:
        workers: worker processes (default: the machine's cores); 0 converts in this process.
        last_state_norm: "pre" or "post": whether the files' last hidden state is taken before or after the
            verifier's final norm, for formats whose files may not say it (Model-Optimizer, AngelSlim's vLLM
            backend); required there, refused where it contradicts the files or the format.
        scheduler: run the per-sample work on Dask (`pip install h5feed[dask]`): "local" starts a
            `distributed.LocalCluster` of `workers` processes; "tcp://HOST:PORT" uses the cluster of that
            scheduler, whose workers must reach `src` and `dst` by the same paths as this process.
        shard_tokens: rows per shard, a multiple of `chunk_tokens` (default: the longest sample,
            rounded up, at most 8192), so that a sample is one object per array.
        durable: fsync each shard before its journal line, and the index before the status flip,
            so that a power loss loses no journaled sample (`--no-fsync` turns it off).
        storage_options: fsspec options of a bucket SRC and DST (credentials, endpoint_url, ...).
        staging_dir: local folder of a bucket DST's conversion (default: one per DST under
            ~/.cache/h5feed/staging; keep it to resume), and of the sample files workers fetch from a bucket SRC.
        lock_timeout: seconds to wait for files their writer still holds locked (vLLM's): one still locked then is
            an error, or with skip_bad a recorded skip that the next run appends once it is written.
        precision: "exact" keeps the source's hidden states bit for bit; "fp8" quantizes them (lossy) as
            hs-connectors' fp8 backend does (float8_e4m3fn, one float32 scale per token; `h5feed.store.fp8`),
            about half the size, read back in bfloat16 as its FP8Transfer returns them.
        retry_skipped: on a complete store, try the files it skipped (planning or converting) again (repaired
            since): those that load now are appended, the others stay recorded as skipped (with skip_bad; else
            the first is an error).  Without it, a rerun leaves them as they were.
    """
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
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be at least 1")
    if shard_tokens is not None and (shard_tokens < chunk_tokens or shard_tokens % chunk_tokens):
        raise ValueError(f"shard_tokens must be a multiple of chunk_tokens ({chunk_tokens}), not {shard_tokens}")
    chunk_codec(codec)  # validates the name before anything is written
    if last_state_norm not in (None, "pre", "post"):
        raise ValueError(f"last_state_norm must be 'pre' or 'post', not {last_state_norm!r}")
    if precision not in ("exact", "fp8"):
        raise ValueError(f"precision must be 'exact' or 'fp8', not {precision!r}")
    if not lock_timeout >= 0:
        raise ValueError(f"lock_timeout must be 0 or more seconds, not {lock_timeout!r}")
    settings = _Settings(format, workers, scheduler, codec, chunk_tokens, shard_tokens, skip_bad, overwrite, progress,
                         durable, last_state_norm, lock_timeout, precision, retry_skipped)
    try:
        return _convert_anywhere(src, dst, settings, dict(storage_options or {}), staging_dir)
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


@dataclass(frozen=True)
class _Settings:
    """The caller's choices, as `convert` checked them, handed down whole."""

    format: str | None
    workers: int
    scheduler: str | None
    codec: str
    chunk_tokens: int
    shard_tokens: int | None
    skip_bad: bool
    overwrite: bool
    progress: bool
    durable: bool
    last_state_norm: LastStateNorm | None
    lock_timeout: float
    precision: Precision
    retry_skipped: bool


@dataclass(frozen=True)
class _Listing:
    """What this run found in SRC: the sample files, the entries that are no sample (recorded as skipped), and the
    files their writer was still writing (recorded as skipped too, but tried again by the next run)."""

    files: list[SourceFile]
    unreadable: list[dict[str, str]]
    unfinished: list[dict[str, str]]


@dataclass(frozen=True)
class _Job:
    """One conversion into a local folder, as `_convert_locally` set it up; each step takes it whole."""

    src: Path  # SRC, or a bucket SRC's shadow folder
    source_root: str  # SRC as the store records it: the folder, or the bucket's URL
    dst: Path
    fmt: SourceFormat
    options: _Options
    settings: _Settings
    fetcher: SourceFetcher | None  # a bucket SRC's: fetches each sample file for the worker that reads it
    publisher: BucketPublisher | None  # a bucket DST's: uploads each journaled sample


def _convert_anywhere(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    settings: _Settings,
    options: dict[str, Any],
    staging_dir: str | os.PathLike[str] | None,
) -> ConvertReport:
    """A bucket SRC mirrored into a shadow folder, a bucket DST converted in its staging folder, then published."""
    with contextlib.ExitStack() as stack:
        publisher: BucketPublisher | None = None
        if is_remote(dst):
            publisher = stack.enter_context(BucketPublisher.open(os.fspath(dst).rstrip("/"), options, staging_dir,
                                                                 settings.overwrite))
            stack.enter_context(naming(StoreError, {str(publisher.store): publisher.objects.url}))
            dst, staging_dir = publisher.store, publisher.root
            settings = dataclasses.replace(settings, overwrite=False)  # the publisher started over
        sources: BucketSources | None = None
        if is_remote(src):
            sources = stack.enter_context(BucketSources.open(os.fspath(src), options, staging_dir, settings.skip_bad))
        report = _convert_locally(sources.shadow if sources else Path(src).resolve(), Path(dst), sources, publisher,
                                  settings)
        if publisher is not None:
            publisher.publish_end()
            report.store = publisher.objects.url
        return report


def _convert_locally(
    src_path: Path,
    dst_path: Path,
    sources: BucketSources | None,
    publisher: BucketPublisher | None,
    s: _Settings,
) -> ConvertReport:
    """The conversion into a local folder (a bucket DST's staging store); SRC local or a bucket's shadow."""
    format = s.format or (None if s.overwrite else _planned_format(dst_path))  # a resume reads what the plan read
    if sources is not None and not format:
        sources.materialize_first()  # detection reads the keys of a file
    fmt = FORMATS[format] if format else detect_format(src_path, s.skip_bad)  # type: ignore[index]
    if sources is not None:
        sources.check_format(fmt)
    found = fmt.scan(src_path, s.skip_bad, s.lock_timeout)  # with skip_bad, unreadable entries come back as skips
    for entry in found.skipped:
        log.warning("skipping %s: %s", entry.path, entry.problem)
    options = _Options(fmt.name, s.codec, s.chunk_tokens, s.shard_tokens, s.last_state_norm, s.precision)
    if dst_path.exists() and not s.overwrite and not holds_no_samples(dst_path) and \
            not (dst_path / "zarr.json").exists():  # an open_writer that appended nothing leaves only its locks
        raise StoreError(dst_path, "exists and is not an h5feed store; choose another DST or pass --overwrite")
    job = _Job(src_path, sources.url if sources else str(src_path), dst_path, fmt, options, s,
               sources.fetcher if sources else None, publisher)
    created = not dst_path.exists()
    listing = _Listing(found.files, [*(sources.skipped if sources else []),  # bad keys, bad files
                                     *(e.record() for e in found.skipped if not e.unfinished)],
                       [e.record() for e in found.skipped if e.unfinished])
    try:
        with WriterLock.acquire(dst_path) as lock, _PoolMaker(s.workers, s.scheduler, lock) as pool:
            return _convert(job, pool, listing)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreError(dst_path, "disk full: free space and run the same command to resume") from exc
        raise
    finally:
        if created:  # a run that failed before writing anything leaves no folder behind
            with contextlib.suppress(OSError):
                dst_path.rmdir()


def _convert(job: _Job, pool: _PoolMaker, listing: _Listing) -> ConvertReport:
    """Plan (or resume, or extend the plan of an append), convert what the journal lacks, finalize."""
    started = time.perf_counter()
    dst_path, durable = job.dst, job.settings.durable
    if job.settings.overwrite:
        _clear(dst_path)
    info = read_info(dst_path) if (dst_path / "zarr.json").exists() else None
    if info is not None and info.status != "complete" and not (dst_path / PLAN_FILE).exists():
        _clear(dst_path)  # killed while planning: nothing was converted yet
        info = None
    plan: Plan | None = None
    append: _Append | None = None
    if info is not None and info.source_root == WRITER_SOURCE:
        raise StoreError(dst_path, f"was written by {WRITER_API}, not converted: append to it with open_writer, or "
                         "convert into another DST")
    if info is not None and info.status == "complete":
        _check_complete_matches(dst_path, info, job.options)
        rerun = _plan_of_complete(job, info, listing)
        if rerun is None:  # nothing new, nothing unfinished
            return _check_or_rebuild_index(dst_path, info, durable)
        plan, append = rerun
    elif info is not None:
        plan = _read_plan(job, listing.files)

    if plan is None:
        plan = _make_plan(job, pool(), listing)
    elif append is not None and info is not None:
        plan = _extend_plan(job, pool(), plan, append, info)
    _remove_partial_writes(dst_path)
    grow_arrays(dst_path, plan.total_rows, durable)  # an append's new rows (a no-op otherwise)
    if job.publisher is not None:
        job.publisher.publish_start()
    samples = plan.samples
    done = read_journal(dst_path)
    pending = [i for i in range(len(samples)) if i not in done]
    if info is not None and info.status != "complete":
        log.info("%s: resuming an unfinished conversion: %d of %d samples were done by an earlier run; %d to go",
                 dst_path, len(done), len(samples), len(pending))
    report = ConvertReport(dst_path, 0, 0, 0, sum("checksum" in r for r in done.values()))
    if pending:
        # from the plan, not the listing: a file gone since planning fails to load (and --skip-bad skips it)
        by_relpath = {s.relpath: SourceFile(contained_path(job.src, s.relpath), s.sample_index, s.relpath)
                      for s in samples}
        t0 = time.perf_counter()
        _convert_pending(job, pool(), samples, pending, by_relpath, report)
        report.seconds_converting = time.perf_counter() - t0
        done = read_journal(dst_path)
    skipped = published_skips(plan, done)
    if not any("checksum" in r for r in done.values()):
        raise SourceError(job.src, f"no sample could be converted: all {len(skipped)} were skipped "
                          f"(first: {'; '.join(s['path'] + ': ' + s['problem'] for s in skipped[:3])})")
    _remove_partial_writes(dst_path)  # what a worker killed mid-write left (its sample was redone elsewhere)
    _finalize(dst_path, samples, done, skipped, durable, rebuild=info is not None and _damaged(dst_path))
    info = read_info(dst_path)
    report.num_samples, report.num_tokens, report.skipped = info.num_samples, info.num_tokens, skipped
    report.seconds = time.perf_counter() - started
    return report


def _planned_format(dst: Path) -> str | None:
    try:
        return Plan.read(dst).options.format
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        _finalize(dst, Plan.read(dst).samples, read_journal(dst), info.skipped, durable, rebuild=True)
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


# --- the workers --------------------------------------------------------------------------------


class _PoolMaker:
    """The task pool, started on first use (a run with nothing left to convert starts none), stopped on exit."""

    def __init__(self, workers: int, scheduler: str | None, lock: WriterLock) -> None:
        self.workers, self.scheduler, self.lock = workers, scheduler, lock
        self._pool: TaskPool | None = None

    def __call__(self) -> TaskPool:
        if self._pool is None:
            if self.scheduler is not None:
                from h5feed.conversion.cluster import DaskPool

                self._pool = DaskPool(self.scheduler, self.workers).__enter__()
            else:
                self._pool = (_InlinePool() if self.workers == 0 else _ProcessPool(self.workers)).__enter__()
            self.lock.record_semaphores()  # the pool's, for the next writer to clean up after a SIGKILL
        return self._pool

    def __enter__(self) -> _PoolMaker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.__exit__(*exc)


class _ProcessPool(ProcessPoolExecutor):
    """Spawned worker processes (safe whatever threads torch or zarr started here), that die with the converter."""

    shares_page_cache = True

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, mp_context=_WorkerContext(), initializer=_init_worker,
                         initargs=(os.getpid(),))
        self._workers = workers

    def slots(self) -> int:
        return self._workers


# The first lines a worker's interpreter runs, before it imports anything: Linux kills the worker when the converter
# dies (PR_SET_PDEATHSIG, which fires when the thread that started the worker ends: the driver's, which submits every
# task and lives as long as the conversion), and a worker whose converter died before that exits.  Any later (in the
# initializer) is seconds too late: a spawned worker imports h5feed and torch first (unpickling the initializer, and
# re-running the `h5feed` script), and a converter SIGKILLed meanwhile left it running, with the pool's semaphores.
_DIE_WITH_CONVERTER = """\
import ctypes, os, signal
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):  # not Linux: _exit_when_orphaned watches, once h5feed is imported
    pass
if os.getppid() != {converter}:
    os._exit(1)
"""


class _WorkerPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn (its `_launch`, as of Python 3.10 to 3.13), with `_DIE_WITH_CONVERTER` run first."""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        data = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), data)
            reduction.dump(process_obj, data)
        finally:
            set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            command = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            if command[-3:-2] == ["-c"]:  # [python, flags..., "-c", program, "--multiprocessing-fork"]
                command[-2] = _DIE_WITH_CONVERTER.format(converter=os.getpid()) + command[-2]
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), command, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(data.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))
            os.close(child_r)
            os.close(child_w)


class _WorkerProcess(SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _WorkerPopen:
        return _WorkerPopen(process_obj)


class _WorkerContext(SpawnContext):
    """The spawn start method, with workers that die with the converter (`_WorkerPopen`)."""

    Process = _WorkerProcess


class _InlinePool(Executor):
    """Runs each task at submit time: `workers=0`, for debugging and small jobs."""

    shares_page_cache = True

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def slots(self) -> int:
        return 1


def _init_worker(parent: int) -> None:
    """One core's worth of work per process (the processes are the parallelism); and where the kernel does not kill
    a worker with the converter (`_DIE_WITH_CONVERTER`), a worker exits within a second of the converter's death."""
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_name() -> str:
    """Who runs this task: a Dask worker's address, or host:pid."""
    if "distributed" in sys.modules:
        from distributed import get_worker

        with contextlib.suppress(ValueError):  # not in a Dask worker
            return str(get_worker().address)
    return f"{socket.gethostname()}:{os.getpid()}"


# --- plan -------------------------------------------------------------------------------


def _make_plan(job: _Job, pool: TaskPool, listing: _Listing) -> Plan:
    """Probe every file, check they agree on H, K and dtype, and lay the samples out."""
    fmt, src_root, dst, options, durable = job.fmt, job.src, job.dst, job.options, job.settings.durable
    probed, skipped = _probe(job, pool, listing.files, None)
    shapes = [(source, shape) for source, shape, _ in probed]
    if not probed:
        raise SourceError(src_root, "no readable sample files (all were skipped)")
    reference = probed[0][1]
    chunk_tokens = options.chunk_tokens
    shard_tokens = options.shard_tokens or _default_shard_tokens([shape for _, shape, _ in probed], chunk_tokens)
    planned, row = _lay_out(probed, 0, shard_tokens)
    info = new_store_info(fmt, reference, codec=options.codec, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens,
                          source_root=job.source_root, precision=options.precision,
                          last_state_norm=last_state_norm_of(fmt, src_root, shapes, options.last_state_norm),
                          source_info=fmt.source_info(src_root))
    info = dataclasses.replace(info, companions=_keep_companions(fmt, src_root, dst, durable))
    info = dataclasses.replace(info, format_version=info.format_version_needed)
    create_arrays(dst, info, total_rows=row)
    if durable:
        fsync_tree(dst)
    plan = Plan(options, tuple(planned), tuple(listing.unreadable + skipped), row, unfinished=tuple(listing.unfinished),
                store=info.to_json())
    plan.write(dst, durable)
    return plan


def _keep_companions(fmt: SourceFormat, src_root: Path, dst: Path, durable: bool) -> dict[str, dict[str, Any]]:
    """Copy the small files the trainer needs beside the samples into `companions/`, byte for byte, and record
    each one's size and crc32c (a large one, like NeMo's target embeddings, is recorded only)."""
    kept: dict[str, dict[str, Any]] = {}
    for companion in fmt.companions(src_root):
        data = b""
        try:
            if companion.copy:
                data = companion.path.read_bytes()
                crc, size = crc32c(data), len(data)
            else:
                crc, size = _file_crc32c(companion.path)
        except OSError as exc:
            raise SourceError(companion.path, f"cannot be read ({exc.strerror or exc})") from exc
        kept[companion.relpath] = {"source": companion.relpath, "bytes": size, "crc32c": crc}
        if companion.copy:
            (dst / COMPANIONS_DIR).mkdir(exist_ok=True)
            write_atomically(dst / COMPANIONS_DIR / companion.relpath, data, durable=durable)
            kept[companion.relpath]["copy"] = f"{COMPANIONS_DIR}/{companion.relpath}"
    return kept


def _file_crc32c(path: Path) -> tuple[int, int]:
    """(crc32c, size) of a file, read 16 MiB at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            crc, size = crc32c(block, crc), size + len(block)
    return crc, size


def _probe(
    job: _Job, pool: TaskPool, sources: list[SourceFile], reference: SampleShape | None
) -> tuple[list[tuple[SourceFile, SampleShape, os.stat_result]], list[dict[str, str]]]:
    """Shapes of the sources (each checked against `reference`, or the first one), with their stat
    as planned; and the skipped ones, with skip_bad."""
    probed: list[tuple[SourceFile, SampleShape, os.stat_result]] = []
    skipped: list[dict[str, str]] = []
    results = pool.map(_probe_one, [job.fmt.name] * len(sources), sources, [job.fetcher] * len(sources), chunksize=16)
    progress = job.settings.progress
    for source, result in tqdm(zip(sources, results), total=len(sources), desc="probing", disable=not progress):
        try:
            if isinstance(result, SourceError):
                raise result
            shape, stat = result
            reference = reference or shape
            check_same_shape(source.path, shape, reference, "the first sample")
            _check_same_layout(source, shape, reference)
            probed.append((source, shape, stat))
        except SourceError as exc:
            if not job.settings.skip_bad:
                raise
            log.warning("skipping %s", exc)
            skipped.append({"path": source.relpath, "problem": exc.problem})
    return probed, skipped


def _lay_out(
    probed: list[tuple[SourceFile, SampleShape, os.stat_result]], row: int, shard_tokens: int
) -> tuple[list[PlannedSample], int]:
    """Plan entries for the probed samples from row `row` on, each on a shard boundary; and the row after them."""
    planned = []
    for source, shape, stat in probed:
        planned.append(PlannedSample(source.relpath, source.sample_index, shape.num_tokens, row, stat.st_size,
                                      stat.st_mtime_ns))
        row += rows_taken(shape.num_tokens, shard_tokens)
    return planned, row


def _default_shard_tokens(shapes: list[SampleShape], chunk_tokens: int) -> int:
    """The longest sample rounded up to whole chunks (one object per sample and array), within bounds."""
    longest = max(s.num_tokens for s in shapes)
    cap = max(chunk_tokens, MAX_DEFAULT_SHARD_TOKENS // chunk_tokens * chunk_tokens)
    return min(math.ceil(longest / chunk_tokens) * chunk_tokens, cap)


def _check_same_layout(source: SourceFile, shape: SampleShape, reference: SampleShape) -> None:
    """One store holds one set of optional arrays and one item layout: every sample must agree with the first."""
    if shape.extras != reference.extras:
        def names(s: SampleShape) -> str:
            return ", ".join(f"{e.name} ({e.dtype}, width {e.width})" for e in s.extras) or "none"
        raise SourceError(source.path, f"holds the optional arrays {names(shape)}, but the first sample holds "
                          f"{names(reference)}: convert each set into its own store")
    if shape.layout != reference.layout:
        raise SourceError(source.path, f"is laid out as {shape.layout}, the first sample as {reference.layout}: "
                          "convert each set into its own store")


def _probe_one(
    format_name: str, source: SourceFile, fetcher: SourceFetcher | None = None
) -> tuple[SampleShape, os.stat_result] | SourceError:
    """The file's shape and its stat before reading (a change after it shows at conversion); a bucket's
    file is stat'ed in the shadow (the object's size and mtime as listed) and fetched to be read."""
    try:
        fmt = FORMATS[format_name]  # type: ignore[index]
        stat = fmt.file_of(source.path).stat()
        if fetcher is not None:
            with fetcher.fetched(source) as local:
                return fmt.probe(local), stat
        return fmt.probe(source), stat
    except SourceError as exc:
        return exc
    except OSError as exc:
        return SourceError(source.path, f"cannot be read ({exc.strerror or exc})")


def _check_complete_matches(dst: Path, info: StoreInfo, options: _Options) -> None:
    """A rerun on a complete store asking for another codec, chunk size or format must not pass as done."""
    differ = differing_settings(info, {**options.to_json(), "shard_tokens": options.shard_tokens or info.shard_tokens})
    if differ is not None:
        raise StoreError(dst, f"is complete but was converted with {differ[0]}, not {differ[1]}: run the command "
                         "with the store's settings to append to it, or choose another DST or pass --overwrite")


def _read_plan(job: _Job, sources: list[SourceFile]) -> Plan:
    """The plan of an unfinished conversion, if this command is the same one that started it."""
    dst, options = job.dst, job.options
    try:
        plan = Plan.read(dst)
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise StoreError(dst, f"unfinished store without a readable plan ({exc}); pass --overwrite to start again") from exc
    differ = settings_difference(plan.options.to_json(), options.to_json())
    if differ is not None:
        raise StoreError(dst, f"was started with {differ[0]}, not {differ[1]}: repeat that command to resume, "
                         "or pass --overwrite")
    missing = plan.known() - {s.relpath for s in sources}
    if missing and not job.settings.skip_bad:
        raise StoreError(
            dst, f"source files of the unfinished conversion are gone: {sorted(missing)[:5]}; pass --skip-bad to skip them"
        )
    return plan


# --- append ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Append:
    """What an append adds to the plan: files SRC has that the plan has not seen, and skips to record."""

    new: list[SourceFile]
    skipped: list[dict[str, str]]
    published: int  # plan positions that a finished run published (an unfinished append's stay after it)
    unfinished: list[dict[str, str]]  # what this run found still being written (replaces the plan's)
    retried: list[int] = field(default_factory=list)  # positions whose conversion-time skip `new` supersedes


def _plan_of_complete(job: _Job, info: StoreInfo, listing: _Listing) -> tuple[Plan, _Append | None] | None:
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
    kept = sum("checksum" in r for r in done.values())
    finished = len(done) == len(samples) and (info.num_samples, info.skipped) == (kept, published_skips(plan, done))
    out_of_store = _failed_while_converting(plan, done)  # skipped while converting, or dropped by `h5feed repair`
    failed = out_of_store if job.settings.retry_skipped else {}
    gone: list[dict[str, str]] = []  # the records of the files skipped before that are no longer there
    if job.settings.retry_skipped and (plan.skipped or failed):
        retried = [s for s in plan.skipped if s["path"] not in {p.relpath for p in samples}]
        log.info("%s: trying the %d file(s) skipped before again", dst, len(retried) + len(failed))
        plan = dataclasses.replace(plan, skipped=tuple(s for s in plan.skipped if s not in retried))
        present = {f.relpath for f in listing.files} | {s["path"] for s in listing.unreadable + listing.unfinished}
        gone = [_gone(s["path"], s["problem"]) for s in retried if s["path"] not in present] + \
            [_gone(relpath, done[found[0]]["skipped"]) for relpath, found in failed.items() if relpath not in present]
        for record in gone:
            log.warning("%s: %s %s", dst, record["path"], record["problem"])
    known = plan.known() - set(failed)
    new_skips = [s for s in listing.unreadable if s["path"] not in known] + gone
    for changed, problem in _changed_since_planned(src, plan):
        if changed in out_of_store:
            continue  # none of its samples is in the store: nothing to keep; --retry-skipped plans it again below
        if not job.settings.skip_bad:
            raise SourceError(src / changed, f"{problem}; convert into another DST to take the new content, or pass "
                              "--skip-bad to record it as skipped and keep the samples converted before")
        record = {"path": changed, "problem": f"{problem}; the store keeps the samples converted before"}
        if record not in plan.skipped and record not in new_skips:
            log.warning("skipping %s: %s", src / changed, record["problem"])
            new_skips.append(record)
    new = [s for s in listing.files if s.relpath not in known]
    unfinished_changed = listing.unfinished != list(plan.unfinished)
    if new or new_skips or unfinished_changed:
        if not journal_sound:
            raise StoreError(dst, f"cannot append: its journal ({JOURNAL_FILE}) lacks samples converted before, and "
                             "an append rewrites the index from it; convert into another DST, or pass --overwrite")
        log.info("%s: appending %d new sample file(s) after its %d samples", dst, len(new), info.num_samples)
        superseded = {f.relpath for f in new} | {record["path"] for record in gone}  # planned again, or gone
        retried_positions = sorted(i for relpath in failed for i in failed[relpath] if relpath in superseded)
        return plan, _Append(new, new_skips, len(samples) if finished else published, listing.unfinished,
                             retried_positions)
    if finished or not journal_sound:
        return None  # done, or a damaged journal: the index is checked (and rebuilt from the journal if need be)
    return plan, None  # an append killed before it published its index: finish it


def _gone(relpath: str, problem: str) -> dict[str, str]:
    """The skipped record of a file skipped before (for `problem`) that --retry-skipped no longer finds in SRC."""
    if problem.startswith("is gone: "):
        return {"path": relpath, "problem": problem}  # gone at an earlier retry already
    return {"path": relpath, "problem": f"is gone: it was skipped ({problem}); --retry-skipped found no file to try "
            "again"}


def _failed_while_converting(plan: Plan, done: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
    """The files none of whose samples converted (each skipped while converting, not while planning), with
    their plan positions: planned again after the last sample, they can be retried whole."""
    positions: dict[str, list[int]] = {}
    for i, sample in enumerate(plan.samples):
        positions.setdefault(sample.relpath, []).append(i)
    return {relpath: found for relpath, found in positions.items()
            if all(i not in plan.retried and "skipped" in done.get(i, {}) for i in found)}


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


def _extend_plan(job: _Job, pool: TaskPool, plan: Plan, append: _Append, info: StoreInfo) -> Plan:
    """Probe the new files and plan them after the last row (a sample longer than a shard spans several)."""
    reference = SampleShape(0, info.hidden_size, info.num_aux_layers, info.source_dtype)
    probed, skipped = _probe(job, pool, append.new, reference)
    planned, row = _lay_out(probed, plan.total_rows, info.shard_tokens)
    plan = dataclasses.replace(plan, samples=plan.samples + tuple(planned),
                               skipped=plan.skipped + tuple(append.skipped + skipped), total_rows=row,
                               append_from=append.published, unfinished=tuple(append.unfinished),
                               retried=plan.retried + tuple(append.retried))
    plan.write(job.dst, job.settings.durable)  # from here a rerun resumes it
    return plan


# --- convert ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Converted:
    """What a task sends back: the journal record, or the source's problem; and who did it, how fast."""

    record: dict[str, Any] | None
    error: SourceError | None
    worker: str
    seconds: float


def _convert_task(
    format_name: str,
    dst: str,
    source: SourceFile,
    start: int,
    expected: SampleShape,
    info: StoreInfo,
    durable: bool,
    fetcher: SourceFetcher | None = None,
) -> _Converted:
    """One sample, on a worker.  A bad source comes back as a value, not raised: Dask retries only
    what may pass on another try (a dead worker, a failed write), never a broken file."""
    t0 = time.perf_counter()
    record, error = None, None
    try:
        with fetcher.fetched(source) if fetcher is not None else contextlib.nullcontext(source) as local:
            record = convert_one(format_name, dst, local, start, expected, info, durable)
    except SourceError as exc:
        error = exc
    return _Converted(record, error, _worker_name(), time.perf_counter() - t0)


def _convert_pending(
    job: _Job,
    pool: TaskPool,
    samples: Sequence[PlannedSample],
    pending: list[int],
    by_relpath: dict[str, SourceFile],
    report: ConvertReport,
) -> None:
    """Convert the samples not yet in the journal, twice as many in flight as the pool runs at once;
    each journaled sample is handed to the publisher of a bucket DST."""
    dst, fetcher, publisher, durable = job.dst, job.fetcher, job.publisher, job.settings.durable
    info = read_info(dst)
    bar = tqdm(total=len(samples), initial=len(samples) - len(pending), desc="converting", unit="sample",
               disable=not job.settings.progress, smoothing=0.1)
    failure: BaseException | None = None
    todo = iter(pending)
    in_flight: dict[Future[_Converted], int] = {}
    with open(dst / JOURNAL_FILE, "a") as journal:
        if journal.tell() and not (dst / JOURNAL_FILE).read_text().endswith("\n"):
            journal.write("\n")  # end a line cut short by a kill, or the next record would be lost with it

        def submit_more() -> None:
            while len(in_flight) < 2 * pool.slots():
                i = next(todo, None)
                if i is None:
                    return
                s = samples[i]
                expected = SampleShape(s.num_tokens, info.hidden_size, info.num_aux_layers, info.source_dtype)
                if pool.shares_page_cache and fetcher is None:
                    read_ahead(by_relpath[s.relpath].path)  # the disk reads queued files while workers encode
                in_flight[pool.submit(_convert_task, job.fmt.name, str(dst), by_relpath[s.relpath], s.start, expected,
                                      info, durable, fetcher)] = i

        submit_more()
        while in_flight:
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in finished:
                i = in_flight.pop(future)
                try:
                    result = future.result()
                except OSError as exc:
                    failure = failure or _disk_error(dst, samples[i], exc)
                    continue
                except H5feedError as exc:  # an object of a bucket SRC that cannot be fetched: names it
                    failure = failure or exc
                    continue
                except Exception as exc:  # a crashed worker: BrokenProcessPool, KilledWorker and the like
                    failure = failure or H5feedError(f"converting {samples[i].relpath} failed: {exc!r}")
                    continue
                record = result.record
                if result.error is not None:
                    if not job.settings.skip_bad:
                        failure = failure or result.error
                        continue
                    log.warning("skipping %s", result.error)
                    record = {"skipped": result.error.problem}
                journal.write(json.dumps({"i": i, **record}) + "\n")
                journal.flush()
                if durable:  # after the worker's fsync of the shards: a journaled sample survives power loss
                    os.fsync(journal.fileno())
                if publisher is not None and "checksum" in record:
                    publisher.sample_done(samples[i].start, samples[i].num_tokens, info)
                _count(report, record, result)
                bar.update(1)
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"in {report.bytes_in / elapsed / 1e6:.0f} MB/s, out {report.bytes_out / elapsed / 1e6:.0f} MB/s")
            if failure is None:
                submit_more()
    bar.close()
    if failure is not None:
        raise failure


def _count(report: ConvertReport, record: dict[str, Any], result: _Converted) -> None:
    report.converted_now += "checksum" in record  # a skipped file is counted in skipped only
    report.bytes_in += record.get("bytes_in", 0)
    report.bytes_out += record.get("bytes_out", 0)
    worker = report.workers.setdefault(result.worker, WorkerStats())
    worker.samples += "checksum" in record
    worker.bytes_in += record.get("bytes_in", 0)
    worker.bytes_out += record.get("bytes_out", 0)
    worker.seconds += result.seconds


def _disk_error(dst: Path, sample: PlannedSample, exc: OSError) -> H5feedError:
    if exc.errno == errno.ENOSPC:
        return StoreError(dst, f"disk full while writing {sample.relpath}: free space and run the same command to resume")
    return StoreError(dst, f"writing {sample.relpath} failed: {exc}")


def convert_one(
    format_name: str,
    dst: str,
    source: SourceFile,
    start: int,
    expected: SampleShape,
    info: StoreInfo,
    durable: bool,
) -> dict[str, Any]:
    """Load one source file, check it against the plan (it may have changed since), write its shards into the store
    folder `dst`; in a worker.  `h5feed repair` re-encodes a damaged sample with it, so as the same bytes."""
    fmt = FORMATS[format_name]  # type: ignore[index]
    sample = fmt.load(source)
    num_tokens = expected.num_tokens
    if sample.shape.num_tokens != num_tokens:
        raise SourceError(source.path, f"has {sample.shape.num_tokens} tokens now, {num_tokens} when conversion started")
    check_same_shape(source.path, sample.shape, expected, "the first sample")
    check_token_values(source.path, sample)
    if {e.name: e.record() for e in sample.shape.extras} != info.extra_arrays:
        raise SourceError(source.path, f"holds the optional arrays {[e.name for e in sample.shape.extras]} now, "
                          f"{list(info.extra_arrays)} when conversion started")
    if info.lossy:
        sample = with_fp8_scales(source.path, sample)
    record = write_sample(Path(dst), info, sample, start, durable)
    return {**record, "bytes_in": fmt.source_nbytes(source)}


# --- journal and finalize ----------------------------------------------------------------


def published_skips(plan: Plan, done: dict[int, dict[str, Any]]) -> list[dict[str, str]]:
    """The store's `skipped`: what planning skipped, then the files still being written, then the files that failed
    to convert (or that `h5feed repair` dropped), in plan order."""
    return list(plan.skipped) + list(plan.unfinished) + [
        {"path": plan.samples[i].relpath, "problem": r["skipped"]} for i, r in sorted(done.items())
        if "skipped" in r and i not in plan.retried
    ]


def journaled_rows(samples: Sequence[PlannedSample], done: dict[int, dict[str, Any]]) -> list[IndexRow]:
    """The index rows of the samples the journal holds converted, in plan order: what the index publishes."""
    return [IndexRow(samples[i].start, samples[i].num_tokens, samples[i].sample_index, samples[i].relpath,
                     done[i]["checksum"], done[i]["has_loss_mask"])
            for i in range(len(samples)) if "checksum" in done.get(i, {})]


def publish_journal(dst: Path, plan: Plan, done: dict[int, dict[str, Any]], durable: bool) -> None:
    """Publish the samples the journal `done` holds, the index written anew: `h5feed repair`'s rebuild of a
    damaged index, and its publication of the samples it drops (recorded in `done` as skipped)."""
    _finalize(dst, plan.samples, done, published_skips(plan, done), durable, rebuild=True)


def _finalize(
    dst: Path, samples: Sequence[PlannedSample], done: dict[int, dict[str, Any]], skipped: list[dict[str, str]],
    durable: bool, rebuild: bool = False,
) -> None:
    """Rewrite the journal in plan order, then publish the samples it holds (index, then status)."""
    journal = "".join(json.dumps({"i": i, **done[i]}) + "\n" for i in sorted(done))
    write_atomically(dst / JOURNAL_FILE, journal.encode(), durable=durable)  # the same bytes however the run went
    publish_samples(dst, journaled_rows(samples, done), skipped, durable, rebuild)


def _remove_partial_writes(dst: Path) -> None:
    """Shards (and zarr's own files) are written as NAME.<id>.partial and renamed: a kill can leave one behind."""
    for path in dst.rglob(f"*{PARTIAL_SUFFIX}"):
        path.unlink()
