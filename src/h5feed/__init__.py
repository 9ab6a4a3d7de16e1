"""h5feed: the fastest, most trustworthy way to feed large per-sample hidden states to a GPU trainer."""

from h5feed.conversion import (
    BucketOptions,
    ConvertReport,
    RepairReport,
    RunOptions,
    SkipPolicy,
    StoreSettings,
    StoreWriter,
    WriteOptions,
    WriterReport,
    convert,
    open_writer,
    repair,
)
from h5feed.errors import CorruptSampleError, H5feedError, PathError, SourceError, StoreError, WorkerDiedError
from h5feed.flavors import TrainerCollate, trainer_collate
from h5feed.loading.backends.cuda import CudaOptions
from h5feed.loading.backends.threads import ThreadsOptions
from h5feed.loading.backends.workers import WorkersOptions
from h5feed.loading.batch_loader import BatchLoader, CudaBatchLoader
from h5feed.loading.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader, select_samples, split_samples
from h5feed.loading.follow import Follow
from h5feed.loading.options import ReadOptions, ScheduleOptions, StoreOptions
from h5feed.observe import Monitor, monitor
from h5feed.observe.metrics import LoaderCounters, LoaderSnapshot
from h5feed.store import RawSample, Store
from h5feed.verify import describe_store, verify_store

__version__ = "0.1.0"

__all__ = [
    "BatchLoader",
    "BucketOptions",
    "ConvertReport",
    "CorruptSampleError",
    "CudaBatchLoader",
    "CudaOptions",
    "Follow",
    "H5feedError",
    "HiddenStatesDataset",
    "HiddenStatesStream",
    "LoaderCounters",
    "LoaderSnapshot",
    "Monitor",
    "PathError",
    "RawSample",
    "ReadOptions",
    "RepairReport",
    "RunOptions",
    "ScheduleOptions",
    "SkipPolicy",
    "SourceError",
    "Store",
    "StoreError",
    "StoreOptions",
    "StoreSettings",
    "StoreWriter",
    "StreamLoader",
    "ThreadsOptions",
    "TrainerCollate",
    "WorkerDiedError",
    "WorkersOptions",
    "WriteOptions",
    "WriterReport",
    "convert",
    "describe_store",
    "monitor",
    "open_writer",
    "repair",
    "select_samples",
    "split_samples",
    "trainer_collate",
    "verify_store",
]
