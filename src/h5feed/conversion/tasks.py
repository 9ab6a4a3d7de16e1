"""The convert step of `h5feed convert`: each sample the journal lacks, converted by a task and journaled.

A worker runs one task per sample (`convert_one`: load the file, check it against the plan, write its
shards, each atomically); the driver keeps twice as many tasks in flight as the pool runs at once, and
appends each finished sample to the journal, fsynced after the worker fsynced the sample's shards, so
that a journaled sample survives a power loss.  A bad source file comes back from its task as a value,
an error or (with --skip-bad) a recorded skip; a dead worker or a failed write stops the run, which the
same command resumes.  A bucket DST's publisher uploads each journaled sample as it comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from h5feed.conversion.bucket_sources import SourceFetcher
from h5feed.conversion.job import ConvertReport, Job, WorkerStats
from h5feed.conversion.plan import PlannedSample
from h5feed.conversion.pool import TaskPool, worker_name
from h5feed.conversion.samples import check_same_shape, with_fp8_scales, write_sample
from h5feed.errors import H5feedError, SourceError, StoreError
from h5feed.formats import FORMATS, SampleShape, SourceFile
from h5feed.formats.checks import check_token_values
from h5feed.store import read_ahead
from h5feed.store.journal import JOURNAL_FILE, JournalRecord, JournalWriter
from h5feed.store.layout import StoreInfo, read_info

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Converted:
    """What a task sends back: the journal record, or the source's problem; and who did it, how fast."""

    record: JournalRecord | None  # without its plan position: the driver journals it with it
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
    return _Converted(record, error, worker_name(), time.perf_counter() - t0)


def convert_pending(
    job: Job,
    pool: TaskPool,
    samples: Sequence[PlannedSample],
    pending: list[int],
    by_relpath: dict[str, SourceFile],
    report: ConvertReport,
) -> None:
    """Convert the samples not yet in the journal, twice as many in flight as the pool runs at once;
    each journaled sample is handed to the publisher of a bucket DST."""
    dst, fetcher, publisher, durable = job.dst, job.fetcher, job.publisher, job.request.run.durable
    info = read_info(dst)
    bar = tqdm(total=len(samples), initial=len(samples) - len(pending), desc="converting", unit="sample",
               disable=not job.request.progress, smoothing=0.1)
    failure: BaseException | None = None
    todo = iter(pending)
    in_flight: dict[Future[_Converted], int] = {}
    with JournalWriter(dst / JOURNAL_FILE, end_cut_line=True) as journal:

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
                if result.error is not None:
                    if not job.request.skips.skip_bad:
                        failure = failure or result.error
                        continue
                    log.warning("skipping %s", result.error)
                    record = JournalRecord.skip(i, result.error.problem)
                else:
                    assert result.record is not None
                    record = dataclasses.replace(result.record, i=i)
                journal.append(record, sync=durable)  # after the worker's fsync of the shards: survives power loss
                if publisher is not None and record.converted:
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


def _count(report: ConvertReport, record: JournalRecord, result: _Converted) -> None:
    bytes_in, bytes_out = record.bytes_in or 0, record.bytes_out or 0
    report.converted_now += record.converted  # a skipped file is counted in skipped only
    report.bytes_in += bytes_in
    report.bytes_out += bytes_out
    worker = report.workers.setdefault(result.worker, WorkerStats())
    worker.samples += record.converted
    worker.bytes_in += bytes_in
    worker.bytes_out += bytes_out
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
) -> JournalRecord:
    """Load one source file, check it against the plan (it may have changed since), write its shards into the store
    folder `dst`; in a worker.  `h5feed repair` re-encodes a damaged sample with it, so as the same bytes."""
    fmt = FORMATS[format_name]  # type: ignore[index]
    sample = fmt.load(source)
    num_tokens = expected.num_tokens
    if sample.shape.num_tokens != num_tokens:
        raise SourceError(source.path, f"has {sample.shape.num_tokens} tokens now, {num_tokens} when conversion started")
    check_same_shape(source.path, sample.shape, expected, "the first sample")
    check_token_values(source.path, sample)
    if {e.name: e for e in sample.shape.extras} != info.extra_arrays:
        raise SourceError(source.path, f"holds the optional arrays {[e.name for e in sample.shape.extras]} now, "
                          f"{list(info.extra_arrays)} when conversion started")
    if info.lossy:
        sample = with_fp8_scales(source.path, sample)
    record = write_sample(Path(dst), info, sample, start, durable)
    return dataclasses.replace(record, bytes_in=fmt.source_nbytes(source))
