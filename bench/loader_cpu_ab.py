"""What a change costs on the trainer's path: BatchLoader's CPU seconds per sample from two checkouts, alternating.

`read_cost_ab.py` times `Store.read_sample` alone; this times the whole 2-core path `h5feed bench
--workers 4` measures (speculators-legacy, batch 1, max_len 2048, bf16): the trainer's process, its
delivery thread and its worker processes or reader threads.  Each pass runs in a fresh process with
one checkout's h5feed: it builds the loader, runs one untimed pass (the ring's first touch, the page
cache), then, for "cold", evicts the store's files from the page cache (POSIX_FADV_DONTNEED: no root
needed), and times one pass.  Passes alternate A, B, A, B, ... so the shared machine's noise hits
both alike.  CPU is the pass's process and its reaped workers (`os.times`), split into the trainer's
process ("main") and the workers; "other" is the share of the machine's CPUs that other processes
used meanwhile (from /proc/stat): passes with much of it are suspect.

    python bench/loader_cpu_ab.py --a OLD_ROOT --b NEW_ROOT [--store STORE] [--workers 4] [--threads]
        [--cache cold|warm] [--samples 24] [--passes 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONE_PASS = r"""
import json, os, sys, time
import torch
from pathlib import Path
from h5feed import BatchLoader

store, workers, threads, cache, samples = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])

def busy():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait

def evict():
    for path in Path(store).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

parallel = {"threads": workers} if threads else {"num_workers": workers}
loader = BatchLoader(store, flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16,
                     batch_size=1, samples=list(range(samples)), **parallel)
for batch in loader:  # untimed: the ring's first touch, workers' imports
    del batch
if cache == "cold":
    evict()
t0, machine0, wall0 = os.times(), busy(), time.perf_counter()
n = 0
for batch in loader:
    float(batch["hidden_states"].view(-1)[-1])
    n += 1
    del batch
wall, t1, machine = time.perf_counter() - wall0, os.times(), busy() - machine0
main = (t1.user + t1.system) - (t0.user + t0.system)
children = (t1.children_user + t1.children_system) - (t0.children_user + t0.children_system)
print(json.dumps({"cpu_s_per_sample": (main + children) / n, "main_cpu_s_per_sample": main / n,
                  "worker_cpu_s_per_sample": children / n, "wall_s_per_sample": wall / n,
                  "other_cpu_share": max(0.0, machine - main - children) / (wall * os.cpu_count())}))
"""

KEYS = ("cpu_s_per_sample", "main_cpu_s_per_sample", "worker_cpu_s_per_sample", "wall_s_per_sample", "other_cpu_share")


def one_pass(root: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    command = [sys.executable, "-c", ONE_PASS, str(args.store), str(args.workers), "1" if args.threads else "0",
               args.cache, str(args.samples)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True,
                        help="the baseline: a folder holding an h5feed/ package (a checkout's src/)")
    parser.add_argument("--b", type=Path, required=True,
                        help="the change: a folder holding an h5feed/ package (a checkout's src/)")
    default_store = Path("~/.cache/h5feed/bench/speculators-legacy-pt-H7168-K3-T1500-1900-n48-s0/store")
    parser.add_argument("--store", type=Path, default=default_store.expanduser())
    parser.add_argument("--workers", type=int, default=4, help="worker processes (or, with --threads, threads)")
    parser.add_argument("--threads", action="store_true", help="reader threads in the trainer's process")
    parser.add_argument("--cache", choices=("cold", "warm"), default="warm")
    parser.add_argument("--samples", type=int, default=24, help="the store's first samples, read in each pass")
    parser.add_argument("--passes", type=int, default=5, help="passes of each checkout")
    args = parser.parse_args()
    passes: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for _ in range(args.passes):
        for name in ("a", "b"):
            passes[name].append(one_pass(getattr(args, name), args))
            print(name, json.dumps(passes[name][-1]), file=sys.stderr, flush=True)
    summary: dict[str, object] = {"loader": f"{args.workers} {'threads' if args.threads else 'workers'}",
                                  "cache": args.cache, "samples": args.samples, "passes": passes}
    for key in KEYS:
        a, b = (statistics.median(p[key] for p in passes[n]) for n in ("a", "b"))
        summary[key] = {"a": a, "b": b, "b_over_a": b / a if a else None}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
