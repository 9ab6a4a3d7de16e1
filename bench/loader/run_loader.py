"""Run one of `h5feed bench`'s loaders over the bench store, as the bench does, for a profiler.

    python bench/loader/run_loader.py LOADER WORKERS PASSES [STORE]
    py-spy record -s -n -r 100 -f raw -o prof.txt -- python bench/loader/run_loader.py BatchLoader-threads 4 3

LOADER is one of `h5feed.bench.LOADERS` (pt-baseline, BatchLoader, BatchLoader-threads,
StreamLoader, HiddenStatesDataset, HiddenStatesStream-items).  STORE defaults to the
embedded bench set (built by `h5feed bench`).  Same settings as the bench: batch_size 1,
speculators 0.4's collate, bfloat16, max_len 2048, flavor speculators-legacy, store order.
Prints samples/s and CPU seconds per sample of each pass, and the h5feed loaders' read and
decode seconds per sample.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from h5feed.bench import DEFAULT_CACHE_DIR, LOADERS, MemorySampler, SyntheticSpec
from h5feed.bench.loaders import Setup, hidden_tensors, make_loader
from h5feed.store import Store


def main() -> None:
    which, workers, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if which not in LOADERS:
        raise SystemExit(f"unknown loader {which!r}: one of {', '.join(LOADERS)}")
    path = Path(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_CACHE_DIR.expanduser() / SyntheticSpec().name / "store"
    store = Store(path)
    files = [Path(store.info.source_root) / p for p in store.source_paths]
    setup = Setup(store, "speculators-legacy", 2048, torch.bfloat16, workers, files, "error")
    sampler = MemorySampler(interval=3600)  # CPU only: memory is sampled at the start and end
    built = make_loader(which, setup)  # built once, iterated once per pass, as `h5feed bench` does
    for _ in range(passes):
        built.start_pass()
        with sampler:
            t0, n = time.perf_counter(), 0
            for batch in built.batches:
                float(hidden_tensors(batch)[0].view(-1)[-1])
                n += 1
                del batch
            seconds = time.perf_counter() - t0
        stats = built.pass_stats(seconds)
        line = f"{which}: {n / seconds:.2f} samples/s, {sampler.cpu_seconds / n:.3f} CPU s/sample"
        if stats and stats[0].decode_seconds is not None:
            read = sum(w.read_seconds or 0.0 for w in stats) / n
            decode = sum(w.decode_seconds or 0.0 for w in stats) / n
            line += f" (read {read * 1e3:.1f} ms, decode {decode * 1e3:.1f} ms per sample, wall)"
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
