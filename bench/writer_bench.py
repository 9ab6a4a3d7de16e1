"""What `h5feed.open_writer` adds to an extraction loop, against `torch.save` of one `.pt` file per sample.

For the same synthetic samples (Kimi-shaped by default: H=7168, K=3, 1500..1900 tokens, bf16, made once in
memory), time per sample of (a) `torch.save` into a folder, as pipelines do today, and (b) `writer.append`
into a store, each in one pass, with fsync (durable) on both sides; and the disk each takes.  A follower's
data wait is measured by `tests/test_writer.py` and the example, not here.  With `--device cuda` the samples
lie on the GPU, as an extraction's do: the `.pt` side copies them to the host before `torch.save` (as the
pipelines' scripts do), the writer is handed the CUDA tensors.

    python bench/writer_bench.py --samples 8 --out /tmp/writer_bench [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

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


def timed_pt(samples: list[dict], folder: Path) -> tuple[float, float]:
    folder.mkdir(parents=True)
    proc = psutil.Process()
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    for i, sample in enumerate(samples):
        path = folder / f"data_{i}.pt"
        torch.save({key: on_host(value) for key, value in sample.items()}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0


def timed_writer(samples: list[dict], store: Path, publish_every: int) -> tuple[float, float, h5feed.WriterReport]:
    proc = psutil.Process()
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    with h5feed.open_writer(store, publish_every=publish_every) as writer:
        for i, sample in enumerate(samples):
            writer.append(sample, name=f"data_{i}.pt")
    return time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0, writer.report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--aux-layers", type=int, default=3)
    p.add_argument("--tokens", default="1500:1900")
    p.add_argument("--publish-every", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("/tmp/writer_bench"))
    p.add_argument("--device", default="cpu", help="where the samples lie when they are saved (cuda: an extraction's)")
    args = p.parse_args()
    low, high = (int(x) for x in args.tokens.split(":"))
    shutil.rmtree(args.out, ignore_errors=True)
    samples = make_samples(args.samples, args.hidden_size, args.aux_layers, (low, high), seed=0)
    if args.device != "cpu":
        samples = [{key: [v.to(args.device) for v in value] if isinstance(value, list) else value.to(args.device)
                    for key, value in sample.items()} for sample in samples]
        torch.cuda.synchronize()
    raw = sum(sum(h.nbytes for h in s["hidden_states"]) + s["input_ids"].nbytes + s["loss_mask"].nbytes for s in samples)
    pt_s, pt_cpu = timed_pt(samples, args.out / "pt")
    w_s, w_cpu, report = timed_writer(samples, args.out / "store.zarr", args.publish_every)
    pt_bytes, store_bytes = folder_bytes(args.out / "pt"), folder_bytes(args.out / "store.zarr")
    result = {
        "samples": args.samples, "device": args.device, "raw_MB": raw / 1e6, "other_cpu_load1": os.getloadavg()[0],
        "pt": {"ms_per_sample": 1e3 * pt_s / args.samples, "cpu_s_per_sample": pt_cpu / args.samples,
               "disk_MB": pt_bytes / 1e6},
        "writer": {"ms_per_sample": 1e3 * w_s / args.samples, "cpu_s_per_sample": w_cpu / args.samples,
                   "append_ms_per_sample": 1e3 * report.seconds / args.samples, "disk_MB": store_bytes / 1e6},
        "disk_ratio_pt_over_store": pt_bytes / store_bytes,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
