"""What `h5feed.convert` and `h5feed.open_writer` are given beyond their common arguments, as typed, frozen groups.

A conversion's settings fall into a few groups, and each group is one object here: what the store is
written with (`StoreSettings`: its codec, chunking and precision, and the last state's norm; recorded in
the store, so that a rerun, an append and every writer of the store give the same), how a bucket SRC or
DST is reached (`BucketOptions`), how `convert` runs (`RunOptions`: where its tasks run, and whether it
fsyncs) and what it does with a file it cannot convert (`SkipPolicy`), and how a writer writes
(`WriteOptions`).  The common arguments stay direct (`src`, `dst`, `format`, `workers`, ...)::

    h5feed.convert("s3://runs/hs", "s3://stores/hs.zarr", workers=8,
                   settings=StoreSettings(precision="fp8"), skips=SkipPolicy(skip_bad=True),
                   bucket=BucketOptions(storage_options={"endpoint_url": "http://minio:9000"}))

`convert` and `open_writer` check the values they are given, with the errors they always gave.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from h5feed.formats import DEFAULT_LOCK_TIMEOUT_S
from h5feed.store.layout import DEFAULT_CHUNK_TOKENS, LastStateNorm, Precision

DEFAULT_BLOCK_SHARDS = 16  # shards a writer reserves at a time: the arrays are grown once per block


@dataclass(frozen=True)
class StoreSettings:
    """What the store is written with, as it records it: every rerun, append and writer of a store gives the same.

    codec: "zstd" (Blosc zstd-1, byte shuffle, 1 MiB blocks), "lz4" (Blosc lz4, bitshuffle) or "none".
    chunk_tokens: rows per inner chunk, the unit of decoding.
    shard_tokens: rows per shard, the unit of storage, a multiple of `chunk_tokens`; a sample starts on a shard
        boundary, and a longer one spans several shards.  None: for `convert`, the longest sample rounded up
        (at most 8192), so that a sample is one object per array; for a writer, which cannot know it, 8192.
    precision: "exact" keeps the source's hidden states bit for bit; "fp8" quantizes them (lossy) as
        hs-connectors' fp8 backend does (float8_e4m3fn, one float32 scale per token; `h5feed.store.fp8`),
        about half the size, read back in bfloat16 as its FP8Transfer returns them.
    last_state_norm: "pre" or "post": whether the last hidden state is taken before or after the verifier's
        final norm, for formats whose files (or dicts) may not say it (Model-Optimizer, AngelSlim's vLLM
        backend, vLLM's own files); required there, refused where it contradicts the files or the format.
    """

    codec: str = "zstd"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    shard_tokens: int | None = None
    precision: Precision = "exact"
    last_state_norm: LastStateNorm | None = None


@dataclass(frozen=True)
class BucketOptions:
    """How a SRC or DST in a bucket is reached, and where the work on it is staged locally.

    storage_options: fsspec's options of the bucket (credentials, endpoint_url, ...), for SRC and DST alike.
    staging_dir: the local folder a bucket DST is converted in (default: one per DST under
        ~/.cache/h5feed/staging; keep it to resume), and where workers fetch a bucket SRC's files; for a
        writer, the folder it works in (its journal and the samples being uploaded; default: one per store and
        writer id under `$XDG_CACHE_HOME/h5feed/staging`, which resumes a writer restarted with its id).
    """

    storage_options: Mapping[str, Any] | None = None
    staging_dir: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class RunOptions:
    """How `convert` runs: where its per-sample tasks run (beside its `workers`), and whether it fsyncs.

    scheduler: run the per-sample work on Dask (`pip install h5feed[dask]`): "local" starts a
        `distributed.LocalCluster` of `workers` processes; "tcp://HOST:PORT" uses the cluster of that
        scheduler, whose workers must reach `src` and `dst` by the same paths as this process.
    durable: fsync each shard before its journal line, and the index before the status flip, so that a power
        loss loses no journaled sample (`--no-fsync` turns it off).
    """

    scheduler: str | None = None
    durable: bool = True


@dataclass(frozen=True)
class SkipPolicy:
    """What `convert` does with a source file it cannot convert.

    skip_bad: skip unreadable files (and files that changed since they were converted) and record them in the
        store, instead of stopping at the first with its error.
    retry_skipped: on a complete store, try the files it skipped (planning or converting) again (repaired
        since): those that load now are appended, the others stay recorded as skipped (with skip_bad; else
        the first is an error).  Without it, a rerun leaves them as they were.
    lock_timeout: seconds to wait for files their writer still holds locked (vLLM's): one still locked then is
        an error, or with skip_bad a recorded skip that the next run appends once it is written.
    """

    skip_bad: bool = False
    retry_skipped: bool = False
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S


@dataclass(frozen=True)
class WriteOptions:
    """How an `open_writer` writer writes and publishes its samples.

    durable: fsync each sample's shards before its journal line (a power loss keeps every journaled one).
    write_behind: samples that may still be compressed and written, on a thread of the writer's own, after
        `append` returned: the extraction's next forward pass runs meanwhile (the compression lets the GIL go).
        `append` checks the sample and copies its tensors first (a CUDA tensor to the host, a host one too, so
        the caller may reuse its buffers); it waits while `write_behind` samples are in flight (memory stays
        bounded), and an error while writing (a full disk) is raised by the next `append`, `publish` or
        `close`.  0 (the default): each sample is written before `append` returns.
    publish_every: samples between publications of the index (readers opening the store see the samples
        published so far); close() publishes the rest.
    block_shards: shards reserved at a time while other writers append too (the rows of a block left unused at
        close or by a kill take no disk: no file holds them).
    """

    durable: bool = True
    write_behind: int = 0
    publish_every: int = 16
    block_shards: int = DEFAULT_BLOCK_SHARDS
