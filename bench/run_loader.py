"""Run one of the bench's loaders over the bench store, as `h5feed bench` does, for a profiler.

    python bench/run_loader.py {baseline,dataset,stream} WORKERS PASSES [STORE]

STORE defaults to the embedded bench set (built by `h5feed bench`).  Same settings as
the bench: batch_size=None, bfloat16, max_len 2048, flavor speculators-legacy, no shuffle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from h5feed.baseline import Eagle3SampleFileDataset
from h5feed.bench import DEFAULT_CACHE_DIR, SyntheticSpec
from h5feed.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader
from h5feed.store import Store


def main() -> None:
    which, workers, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    path = Path(sys.argv[4]) if len(sys.argv) > 4 else DEFAULT_CACHE_DIR.expanduser() / SyntheticSpec().name / "store"
    store = Store(path)
    files = [Path(store.info.source_root) / p for p in store.source_paths]
    for _ in range(passes):
        if which == "dataset":
            ds = HiddenStatesDataset(path, "speculators-legacy", 2048, hidden_states_dtype=torch.bfloat16)
            loader = DataLoader(ds, batch_size=None, num_workers=workers)
        elif which == "stream":
            stream = HiddenStatesStream(path, "speculators-legacy", 2048, hidden_states_dtype=torch.bfloat16, shuffle=False)
            loader = StreamLoader(stream, batch_size=None, num_workers=workers)
        elif which == "baseline":
            base = Eagle3SampleFileDataset(2048, file_list=files, hidden_states_dtype=torch.bfloat16)
            loader = DataLoader(base, batch_size=None, num_workers=workers)
        else:
            raise SystemExit(f"unknown loader {which!r}: baseline, dataset or stream")
        t0, n = time.perf_counter(), 0
        for item in loader:
            float(item["hidden_states"][-1, -1])
            n += 1
        print(f"{which}: {n / (time.perf_counter() - t0):.2f} samples/s", file=sys.stderr)


if __name__ == "__main__":
    main()
