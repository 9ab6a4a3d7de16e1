"""Converter throughput and compression ratio on the bench's Kimi-shaped set, on the local pool and on Dask.

For each worker count, converts the embedded `h5feed bench` source set (built
and cached by `h5feed.bench.ensure_default_set`) into a fresh store and reports
MB/s in (source file bytes) and out (chunk bytes written), per worker, the
compression ratio, the CPU seconds it took and the peak memory of one worker.
The page cache is dropped before each run when possible (root), so the source
is read from disk as in a first conversion.

With `--scheduler local`, each worker count also runs on a Dask `LocalCluster`
of as many single-thread worker processes (started before the clock starts),
and with `--scheduler tcp://HOST:PORT` on that cluster (its own workers).  Each
run reports the engine's overhead per sample: the time the worker slots spent
outside the conversion tasks, (slots x seconds converting - task seconds) /
samples; the difference between the engines is what Dask costs per sample.
`--fsync both` runs each configuration with and without the fsyncs.  `--tiny N`
converts N one-token samples instead (H=16): the work per sample is then next to
nothing, and a worker's milliseconds per sample are what the engine costs.

    python bench/convert/convert_bench.py --workers 1 2 --scheduler local --fsync both --num-samples 24
    python bench/convert/convert_bench.py --workers 1 2 --scheduler local --tiny 400
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from h5feed.bench import (
    DEFAULT_CACHE_DIR,
    MemorySampler,
    SyntheticSpec,
    drop_page_cache,
    ensure_default_set,
    format_ruled_table,
)
from h5feed.conversion import RunOptions, convert
from h5feed.conversion.cluster import local_cluster
from h5feed.store import Store, chunk_encoder
from h5feed.testing.synthetic import write_synthetic


@dataclass
class ConvertRun:
    engine: str  # "pool", or "dask" with the scheduler's address
    workers: int  # worker processes (Dask: worker threads of the cluster)
    fsync: bool
    cold: bool
    samples: int
    tokens: int
    seconds: float
    bytes_in: int  # source file bytes
    bytes_out: int  # chunk bytes written (the store's hidden, id and mask chunks)
    raw_bytes: int  # tensor bytes the samples hold (hidden states + input_ids + loss_mask)
    mb_in_per_s: float
    mb_out_per_s: float
    mb_in_per_s_per_worker: float
    mb_out_per_s_per_worker: float
    ratio_file: float  # bytes_in / bytes_out
    ratio_raw: float  # raw_bytes / bytes_out
    cpu_seconds: float  # this process and its workers
    peak_worker_memory_bytes: int  # the largest PSS (RSS if no PSS) any one worker reached
    memory_metric: str
    other_cpu_share: float  # share of the CPUs other processes used meanwhile
    seconds_converting: float  # the convert step alone (not probing and planning, not finalizing)
    task_seconds: float  # summed over the tasks, as the workers timed them
    overhead_ms_per_sample: float  # (workers x seconds_converting - task_seconds) / samples
    cluster_start_seconds: float  # starting the LocalCluster (not in `seconds`)


def run(src: Path, dst: Path, workers: int, cold: bool, fsync: bool, scheduler: str | None = None,
        cluster_start_seconds: float = 0.0) -> ConvertRun:
    if dst.exists():
        shutil.rmtree(dst)
    if cold:
        problem = drop_page_cache()
        if problem:
            raise RuntimeError(problem)
    with MemorySampler(interval=0.1) as sampler:
        if scheduler is None:
            report = convert(src, dst, workers=workers, progress=False, run=RunOptions(durable=fsync))
        else:
            report = convert(src, dst, progress=False, run=RunOptions(scheduler=scheduler, durable=fsync))
    store = Store(dst)
    raw = int(store.sample_lengths.sum()) * store.token_nbytes
    seconds = report.seconds
    task_seconds = sum(w.seconds for w in report.workers.values())
    return ConvertRun(
        engine="pool" if scheduler is None else f"dask {scheduler}", workers=workers, fsync=fsync,
        cold=cold, samples=report.num_samples, tokens=report.num_tokens, seconds=seconds,
        bytes_in=report.bytes_in, bytes_out=report.bytes_out, raw_bytes=raw,
        mb_in_per_s=report.bytes_in / seconds / 1e6, mb_out_per_s=report.bytes_out / seconds / 1e6,
        mb_in_per_s_per_worker=report.bytes_in / seconds / 1e6 / workers,
        mb_out_per_s_per_worker=report.bytes_out / seconds / 1e6 / workers,
        ratio_file=report.bytes_in / report.bytes_out, ratio_raw=raw / report.bytes_out,
        cpu_seconds=sampler.cpu_seconds, peak_worker_memory_bytes=sampler.peak_child, memory_metric=sampler.metric,
        other_cpu_share=sampler.other_cpu_share, seconds_converting=report.seconds_converting,
        task_seconds=task_seconds,
        overhead_ms_per_sample=(workers * report.seconds_converting - task_seconds) / report.num_samples * 1e3,
        cluster_start_seconds=cluster_start_seconds,
    )


def run_on_dask(src: Path, dst: Path, scheduler: str, workers: int, cold: bool, fsync: bool) -> ConvertRun:
    """One run on the cluster at `scheduler`, or on a fresh LocalCluster of `workers` processes ("local")."""
    import distributed

    if scheduler != "local":
        with distributed.Client(scheduler) as client:
            threads = sum(client.nthreads().values())
        return run(src, dst, threads, cold, fsync, scheduler)
    t0 = time.perf_counter()
    with local_cluster(workers, dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        client.run(importlib.import_module, "h5feed.conversion.converter")  # the workers' imports, before the clock starts
        started = time.perf_counter() - t0
        return run(src, dst, workers, cold, fsync, cluster.scheduler_address, started)


def codec_rates(store_path: Path) -> dict[str, float]:
    """The store codec's encode and decode rates on one core, on the hidden chunks of sample 0 (MB/s of raw bytes)."""
    from numcodecs import blosc

    store = Store(store_path)
    if store.info.codec.name != "blosc":
        return {}
    blosc.use_threads = False
    raw = store.read_sample(0)
    c = store.info.chunk_tokens
    chunks = [t[i : i + c].view(torch.uint16).numpy().copy() for t in (raw.aux_hidden_states, raw.last_hidden_state)
              for i in range(0, len(t) - c + 1, c)]
    encode = chunk_encoder(store.info.codec, itemsize=2)  # what the converter writes
    nbytes = sum(a.nbytes for a in chunks)
    t0 = time.process_time()
    encoded = [encode(a) for a in chunks]
    enc = time.process_time() - t0
    outs = [np.empty_like(a) for a in chunks]
    for e, o in zip(encoded, outs):
        blosc.decompress(e, o)  # touch the outputs once: decode is timed into warm buffers
    t0 = time.process_time()
    for e, o in zip(encoded, outs):
        blosc.decompress(e, o)  # what the reader does
    dec = time.process_time() - t0
    return {"encode_mb_per_s_per_core": nbytes / enc / 1e6, "decode_mb_per_s_per_core": nbytes / dec / 1e6,
            "ratio": nbytes / sum(len(e) for e in encoded)}


def table(runs: list[ConvertRun]) -> str:
    header = ["engine", "workers", "fsync", "cache", "samples", "seconds", "MB/s in", "MB/s out", "in/worker",
              "out/worker", "worker ms/sample", "overhead ms/sample", "ratio (file)", "ratio (raw)", "CPU s", "CPU ms/sample",
              "peak/worker", "other CPU"]
    rows = [header] + [[
        r.engine.split()[0], str(r.workers), "on" if r.fsync else "off", "cold" if r.cold else "warm", str(r.samples),
        f"{r.seconds:.1f}", f"{r.mb_in_per_s:.0f}", f"{r.mb_out_per_s:.0f}", f"{r.mb_in_per_s_per_worker:.0f}",
        f"{r.mb_out_per_s_per_worker:.0f}", f"{r.seconds_converting * r.workers / r.samples * 1e3:.1f}",
        f"{r.overhead_ms_per_sample:.1f}", f"{r.ratio_file:.3f}",
        f"{r.ratio_raw:.3f}", f"{r.cpu_seconds:.1f}", f"{r.cpu_seconds / r.samples * 1e3:.0f}",
        f"{r.peak_worker_memory_bytes / 1e9:.2f} GB {r.memory_metric.upper()}", f"{100 * r.other_cpu_share:.0f}%",
    ] for r in runs]
    return "\n".join(format_ruled_table(rows, right=set(range(len(header))) - {0, 2, 3}))


def dask_cost(runs: list[ConvertRun]) -> list[str]:
    """What Dask adds per sample over the pool with the same workers and fsync: in wall time of a worker
    (seconds converting x workers / samples), and in CPU time (of the whole process tree: on a busy
    machine the steadier figure)."""
    pool = {(r.workers, r.fsync): r for r in runs if r.engine == "pool"}
    lines = []
    for r in runs:
        p = pool.get((r.workers, r.fsync))
        if r.engine != "pool" and p is not None:
            wall = (r.seconds_converting - p.seconds_converting) * r.workers / r.samples * 1e3
            cpu = (r.cpu_seconds - p.cpu_seconds) / r.samples * 1e3
            lines.append(f"dask vs pool, {r.workers} worker(s), fsync {'on' if r.fsync else 'off'}: "
                         f"{r.mb_in_per_s:.0f} vs {p.mb_in_per_s:.0f} MB/s in; per sample {wall:+.0f} ms of a worker's "
                         f"wall time, {cpu:+.0f} ms of CPU (LocalCluster start {r.cluster_start_seconds:.1f} s, not counted)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default: 1 2)")
    p.add_argument("--num-samples", type=int, default=SyntheticSpec.num_samples)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--dst", type=Path, help="scratch store (default: CACHE_DIR/convert-bench-store, removed after)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                   help="drop the page cache before each run (default: when possible)")
    p.add_argument("--scheduler", help="also convert on Dask: 'local' (a LocalCluster of each worker count) or "
                   "tcp://HOST:PORT (that cluster's workers)")
    p.add_argument("--fsync", choices=["on", "off", "both"], default="on",
                   help="durable runs (fsync each shard and journal line), --no-fsync runs, or both (default: on)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of runs of every configuration, the fastest of each kept (on a shared machine: the "
                   "least disturbed)")
    p.add_argument("--tiny", type=int, metavar="N", help="convert N one-token samples of H=16 instead: the engine's "
                   "cost per sample")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    spec = SyntheticSpec(num_samples=a.num_samples)
    say = lambda m: print(f"[convert_bench] {m}", file=sys.stderr, flush=True)
    if a.tiny:
        store = None
        src = Path(a.cache_dir).expanduser() / f"convert-bench-tiny-{a.tiny}"
        if not src.exists():
            write_synthetic(src, spec.format, a.tiny, 16, lengths=(1, 1))
    else:
        store = ensure_default_set(a.cache_dir, spec, log=say)
        src = store.parent / "src"
    dst = a.dst or Path(a.cache_dir).expanduser() / "convert-bench-store"
    cold = a.cold is not False and drop_page_cache() is None
    if a.cold and not cold:
        say("cannot drop the page cache (needs root): warm runs only")
    fsyncs = {"on": [True], "off": [False], "both": [True, False]}[a.fsync]
    configs = [(workers, fsync, scheduler) for workers in a.workers for fsync in fsyncs
               for scheduler in ([None, a.scheduler] if a.scheduler else [None])]
    tries: dict[tuple[int, bool, str | None], list[ConvertRun]] = {c: [] for c in configs}
    for _ in range(a.repeat):  # rounds of every configuration: a busy spell of the machine hits them alike
        for workers, fsync, scheduler in configs:
            r = (run(src, dst, workers, cold, fsync) if scheduler is None else
                 run_on_dask(src, dst, scheduler, workers, cold, fsync))
            say(f"{r.engine} workers={r.workers} fsync={'on' if r.fsync else 'off'}: {r.mb_in_per_s:.0f} MB/s in, "
                f"{r.mb_out_per_s:.0f} MB/s out, overhead {r.overhead_ms_per_sample:.1f} ms/sample, {r.seconds:.1f} s")
            tries[workers, fsync, scheduler].append(r)
    runs = [min(tries[c], key=lambda t: t.seconds) for c in configs]
    shutil.rmtree(dst, ignore_errors=True)
    rates = codec_rates(store) if store else {}
    info: dict[str, Any] = {"source": str(src), "cpus": psutil.cpu_count(), "codec_one_core": rates,
                            "runs": [asdict(r) for r in runs]}
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"source {src}\n" + table(runs))
        print("\n".join(dask_cost(runs)))
        if rates:
            print(f"codec {Store(store).info.codec} on one core, hidden chunks of sample 0: encode "
                  f"{rates['encode_mb_per_s_per_core']:.0f} MB/s, decode {rates['decode_mb_per_s_per_core']:.0f} MB/s "
                  f"(raw bytes), ratio {rates['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
