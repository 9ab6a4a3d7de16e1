"""Summarise a `py-spy record --subprocesses --native --format raw` profile of a DataLoader run.

Splits the samples of the worker processes (stacks under two `process` frames)
from the main process's, and files each worker sample under the innermost frame
that says what it was doing: decode, reading chunk files, allocating shared
memory, handing the item to the trainer (pickling, fd passing), and so on.

    py-spy record -s -n -r 100 -f raw -o prof.txt -- python bench/run_loader.py dataset 4 3
    python bench/pyspy_summary.py prof.txt [--only _worker_loop]

`--only TEXT` keeps the stacks with a frame containing TEXT (e.g. `_worker_loop`: the
worker's main thread, which runs `__getitem__`; with `py-spy --idle` that shows where its
wall time goes, waits on the disk included).
"""

from __future__ import annotations

import sys
from collections import Counter

# (category, substrings of a frame); the stack is scanned from the leaf up, the first match wins
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("decode: zstd entropy/sequences", ("ZSTD_", "HUF_", "BIT_", "FSE_", "MEM_read")),
    ("decode: unshuffle stores into the output (+ first-touch faults of fresh pages)", ("_mm_storeu_si128",)),
    ("decode: other blosc", ("blosc", "decompress (numcodecs")),
    ("shared-memory allocation (fallocate of the item's buffers)", ("_new_shared", "posix_fallocate")),
    ("read: open/mmap(MAP_POPULATE)/munmap of chunk files", ("_read_chunk",)),
    ("hand-off to the trainer: pickling, copy into shm, fd passing", (
        "reduce_storage", "_share_fd", "share_memory", "ForkingPickler", "queues.py", "connection.py",
        "reduction.py", "resource_sharer", "direct_copy_kernel")),
    ("baseline: torch.cat of the aux layers (reads the mmapped file)", ("cat_serial_kernel", "standardize_data_v1")),
    ("baseline: torch.load (mmap, unpickle)", ("serialization.py",)),
    ("item building (flavor / shift)", ("flavors.py", "shift_batch")),
    ("counters", ("metrics.py",)),
    ("prefetch queue / DataLoader plumbing", ("datasets.py", "fetch.py", "sampler.py", "worker.py")),
]


IDLE = ("Queue.get (multiprocessing/queues.py", "Queue.get (queue.py")


def classify(frames: list[str]) -> str:
    if any(needle in frame for frame in frames for needle in IDLE):
        return "idle: waiting for work (the next index, or a free prefetch slot)"
    for frame in reversed(frames):
        for category, needles in RULES:
            if any(n in frame for n in needles):
                return category
    return "other"


def main(path: str, only: str | None = None) -> None:
    workers: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    main_samples = 0
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        depth = sum(f.startswith("process ") for f in frames)
        frames = [f for f in frames if not f.startswith("process ")]
        if depth < 2:
            main_samples += n
            continue
        if only is not None and not any(only in f for f in frames):
            continue
        workers[classify(frames)] += n
        leaves[frames[-1][:100] if frames else "?"] += n
    total = sum(workers.values()) or 1
    print(f"worker samples: {total} (main process: {main_samples}, not broken down)")
    for category, n in workers.most_common():
        print(f"  {100 * n / total:5.1f}%  {category}")
    print("top leaf frames in the workers:")
    for frame, n in leaves.most_common(8):
        print(f"  {100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1]
        del args[i : i + 2]
    main(args[0], only)
