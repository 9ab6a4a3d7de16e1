"""`h5feed convert` (`h5feed.convert`): per-sample source files into one store, bit for bit, crash-safe and resumable.

- `options`: the typed, frozen groups `convert` and `open_writer` take beyond their common arguments;
- `converter`: `convert` itself, the driver that runs the steps below in order (`job`: what they share);
- `plan` and `planning`: the plan file's contents, and the step that probes the sources and writes it;
- `append`: a rerun on a complete store, and the plan an append extends;
- `tasks`: the convert step, the per-sample tasks and their journal lines;
- `finalize`: the journal rewritten in plan order, the index published, the status flipped;
- `pool`: where the tasks run (spawned workers that die with the converter), and the semaphores they leave;
- `samples`: a sample's shards, the arrays' growth and the index publication, shared with the writer;
- `repair`: a damaged store mended in place from its source files (`h5feed repair`);
- `writer`: `open_writer`, extraction code appending samples straight into a store;
- `cluster`: the same per-sample tasks on a Dask cluster (`--scheduler`, `--dask`);
- `bucket_sources`: sources listed and fetched from a bucket;
- `publish`: a store in a bucket, converted in a local staging folder and published object by object;
- `lock`: one writer at a time, on a folder (flock) or in a bucket (conditional PUT and heartbeat).
"""

from h5feed.conversion.converter import ConvertReport, convert
from h5feed.conversion.options import BucketOptions, RunOptions, SkipPolicy, StoreSettings, WriteOptions
from h5feed.conversion.repair import RepairReport, repair
from h5feed.conversion.writer import StoreWriter, WriterReport, open_writer

__all__ = ["BucketOptions", "ConvertReport", "RepairReport", "RunOptions", "SkipPolicy", "StoreSettings", "StoreWriter",
           "WriteOptions", "WriterReport", "convert", "open_writer", "repair"]
