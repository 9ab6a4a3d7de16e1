"""An EAGLE-3 drafter training step fed by the `.pt` baseline and by every h5feed path: how long it waits for data.

The whole GPU run (one H200, 16 cores), from the repository root, with the wheels h5feed
needs beside torch in .whl/ (see the device notes):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/loader/train_step.py --make-data 48 \
        --hidden-size 7168 --workers 1,2,4 --step-ms 65 --convert-workers 16 --cold --out $OUT

A CPU smoke run (seconds):

    python bench/loader/train_step.py --make-data 4 --hidden-size 32 --tokens 40:60 --max-len 64 --workers 1 \\
        --out /tmp/ts

Why: one H200 trains a Kimi-shaped EAGLE-3 drafter at ~15 samples/s, i.e. as
much hidden-state data as its disk can give (bench/RESULTS.md), so the loader, not the
GPU, decides the speed.  This measures it end to end, the way trainers run it:
the same model, the same samples in the same order, speculators 0.4's own collate
(`create_collate_fn(max_len)`: cat, then pad) and `pin_memory=True` for the
loaders that hand items to a collate, each from a cold page cache with `--cold`,
each wrapped in `h5feed.monitor` (data-wait %, GPU idle %):

- `baseline`: speculators 0.4's `.pt` dataset (`h5feed.testing.baseline`) in a DataLoader;
- `h5feed-stream`: the drop-in `HiddenStatesStream` in the same DataLoader (same collate);
- `h5feed-batch`: `BatchLoader`, DataLoader worker processes decoding straight into
  page-locked batch slots (no item, no collate copy, no pin copy);
- `h5feed-batch-threads`: `BatchLoader` with reader threads in the trainer's process;
- `h5feed-gpu`: `CudaBatchLoader`, reader threads only read and check compressed frames,
  the GPU decodes them (nvCOMP).

Each at every `--workers` count (processes, or threads).  CPU cores used by loading =
(CPU seconds of the process and its reaped workers - the training thread's own CPU per
step x steps) / wall seconds.  `--step-ms` picks the draft vocabulary whose step is
closest to it (a Kimi-shaped step on one H200 is 65-80 ms).

The step: fc from K*H to H over the aux hidden states, one Llama-style decoder
layer on cat[embedding(input_ids), hidden] (2H -> H, as EAGLE-3 does: RMSNorm,
rotary attention through `scaled_dot_product_attention`, SwiGLU MLP), lm_head to
the draft vocabulary, 3 training-time-test steps (the layer's output is the
next step's hidden input, one token further ahead, with a loss on each) against
the soft targets of a frozen verifier head, AdamW; bf16 autocast on the GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the h5feed of this checkout

import h5feed
from h5feed.bench.step import TTT_STEPS, Batch, DrafterStep, Shape, warm_batch
from h5feed.loading.datasets import HiddenStatesStream, StreamLoader
from h5feed.store import Store
from h5feed.testing.baseline import create_collate_fn

log = logging.getLogger("train_step")


def calibrate(shape: Shape, device: torch.device, batch: Batch, step_ms: float) -> tuple[DrafterStep, Shape, float]:
    """The trainer whose step is closest to `step_ms` on this device, by the draft vocabulary's size (the
    rest of the model keeps Kimi's shape): a Kimi-shaped step is 65-80 ms on one H200 (bench/RESULTS.md)."""
    best: tuple[DrafterStep, Shape, float] | None = None
    for vocab in (32000, 24000, 16000, 12000, 8000, 4000):
        candidate = replace(shape, vocab=vocab)
        trainer = DrafterStep(candidate, device)
        ms = step_seconds(trainer, batch)[0] * 1e3
        log.info("draft vocabulary %d: %.1f ms per step", vocab, ms)
        if best is None or abs(ms - step_ms) < abs(best[2] - step_ms):
            best = (trainer, candidate, ms)
        if ms <= step_ms:
            break
    assert best is not None
    return best


def step_seconds(trainer: DrafterStep, batch: Batch, steps: int = 5) -> tuple[float, float]:
    """Wall and CPU seconds of one training step on a batch already at hand (page-locked, as the loaders
    deliver it on a GPU box), after two warm-up steps."""
    if trainer.cuda:
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for _ in range(2):  # kernels, allocator and optimizer state before anything is timed
        trainer(batch).item()
    wall, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        trainer(batch).item()
    return (time.perf_counter() - wall) / steps, (cpu_seconds() - cpu) / steps


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (DataLoader workers are reaped per epoch)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# --- data -----------------------------------------------------------------------------------------


def make_data(n: int, hidden: int, tokens: tuple[int, int], data_dir: Path, convert_workers: int,
              flavor: str = "speculators-legacy") -> Store:
    """A synthetic Kimi-shaped `.pt` set of the flavor's pipeline and its store (speculators': `h5feed bench`'s
    builder; Model-Optimizer's HF dumps, post-norm last state, written and converted here; both reused when
    complete)."""
    from h5feed.bench import SyntheticSpec, ensure_default_set
    from h5feed.testing.synthetic import PipelineOptions, write_synthetic

    if flavor == "speculators-legacy":
        spec = SyntheticSpec(num_samples=n, hidden_size=hidden, tokens=tokens)
        return Store(ensure_default_set(data_dir, spec, convert_workers=convert_workers, progress=False, log=log.info))
    folder = data_dir / f"modelopt-pt-H{hidden}-K3-T{tokens[0]}-{tokens[1]}-n{n}-s0"
    try:
        store = Store(folder / "store")
        if len(store) == n:
            log.info("reusing the store %s", store.path)
            return store
    except h5feed.H5feedError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
    log.info("writing %d synthetic Model-Optimizer samples (H=%d) to %s", n, hidden, folder / "src")
    write_synthetic(folder / "src", "modelopt-pt", n, hidden, 3, tokens, 0, pipeline=PipelineOptions(variant="hf"))
    log.info("converting with %d worker(s)", convert_workers)
    h5feed.convert(folder / "src", folder / "store", workers=convert_workers, progress=False,
                   settings=h5feed.StoreSettings(last_state_norm="post"))
    return Store(folder / "store")


def fp8_store(exact: Store, convert_workers: int) -> Store:
    """The same source files converted with `--precision fp8` beside `exact` (reused when complete): the loaders
    then read FP8 hidden states, dequantized to bf16 (the baseline still reads the bf16 `.pt` files)."""
    path = exact.path.parent / f"{exact.path.name}-fp8"
    try:
        store = Store(path)
        if len(store) == len(exact):
            log.info("reusing the FP8 store %s", path)
            return store
    except h5feed.H5feedError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    log.info("converting %s again with --precision fp8 (%d workers)", exact.info.source_root, convert_workers)
    h5feed.convert(exact.info.source_root, path, workers=convert_workers, progress=False,
                   settings=h5feed.StoreSettings(precision="fp8", last_state_norm=exact.info.last_state_norm))
    return Store(path)


class ModelOptFiles(torch.utils.data.Dataset):
    """Model-Optimizer 0.46's `OfflineSupervisedDataset` (modelopt/torch/speculative/eagle/utils.py), re-stated:
    one `torch.load` per item, labels the ids one on, attention and loss masks of ones."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        data = torch.load(self.files[index], weights_only=True)
        labels = torch.full_like(data["input_ids"], -100)
        labels[..., :-1] = data["input_ids"][..., 1:]
        return {"input_ids": data["input_ids"], "base_model_hidden_states": data["hidden_states"],
                "aux_hidden_states": data["aux_hidden_states"], "attention_mask": torch.ones_like(data["input_ids"]),
                "loss_mask": torch.ones_like(data["input_ids"]), "labels": labels,
                "base_hidden_prenorm": bool(data.get("hidden_states_prenorm", False))}


def modelopt_collate(train_len: int) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """Model-Optimizer 0.46's `EagleOfflineDataCollator(train_len)`, re-stated: each key padded or cut, stacked."""

    def pad_or_truncate(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros([train_len, *x.shape[1:]])
        out[: min(train_len, x.size(0))] = x[:train_len]
        return out

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = {k: torch.stack([pad_or_truncate(f[k]) for f in features])
                 for k in ("input_ids", "attention_mask", "loss_mask", "labels")}
        outputs = {k: torch.stack([pad_or_truncate(f[k]) for f in features])
                   for k in ("base_model_hidden_states", "aux_hidden_states")}
        return {**batch, "base_model_outputs": {**outputs, "base_hidden_prenorm": features[0]["base_hidden_prenorm"]}}

    return collate


def evict(store: Store) -> str:
    """Drop the page cache (root), or else evict this run's files with posix_fadvise; says which."""
    from h5feed.bench import drop_page_cache

    problem = drop_page_cache()
    if problem is None:
        return "drop_caches"
    root = Path(store.info.source_root)
    files = [root / p for p in store.source_paths] + [p for p in store.path.rglob("*") if p.is_file()]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return f"posix_fadvise(DONTNEED) on {len(files)} files ({problem})"


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path`: a cold cache means nothing on tmpfs."""
    best = max((p for p in psutil.disk_partitions(all=True) if str(path.resolve()).startswith(p.mountpoint)),
               key=lambda p: len(p.mountpoint), default=None)
    return best.fstype if best is not None else "unknown"


LOADERS = ("baseline", "h5feed-stream", "h5feed-batch", "h5feed-batch-threads", "h5feed-gpu")


def loaders(store: Store, args: argparse.Namespace, workers: int, pin: bool) -> dict[str, Callable[[], Any]]:
    """Builders of every loader, over the same samples in the same order, delivering the same batches."""
    modelopt = args.flavor == "modelopt"
    collate = modelopt_collate(args.max_len) if modelopt else create_collate_fn(args.max_len)  # the trainers' own
    stream_args: dict[str, Any] = {"flavor": args.flavor, "max_len": args.max_len,
                                   "hidden_states_dtype": torch.bfloat16,
                                   "schedule": h5feed.ScheduleOptions(seed=args.seed)}
    order = HiddenStatesStream(store, **stream_args).epoch_order()
    common: dict[str, Any] = {"batch_size": 1, "num_workers": workers, "collate_fn": collate, "pin_memory": pin}

    def baseline() -> DataLoader:
        from h5feed.testing.baseline import Eagle3SampleFileDataset  # speculators 0.4's loader, re-stated

        root = Path(store.info.source_root)
        if modelopt:
            return DataLoader(ModelOptFiles([root / p for p in store.source_paths]), sampler=order, **common)
        dataset = Eagle3SampleFileDataset(max_len=args.max_len, file_list=[root / p for p in store.source_paths],
                                          hidden_states_dtype=torch.bfloat16)
        return DataLoader(dataset, sampler=order, **common)

    return {
        "baseline": baseline,
        "h5feed-stream": lambda: StreamLoader(HiddenStatesStream(store, **stream_args), **common),
        "h5feed-batch": lambda: h5feed.BatchLoader(store, **stream_args, num_workers=workers),
        "h5feed-batch-threads": lambda: h5feed.BatchLoader(store, **stream_args,
                                                           decode=h5feed.ThreadsOptions(threads=workers)),
        "h5feed-gpu": lambda: _cuda_batch_loader(store, stream_args, workers),
    }


def _cuda_batch_loader(store: Store, stream_args: dict[str, Any], threads: int) -> Any:
    from h5feed import CudaBatchLoader

    return CudaBatchLoader(store, h5feed.CudaOptions(threads=threads), **stream_args)


# --- the run --------------------------------------------------------------------------------------


def train(name: str, loader: Any, trainer: DrafterStep, args: argparse.Namespace, cache: str, workers: int,
          train_cpu_per_step: float) -> dict[str, Any]:
    monitored = h5feed.monitor(loader, every=args.every, log_dir=args.out, stall_after=args.stall_after,
                               name=f"{name}-w{workers}")
    losses, waits = [], []  # waits: each next() on the training thread, the monitor's share included
    wall, cpu = time.perf_counter(), cpu_seconds()
    asked = wall
    for step, batch in enumerate(monitored, 1):
        waits.append(time.perf_counter() - asked)
        losses.append(trainer(batch).item())  # trainers log the loss every step: one sync per step
        if args.steps and step >= args.steps:
            break
        asked = time.perf_counter()
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu  # the epoch's workers are reaped by now
    s = monitored.summary()
    loading_cpu = max(0.0, cpu - train_cpu_per_step * len(losses))
    return {
        "loader": name,
        "workers": workers,
        "cache": cache,
        "batches": s["batches"],
        "steps": s["steps"],  # every batch: the first step begins at iter(), its wait the first batch's
        "step_time_s": s["step_time(s)"],
        "data_loading_s": s["data_loading(s)"],
        "data_loading_pct": s["data_loading(%)"],
        "gpu_idle_pct": s["gpu_idle(%)"],
        "samples_per_s": s["throughput(samples/s)"],
        "first_batch_s": s["first_batch(s)"],
        "next_ms_median": statistics.median(waits[1:]) * 1e3 if len(waits) > 1 else None,  # the first: start-up
        "loading_cpu_cores": loading_cpu / wall,
        "loading_cpu_s_per_sample": loading_cpu / max(len(losses), 1),
        "gpu_decode_ms_per_sample": getattr(loader, "gpu_decode_ms", 0.0) / max(len(losses), 1),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]]) -> str:
    rows = [["loader", "workers", "cache", "steps", "step time", "data-wait %", "GPU idle %", "samples/s",
             "loading cores", "CPU s/sample", "next() median ms"]]
    rows += [[r["loader"], str(r["workers"]), "FAILED", r["error"][:60]] + [""] * 7 for r in runs if "error" in r]
    runs = [r for r in runs if "error" not in r]
    rows += [[r["loader"], str(r["workers"]), r["cache"], str(r["steps"]), _num(r["step_time_s"], ".3f") + " s",
              _num(r["data_loading_pct"], ".1f"), _num(r["gpu_idle_pct"], ".1f"), _num(r["samples_per_s"], ".2f"),
              _num(r["loading_cpu_cores"], ".2f"), _num(r["loading_cpu_s_per_sample"], ".3f"),
              _num(r["next_ms_median"], ".2f")] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def add_data_options(p: argparse.ArgumentParser) -> None:
    """The data options the GPU benches share: a store, or synthetic Kimi-shaped samples made (and reused) under
    `--data-dir`, as `h5feed bench` makes its own."""
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help="an h5feed store; its source_root holds the .pt files")
    data.add_argument("--make-data", type=int, metavar="N", help="write N synthetic Kimi-shaped samples and convert them")
    p.add_argument("--data-dir", type=Path, default=Path("~/.cache/h5feed/bench").expanduser(),
                   help="where --make-data builds (shared with `h5feed bench`; reused when complete)")
    p.add_argument("--hidden-size", type=int, help="--make-data's H (default: the store's; 7168 with CUDA, 64 without)")
    p.add_argument("--tokens", default="1500:1900", help="--make-data tokens per sample, LO:HI (default %(default)s)")
    p.add_argument("--convert-workers", type=int, default=os.cpu_count() or 1, help="0 converts in this process")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_options(p)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--flavor", choices=("speculators-legacy", "modelopt"), default="speculators-legacy",
                   help="the trainer whose files, dataset and collate are measured (default %(default)s)")
    p.add_argument("--precision", choices=("exact", "fp8"), default="exact",
                   help="fp8: the h5feed loaders read a --precision fp8 conversion of the same files (lossy; the "
                   "baseline reads the bf16 files)")
    p.add_argument("--workers", default="4",
                   help="comma-separated worker (or thread) counts, each loader at each (default %(default)s)")
    p.add_argument("--step-ms", type=float, help="pick the draft vocabulary whose step is closest to this (GPU)")
    p.add_argument("--steps", type=int, help="stop each run after this many steps (default: one epoch)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (root; else fadvise)")
    p.add_argument("--loaders", default=",".join(LOADERS),
                   help="comma-separated, run in this order at each worker count (default: all; h5feed-gpu needs "
                   "CUDA and nvCOMP)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between monitor lines")
    p.add_argument("--stall-after", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="folder for train_step.json and the monitors' JSON lines")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.make_data:
        lo, hi = (int(x) for x in args.tokens.split(":"))
        hidden = args.hidden_size or (7168 if device.type == "cuda" else 64)
        store = make_data(args.make_data, hidden, (lo, hi), args.data_dir, args.convert_workers, args.flavor)
        if args.precision == "fp8":
            store = fp8_store(store, args.convert_workers)
    else:
        store = Store(args.data)
        if args.hidden_size not in (None, store.hidden_size):
            raise SystemExit(f"--hidden-size {args.hidden_size} but {args.data} holds H={store.hidden_size}")
    shape = Shape.for_hidden(store.hidden_size, store.num_aux_layers)
    fs = filesystem(store.path)
    if args.cold and fs in ("tmpfs", "ramfs"):
        log.warning("%s is on %s: a cold page cache means nothing there", store.path, fs)

    warm = warm_batch(shape, args.max_len)
    if args.step_ms:
        trainer, shape, _ = calibrate(shape, device, warm, args.step_ms)
    else:
        trainer = DrafterStep(shape, device)
    step_s, train_cpu_per_step = step_seconds(trainer, warm)
    log.info("step %.1f ms with the batch at hand, %.1f ms of CPU on the training thread", step_s * 1e3,
             train_cpu_per_step * 1e3)

    runs = []
    for workers in (int(w) for w in args.workers.split(",")):
        builders = loaders(store, args, workers, pin=device.type == "cuda")
        for name in args.loaders.split(","):
            try:
                loader = builders[name]()  # built first: the baseline reads its first file's folder here
                cache = evict(store) if args.cold else "as found"
                log.info("%s, %d workers: %s batches, cache %s", name, workers, len(loader), cache)
                runs.append(train(name, loader, trainer, args, cache, workers, train_cpu_per_step))
                del loader
            except Exception as exc:  # one loader's failure is a finding, not the end of the other runs
                log.exception("%s with %d workers failed", name, workers)
                runs.append({"loader": name, "workers": workers, "error": repr(exc)})

    result = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "shape": asdict(shape),
                   "ttt_steps": TTT_STEPS, "store": str(store.path), "samples": len(store), "filesystem": fs,
                   "step_ms_batch_at_hand": step_s * 1e3, "train_cpu_ms_per_step": train_cpu_per_step * 1e3},
        "machine": {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "cpus": os.cpu_count(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "runs": runs,
    }
    (args.out / "train_step.json").write_text(json.dumps(result, indent=2))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
