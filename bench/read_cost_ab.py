"""What a change to the read path costs: two checkouts of h5feed read the same samples, in alternating passes.

Each package converts the same synthetic source set (Kimi shape by default) into its own store (a store
format may differ between them), then single-threaded passes over every sample run in fresh processes,
A, B, A, B, ..., so the machine's noise hits both alike.  Each pass reports CPU and wall seconds per
sample (reads with checks on, into pooled buffers, as the loaders read); the summary gives the medians
and B's cost relative to A.

    python bench/read_cost_ab.py --a OLD_ROOT --b NEW_ROOT --work /tmp/ab [--samples 16] [--passes 5] [--rounds 3]

OLD_ROOT and NEW_ROOT are folders that hold an `h5feed/` package (a worktree's src/, or that of a `git archive`
of a commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE_PASS = """
import json, sys, time
from h5feed.store import BufferPool, ReadStats, Store
store, pool, stats, rounds = Store(sys.argv[1]), BufferPool(capacity=4), ReadStats(), int(sys.argv[2])
for i in range(len(store)):  # warm-up: buffers, page cache
    store.read_sample(i, allocate=pool, stats=stats)
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(rounds):
    for i in range(len(store)):
        store.read_sample(i, allocate=pool, stats=stats)
n = rounds * len(store)
print(json.dumps({"cpu_s_per_sample": (time.process_time() - cpu) / n, "wall_s_per_sample": (time.perf_counter() - wall) / n}))
"""


def run_with(root: Path, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True,
                        help="the baseline: a folder holding an h5feed/ package (a checkout's src/)")
    parser.add_argument("--b", type=Path, required=True,
                        help="the change: a folder holding an h5feed/ package (a checkout's src/)")
    parser.add_argument("--work", type=Path, required=True, help="where the sources and the two stores go")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="reads of every sample in one pass")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="conversion workers")
    args = parser.parse_args()
    src = args.work / "src"
    if not src.exists():
        write = ("import sys; from pathlib import Path; from h5feed.synthetic import write_synthetic; "
                 f"write_synthetic(Path(sys.argv[1]), 'speculators-legacy-pt', {args.samples}, {args.hidden_size}, 3, "
                 "(1500, 1900), 0)")
        run_with(args.b, ["-c", write, str(src)])
    stores = {"a": args.work / "store-a", "b": args.work / "store-b"}
    for name, store in stores.items():
        if not store.exists():
            run_with(getattr(args, name), ["-m", "h5feed", "convert", str(src), str(store), "--workers", str(args.workers)])
    passes: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for _ in range(args.passes):
        for name, store in stores.items():
            passes[name].append(json.loads(run_with(getattr(args, name), ["-c", ONE_PASS, str(store), str(args.rounds)])))
    summary: dict[str, object] = {"samples": args.samples, "hidden_size": args.hidden_size, "passes": passes}
    for key in ("cpu_s_per_sample", "wall_s_per_sample"):
        a, b = (statistics.median(p[key] for p in passes[n]) for n in ("a", "b"))
        summary[key] = {"a": a, "b": b, "b_over_a": b / a}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
