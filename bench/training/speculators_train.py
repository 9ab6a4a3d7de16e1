"""speculators 0.9's own `train` command: how long its steps wait for data with the `file` backend, the `h5feed`
backend and h5feed's `BatchLoader`, on the same data.

The GPU run (one H200), from the repository root, with these wheels in .whl/ (Python 3.12, manylinux; the
image has torch, transformers, pandas, pyarrow, typer, rich and the rest): speculators==0.9.0 hs-connectors==0.9.0
datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 openai==3.57.0 jiter==0.19.0 httpx2==2.16.2
httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 loguru==0.7.3 pydantic==2.14.4 pydantic_core==2.50.5
pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 python-dotenv==1.2.4 zarr==3.1.6
numcodecs==0.16.6 crc32c==2.9.post0 donfig==0.8.1.post1 google-crc32c==1.9.0:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 \
        python3 bench/training/speculators_train.py --make-data 240 --hidden-size 2048 --tokens 256:1024 \
        --total-seq-len 2048 --workers 8 --steps 20 --cold --work /tmp/spec --out $OUT

(eager: on torch 2.11 speculators' `torch.compile` of its fused loss fails in dynamo; at 8192 tokens a step and a
full vocabulary its eager loss outgrows an H200's memory)

or on real data: ``--data DATA --store STORE --verifier VERIFIER`` (speculators' data folder, its converted
store, the verifier it was generated from).  ``--make-data`` writes synthetic samples, converts them, and a
verifier of the same hidden size with few layers (its weights are random: only shapes and speed matter).

Each arm runs speculators' `train` (eagle3, one draft layer) in its own process, for `--steps` steps:

- ``file``: ``--hidden-states-backend file``: speculators' DataLoader (its packing sampler, collate and spawned
  workers) reading ``hidden_states/hs_{i}.safetensors``;
- ``h5feed``: ``--hidden-states-backend h5feed --h5feed-store STORE`` (``python -m h5feed.speculators_train``):
  the same DataLoader reading the store;
- ``batchloader``: the same command, its train loader replaced, in this bench's process only, by
  ``h5feed.BatchLoader(flavor="speculators")`` over the train split's samples with as many samples per batch as
  the file arm's packed batches hold on average (the same max_len row, shift and keys; not the same packing).

Measured by a thin wrapper round the train loader that speculators' Trainer iterates: the seconds the trainer is
blocked in ``next()`` (data wait) and between batches (the step), after ``--warmup`` steps.  Drop the page cache
between arms (``--cold``, where the machine allows) to measure the disk, not memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ARMS = ("file", "h5feed", "batchloader")


class TimedLoader:
    """The train loader, timed: what the trainer waits in `next()` and what a whole step takes.

    Forwards everything else (`len`, `batch_sampler`: speculators' Trainer reads both)."""

    def __init__(self, loader: Any, record: Path) -> None:
        self.loader, self.record = loader, record

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        waits, steps = [], []
        it, last = iter(self.loader), time.perf_counter()
        try:
            while True:
                start = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                now = time.perf_counter()
                waits.append(now - start)
                steps.append(now - last)
                last = now
                yield batch
        finally:
            self.record.write_text(json.dumps({"wait_s": waits, "step_s": steps}))


def child(arm: str, record: Path, train_argv: list[str]) -> None:
    """Run speculators' train in this process, its train loader timed (and, for `batchloader`, replaced)."""
    import speculators.train.cli as train_cli
    import torch

    import h5feed
    from h5feed.integrations.speculators import samples_by_file_index
    from h5feed.integrations.speculators_train import main  # registers the backend; speculators parses in main

    build_loaders = train_cli.create_train_val_loaders

    def timed_loaders(**kwargs: Any) -> tuple[Any, Any]:
        train_loader, val_loader = build_loaders(**kwargs)
        if arm == "batchloader":
            store = kwargs["transfer"].store
            dataset = train_loader.dataset
            by_file = samples_by_file_index(store)
            samples = [by_file[dataset.start_file_idx + i] for i in range(len(dataset))]
            batch_size = max(1, round(len(dataset) / len(train_loader)))
            train_loader = h5feed.BatchLoader(store, flavor="speculators", max_len=kwargs["total_seq_len"],
                                              hidden_states_dtype=torch.bfloat16, batch_size=batch_size,
                                              num_workers=kwargs["num_workers"],
                                              schedule=h5feed.ScheduleOptions(samples=samples, seed=kwargs["seed"]))
        return TimedLoader(train_loader, record), val_loader

    train_cli.create_train_val_loaders = timed_loaders  # the bench's process only: speculators' files are unchanged
    main(train_argv)


def make_data(work: Path, num_samples: int, hidden_size: int, tokens: tuple[int, int]) -> tuple[Path, Path, Path]:
    """Synthetic speculators data (Arrow + hs_{i}.safetensors), its store, and a verifier of that hidden size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import h5feed
    from h5feed.testing.synthetic import VOCAB_SIZE, write_synthetic

    data, store, verifier = work / "data", work / "hs.zarr", work / "verifier"
    if not (data / "state.json").exists():
        write_synthetic(data, "speculators-safetensors", num_samples, hidden_size, lengths=tokens, seed=0)
    if not store.exists():
        h5feed.convert(data, store, workers=os.cpu_count() or 1, progress=False)
    if not (verifier / "config.json").exists():
        config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=8, num_attention_heads=max(1, hidden_size // 128),
                             num_key_value_heads=max(1, hidden_size // 128), max_position_embeddings=32768)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(verifier)
    return data, store, verifier


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"--cold: cannot drop the page cache ({e}); the arms after the first may read from memory")


def summary(arm: str, record: Path, warmup: int, seq_len: int) -> dict[str, Any]:
    times = json.loads(record.read_text())
    waits, steps = times["wait_s"][warmup:], times["step_s"][warmup:]
    if not steps:
        raise SystemExit(f"{arm}: only {len(times['step_s'])} steps ran; ask for more than --warmup {warmup}")
    return {"arm": arm, "steps": len(steps), "wait_ms_mean": 1000 * statistics.fmean(waits),
            "wait_ms_p95": 1000 * sorted(waits)[int(0.95 * (len(waits) - 1))],
            "step_ms_mean": 1000 * statistics.fmean(steps), "data_wait_pct": 100 * sum(waits) / sum(steps),
            "row_tokens_per_s": seq_len * len(steps) / sum(steps)}  # total_seq_len rows per second, padding included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="speculators' data folder (Arrow dataset + hidden_states/)")
    parser.add_argument("--store", type=Path, help="the store converted from it")
    parser.add_argument("--verifier", type=Path, help="the verifier's folder (config.json + weights)")
    parser.add_argument("--make-data", type=int, metavar="N", help="write N synthetic samples into --work instead")
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--tokens", default="512:2048", help="synthetic samples' lengths, MIN:MAX")
    parser.add_argument("--work", type=Path, default=Path("/tmp/speculators_train_bench"))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers (speculators' --num-workers)")
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each arm")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    # the child's own arguments, then `--` and speculators' (whose --total-seq-len this parser would otherwise take)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, train_argv = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.child:
        child(args.child, args.record, train_argv)
        return
    if args.make_data:
        low, high = (int(x) for x in args.tokens.split(":"))
        packed = args.make_data * (low + high) / 2 / args.total_seq_len  # speculators packs samples into each step
        if packed < args.warmup + args.steps:
            parser.error(f"--make-data {args.make_data} samples of {args.tokens} tokens pack into at most about "
                         f"{packed:.0f} steps of --total-seq-len {args.total_seq_len}: fewer than --warmup + --steps "
                         f"({args.warmup + args.steps}); make more samples")
        args.data, args.store, args.verifier = make_data(args.work, args.make_data, args.hidden_size, (low, high))
    elif not (args.data and args.store and args.verifier):
        parser.error("give --data, --store and --verifier, or --make-data N")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for arm in args.arms.split(","):
        backend = ["--hidden-states-backend", "file"] if arm == "file" else [
            "--hidden-states-backend", "h5feed", "--h5feed-store", str(args.store)]
        record, save = args.out / f"speculators_train_{arm}.json", args.work / f"ckpt_{arm}"
        train_argv = ["--verifier-name-or-path", str(args.verifier), "--data-path", str(args.data),
                      "--speculator-type", "eagle3", "--num-layers", "1", "--mask-token-id", "0",
                      "--total-seq-len", str(args.total_seq_len), "--num-workers", str(args.workers),
                      "--epochs", "1", "--max-steps", str(args.steps), "--save-path", str(save),
                      "--no-resume-from-checkpoint", "--log-dir", str(args.work / f"logs_{arm}"), *backend]
        if args.cold:
            drop_page_cache()
        subprocess.run([sys.executable, __file__, "--child", arm, "--record", str(record), "--", *train_argv], check=True)
        results.append(summary(arm, record, args.warmup, args.total_seq_len))
        print(json.dumps(results[-1]), flush=True)
    (args.out / "speculators_train.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
