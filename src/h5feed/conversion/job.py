"""What one run of `h5feed convert` works with, handed from step to step whole; and what it reports.

`convert` checks the caller's choices once (`Request`), lists SRC (`Listing`), and sets up one
conversion into a local folder (`Job`): a bucket SRC is read through its shadow folder and a
fetcher, a bucket DST is converted in its staging folder and published.  The steps (planning,
appending, converting, finalizing: one module each) take these whole instead of a dozen arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from h5feed.conversion.bucket_sources import SourceFetcher
from h5feed.conversion.options import RunOptions, SkipPolicy, StoreSettings
from h5feed.conversion.plan import PlanOptions
from h5feed.conversion.publish import BucketPublisher
from h5feed.formats import SourceFile, SourceFormat
from h5feed.store.attributes import SkippedFile


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
    skipped: list[SkippedFile] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    seconds_converting: float = 0.0  # the convert step alone (not planning, not finalizing)
    workers: dict[str, WorkerStats] = field(default_factory=dict)  # by worker: host:pid, or a Dask worker's address


@dataclass(frozen=True)
class Request:
    """The caller's choices, as `convert` checked them, handed down whole."""

    format: str | None
    workers: int
    overwrite: bool
    progress: bool
    settings: StoreSettings
    run: RunOptions
    skips: SkipPolicy


@dataclass(frozen=True)
class Listing:
    """What this run found in SRC: the sample files, the entries that are no sample (recorded as skipped), and the
    files their writer was still writing (recorded as skipped too, but tried again by the next run)."""

    files: list[SourceFile]
    unreadable: list[SkippedFile]
    unfinished: list[SkippedFile]


@dataclass(frozen=True)
class Job:
    """One conversion into a local folder, as `convert` set it up; each step takes it whole."""

    src: Path  # SRC, or a bucket SRC's shadow folder
    source_root: str  # SRC as the store records it: the folder, or the bucket's URL
    dst: Path
    fmt: SourceFormat
    options: PlanOptions
    request: Request
    fetcher: SourceFetcher | None  # a bucket SRC's: fetches each sample file for the worker that reads it
    publisher: BucketPublisher | None  # a bucket DST's: uploads each journaled sample
