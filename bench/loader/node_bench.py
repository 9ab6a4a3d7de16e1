"""Can one box's cores and disk feed N training ranks?  N rank processes, each with its own loader, the step emulated.

A GPU node runs one training rank a GPU (8 of them, on 16-128 cores), and every rank runs its own
loader: the ranks share the disk, the page cache and the cores.  This launches `--ranks` rank
processes on this box (spawned, no process group: the ranks do not talk to each other), each
reading its shard (rank r of N) through one loader, all starting together, and emulates each
rank's training step: the batch is copied to the GPU (`.to("cuda", non_blocking=True)`, then the trainer's
stream synchronized, as `loss.item()` does; skipped without CUDA), then the rank sleeps `--step-ms` (65 ms: a
Kimi-shaped EAGLE-3 drafter step on one H200).  A box with one GPU thus stands for a node of N.

Loaders (`--loaders`):

- `pt-baseline`: speculators 0.4's `.pt` dataset (`h5feed.testing.baseline`) in a DataLoader with its collate
  (`create_collate_fn(max_len)`) and pin_memory, as its trainer runs it;
- `workers`: `h5feed.BatchLoader` with `--workers` DataLoader worker processes (with CUDA, `device="cuda"`: the
  batch copied to the GPU one batch ahead, an FP8 store's hidden states dequantized there);
- `threads`: `h5feed.BatchLoader` with `--workers` reader threads in the rank's process (`device="cuda"` too);
- `cuda`: `h5feed.BatchLoader(decode="cuda")` with `--workers` reader threads (needs CUDA).

Every loader gives rank r the same samples in the same order: every N-th sample of the store
from r on, unshuffled (padded to equal counts, as DistributedSampler does).  With `--fp8` the
h5feed loaders also read an FP8 copy of the store (the baseline has only its `.pt` files).

Per rank: samples; wall time from the loader's creation to the end of its last step; data wait,
the time the rank is blocked in the loader (building it, `iter()` and every `next()`, the first
included: the time its GPU would idle), as % of wall; the median `next()`; CPU seconds of the
rank's process tree (the rank and its loader's workers, reaped ones included) less the copy to
the GPU, i.e. the loader's CPU, since the step is a sleep.  Per node: samples/s (all samples
over the span from the first start to the last end), what N steps need (N x 1000 / step_ms),
the share of it delivered, loader cores in all and per GPU, and the box meanwhile: the 1-minute
load average (highest seen) and the cores other processes kept busy.  A pass is one epoch of
the rank's shard, and a box's disk holds few Kimi-shaped samples, so start-up weighs: the time
to the first batch (the slowest rank's) and, from it on, the wait (the worst rank's) and the
share delivered (each rank's samples over its own time) are given apart.

On the H200 box (one GPU, 16 cores), from the repository root, with the wheels h5feed needs
beside torch in .whl/ (as for bench/loader/train_step.py):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/loader/node_bench.py --ranks 8 \\
        --make-data 160 --hidden-size 7168 --convert-workers 16 --fp8 --workers 2 --step-ms 65 \\
        --loaders pt-baseline,workers,threads,cuda --cold --warm --out $OUT/node_bench.json

A CPU smoke run (a minute here, mostly the ranks' start: importing torch; at 5 ms steps a sleep's
overshoot on a busy box already shows in the shares delivered):

    python bench/loader/node_bench.py --ranks 2 --make-data 8 --hidden-size 64 --tokens 40:60 --max-len 64 \\
        --workers 1 --step-ms 5 --convert-workers 0 --data-dir /tmp/nb --warm --out /tmp/nb/node_bench.json

A rank that fails, dies or outlasts `--timeout` is reported with its error; Ctrl-C or an error
in this process kills every rank's process tree before it exits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the h5feed of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_step beside this file

from train_step import add_data_options, evict, fp8_store, make_data

import h5feed
from h5feed.bench import format_ruled_table
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.store import Store
from h5feed.testing.baseline import Eagle3SampleFileDataset, create_collate_fn

log = logging.getLogger("node_bench")

LOADERS = ("pt-baseline", "workers", "threads", "cuda")
GRACE_S = 5.0  # how long a rank that exited may take to have its last message read


# --- results ----------------------------------------------------------------------------------------


@dataclass
class RankJob:
    """What one rank runs: sent to its process."""

    loader: str
    store: str
    rank: int
    ranks: int
    workers: int
    max_len: int
    step_ms: float
    start_method: str  # how the loader's worker processes start: as in a rank that torchrun started
    repeat: int = 1  # the store's samples read this many times over in one epoch (a longer epoch, as a larger store's)


@dataclass
class RankResult:
    """One rank's figures, or its error (then the figures are those of a rank that delivered nothing)."""

    rank: int
    samples: int = 0
    start: float = 0.0  # time.monotonic(): one clock for every process of the box
    end: float = 0.0
    wall_s: float = 0.0
    wait_s: float = 0.0  # blocked in the loader: building it, iter() and every next()
    wait_pct: float = 0.0
    first_batch_s: float = 0.0  # from the loader's creation to its first batch
    next_median_ms: float = 0.0
    steady_wait_pct: float = 0.0  # from the first batch on: the passes here are short, start-up weighs
    steady_samples_per_s: float = 0.0
    loader_cpu_s: float = 0.0
    copy_cpu_s: float = 0.0
    error: str | None = None


@dataclass
class BoxState:
    """The box's CPU counters at one moment: what other processes did meanwhile is the difference."""

    time: float
    busy_s: float  # CPU seconds of every core at work (guest time is in user time already)
    own_cpu_s: float  # this process's own CPU (the ranks report theirs)

    @classmethod
    def now(cls) -> BoxState:
        cpu = psutil.cpu_times()
        not_work = sum(getattr(cpu, k, 0.0) for k in ("idle", "iowait", "steal", "guest", "guest_nice"))
        me = psutil.Process().cpu_times()
        return cls(time.monotonic(), sum(cpu) - not_work, me.user + me.system)


@dataclass
class PassResult:
    """One loader over one store, all ranks together, from one cache state."""

    loader: str
    data: str  # "exact" or "fp8"
    cache: str  # "cold", "as found" or "warm"
    eviction: str  # how a cold pass emptied the cache
    ranks: list[RankResult]
    step_ms: float
    cpus: int
    node_samples_per_s: float = 0.0
    need_samples_per_s: float = 0.0
    delivered_pct: float = 0.0
    first_batch_s: float = 0.0  # the slowest rank's
    steady_samples_per_s: float = 0.0  # each rank's own from its first batch on, summed
    steady_delivered_pct: float = 0.0
    wall_s: float = 0.0
    loader_cores: float = 0.0
    loader_cores_per_gpu: float = 0.0
    load_avg_max: float = 0.0
    busy_cores: float = 0.0
    other_cores: float = 0.0
    errors: list[str] = field(default_factory=list)

    def summarise(self, before: BoxState, after: BoxState, load_avg_max: float) -> None:
        """The node's figures from its ranks' and the box's."""
        n = len(self.ranks)
        done = [r for r in self.ranks if r.error is None]
        self.errors = [f"rank {r.rank}: {r.error}" for r in self.ranks if r.error is not None]
        self.need_samples_per_s = n * 1000.0 / self.step_ms
        self.load_avg_max = load_avg_max
        if done:
            self.wall_s = max(r.end for r in done) - min(r.start for r in done)
            self.node_samples_per_s = sum(r.samples for r in done) / self.wall_s
            self.delivered_pct = 100.0 * self.node_samples_per_s / self.need_samples_per_s
            self.first_batch_s = max(r.first_batch_s for r in done)
            self.steady_samples_per_s = sum(r.steady_samples_per_s for r in done)
            self.steady_delivered_pct = 100.0 * self.steady_samples_per_s / self.need_samples_per_s
            self.loader_cores = sum(r.loader_cpu_s for r in done) / self.wall_s
            self.loader_cores_per_gpu = self.loader_cores / n
        seconds = after.time - before.time
        ours = sum(r.loader_cpu_s + r.copy_cpu_s for r in done) + after.own_cpu_s - before.own_cpu_s
        self.busy_cores = (after.busy_s - before.busy_s) / seconds
        self.other_cores = max(0.0, (after.busy_s - before.busy_s - ours) / seconds)


# --- in each rank -----------------------------------------------------------------------------------


def die_with_parent() -> None:
    """Have the kernel kill this rank when the launcher dies, however it dies (Linux; elsewhere the launcher's
    own clean-up has to do)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_loader(job: RankJob, cuda: bool) -> Any:
    """This rank's loader over its shard: rank r of N of the unshuffled store."""
    store = Store(job.store)
    schedule = h5feed.ScheduleOptions(samples=list(range(len(store))) * job.repeat if job.repeat > 1 else None,
                                      shuffle=False, rank=job.rank, world_size=job.ranks)
    items: dict[str, Any] = {"flavor": "speculators-legacy", "max_len": job.max_len,
                             "hidden_states_dtype": torch.bfloat16, "schedule": schedule}
    device = "cuda" if cuda else None  # as a GPU trainer's BatchLoader delivers: copied a batch ahead
    if job.loader == "workers":
        return h5feed.BatchLoader(store, **items, num_workers=job.workers, device=device)
    if job.loader == "threads":
        return h5feed.BatchLoader(store, **items, decode=h5feed.ThreadsOptions(threads=job.workers, device=device))
    if job.loader == "cuda":
        return h5feed.BatchLoader(store, **items, decode=h5feed.CudaOptions(threads=job.workers))
    sequence = HiddenStatesStream(store, **items).rank_sequence()  # the same samples as h5feed's
    root = Path(store.info.source_root)
    dataset = Eagle3SampleFileDataset(max_len=job.max_len, file_list=[root / p for p in store.source_paths],
                                      hidden_states_dtype=torch.bfloat16)
    return DataLoader(dataset, batch_size=1, sampler=sequence, num_workers=job.workers,
                      collate_fn=create_collate_fn(job.max_len), pin_memory=cuda)


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system
    return total


def to_gpu(batch: Mapping[str, Any]) -> None:
    """The trainer's copy of the batch to the GPU, waited for on the trainer's stream only (as its `loss.item()`
    waits): a device-wide synchronize would also wait for a GPU loader's decodes queued ahead on its own stream."""
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            value.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()


def run_rank(job: RankJob, start: Any, cuda: bool) -> RankResult:
    """One epoch of the rank's shard, each batch copied and then slept on as the step."""
    result = RankResult(job.rank)
    nexts: list[float] = []
    start.wait()
    cpu0, result.start = tree_cpu_seconds(), time.monotonic()
    loader = build_loader(job, cuda)
    batches = iter(loader)
    result.end = time.monotonic()
    setup_s = result.end - result.start
    while True:
        t = time.monotonic()
        try:
            batch = next(batches)
        except StopIteration:
            break
        nexts.append(time.monotonic() - t)
        if cuda:
            c = time.thread_time()
            to_gpu(batch)
            result.copy_cpu_s += time.thread_time() - c
        del batch
        time.sleep(job.step_ms / 1000)
        result.end = time.monotonic()  # the epoch's end (the loader's shutdown after it is not the trainer's wait)
    del batches
    if isinstance(loader, h5feed.BatchLoader):
        loader.close()  # its workers are reaped, so that their CPU is counted
    del loader
    result.samples = len(nexts)
    result.wall_s = result.end - result.start
    result.wait_s = setup_s + sum(nexts)
    result.wait_pct = 100.0 * result.wait_s / result.wall_s
    result.first_batch_s = setup_s + (nexts[0] if nexts else 0.0)
    result.next_median_ms = 1e3 * statistics.median(nexts) if nexts else 0.0
    steady_s = result.wall_s - result.first_batch_s
    if steady_s > 0:
        result.steady_wait_pct = 100.0 * sum(nexts[1:]) / steady_s
        result.steady_samples_per_s = result.samples / steady_s  # its steps: 1000 / step_ms with no wait
    result.loader_cpu_s = tree_cpu_seconds() - cpu0 - result.copy_cpu_s
    return result


def rank_main(job: RankJob, start: Any, messages: Any) -> None:
    """A rank's process: says it is ready, waits for the start, sends its result as a JSON line (or its error)."""
    die_with_parent()
    mp.set_start_method(job.start_method, force=True)  # else a spawned rank spawns its workers too
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # one thread a rank, as torchrun sets it
    try:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.zeros(1, device="cuda")  # the CUDA context, before anything is timed
        messages.put(("ready", job.rank, ""))
        messages.put(("result", job.rank, json.dumps(asdict(run_rank(job, start, cuda)))))
    except KeyboardInterrupt:
        pass  # the launcher stops every rank and says so
    except BaseException:
        messages.put(("error", job.rank, traceback.format_exc().strip()))


# --- the launcher -----------------------------------------------------------------------------------


def kill_tree(proc: mp.process.BaseProcess) -> None:
    """A rank and every process under it (its loader's workers), by their ids."""
    try:
        root = psutil.Process(proc.pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code} without a result"


class Ranks:
    """The rank processes of one pass, their messages, and the box's load while they run."""

    def __init__(self, jobs: list[RankJob]) -> None:
        ctx = mp.get_context("spawn")
        self.start, self.messages = ctx.Event(), ctx.Queue()
        self.procs = [ctx.Process(target=rank_main, args=(job, self.start, self.messages), name=f"rank{job.rank}")
                      for job in jobs]
        self.results: dict[int, RankResult] = {}
        self.load_avg_max = 0.0
        for p in self.procs:
            p.start()

    def gather(self, kind: str, timeout: float) -> None:
        """Read messages until every rank still running has sent one of `kind`; a rank that sends an error, dies,
        or does not answer within `timeout` gets a result saying so."""
        waiting = {r for r in range(len(self.procs)) if r not in self.results}
        deadline, dead_since = time.monotonic() + timeout, {}
        while waiting and time.monotonic() < deadline:
            self.load_avg_max = max(self.load_avg_max, os.getloadavg()[0])
            try:
                what, rank, payload = self.messages.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for r in sorted(waiting):
                    if not self.procs[r].is_alive() and now - dead_since.setdefault(r, now) > GRACE_S:
                        self.results[r] = RankResult(r, error=exit_reason(self.procs[r].exitcode))
                        waiting.discard(r)
                continue
            if what == "error":
                self.results[rank] = RankResult(rank, error=payload)
            elif what == "result":
                self.results[rank] = RankResult(**json.loads(payload))
            if what in (kind, "error"):
                waiting.discard(rank)
        for r in waiting:
            kill_tree(self.procs[r])
            self.results[r] = RankResult(r, error=f"no {kind} message within {timeout:.0f} s: killed")

    def stop(self, wait_s: float) -> None:
        """Every rank gone: joined if it ends within `wait_s`, else killed with its workers."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                kill_tree(p)
            p.join()
        self.messages.close()


def run_pass(loader: str, store: Store, data: str, cache: str, args: argparse.Namespace) -> PassResult:
    """One loader over `store` in `--ranks` ranks started together; `cache` "cold" drops the page cache first."""
    jobs = [RankJob(loader, str(store.path), r, args.ranks, args.workers, args.max_len, args.step_ms,
                    mp.get_start_method(), args.repeat) for r in range(args.ranks)]
    log.info("%s on %s (%s): %d ranks", loader, data, cache, args.ranks)
    ranks = Ranks(jobs)
    try:
        ranks.gather("ready", args.timeout)
        eviction = evict(store) if cache == "cold" else ""
        ranks.load_avg_max = 0.0  # from the start on
        before = BoxState.now()
        ranks.start.set()
        ranks.gather("result", args.timeout)
        after = BoxState.now()
    except BaseException:  # Ctrl-C or an error here: no rank outlives this process
        ranks.stop(wait_s=0)
        raise
    ranks.stop(wait_s=30)
    result = PassResult(loader, data, cache, eviction, [ranks.results[r] for r in range(args.ranks)], args.step_ms,
                        os.cpu_count() or 1)
    result.summarise(before, after, ranks.load_avg_max)
    return result


def stores(args: argparse.Namespace, cuda: bool) -> dict[str, Store]:
    """The stores read: the given or made one ("exact"), and with --fp8 its FP8 copy."""
    if args.make_data:
        lo, hi = (int(x) for x in args.tokens.split(":"))
        exact = make_data(args.make_data, args.hidden_size or (7168 if cuda else 64), (lo, hi), args.data_dir,
                          args.convert_workers)
    else:
        exact = Store(args.data)
    return {"exact": exact, **({"fp8": fp8_store(exact, args.convert_workers)} if args.fp8 else {})}


def passes(args: argparse.Namespace, data: dict[str, Store], cuda: bool) -> list[PassResult]:
    """Every loader over every store it reads, cold (or as found) and then, with --warm, once more."""
    results = []
    for loader in args.loaders:
        if loader == "cuda" and not cuda:
            log.info("cuda: left out, no CUDA here")
            continue
        for name, store in data.items():
            if loader == "pt-baseline" and name != "exact":
                continue  # the baseline reads the .pt files, whatever the store's precision
            for cache in ["cold" if args.cold else "as found", *(["warm"] if args.warm else [])]:
                results.append(run_pass(loader, store, name, cache, args))
                print(table(results[-1:]), flush=True)
    return results


def table(results: list[PassResult]) -> str:
    head = ["loader", "data", "cache", "samples", "wait % by rank", "next() ms", "samples/s", "need", "delivered %",
            "first batch s (max)", "steady wait % (max)", "steady delivered %", "loader cores", "per GPU", "load avg",
            "other cores"]
    rows = [head]
    for p in results:
        waits = " ".join("ERR" if r.error else f"{r.wait_pct:.1f}" for r in p.ranks)
        medians = [r.next_median_ms for r in p.ranks if r.error is None]
        steady = [r.steady_wait_pct for r in p.ranks if r.error is None]
        rows.append([p.loader, p.data, p.cache, str(sum(r.samples for r in p.ranks)), waits,
                     f"{statistics.median(medians):.1f}" if medians else "-", f"{p.node_samples_per_s:.1f}",
                     f"{p.need_samples_per_s:.1f}", f"{p.delivered_pct:.0f}", f"{p.first_batch_s:.2f}",
                     f"{max(steady):.1f}" if steady else "-", f"{p.steady_delivered_pct:.0f}", f"{p.loader_cores:.2f}",
                     f"{p.loader_cores_per_gpu:.2f}", f"{p.load_avg_max:.1f}", f"{p.other_cores:.2f}"])
    lines = format_ruled_table(rows, right=set(range(3, len(head))))
    for p in results:
        lines += [f"{p.loader} ({p.data}, {p.cache}): {e.splitlines()[-1]}"
                  + (" (the traceback in the JSON)" if "\n" in e else "") for e in p.errors]
    lines += sorted({f"cold: {p.eviction}" for p in results if p.eviction})
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8,
                   help="training ranks of the node, one process each (default %(default)s)")
    add_data_options(p)
    p.add_argument("--fp8", action="store_true", help="the h5feed loaders also read an FP8 copy of the store")
    p.add_argument("--loaders", default="pt-baseline,workers,threads",
                   help=f"comma-separated, run in this order, of {', '.join(LOADERS)} (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (or threads) of each rank's loader")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--step-ms", type=float, default=65.0, help="the emulated training step (default %(default)s)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each loader (root; else fadvise)")
    p.add_argument("--warm", action="store_true", help="a second pass of each loader after the first")
    p.add_argument("--repeat", type=int, default=1,
                   help="read the store's samples this many times over in each epoch: the longer epoch of a larger "
                        "store, for steady figures from a box's few samples (the repeats of a cold pass come from "
                        "the page cache: use it for warm figures)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds the ranks may take to get ready, and again to finish (default %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file of every figure")
    args = p.parse_args(argv)
    args.loaders = args.loaders.split(",")
    unknown = set(args.loaders) - set(LOADERS)
    if unknown:
        p.error(f"unknown loader(s) {', '.join(sorted(unknown))}: choose from {', '.join(LOADERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    cuda = torch.cuda.is_available()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = stores(args, cuda)
    try:
        results = passes(args, data, cuda)
    except KeyboardInterrupt:
        print("interrupted: every rank stopped", file=sys.stderr)
        return 130
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"stores": {name: str(s.path) for name, s in data.items()}, "samples": len(data["exact"])},
        "machine": {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "passes": [asdict(p) for p in results],
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nall passes ({args.ranks} ranks, {args.step_ms:g} ms steps, {os.cpu_count()} cores):")
    print(table(results))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
