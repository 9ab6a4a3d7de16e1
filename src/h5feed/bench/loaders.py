"""The loaders `h5feed bench` times, each built fresh for a pass, and the per-worker figures each one gives.

Every loader but the last delivers the trainer's batches: batch_size 1, the flavor's
trainer collate (speculators 0.4 `create_collate_fn(max_len)` for speculators-legacy),
in the order of the store:

- ``pt-baseline``: speculators 0.4's `Eagle3SampleFileDataset` over the store's source
  files in `DataLoader(batch_size=1, num_workers=W, collate_fn=create_collate_fn(max_len),
  pin_memory=True)`, as its trainer runs it;
- ``BatchLoader``: `h5feed.BatchLoader(num_workers=W)`: worker processes decode straight
  into recycled (page-locked) batch slots;
- ``BatchLoader-threads``: `h5feed.BatchLoader(decode=ThreadsOptions(threads=W))`: the same with W reader threads
  in the trainer's process;
- ``BatchLoader-cuda``: `h5feed.BatchLoader(decode=CudaOptions(threads=W))`: W reader threads read and
  check the compressed chunks, the GPU decodes them, the batches arrive on the GPU (measured where
  CUDA and nvCOMP are here and the store's codec allows it);
- ``StreamLoader``: the drop-in: `HiddenStatesStream` in a `StreamLoader` with the trainer's
  collate and `pin_memory=True`;
- ``HiddenStatesDataset``: the map-style drop-in in the baseline's DataLoader (not in the default set).

and, for comparison with figures of earlier benches only:

- ``HiddenStatesStream-items``: the stream's items with `batch_size=None` and no collate,
  a path no trainer uses (no ratio, no target).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from h5feed.flavors import trainer_collate
from h5feed.loading.backends.cuda import CudaOptions
from h5feed.loading.backends.threads import ThreadsOptions
from h5feed.loading.backends.workers import WorkersOptions
from h5feed.loading.batch_loader import BatchLoader
from h5feed.loading.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader
from h5feed.loading.options import ScheduleOptions
from h5feed.observe.metrics import MAX_WORKERS, LoaderCounters
from h5feed.store import Store, crc32c
from h5feed.testing.baseline import Eagle3SampleFileDataset, create_collate_fn

Batch = dict[str, Any]

BASELINE = "pt-baseline"
ITEMS = "HiddenStatesStream-items"
GPU_DECODE = "BatchLoader-cuda"
LOADERS = (BASELINE, "BatchLoader", "BatchLoader-threads", GPU_DECODE, "StreamLoader", "HiddenStatesDataset", ITEMS)
DEFAULT_LOADERS = (BASELINE, "BatchLoader", "BatchLoader-threads", GPU_DECODE, "StreamLoader")  # ITEMS: asked for
LOADER_LABELS = {
    BASELINE: "speculators 0.4 .pt, DataLoader + 0.4 collate + pin_memory (baseline)",
    "BatchLoader": "h5feed BatchLoader, worker processes",
    "BatchLoader-threads": "h5feed BatchLoader, reader threads (num_workers=0)",
    GPU_DECODE: "h5feed BatchLoader(decode=\"cuda\"), reader threads, decoded on the GPU",
    "StreamLoader": "h5feed HiddenStatesStream, StreamLoader + 0.4 collate + pin_memory",
    "HiddenStatesDataset": "h5feed HiddenStatesDataset, DataLoader + 0.4 collate + pin_memory",
    ITEMS: "[old path, no trainer] HiddenStatesStream items, batch_size=None, no collate",
}
SHORT_LABELS = {  # the table's names (the long ones are listed under it)
    BASELINE: ".pt baseline",
    "BatchLoader": "BatchLoader, workers",
    "BatchLoader-threads": "BatchLoader, threads",
    GPU_DECODE: "BatchLoader, GPU decode",
    "StreamLoader": "StreamLoader + collate",
    "HiddenStatesDataset": "Dataset + collate",
    ITEMS: "items, no trainer",
}
# The trainer-path loaders a user can take from the bench, as the code that makes them (formatted with the
# bench's flavor, max_len, workers and dtype, and `device`: ', device="cuda"' where the step ran on a GPU, else
# ''); the baseline and the item path are not advice.
USABLE = {
    "BatchLoader": ('h5feed.BatchLoader(STORE, flavor="{flavor}", max_len={max_len}, batch_size=1, '
                    'num_workers={workers}, hidden_states_dtype=torch.{dtype}{device})'),
    "BatchLoader-threads": ('h5feed.BatchLoader(STORE, flavor="{flavor}", max_len={max_len}, batch_size=1, '
                            'hidden_states_dtype=torch.{dtype}, decode=h5feed.ThreadsOptions(threads={workers}{device}))'),
    GPU_DECODE: ('h5feed.BatchLoader(STORE, flavor="{flavor}", max_len={max_len}, batch_size=1, '
                 'hidden_states_dtype=torch.{dtype}, decode=h5feed.CudaOptions(threads={workers}))'),
    "StreamLoader": ('h5feed.StreamLoader(h5feed.HiddenStatesStream(STORE, "{flavor}", {max_len}, '
                     'hidden_states_dtype=torch.{dtype}), batch_size=1, num_workers={workers}, '
                     'collate_fn=YOUR_COLLATE, pin_memory=True)'),
    "HiddenStatesDataset": ('DataLoader(h5feed.HiddenStatesDataset(STORE, "{flavor}", {max_len}, '
                            'hidden_states_dtype=torch.{dtype}), batch_size=1, num_workers={workers}, '
                            'collate_fn=YOUR_COLLATE, pin_memory=True)'),
}


@dataclass
class WorkerPass:
    """One DataLoader worker's share of a pass.

    For h5feed loaders it comes from the dataset's `counters.snapshot()` (bytes read from the
    store, compressed); the baseline has no counters, so the bench counts its items and the
    sizes of the files they came from.
    """

    worker: int
    samples: int
    samples_per_s: float  # over the pass's wall time
    bytes_read: int
    read_gb_per_s: float
    busy_seconds: float  # baseline: time in __getitem__; h5feed: read + decode seconds
    read_seconds: float | None = None
    decode_seconds: float | None = None


@dataclass(frozen=True)
class WorkerCounts:
    """A worker's running totals; a pass's figures are the difference of two (a loader serves every pass)."""

    samples: int
    bytes_read: int
    busy_seconds: float
    read_seconds: float | None = None
    decode_seconds: float | None = None

    def since(self, before: WorkerCounts | None, seconds: float, worker: int) -> WorkerPass:
        def minus(a: float | None, b: float | None) -> float | None:
            return None if a is None else a - (b or 0.0)

        b = before or WorkerCounts(0, 0, 0.0)
        samples, nbytes = self.samples - b.samples, self.bytes_read - b.bytes_read
        return WorkerPass(worker, samples, samples / seconds, nbytes, nbytes / seconds / 1e9,
                           self.busy_seconds - b.busy_seconds, minus(self.read_seconds, b.read_seconds),
                           minus(self.decode_seconds, b.decode_seconds))


class CountedBaseline(Dataset[Batch]):
    """Bench-side bookkeeping around the baseline (which has no counters): items and file bytes per worker.

    It only counts; the item is the baseline's, untouched.
    """

    def __init__(self, inner: Eagle3SampleFileDataset) -> None:
        self.inner = inner
        self.table = torch.zeros(MAX_WORKERS, 3, dtype=torch.float64).share_memory_()  # samples, bytes, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Batch:
        t0 = time.perf_counter()
        item = self.inner[index]
        elapsed = time.perf_counter() - t0
        info = get_worker_info()
        row = self.table[info.id if info is not None else 0]
        row[0] += 1
        row[1] += os.stat(self.inner.data[index]).st_size
        row[2] += elapsed
        return item

    def counts(self) -> dict[int, WorkerCounts]:
        return {w: WorkerCounts(int(samples), int(nbytes), busy) for w, (samples, nbytes, busy)
                in enumerate(self.table.tolist()) if samples}


def h5feed_counts(counters: LoaderCounters) -> dict[int, WorkerCounts]:
    return {w.worker: WorkerCounts(w.samples, w.bytes_read, w.read_seconds + w.decode_seconds, w.read_seconds,
                                   w.decode_seconds) for w in counters.snapshot().workers}


@dataclass
class Setup:
    """What every loader of a run shares: the store, the trainer's settings, the baseline's files."""

    store: Store
    flavor: str
    max_len: int
    dtype: torch.dtype
    workers: int
    baseline_files: list[Path] | None
    missing_loss_mask: str
    device: torch.device | None = None  # the GPU the training step runs on: BatchLoader delivers batches there

    def trainer_collate(self) -> Callable[[list[Batch]], Batch]:
        """The collate the flavor's trainer runs: speculators 0.4's own for speculators-legacy, else h5feed's
        restatement of the trainer's (tested equal to it)."""
        if self.flavor == "speculators-legacy":
            return create_collate_fn(self.max_len)
        return trainer_collate(self.flavor, self.max_len, hidden_states_dtype=self.dtype)

    def stream(self) -> HiddenStatesStream:
        return HiddenStatesStream(self.store, self.flavor, self.max_len, hidden_states_dtype=self.dtype,  # type: ignore[arg-type]
                                  missing_loss_mask=self.missing_loss_mask,  # type: ignore[arg-type]
                                  schedule=ScheduleOptions(shuffle=False))


class BuiltLoader:
    """A loader built once and iterated once per pass, as a trainer iterates it once per epoch (what it builds
    once, such as BatchLoader's ring of batch slots, is built once); `pass_stats` gives a pass's per-worker figures."""

    def __init__(self, batches: Iterable[Batch], counts: Callable[[], dict[int, WorkerCounts]],
                 gpu_decode_ms: Callable[[], float] = lambda: 0.0) -> None:
        self.batches, self._counts, self._gpu_decode_ms = batches, counts, gpu_decode_ms
        self._before: dict[int, WorkerCounts] = {}
        self._gpu_before = 0.0

    def start_pass(self) -> None:
        self._before, self._gpu_before = self._counts(), self._gpu_decode_ms()

    def pass_gpu_decode_ms(self) -> float:
        """The GPU time the loader spent decoding since `start_pass` (0 for loaders that decode on the CPU)."""
        return self._gpu_decode_ms() - self._gpu_before

    def pass_stats(self, seconds: float) -> list[WorkerPass]:
        """Each worker's share of the pass since `start_pass`."""
        stats = [now.since(self._before.get(w), seconds, w) for w, now in sorted(self._counts().items())]
        return [w for w in stats if w.samples]


def make_loader(name: str, s: Setup) -> BuiltLoader:
    """The loader `name`, with fresh counters."""
    trainer = {"batch_size": 1, "num_workers": s.workers, "collate_fn": s.trainer_collate(), "pin_memory": True}
    if name == BASELINE:
        assert s.baseline_files is not None
        baseline = CountedBaseline(Eagle3SampleFileDataset(s.max_len, file_list=s.baseline_files,
                                                           hidden_states_dtype=s.dtype))
        return BuiltLoader(DataLoader(baseline, shuffle=False, **trainer), baseline.counts)
    if name in ("BatchLoader", "BatchLoader-threads", GPU_DECODE):
        decode: object
        if name == "BatchLoader":
            decode = WorkersOptions(num_workers=s.workers, device=s.device) if s.workers else ThreadsOptions(
                device=s.device)
        elif name == "BatchLoader-threads":
            decode = ThreadsOptions(threads=max(s.workers, 1), device=s.device)
        else:
            decode = CudaOptions(threads=max(s.workers, 1))
        loader = BatchLoader(s.stream(), batch_size=1, decode=decode)
        return BuiltLoader(loader, lambda: h5feed_counts(loader.dataset.counters), lambda: loader.gpu_decode_ms)
    if name == "StreamLoader":
        stream = s.stream()
        return BuiltLoader(StreamLoader(stream, **trainer), lambda: h5feed_counts(stream.counters))
    if name == "HiddenStatesDataset":
        dataset = HiddenStatesDataset(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype,  # type: ignore[arg-type]
                                      missing_loss_mask=s.missing_loss_mask)  # type: ignore[arg-type]
        return BuiltLoader(DataLoader(dataset, shuffle=False, **trainer), lambda: h5feed_counts(dataset.counters))
    if name == ITEMS:
        stream = s.stream()
        return BuiltLoader(StreamLoader(stream, batch_size=None, num_workers=s.workers),
                           lambda: h5feed_counts(stream.counters))
    raise ValueError(f"unknown loader {name!r}: one of {', '.join(LOADERS)}")


def hidden_tensors(batch: Batch) -> list[torch.Tensor]:
    """The hidden-state tensors of a batch or item, whatever the flavor calls them."""
    return [v for k, v in batch.items() if isinstance(v, torch.Tensor) and ("hidden_state" in k or k == "target")]


def digest(batch: Batch) -> dict[str, Any]:
    """Each key's shape, dtype and crc32c of its bytes: batches compared without keeping them."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[key] = (tuple(value.shape), str(value.dtype), crc32c(raw))
        else:
            out[key] = value
    return out


def compare_digests(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str:
    """"equal", or where the first difference between two passes' batch digests lies."""
    if len(got) != len(want):
        return f"DIFFER: {len(got)} batches, not {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            keys = sorted(k for k in set(g) | set(w) if g.get(k) != w.get(k))
            return f"DIFFER: batch {i} ({', '.join(keys)})"
    return "equal"
