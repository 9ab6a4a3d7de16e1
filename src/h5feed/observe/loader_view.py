"""What the monitor reads of the loader it wraps, where the loader has it, and how it describes that loader.

Why apart from the monitor: the monitor measures any iterable of batches, and what it can say beyond the step's
time (the workers' counters, the store and the object a worker reads, samples a batch, the worker pool and how it
starts) depends on what the loader exposes.  torch's DataLoader, StreamLoader and BatchLoader have it all; any
other loader is measured all the same.  It is read once, here, through protocols, so the monitor's hot path and
its reporting thread never ask the loader again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from h5feed.observe.metrics import CountedReader, LoaderCounters
from h5feed.observe.watchdog import LoaderSetup
from h5feed.store import Store


@runtime_checkable
class OverDataset(Protocol):
    """A loader over a dataset (whose counters, when it is h5feed's, the monitor shows)."""

    dataset: Any


@runtime_checkable
class OverStore(Protocol):
    """A dataset that reads a store (an h5feed `Store`, which the monitor describes, or another)."""

    store: Any


@runtime_checkable
class Batched(Protocol):
    """A loader that says how many samples a batch holds."""

    batch_size: int | None


@runtime_checkable
class Sampled(Protocol):
    """A loader whose batches a batch sampler makes (None: `batch_size` says, or one sample a batch)."""

    batch_sampler: Any


@runtime_checkable
class WorkerPool(Protocol):
    """A loader that reads in worker processes, and says how they start."""

    num_workers: int
    multiprocessing_context: Any


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's once initialised, else torchrun's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class LoaderView:
    """What the monitor knows of the loader it wraps (see the module's docstring)."""

    loader: Any
    dataset: Any  # the loader's dataset, or None
    counters: LoaderCounters | None  # the dataset's h5feed counters, or None: worker activity cannot be seen
    store: Any  # what the dataset reads (an h5feed Store, or another), or None
    batch_size: int  # samples a batch holds, for samples/s (1 when the loader does not say)
    per_batch: int | None  # the same for the samples ready ahead: None when a batch sampler makes the batches
    setup: LoaderSetup  # what it reads with, for the diagnosis

    @classmethod
    def of(cls, loader: Any) -> LoaderView:
        dataset = loader.dataset if isinstance(loader, OverDataset) else None
        reader = dataset if isinstance(dataset, CountedReader) else None
        counters = reader.counters if reader is not None and isinstance(reader.counters, LoaderCounters) else None
        store = dataset.store if isinstance(dataset, OverStore) else None
        sampled = isinstance(loader, Sampled) and loader.batch_sampler is not None
        per_batch = loader.batch_size if isinstance(loader, Batched) else None
        ours = store if isinstance(store, Store) else None
        setup = LoaderSetup(workers=loader.num_workers if isinstance(loader, WorkerPool) else 0,
                            cores=len(os.sched_getaffinity(0)), remote=ours is not None and ours.remote,
                            fp8=ours.info.fp8 if ours is not None else None)
        return cls(loader, dataset, counters, store, per_batch or 1, per_batch or (None if sampled else 1), setup)

    def describe(self) -> str:
        """The loader in a line: the store it reads (or what it iterates), its workers and how they start, the
        batch size, and whether its workers can be seen."""
        if isinstance(self.store, Store):
            s = self.store
            parts = [f"store {s.path} ({len(s)} samples, H={s.hidden_size}, K={s.num_aux_layers})"]
        else:
            source = self.loader if self.dataset is None else self.dataset
            size = f" of {len(source)} samples" if hasattr(source, "__len__") else ""
            parts = [f"{type(source).__name__}{size}"]
        workers = self.loader.num_workers if isinstance(self.loader, WorkerPool) else 0
        if workers:
            context = self.loader.multiprocessing_context
            method = context.get_start_method() if context is not None else torch.multiprocessing.get_start_method(True)
            plural = "s" if workers > 1 else ""
            parts.append(f"{workers} DataLoader worker{plural} ({method or 'default start method'})")
        else:
            parts.append("reading in this process")
        parts.append(f"batch_size {self.batch_size}")
        if self.counters is None:
            parts.append("no h5feed counters: worker activity cannot be seen")
        return ", ".join(parts)

    def object_of(self, index: int | None) -> str | None:
        """The store object a worker reads for a sample index, for h5feed datasets."""
        if index is None or not isinstance(self.store, Store) or not 0 <= index < len(self.store):
            return None
        return self.store.sample_object(index)
