"""How long the trainer's thread spends in `next(loader)` when batches are ready: BatchLoader under a simulated step.

    python bench/loader/next_latency.py [--steps 80] [--step-ms 60] [--cache /tmp/h5feed-next-latency]

For each shape (tiny: H=64, 64-128 tokens; medium: H=1024 x 3 aux layers, 512-1024 tokens;
speculators-legacy batches of 1, max_len 1024, bf16) and each loader (2 worker processes,
2 threads), times `next()` on the training thread around a step simulated by sleeping
`--step-ms` (a GPU step waits without holding the GIL), after 10 warm-up steps, warm page
cache.  Prints one line per case: median and p90 of `next()` in ms, and the median of the
trainer's drop of a batch (`del batch`: where a slot's release runs).  To compare two
versions in one run, run it once per version with PYTHONPATH pointing at each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import h5feed
from h5feed import BatchLoader
from h5feed.testing.synthetic import write_synthetic

SHAPES = {"tiny": (64, (64, 128)), "medium": (1024, (512, 1024))}  # hidden size, token lengths
SAMPLES = 96
WARMUP = 10


def store_for(cache: Path, shape: str) -> Path:
    hidden, lengths = SHAPES[shape]
    store = cache / shape / "store"
    if not (store / "zarr.json").exists():
        files = write_synthetic(cache / shape / "src", "speculators-legacy-pt", SAMPLES, hidden, lengths=lengths)
        assert files
        h5feed.convert(cache / shape / "src", store, workers=0, progress=False)
    return store


def next_latencies(store: Path, steps: int, step_seconds: float,
                   **loader_kwargs: Any) -> tuple[list[float], list[float]]:
    """Seconds of each `next()`, and of each drop of the batch before (what gives its slot back), after warm-up."""
    loader = BatchLoader(store, flavor="speculators-legacy", max_len=1024, hidden_states_dtype=torch.bfloat16,
                         batch_size=1, **loader_kwargs)
    seconds: list[float] = []
    drops: list[float] = []
    with loader:
        while len(seconds) < WARMUP + steps:
            batches = iter(loader)
            while len(seconds) < WARMUP + steps:
                t0 = time.perf_counter()
                batch = next(batches, None)
                elapsed = time.perf_counter() - t0
                if batch is None:
                    break
                seconds.append(elapsed)
                time.sleep(step_seconds)  # the step: the GPU works, the training thread waits without the GIL
                t0 = time.perf_counter()
                del batch
                drops.append(time.perf_counter() - t0)
            del batches
    return seconds[WARMUP:], drops[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--step-ms", type=float, default=60.0)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/h5feed-next-latency"))
    args = parser.parse_args()
    print(f"h5feed from {Path(h5feed.__file__).parent}")
    for shape in SHAPES:
        store = store_for(args.cache, shape)
        for name, kwargs in (("2 workers", {"num_workers": 2}),
                             ("2 threads", {"decode": h5feed.ThreadsOptions(threads=2)})):
            taken, dropped = next_latencies(store, args.steps, args.step_ms / 1e3, **kwargs)
            ms = sorted(s * 1e3 for s in taken)
            p90 = ms[int(0.9 * (len(ms) - 1))]
            print(f"{shape:6} {name:9}: next() median {statistics.median(ms):.3f} ms, p90 {p90:.3f} ms; "
                  f"dropping a batch median {statistics.median(dropped) * 1e3:.3f} ms "
                  f"({len(ms)} steps of {args.step_ms:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
