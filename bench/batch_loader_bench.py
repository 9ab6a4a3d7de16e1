"""Samples/s and CPU seconds per sample of the trainer's path: DataLoader + collate + pin_memory vs BatchLoader.

    PYTHONPATH=. python bench/batch_loader_bench.py STORE --max-len 2048 --passes 3 --repeat 4

Every loader delivers the same speculators-legacy batches (checked on the first pass);
the first pass also warms the page cache and the slot memory, the next `--passes` are timed.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

import h5feed
from h5feed.baseline import create_collate_fn
from h5feed.store import crc32c

FLAVOR = "speculators-legacy"


def loaders(store: str, max_len: int, batch_size: int, dtype: torch.dtype, samples: list[int]
            ) -> dict[str, Callable[[], Any]]:
    def stream() -> h5feed.HiddenStatesStream:
        return h5feed.HiddenStatesStream(store, FLAVOR, max_len, hidden_states_dtype=dtype, samples=samples, seed=0)

    return {
        "DataLoader(stream), 0.4 collate, pin_memory, 4 workers": lambda: DataLoader(
            stream(), batch_size=batch_size, num_workers=4, pin_memory=True, collate_fn=create_collate_fn(max_len)),
        "DataLoader(stream), trainer_collate, pin_memory, 4 workers": lambda: DataLoader(
            stream(), batch_size=batch_size, num_workers=4, pin_memory=True,
            collate_fn=h5feed.trainer_collate(FLAVOR, max_len)),
        "BatchLoader, 4 workers": lambda: h5feed.BatchLoader(
            store, flavor=FLAVOR, max_len=max_len, hidden_states_dtype=dtype, samples=samples, batch_size=batch_size,
            num_workers=4),
        "BatchLoader, 2 workers": lambda: h5feed.BatchLoader(
            store, flavor=FLAVOR, max_len=max_len, hidden_states_dtype=dtype, samples=samples, batch_size=batch_size,
            num_workers=2),
        "BatchLoader, 0 workers, 2 threads": lambda: h5feed.BatchLoader(
            store, flavor=FLAVOR, max_len=max_len, hidden_states_dtype=dtype, samples=samples, batch_size=batch_size,
            threads=2),
    }


def digest(batch: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each key's shape, dtype and crc32c of its bytes: batches compared without keeping them."""
    out = []
    for key, value in batch.items():
        raw = value.contiguous().view(torch.uint8).numpy() if isinstance(value, torch.Tensor) else value
        out.append((key, tuple(value.shape), value.dtype, crc32c(raw)) if isinstance(value, torch.Tensor)
                   else (key, value))
    return out


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="each pass reads every sample this many times")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--only", help="run only the loaders whose name contains this")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    reference: list[list[tuple[Any, ...]]] | None = None
    samples = list(range(len(h5feed.Store(args.store)))) * args.repeat
    print(f"store {args.store}, {len(samples)} samples a pass, max_len {args.max_len}, batch_size "
          f"{args.batch_size}, {args.dtype}, torch threads {torch.get_num_threads()}")
    for name, make in loaders(args.store, args.max_len, args.batch_size, dtype, samples).items():
        if args.only and args.only not in name:
            continue
        loader = make()
        first = [digest(batch) for batch in loader]  # warms the cache; checked below
        if reference is None:
            reference = first
        assert first == reference, f"{name} delivers other batches"
        samples, t0, c0 = 0, time.perf_counter(), cpu_seconds()
        for _ in range(args.passes):
            for batch in loader:
                samples += args.batch_size
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        print(f"{name:62s} {samples / seconds:6.2f} samples/s  {cpu / samples:5.3f} CPU s/sample  ({samples} in "
              f"{seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
