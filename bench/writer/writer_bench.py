"""What `h5feed.open_writer` adds to an extraction loop, against `torch.save` of one `.pt` file per sample.

For the same synthetic samples (Kimi-shaped by default: H=7168, K=3, 1500..1900 tokens, bf16, made once in
memory), time per sample of (a) `torch.save` into a folder, as pipelines do today, and (b) `writer.append`
into a store, each in one pass, with fsync (durable) on both sides; and the disk each takes.  A follower's
data wait is measured by `bench/writer/follow_bench.py`, not here.  `--extract-ms` puts a model's time before
each sample (both sides) and `--write-behind N` lets the writer compress behind it.  With `--device cuda`
the samples lie on the GPU, as an extraction's do: the `.pt` side copies them to the host before
`torch.save` (as the pipelines' scripts do), the writer is handed the CUDA tensors.

`--writers N` also times N writer processes appending to one store at once (`open_writer(writer=...)`, each
its share of the samples, made in the process before the clock starts, its share of the cores for torch's
threads) against one writer process appending them all: samples/s in all, from the first append to the last
close.

    python bench/writer/writer_bench.py --samples 8 --out /tmp/writer_bench [--device cuda]
    python bench/writer/writer_bench.py --samples 8 --extract-ms 800 --write-behind 2 --out /tmp/writer_bench
    python bench/writer/writer_bench.py --samples 32 --writers 4 --hidden-size 1024 --out /tmp/writer_bench

`--bucket` also times the writer into a bucket: moto's S3 server on loopback behind the test proxy
(`tests/s3_server.py`, `--bucket-delay` seconds added to every request), the same samples appended to
`s3://.../store.zarr` from a staging folder under `--out`: what the uploads add to each append, and the
bucket's bytes.  moto keeps objects in its own process's memory, so this is the client's and the
loopback's cost, not a cloud's.

    python bench/writer/writer_bench.py --samples 8 --hidden-size 2048 --bucket --bucket-delay 0.02 \\
        --out /tmp/writer_bench

`--bucket --writers N` times N writer processes appending to one bucket store at once instead (each its share of
the samples, publishing every `--publish-every`): time per sample from the first append to the last close, and
the requests (and PUTs) per sample the proxy saw.
The local `--writers` comparison is skipped then.

    python bench/writer/writer_bench.py --samples 8 --hidden-size 256 --tokens 100:200 --publish-every 1 --bucket \
        --writers 4 --out /tmp/writer_bench
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

import h5feed


def make_samples(n: int, hidden: int, aux: int, lengths: tuple[int, int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        t = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        layers = [(torch.randn(t, hidden, generator=g) * 2).bfloat16() for _ in range(aux + 1)]
        samples.append({"input_ids": torch.randint(0, 150000, (t,), generator=g), "hidden_states": layers,
                        "loss_mask": torch.ones(t, dtype=torch.long)})
    return samples


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def on_host(value: object) -> object:
    """What pipelines save: their tensors copied to the host first."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [on_host(v) for v in value]
    return value


def timed_pt(samples: list[dict], folder: Path, extract_s: float) -> tuple[float, float]:
    folder.mkdir(parents=True)
    proc = psutil.Process()
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    for i, sample in enumerate(samples):
        time.sleep(extract_s)  # the model's forward pass: the GPU works, the GIL is free
        path = folder / f"data_{i}.pt"
        torch.save({key: on_host(value) for key, value in sample.items()}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0


def timed_writer(samples: list[dict], store: Path | str, publish_every: int, extract_s: float,
                 write_behind: int, **options: Any) -> tuple[float, float, h5feed.WriterReport]:
    proc = psutil.Process()
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    with h5feed.open_writer(store, **options,
                            writing=h5feed.WriteOptions(publish_every=publish_every, write_behind=write_behind)) as writer:
        for i, sample in enumerate(samples):
            time.sleep(extract_s)
            writer.append(sample, name=f"data_{i}.pt")
    return time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0, writer.report


def append_share(store: str, writer: str | None, seeds: list[int], shape: dict[str, Any], publish_every: int,
                 ready: Any, times: Any, options: dict[str, Any]) -> None:
    """One writer process: makes its samples, waits for the others, appends them; reports (start, end, tokens).
    Its torch threads are its share of the cores: a process each with all of them spin against each other."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ready.parties))
    samples = [make_samples(1, seed=seed, **shape)[0] for seed in seeds]
    ready.wait()
    start = time.monotonic()
    with h5feed.open_writer(store, writer=writer, **options, writing=h5feed.WriteOptions(publish_every=publish_every)) as w:
        for seed, sample in zip(seeds, samples):
            w.append(sample, name=f"sample-{seed}")
    times.put((start, time.monotonic(), w.report.tokens))


def timed_processes(store: Path | str, writers: int, samples: int, shape: dict[str, Any], publish_every: int,
                    storage_options: dict[str, Any] | None = None, staging: Path | None = None) -> dict:
    """`writers` processes appending `samples` samples in all to one store: samples/s from the first append on."""
    spawn = multiprocessing.get_context("spawn")
    ready, times = spawn.Barrier(writers), spawn.Queue()
    ids = [None] if writers == 1 else [f"w{w}" for w in range(writers)]
    options = [{} if staging is None else {"bucket": h5feed.BucketOptions(storage_options, str(staging / f"w{w}"))}
               for w in range(writers)]
    processes = [spawn.Process(target=append_share, args=(str(store), ids[w], list(range(w, samples, writers)), shape,
                                                          publish_every, ready, times, options[w]))
                 for w in range(writers)]
    for process in processes:
        process.start()
    spans = [times.get(timeout=3600) for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"a writer process exited with {process.exitcode}")
    seconds = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    return {"writers": writers, "seconds": seconds, "samples_per_s": samples / seconds,
            "tokens_per_s": sum(tokens for *_, tokens in spans) / seconds,
            "samples_in_store": len(h5feed.Store(store, storage_options=storage_options))}


def timed_bucket_writer(samples: list[dict], args: argparse.Namespace, extract_s: float) -> dict[str, Any]:
    """The writer into a bucket of moto's server on loopback (the tests' server and proxy, started here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from s3_server import running_s3

    with running_s3() as s3:
        bucket = s3.new_bucket()
        s3.proxy.delay = args.bucket_delay
        if args.writers:
            shape = {"hidden": args.hidden_size, "aux": args.aux_layers, "lengths": args.lengths}
            timed = timed_processes(f"s3://{bucket}/store.zarr", args.writers, len(samples), shape, args.publish_every,
                                    s3.storage_options, args.out / "staging")
            requests = s3.proxy.requests()
            n = len(samples)
            return {"writers": args.writers, "ms_per_sample": 1e3 * timed["seconds"] / n,
                    "requests_per_sample": len(requests) / n,
                    "puts_per_sample": sum(r.method == "PUT" for r in requests) / n,
                    "samples_in_store": timed["samples_in_store"], "delay_s": args.bucket_delay}
        seconds, cpu, report = timed_writer(samples, f"s3://{bucket}/store.zarr", args.publish_every, extract_s,
                                            args.write_behind,
                                            bucket=h5feed.BucketOptions(s3.storage_options, args.out / "staging"))
        stored = sum(o["Size"] for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                     for o in page.get("Contents", []))
        requests = len(s3.proxy.requests())
    n = len(samples)
    return {"ms_per_sample": 1e3 * seconds / n, "cpu_s_per_sample": cpu / n,
            "append_ms_per_sample": 1e3 * report.seconds / n, "bucket_MB": stored / 1e6, "delay_s": args.bucket_delay,
            "requests_per_sample": requests / n, "staging_MB_left": folder_bytes(args.out / "staging") / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--aux-layers", type=int, default=3)
    p.add_argument("--tokens", default="1500:1900")
    p.add_argument("--publish-every", type=int, default=16)
    p.add_argument("--writers", type=int, default=0, help="also time N writer processes into one store against one")
    p.add_argument("--out", type=Path, default=Path("/tmp/writer_bench"))
    p.add_argument("--extract-ms", type=float, default=0.0,
                   help="an extraction's model time before each sample is saved (a sleep: the GPU's forward pass); "
                   "ms_per_sample then is the loop's, the model's time included")
    p.add_argument("--write-behind", type=int, default=0, help="open_writer(writing=WriteOptions(write_behind=N))")
    p.add_argument("--device", default="cpu", help="where the samples lie when they are saved (cuda: an extraction's)")
    p.add_argument("--bucket", action="store_true", help="also time the writer into a loopback S3 bucket (moto)")
    p.add_argument("--bucket-delay", type=float, default=0.0, help="seconds added to every request to the bucket")
    args = p.parse_args()
    low, high = (int(x) for x in args.tokens.split(":"))
    args.lengths = (low, high)
    shutil.rmtree(args.out, ignore_errors=True)
    samples = make_samples(args.samples, args.hidden_size, args.aux_layers, (low, high), seed=0)
    if args.device != "cpu":
        samples = [{key: [v.to(args.device) for v in value] if isinstance(value, list) else value.to(args.device)
                    for key, value in sample.items()} for sample in samples]
        torch.cuda.synchronize()
    raw = sum(sum(h.nbytes for h in s["hidden_states"]) + s["input_ids"].nbytes + s["loss_mask"].nbytes for s in samples)
    extract_s = args.extract_ms / 1e3
    pt_s, pt_cpu = timed_pt(samples, args.out / "pt", extract_s)
    w_s, w_cpu, report = timed_writer(samples, args.out / "store.zarr", args.publish_every, extract_s,
                                      args.write_behind)
    pt_bytes, store_bytes = folder_bytes(args.out / "pt"), folder_bytes(args.out / "store.zarr")
    result = {
        "samples": args.samples, "device": args.device, "extract_ms": args.extract_ms,
        "write_behind": args.write_behind, "raw_MB": raw / 1e6, "other_cpu_load1": os.getloadavg()[0],
        "pt": {"ms_per_sample": 1e3 * pt_s / args.samples, "cpu_s_per_sample": pt_cpu / args.samples,
               "disk_MB": pt_bytes / 1e6},
        "writer": {"ms_per_sample": 1e3 * w_s / args.samples, "cpu_s_per_sample": w_cpu / args.samples,
                   "append_ms_per_sample": 1e3 * report.seconds / args.samples, "disk_MB": store_bytes / 1e6},
        "disk_ratio_pt_over_store": pt_bytes / store_bytes,
    }
    if args.bucket:
        result["bucket_writer"] = timed_bucket_writer(samples, args, extract_s)
    if args.writers > 1 and not args.bucket:
        shape = {"hidden": args.hidden_size, "aux": args.aux_layers, "lengths": (low, high)}
        one = timed_processes(args.out / "one.zarr", 1, args.samples, shape, args.publish_every)
        several = timed_processes(args.out / "several.zarr", args.writers, args.samples, shape, args.publish_every)
        result["processes"] = {"one": one, "several": several, "speedup": several["samples_per_s"] / one["samples_per_s"],
                               "cpus": os.cpu_count()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
