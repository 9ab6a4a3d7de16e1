"""Reading from a loopback S3 server: h5feed's clients, and h5feed's loaders, against the server's own ceiling.

`clients` (default): concurrent range GETs.
Starts moto's S3 server behind the test proxy (`tests/s3_server.py`, in their own processes) once
per added delay, puts N objects of each size straight into moto, then fetches every object as
8 MiB ranges, K requests in flight, with:

- plain:   urllib3 on presigned URLs from K threads: the least a client can do, i.e. the ceiling
           of moto + proxy on this box (moto, not the client, is the bottleneck here);
- s3fs:    `S3Store(use_obstore=False).get_ranges`: s3fs/aiobotocore coroutines on fsspec's event loop;
- obstore: `S3Store.get_ranges` as shipped: obstore (Rust object_store) calls from a thread pool.

Each client gets the same bytes at the same concurrency; each figure is the best of `--trials`
passes (the box is shared), and the CPU seconds this process spent per GB say what the client
costs beside the server.

    python bench/remote/remote_bench.py --sizes 11 50 --objects 6 --concurrency 4 16 --delays 0 0.02

`loaders`: training straight from the bucket.  The first `--samples` samples of a Kimi-shaped store
(default: `h5feed bench`'s set in ~/.cache/h5feed/bench) and their `.pt` files are put into moto,
then, once per added delay:

- ceiling: the plain client fetches every shard of those samples (the bytes the loaders fetch) as
  8 MiB ranges, 16 and 32 in flight (the better counts);
- `.pt` download: the plain client fetches the samples' `.pt` files to a local folder, the time
  "download the set, then train" waits before its first batch;
- the trainer's batches over the s3:// URL (batch_size 1, speculators 0.4's collate at max_len 2048):
  the drop-in `HiddenStatesStream` in a StreamLoader with that collate and pin_memory, and BatchLoader;
  time to the first batch,
  samples/s, GB/s fetched (from the loader's own counters) against the ceiling, requests per sample;
- h5feed's fetch path alone (no decoding), in a forked process: each sample's objects asked for
  `--prefetch` samples ahead, as the stream asks, then taken: what the loaders' I/O can do when
  decoding does not share the box's cores with the server;
- the cache: the StreamLoader with `cache_dir` (epoch 1 fills it, epoch 2 reads it) against the local store.

    python bench/remote/remote_bench.py loaders --samples 16 --workers 2 --delays 0 0.02
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # this checkout's h5feed and the test server

from s3_server import CREDENTIALS, REGION, boto3_client

from h5feed import (
    BatchLoader,
    HiddenStatesStream,
    ReadOptions,
    ScheduleOptions,
    Store,
    StoreOptions,
    StreamLoader,
    WorkersOptions,
)
from h5feed.bench import DEFAULT_CACHE_DIR, MemorySampler, format_ruled_table
from h5feed.io import PART_BYTES, ObjectStore, S3Store, part_ranges, process_stats
from h5feed.store.layout import CHECKSUMMED, object_key
from h5feed.testing.baseline import create_collate_fn

BUCKET = "remote-bench"
CLIENTS = ("plain", "s3fs", "obstore")


@dataclass
class Run:
    delay_ms: float
    size_mb: int
    concurrency: int
    client: str
    seconds: float
    nbytes: int
    client_cpu_s: float
    other_cpu_share: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6


class Server:
    """`tests/s3_server.py` as a process: moto plus the proxy with a fixed added delay."""

    def __init__(self, delay: float) -> None:
        self.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "s3_server.py"), "--delay", str(delay)],
                                        stdout=subprocess.PIPE, text=True)
        self.moto_url, self.proxy_url = self.process.stdout.readline().split()  # type: ignore[union-attr]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def fetch_plain(moto_url: str, proxy_url: str, keys: list[str], k: int,
                into: Path | None = None) -> Callable[[list[tuple[str, int, int]]], int]:
    """K threads of urllib3 on presigned URLs through the proxy; with `into`, each range is written to its file there."""
    import urllib3

    signer = boto3_client(moto_url)
    urls = {key: signer.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=3600)
            .replace(moto_url, proxy_url) for key in keys}
    pool = urllib3.PoolManager(maxsize=k, retries=False)

    def one(r: tuple[str, int, int]) -> int:
        key, start, stop = r
        response = pool.request("GET", urls[key], headers={"Range": f"bytes={start}-{stop - 1}"})
        assert response.status == 206 and len(response.data) == stop - start, response.status
        if into is not None:
            fd = os.open(into / key.replace("/", "_"), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, response.data, start)
            finally:
                os.close(fd)
        return stop - start

    executor = ThreadPoolExecutor(k)
    return lambda ranges: sum(executor.map(one, ranges))


def fetch_store(store: ObjectStore, k: int) -> Callable[[list[tuple[str, int, int]]], int]:
    """K threads, each asking the store for one range at a time: K requests in flight, whatever the backend."""
    executor = ThreadPoolExecutor(k)

    def one(r: tuple[str, int, int]) -> int:
        return len(store.get_ranges(r[0], [(r[1], r[2])])[0])

    return lambda ranges: sum(executor.map(one, ranges))


def measure(fetch: Callable[[list[tuple[str, int, int]]], int], ranges: list[tuple[str, int, int]]
            ) -> tuple[float, int, float, float]:
    """(seconds, bytes, CPU seconds of this process, other processes' CPU share) of one pass."""
    with MemorySampler(interval=3600) as sampler:  # its memory samples cost CPU: only at the start and end
        cpu0, t0 = time.process_time(), time.perf_counter()
        nbytes = fetch(ranges)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return seconds, nbytes, cpu, sampler.other_cpu_share


def bench_delay(delay: float, sizes_mb: list[int], objects: int, concurrencies: list[int], trials: int) -> list[Run]:
    server = Server(delay)
    runs = []
    try:
        direct = boto3_client(server.moto_url)
        direct.create_bucket(Bucket=BUCKET)
        rng = np.random.default_rng(0)
        for size_mb in sizes_mb:
            size = size_mb * 10**6
            keys = [f"s{size_mb}/o{i}" for i in range(objects)]
            for key in keys:
                direct.put_object(Bucket=BUCKET, Key=key, Body=rng.bytes(size))
            ranges = [(key, start, stop) for key in keys for start, stop in part_ranges(size, PART_BYTES)]
            options = {**CREDENTIALS, "endpoint_url": server.proxy_url, "client_kwargs": {"region_name": REGION}}
            for k in concurrencies:
                s3fs = S3Store(f"s3://{BUCKET}", options, concurrency=k, use_obstore=False)
                obstore = S3Store(f"s3://{BUCKET}", options, concurrency=k)
                assert (s3fs.reader, obstore.reader) == ("s3fs", "obstore")
                fetchers = {
                    "plain": fetch_plain(server.moto_url, server.proxy_url, keys, k),
                    "s3fs": fetch_store(s3fs, k),
                    "obstore": fetch_store(obstore, k),
                }
                best: dict[str, tuple[float, int, float, float]] = {}
                for client in CLIENTS:
                    fetchers[client](ranges[:k])  # warm: connections, credentials
                for _ in range(trials):  # clients take turns, so a busy moment of the shared box hits them alike
                    for client in CLIENTS:
                        result = measure(fetchers[client], ranges)
                        if client not in best or result[0] < best[client][0]:
                            best[client] = result
                for client in CLIENTS:
                    runs.append(Run(delay * 1000, size_mb, k, client, *best[client]))
                    print(f"delay {delay * 1000:.0f} ms, {size_mb} MB x {objects}, K={k}, {client}: "
                          f"{runs[-1].mb_per_s:.0f} MB/s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return runs


def report(runs: list[Run]) -> list[str]:
    ceiling = {(r.delay_ms, r.size_mb, r.concurrency): r.mb_per_s for r in runs if r.client == "plain"}
    rows = [["delay", "object", "K", "client", "MB/s", "of ceiling", "client CPU s/GB", "other CPU"]]
    for r in runs:
        rows.append([f"{r.delay_ms:.0f} ms", f"{r.size_mb} MB", str(r.concurrency), r.client, f"{r.mb_per_s:.0f}",
                     f"{100 * r.mb_per_s / ceiling[(r.delay_ms, r.size_mb, r.concurrency)]:.0f}%",
                     f"{r.client_cpu_s / (r.nbytes / 1e9):.2f}", f"{100 * r.other_cpu_share:.0f}%"])
    return format_ruled_table(rows, right={0, 1, 2, 4, 5, 6, 7})


# --- loaders --------------------------------------------------------------------------------------------


@dataclass
class LoaderRun:
    delay_ms: float
    what: str
    samples: int
    seconds: float
    first_s: float | None  # to the first item or batch
    nbytes: int  # fetched from the network (the loader's counters), or by the plain client
    requests: int
    retries: int = 0
    client_cpu_s: float = 0.0  # CPU of this process and its workers (not the server's)
    server_cpu_s: float = 0.0  # CPU of moto and the proxy: on this box they share the cores with the client
    other_cpu_share: float = 0.0  # of the machine's CPUs, used by processes outside this bench meanwhile

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


def default_store() -> Path:
    found = sorted(Path(DEFAULT_CACHE_DIR).expanduser().glob("speculators-legacy-pt-H7168-*/store"))
    if not found:
        raise SystemExit("no bench set: run `h5feed bench` once, or pass --store")
    return found[0]


def touch(batch: dict[str, Any]) -> None:
    """Read one element of every tensor: the data has arrived."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.numel():
            float(value.reshape(-1)[-1])


class Meter:
    """Wall, client CPU (the bench's process tree less the server's) and other processes' CPU share of one pass."""

    def __init__(self, server: Server) -> None:
        self.sampler, self.server = MemorySampler(interval=3600), psutil.Process(server.process.pid)

    def _server_cpu(self) -> float:
        procs = [self.server, *self.server.children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    def measure(self, delay: float, what: str, samples: int, run: Callable[[], tuple[int, int, float | None]],
                counters: Any = None) -> LoaderRun:
        """`run()` gives (items, bytes, seconds to the first item); with `counters`, bytes, requests and
        retries come from the loader's own counters."""
        before = counters.snapshot() if counters is not None else None
        server0 = self._server_cpu()
        with self.sampler:
            t0 = time.perf_counter()
            count, nbytes, first = run()
            seconds = time.perf_counter() - t0
        server_cpu = self._server_cpu() - server0
        client_cpu = self.sampler.cpu_seconds - server_cpu
        requests = retries = 0
        if counters is not None:
            after = counters.snapshot()
            nbytes = int(after.total("network_bytes") - before.total("network_bytes"))
            requests = int(after.total("requests") - before.total("requests"))
            retries = int(after.total("retries") - before.total("retries"))
        result = LoaderRun(delay * 1000, what, count, seconds, first, nbytes, requests, retries, client_cpu,
                           server_cpu, self.sampler.other_cpu_share)
        print(f"delay {delay * 1000:.0f} ms, {what}: {count / seconds:.2f} samples/s, {result.gb_per_s:.3f} GB/s, "
              f"first after {first or 0:.2f} s, {requests} requests, other CPU {100 * result.other_cpu_share:.0f}%",
              file=sys.stderr, flush=True)
        return result


def iterate(loader: Iterable[dict[str, Any]]) -> Callable[[], tuple[int, int, float | None]]:
    """A pass over a loader, timed from the creation of its iterator: (items, 0, seconds to the first item)."""

    def run() -> tuple[int, int, float | None]:
        t0 = time.perf_counter()
        first, count = None, 0
        for batch in loader:
            touch(batch)
            first = first if first is not None else time.perf_counter() - t0
            count += 1
            del batch
        return count, 0, first

    return run


class FetchPass:
    """A pass of the reader's fetch path without decoding, in a child forked for it: each sample's objects
    asked for `ahead` samples early (`Store.will_need`, as the stream asks), then taken from the source and
    dropped.  A child, so that this process never reads through obstore (its DataLoader workers, forked
    later, could not).  Reaches into the reader's internals: bench only."""

    def __init__(self, store: Store, samples: list[int], ahead: int) -> None:
        self.store, self.samples, self.ahead = store, samples, ahead
        self.requests = 0  # of the last pass

    def _take(self, i: int) -> None:
        store = self.store
        chunks = range(-(-int(store.sample_lengths[i]) // store.info.chunk_tokens))
        for name in store._arrays_to_read(None):
            for key, inner, whole in store._objects_of(i, name, chunks):
                with store._source.open(key, inner, whole):
                    pass

    def _in_child(self, results: Any) -> None:
        t0, first, samples = time.perf_counter(), None, self.samples
        for i in samples[: self.ahead]:
            self.store.will_need(i)
        for j, i in enumerate(samples):
            if j + self.ahead < len(samples):
                self.store.will_need(samples[j + self.ahead])
            self._take(i)
            first = first if first is not None else time.perf_counter() - t0
        stats = process_stats()  # a forked child's counts start from zero
        results.put((stats.bytes, stats.requests, first))

    def __call__(self) -> tuple[int, int, float | None]:
        context = multiprocessing.get_context("fork")
        results = context.SimpleQueue()
        child = context.Process(target=self._in_child, args=(results,))
        child.start()
        nbytes, self.requests, first = results.get()
        child.join()
        return len(self.samples), nbytes, first


def stream(location: str | Path, samples: list[int], args: argparse.Namespace, **options: Any) -> HiddenStatesStream:
    """The drop-in stream over `location`, opened with `options` (`StoreOptions`' storage_options, cache_dir)."""
    return HiddenStatesStream(StoreOptions(location, **options), "speculators-legacy", max_len=2048,
                              hidden_states_dtype=torch.bfloat16,
                              schedule=ScheduleOptions(samples=samples, shuffle=False),
                              reading=ReadOptions(prefetch=args.prefetch))


def trainer_loader(dataset: HiddenStatesStream, workers: int) -> StreamLoader:
    """The drop-in as a trainer runs it: batch_size 1, speculators 0.4's own collate, pin_memory."""
    return StreamLoader(dataset, batch_size=1, num_workers=workers, collate_fn=create_collate_fn(2048), pin_memory=True)


def best(runs: list[LoaderRun]) -> LoaderRun:
    return min(runs, key=lambda r: r.seconds)


def bench_loaders(delay: float, store_path: Path, args: argparse.Namespace) -> list[LoaderRun]:
    local = Store(store_path)
    samples = list(range(min(args.samples, len(local))))
    shards = [object_key(local.info, name, int(local.sample_starts[i]) // local.info.shard_tokens)
              for i in samples for name in CHECKSUMMED]
    files = [p.relative_to(store_path).as_posix() for p in store_path.rglob("*") if p.is_file()]
    metadata = [key for key in files if "/c/" not in key or key.startswith("index/")]
    sources = [Path(local.info.source_root) / local.source_paths[i] for i in samples]
    server = Server(delay)
    scratch = Path(tempfile.mkdtemp(prefix="h5feed-remote-bench-"))
    try:
        direct = boto3_client(server.moto_url)
        direct.create_bucket(Bucket=BUCKET)
        for key in [*metadata, *shards]:
            direct.upload_file(str(store_path / key), BUCKET, f"hs.zarr/{key}")
        for path in sources:
            direct.upload_file(str(path), BUCKET, f"pt/{path.name}")
        options = {"storage_options": {**CREDENTIALS, "endpoint_url": server.proxy_url,
                                       "client_kwargs": {"region_name": REGION}}}
        url, n = f"s3://{BUCKET}/hs.zarr", len(samples)
        meter = Meter(server)

        keys = [f"hs.zarr/{key}" for key in shards]
        ranges = [(key, a, b) for key in keys for a, b in part_ranges((store_path / key[8:]).stat().st_size)]
        plain = {k: fetch_plain(server.moto_url, server.proxy_url, keys, k) for k in (16, 32)}
        for fetch in plain.values():
            fetch(ranges[:32])  # warm: connections

        def fetch_all(k: int) -> Callable[[], tuple[int, int, float | None]]:
            return lambda: (n, plain[k](ranges), None)

        fetch_pass = FetchPass(Store(url, **options), samples, args.prefetch)
        trials: dict[str, list[LoaderRun]] = {}
        for _ in range(args.trials):  # interleaved, so a busy moment of the shared box hits every client alike
            for k in plain:
                run = meter.measure(delay, f"plain client, {k} in flight", n, fetch_all(k))
                run.requests = len(ranges)
                trials.setdefault(f"plain {k}", []).append(run)
            dataset = stream(url, samples, args, **options)
            loader = trainer_loader(dataset, args.workers)
            trials.setdefault("stream", []).append(meter.measure(
                delay, f"StreamLoader + 0.4 collate, {args.workers} workers", n, iterate(loader), dataset.counters))
            batches = BatchLoader(StoreOptions(url, **options), flavor="speculators-legacy", max_len=2048,
                                  hidden_states_dtype=torch.bfloat16, batch_size=1,
                                  decode=WorkersOptions(num_workers=args.workers, prefetch=args.prefetch),
                                  schedule=ScheduleOptions(samples=samples, shuffle=False))
            trials.setdefault("batches", []).append(meter.measure(
                delay, f"BatchLoader, {args.workers} workers", n, iterate(batches), batches.dataset.counters))
            run = meter.measure(delay, "h5feed fetch path alone (no decoding), 1 process", n, fetch_pass)
            run.requests = fetch_pass.requests
            trials.setdefault("fetch", []).append(run)
        ceiling = best([best(trials["plain 16"]), best(trials["plain 32"])])
        ceiling.what = f"ceiling: {ceiling.what}"
        runs = [ceiling, best(trials["stream"]), best(trials["batches"]), best(trials["fetch"])]

        pt_keys = [f"pt/{p.name}" for p in sources]
        pt_ranges = [(key, a, b) for key, p in zip(pt_keys, sources) for a, b in part_ranges(p.stat().st_size)]
        download = scratch / "pt"
        download.mkdir()
        fetch_pt = fetch_plain(server.moto_url, server.proxy_url, pt_keys, 16, into=download)
        run = meter.measure(delay, "download the .pt set (then train)", n, lambda: (n, fetch_pt(pt_ranges), None))
        run.first_s, run.requests = run.seconds, len(pt_ranges)
        runs.append(run)
        shutil.rmtree(download)

        cached = stream(url, samples, args, cache_dir=scratch / "cache", **options)
        cached_loader = trainer_loader(cached, args.workers)
        for epoch in (1, 2):
            runs.append(meter.measure(delay, f"StreamLoader + cache_dir, epoch {epoch}", n,
                                      iterate(cached_loader), cached.counters))
        local_stream = stream(store_path, samples, args)
        local_loader = trainer_loader(local_stream, args.workers)
        meter.measure(delay, "StreamLoader, local store (warm-up)", n, iterate(local_loader))
        runs.append(meter.measure(delay, "StreamLoader, local store (warm)", n, iterate(local_loader)))
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return runs


def loader_report(runs: list[LoaderRun]) -> list[str]:
    ceiling = {r.delay_ms: r.gb_per_s for r in runs if r.what.startswith("ceiling")}
    rows = [["delay", "what", "samples/s", "GB/s", "of ceiling", "first item s", "seconds", "requests/sample",
             "retries", "client CPU s/sample", "server CPU s/sample", "other CPU"]]
    for r in runs:
        rows.append([f"{r.delay_ms:.0f} ms", r.what, f"{r.samples / r.seconds:.2f}", f"{r.gb_per_s:.3f}",
                     f"{100 * r.gb_per_s / ceiling[r.delay_ms]:.0f}%" if r.nbytes else "-",
                     f"{r.first_s:.2f}" if r.first_s is not None else "-", f"{r.seconds:.2f}",
                     f"{r.requests / r.samples:.1f}", str(r.retries), f"{r.client_cpu_s / r.samples:.2f}",
                     f"{r.server_cpu_s / r.samples:.2f}", f"{100 * r.other_cpu_share:.0f}%"])
    return format_ruled_table(rows, right={0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["clients", "loaders"], default="clients")
    parser.add_argument("--sizes", type=int, nargs="+", default=[11, 50], help="clients: object sizes, MB")
    parser.add_argument("--objects", type=int, default=6, help="clients: objects of each size")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16], help="clients: requests in flight")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.02], help="seconds the proxy adds per request")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--store", type=Path, help="loaders: a Kimi-shaped format-2 store (default: the bench set)")
    parser.add_argument("--samples", type=int, default=16, help="loaders: samples of the store to read")
    parser.add_argument("--workers", type=int, default=2, help="loaders: DataLoader workers")
    parser.add_argument("--prefetch", type=int, default=4, help="loaders: samples (batches) ahead per worker")
    args = parser.parse_args()
    if args.mode == "loaders":
        store = args.store or default_store()
        runs = [run for delay in args.delays for run in bench_loaders(delay, store, args)]
        print(f"{args.samples} samples of {store}, max_len 2048, bf16; GB/s = 10^9 bytes/s fetched (the loaders' "
              "own counters); ceiling = the plain client on the same shards")
        print("\n".join(loader_report(runs)))
        return
    runs = [run for delay in args.delays
            for run in bench_delay(delay, args.sizes, args.objects, args.concurrency, args.trials)]
    print(f"{args.objects} objects of each size as {PART_BYTES >> 20} MiB ranges; best of {args.trials}; "
          "MB/s = 10^6 bytes/s; ceiling = plain")
    print("\n".join(report(runs)))


if __name__ == "__main__":
    main()
