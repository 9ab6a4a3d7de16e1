"""Concurrent range GETs from a loopback S3 server: h5feed's s3fs and obstore backends against the
server's own ceiling.

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

    python bench/remote_bench.py --sizes 11 50 --objects 6 --concurrency 4 16 --delays 0 0.02
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's h5feed and the test server

from s3_server import CREDENTIALS, REGION, boto3_client

from h5feed.bench import MemorySampler, format_table
from h5feed.io import PART_BYTES, ObjectStore, S3Store, part_ranges

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


def fetch_plain(moto_url: str, proxy_url: str, keys: list[str], k: int) -> Callable[[list[tuple[str, int, int]]], int]:
    import urllib3

    signer = boto3_client(moto_url)
    urls = {key: signer.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=3600)
            .replace(moto_url, proxy_url) for key in keys}
    pool = urllib3.PoolManager(maxsize=k, retries=False)

    def one(r: tuple[str, int, int]) -> int:
        key, start, stop = r
        response = pool.request("GET", urls[key], headers={"Range": f"bytes={start}-{stop - 1}"})
        assert response.status == 206 and len(response.data) == stop - start, response.status
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
    return format_table(rows, right={0, 1, 2, 4, 5, 6, 7})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[11, 50], help="object sizes, MB")
    parser.add_argument("--objects", type=int, default=6, help="objects of each size")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16], help="requests in flight")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.02], help="seconds the proxy adds per request")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    runs = [run for delay in args.delays
            for run in bench_delay(delay, args.sizes, args.objects, args.concurrency, args.trials)]
    print(f"{args.objects} objects of each size as {PART_BYTES >> 20} MiB ranges; best of {args.trials}; "
          "MB/s = 10^6 bytes/s; ceiling = plain")
    print("\n".join(report(runs)))


if __name__ == "__main__":
    main()
