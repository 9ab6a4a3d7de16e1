"""The loaders `h5feed bench` times, each built fresh for a pass, and the per-worker figures each one gives."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from h5feed.baseline import Eagle3SampleFileDataset
from h5feed.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader
from h5feed.metrics import MAX_WORKERS
from h5feed.store import Store

LOADERS = ("pt-baseline", "HiddenStatesDataset", "HiddenStatesStream", "HiddenStatesStream-threads")
LOADER_LABELS = {
    "pt-baseline": "speculators 0.4 .pt (baseline)",
    "HiddenStatesDataset": "h5feed HiddenStatesDataset",
    "HiddenStatesStream": "h5feed HiddenStatesStream",
    "HiddenStatesStream-threads": "h5feed HiddenStatesStream, reader threads in the trainer (num_workers=0)",
}


@dataclass
class WorkerStats:
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


class _CountedBaseline(Dataset[dict[str, Any]]):
    """Bench-side bookkeeping around the baseline (which has no counters): items and file bytes per worker.

    It only counts; the item is the baseline's, untouched.
    """

    def __init__(self, inner: Eagle3SampleFileDataset) -> None:
        self.inner = inner
        self.table = torch.zeros(MAX_WORKERS, 3, dtype=torch.float64).share_memory_()  # samples, bytes, seconds

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        item = self.inner[index]
        elapsed = time.perf_counter() - t0
        info = get_worker_info()
        row = self.table[info.id if info is not None else 0]
        row[0] += 1
        row[1] += os.stat(self.inner.data[index]).st_size
        row[2] += elapsed
        return item

    def worker_stats(self, seconds: float) -> list[WorkerStats]:
        stats = []
        for w, (samples, nbytes, busy) in enumerate(self.table.tolist()):
            if samples:
                stats.append(WorkerStats(w, int(samples), samples / seconds, int(nbytes), nbytes / seconds / 1e9, busy))
        return stats


def _h5feed_worker_stats(dataset: HiddenStatesDataset | HiddenStatesStream, seconds: float) -> list[WorkerStats]:
    snap = dataset.counters.snapshot()
    return [
        WorkerStats(
            worker=w.worker,
            samples=w.samples,
            samples_per_s=w.samples / seconds,
            bytes_read=w.bytes_read,
            read_gb_per_s=w.bytes_read / seconds / 1e9,
            busy_seconds=w.read_seconds + w.decode_seconds,
            read_seconds=w.read_seconds,
            decode_seconds=w.decode_seconds,
        )
        for w in snap.workers
    ]


def _hidden_tensors(item: dict[str, Any]) -> list[torch.Tensor]:
    """The hidden-state tensors of an item, whatever the flavor calls them."""
    return [v for k, v in item.items() if isinstance(v, torch.Tensor) and ("hidden_state" in k or k == "target")]


def _item_tokens(item: dict[str, Any]) -> int:
    if "lengths" in item:
        return int(item["lengths"][0])
    return int(item["input_ids"].shape[-1])


@dataclass
class _Setup:
    store: Store
    flavor: str
    max_len: int | None
    dtype: torch.dtype
    workers: int
    baseline_files: list[Path] | None
    missing_loss_mask: str


def _make_loader(name: str, s: _Setup) -> tuple[Any, DataLoader[Any]]:
    """A fresh dataset and its loader for one pass (fresh counters, fresh workers)."""
    common: dict[str, Any] = {"num_workers": s.workers}
    if name == "pt-baseline":
        assert s.baseline_files is not None
        dataset: Any = _CountedBaseline(
            Eagle3SampleFileDataset(s.max_len or 0, file_list=s.baseline_files, hidden_states_dtype=s.dtype)
        )
        return dataset, DataLoader(dataset, batch_size=None, shuffle=False, **common)
    if name == "HiddenStatesDataset":
        dataset = HiddenStatesDataset(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype,
                                      missing_loss_mask=s.missing_loss_mask)  # type: ignore[arg-type]
        return dataset, DataLoader(dataset, batch_size=None, shuffle=False, **common)
    if name == "HiddenStatesStream":
        dataset = HiddenStatesStream(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype, shuffle=False,
                                     missing_loss_mask=s.missing_loss_mask)  # type: ignore[arg-type]
        return dataset, StreamLoader(dataset, batch_size=None, **common)
    if name == "HiddenStatesStream-threads":
        threads = os.cpu_count() or 1
        dataset = HiddenStatesStream(s.store, s.flavor, s.max_len, hidden_states_dtype=s.dtype, shuffle=False,
                                     missing_loss_mask=s.missing_loss_mask,  # type: ignore[arg-type]
                                     threads=threads, prefetch=2 * threads)
        return dataset, StreamLoader(dataset, batch_size=None, num_workers=0)
    raise ValueError(f"unknown loader {name!r}: one of {', '.join(LOADERS)}")

