"""A trainer following a store while writer processes append to it: how long it waits, and for whom.

Writer processes (`--writers`, each `h5feed.open_writer(store, writer=...)`) append synthetic samples at an
extraction's pace: each sample costs `--extract-ms` of "model" time (a sleep: the GPU's forward pass) before
`append`.  The trainer, in this process, follows the store as it grows (`HiddenStatesStream(follow=Follow())`,
`StreamLoader` with `--workers` DataLoader workers, speculators 0.4's collate) with a step simulated by a
`--step-ms` sleep, until the writers close the store.  It reports the trainer's data wait (its time in
`next()`), how much of the workers' time went to waiting for the writers (h5feed's counters), and the rates of
both sides: when extraction is slower than training the wait is the writers', and the counters say so.

    python bench/writer/follow_bench.py --samples 24 --writers 2 --extract-ms 100 --step-ms 50 --out /tmp/follow_bench
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import h5feed
from h5feed.testing.baseline import create_collate_fn


def sample(i: int, hidden: int, aux: int, lengths: tuple[int, int]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    t = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
    return {"input_ids": torch.randint(0, 32000, (t,), generator=g),
            "hidden_states": [(torch.randn(t, hidden, generator=g) * 2).bfloat16() for _ in range(aux + 1)],
            "loss_mask": torch.ones(t, dtype=torch.long)}


def extraction(store: str, writer: str, indices: list[int], shape: dict[str, Any], extract_s: float,
               ready: Any, report: Any) -> None:
    """One writer process: each of its samples made, the model's time waited, then appended and published."""
    torch.set_num_threads(1)
    samples = [sample(i, shape["hidden"], shape["aux"], shape["lengths"]) for i in indices]
    ready.wait()
    start = time.perf_counter()
    with h5feed.open_writer(store, writer=writer,
                            settings=h5feed.StoreSettings(chunk_tokens=shape["chunk"], shard_tokens=shape["shard"]),
                            writing=h5feed.WriteOptions(publish_every=1)) as w:
        for i, s in zip(indices, samples):
            time.sleep(extract_s)
            w.append(s, name=f"sample-{i}")
    report.put({"writer": writer, "seconds": time.perf_counter() - start, "append_s": w.report.seconds})


def follow(store: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The trainer: every sample the writers publish, one batch of one per simulated step."""
    while not (store / "zarr.json").exists():  # the first writer creates the store with its first sample
        time.sleep(0.01)
    stream = h5feed.HiddenStatesStream(store, max_len=args.max_len, hidden_states_dtype=torch.bfloat16,
                                       schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(poll_s=0.02)))
    loader = h5feed.StreamLoader(stream, batch_size=1, num_workers=args.workers,
                                 collate_fn=create_collate_fn(args.max_len))
    waits: list[float] = []
    start = asked = time.perf_counter()
    for _batch in loader:
        waits.append(time.perf_counter() - asked)
        time.sleep(args.step_ms / 1e3)
        asked = time.perf_counter()
    wall = time.perf_counter() - start
    snapshot = stream.counters.snapshot()
    return {"steps": len(waits), "wall_s": wall, "data_wait_pct": 100 * sum(waits) / wall,
            "first_batch_s": waits[0] if waits else None,
            "next_ms_median_after_first": 1e3 * statistics.median(waits[1:]) if len(waits) > 1 else None,
            "workers_writer_wait_s": snapshot.total("writer_wait_seconds"),
            "workers_read_s": snapshot.total("read_seconds") + snapshot.total("decode_seconds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="the trainer's DataLoader workers")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--aux-layers", type=int, default=3)
    p.add_argument("--tokens", default="500:900")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--extract-ms", type=float, default=100.0, help="the model's time per sample, in each writer")
    p.add_argument("--step-ms", type=float, default=50.0, help="the trainer's step")
    p.add_argument("--out", type=Path, default=Path("/tmp/follow_bench"))
    args = p.parse_args()
    low, high = (int(x) for x in args.tokens.split(":"))
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    store = args.out / "store.zarr"
    shape = {"hidden": args.hidden_size, "aux": args.aux_layers, "lengths": (low, high), "chunk": 256, "shard": 1024}
    spawn = multiprocessing.get_context("spawn")
    ready, report = spawn.Barrier(args.writers + 1), spawn.Queue()
    writers = [spawn.Process(target=extraction, args=(str(store), f"w{w}", list(range(w, args.samples, args.writers)),
                                                      shape, args.extract_ms / 1e3, ready, report))
               for w in range(args.writers)]
    for process in writers:
        process.start()
    ready.wait()
    load0 = os.getloadavg()[0]
    trainer = follow(store, args)
    done = [report.get(timeout=600) for _ in writers]
    for process in writers:
        process.join()
    extraction_s = max(d["seconds"] for d in done)
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load1_at_start": load0, "cpus": os.cpu_count(),
        "extraction": {"samples_per_s": args.samples / extraction_s,
                       "append_ms_per_sample": 1e3 * sum(d["append_s"] for d in done) / args.samples},
        "trainer": {**trainer, "samples_per_s": trainer["steps"] / trainer["wall_s"],
                    "step_bound_samples_per_s": 1e3 / args.step_ms},
        "samples_in_store": len(h5feed.Store(store)),
    }
    print(json.dumps(result, indent=2))
    (args.out / "follow_bench.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
