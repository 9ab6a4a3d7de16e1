"""N ranks of the EAGLE-3 training step under DDP, fed by h5feed and then by the `.pt` baseline: what each rank waits for.

One command takes the number of GPUs, launches that many ranks with torchrun (NCCL, one GPU a
rank; gloo on the CPU when there is no CUDA, so it can be tried anywhere at tiny shapes), and
runs one epoch of `bench/loader/train_step.py`'s Kimi-shaped EAGLE-3 step (imported from it) in each
rank, first fed by h5feed (`HiddenStatesStream` + `StreamLoader`), then by speculators 0.4's
`.pt` loader exactly as its trainer runs it (its collate, `pin_memory`), each from a cold page
cache.  Both loaders give rank r the same samples in the same order (the stream's sharding:
every N-th sample of the epoch's permutation).  Each rank is wrapped in `h5feed.monitor`, whose
per-rank files `h5feed watch OUT` shows.  Per rank and in total it reports: data wait %, GPU
idle %, samples/s, GB/s read from disk, GB/s decoded, CPU cores spent by the loader workers;
and for the machine: the disk holding the store (bytes read over the run), the page cache
before and after, CPU busy and iowait.  JSON in OUT/train_multi_gpu.json, a table on stdout.

On the two-GPU H200 box, from the repository root (wheels of zarr, numcodecs, google-crc32c
and donfig in .whl/, as for train_step.py):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/loader/train_multi_gpu.py --gpus 2 \\
        --make-data 160 --hidden-size 7168 --workers 4 --convert-workers 16 --cold --out $OUT

A CPU smoke run (2 ranks, gloo; seconds):

    python bench/loader/train_multi_gpu.py --gpus 2 --make-data 4 --hidden-size 16 --tokens 20:30 --max-len 32 \\
        --workers 1 --convert-workers 0 --data-dir /tmp/tmg --out /tmp/tmg/out

How each figure is taken: data wait % and GPU idle % by `h5feed.monitor` (from the second
batch on); samples/s likewise; disk bytes per rank from the kernel's I/O accounting of the
rank and its reaped DataLoader workers (`getrusage` blocks in, i.e. bytes really fetched from
the block device, page-cache hits excluded), for the machine from the store's block device
(`psutil.disk_io_counters`); decoded bytes from h5feed's counters, and for the baseline the
full tensors of each file it loads; loader CPU from the workers' CPU time (`getrusage` of the
reaped children) over the rank's wall time.  Rates are over the rank's wall time from the
loader's start to its last batch, start-up included.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the h5feed of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_step beside this file

from train_step import DrafterStep, Shape, add_data_options, evict, filesystem, make_data, step_seconds, train

import h5feed
from h5feed.bench import format_ruled_table
from h5feed.loading.datasets import HiddenStatesDataset, HiddenStatesStream, StreamLoader
from h5feed.store import Store
from h5feed.testing.baseline import Eagle3SampleFileDataset, create_collate_fn
from h5feed.verify import describe_store

log = logging.getLogger("train_multi_gpu")

LOADERS = ("h5feed-batch", "h5feed-stream", "baseline")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# --- in each rank ---------------------------------------------------------------------------------


def build_loader(name: str, store: Store, args: argparse.Namespace, pin: bool) -> tuple[Any, Any, list[int]]:
    """The loader, its dataset, and this rank's samples in the order the loader delivers them.

    `h5feed-batch`: `BatchLoader` (worker processes decode straight into page-locked batch slots);
    `h5feed-stream`: the drop-in stream in a DataLoader with speculators 0.4's collate; `baseline`:
    speculators 0.4's `.pt` dataset in the same DataLoader, with the same collate and pin_memory."""
    stream_args: dict[str, Any] = {"flavor": "speculators-legacy", "max_len": args.max_len,
                                   "hidden_states_dtype": torch.bfloat16,
                                   "schedule": h5feed.ScheduleOptions(seed=args.seed)}
    stream = HiddenStatesStream(store, **stream_args)
    sequence = stream.rank_sequence()  # the same samples in the same order for every loader
    if name == "h5feed-batch":
        loader = h5feed.BatchLoader(store, **stream_args, num_workers=args.workers)
        return loader, loader.dataset, sequence
    common: dict[str, Any] = {"num_workers": args.workers, "collate_fn": create_collate_fn(args.max_len),
                              "pin_memory": pin}
    if name == "h5feed-stream":
        return StreamLoader(stream, batch_size=1, **common), stream, sequence
    root = Path(store.info.source_root)
    dataset = Eagle3SampleFileDataset(max_len=args.max_len, file_list=[root / p for p in store.source_paths],
                                      hidden_states_dtype=torch.bfloat16)
    return DataLoader(dataset, batch_size=1, sampler=sequence, **common), dataset, sequence


def warm_up(trainer: DrafterStep, store: Store, max_len: int) -> float:
    """Kernels, allocator, optimizer state and the first all-reduces, on a real sample, before anything is
    timed; returns the training thread's CPU seconds per step."""
    item = HiddenStatesDataset(store, max_len=max_len, hidden_states_dtype=torch.bfloat16)[0]
    return step_seconds(trainer, create_collate_fn(max_len)([item]), steps=3)[1]


def store_disk(path: Path) -> str | None:
    """The block device (whole disk) holding `path`, as /proc/diskstats names it; None on overlay and the like."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        return None
    real = node.resolve()
    return real.parent.name if (real / "partition").exists() else real.name


def disk_reads(device: str | None) -> tuple[int, int]:
    """(bytes read, ms busy) so far of `device`, or of all disks when it is unknown."""
    counters = psutil.disk_io_counters(perdisk=device is not None)
    c = counters.get(device) if isinstance(counters, dict) else counters
    return (c.read_bytes, getattr(c, "busy_time", 0)) if c is not None else (0, 0)


def machine_state(device: str | None) -> dict[str, Any]:
    mem = psutil.virtual_memory()
    return {"time": time.perf_counter(), "disk": disk_reads(device), "cpu": psutil.cpu_times()._asdict(),
            "page_cache_bytes": mem.cached + mem.buffers, "memory_bytes": mem.total,
            "available_bytes": mem.available}


def machine_figures(before: dict[str, Any], after: dict[str, Any], device: str | None) -> dict[str, Any]:
    seconds = after["time"] - before["time"]
    read = after["disk"][0] - before["disk"][0]
    cpu = {k: after["cpu"][k] - before["cpu"][k] for k in after["cpu"]}
    busy = sum(v for k, v in cpu.items() if k not in ("idle", "iowait", "steal", "guest", "guest_nice"))
    model = Path(f"/sys/block/{device}/device/model") if device else None
    return {
        "seconds": seconds,
        "disk": device or "all disks",
        "disk_model": model.read_text().strip() if model is not None and model.exists() else None,
        "disk_read_bytes": read,
        "disk_read_GBps": read / seconds / 1e9,
        "disk_busy_pct": 100 * (after["disk"][1] - before["disk"][1]) / 1e3 / seconds,
        "page_cache_GB_before": before["page_cache_bytes"] / 1e9,
        "page_cache_GB_after": after["page_cache_bytes"] / 1e9,
        "memory_GB": after["memory_bytes"] / 1e9,
        "available_GB_after": after["available_bytes"] / 1e9,
        "cpus": os.cpu_count(),
        "cpu_busy_cores": busy / seconds,
        "cpu_iowait_cores": cpu.get("iowait", 0.0) / seconds,
    }


def rank_main(args: argparse.Namespace) -> None:
    """One rank: DDP over the drafter step, one monitored epoch of one loader, figures to OUT/LOADER/."""
    from torch.nn.parallel import DistributedDataParallel

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    store = Store(args.data)
    trainer = DrafterStep(Shape.for_hidden(store.hidden_size, store.num_aux_layers), device)
    trainer.model = DistributedDataParallel(trainer.model, device_ids=[local_rank] if cuda else None)
    train_cpu_per_step = warm_up(trainer, store, args.max_len)
    loader, dataset, sequence = build_loader(args.rank_run, store, args, pin=cuda)
    out = args.out / args.rank_run
    out.mkdir(parents=True, exist_ok=True)
    args.out = out  # train() puts the monitor's files here: one per rank

    disk = store_disk(store.path)
    dist.barrier()
    cache = "as found"
    if local_rank == 0:  # one eviction per machine, while every rank waits
        cache = evict(store) if args.cold else cache
        before = machine_state(disk)
    dist.barrier()
    children0, self0 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = train(args.rank_run, loader, trainer, args, cache, args.workers, train_cpu_per_step)
    del loader
    gc.collect()  # the DataLoader's workers are joined (reaped) here at the latest
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    children, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)

    samples = sequence[: result["batches"]]
    if isinstance(dataset, HiddenStatesStream):
        snap = dataset.counters.snapshot()
        decoded = int(snap.total("bytes_delivered"))
    else:
        decoded = sum(int(store.sample_lengths[i]) for i in samples) * store.token_nbytes
    worker_cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
    disk_bytes = 512 * (children.ru_inblock - children0.ru_inblock + me.ru_inblock - self0.ru_inblock)
    result |= {
        "rank": rank, "local_rank": local_rank, "world_size": world, "host": socket.gethostname(),
        "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu", "wall_s": wall,
        "samples": len(samples), "disk_read_bytes": disk_bytes, "disk_read_GBps": disk_bytes / wall / 1e9,
        "decoded_bytes": decoded, "decoded_GBps": decoded / wall / 1e9, "loader_cpu_s": worker_cpu,
        "loader_cores": worker_cpu / wall,
        "main_cpu_s": me.ru_utime + me.ru_stime - self0.ru_utime - self0.ru_stime,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    if local_rank == 0:
        machine = machine_figures(before, machine_state(disk), disk) | {"cache": cache,
                                                                        "filesystem": filesystem(store.path)}
        (out / f"machine-{socket.gethostname()}.json").write_text(json.dumps(machine, indent=2))
    dist.destroy_process_group()


# --- the launcher ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, store: Store, args: argparse.Namespace) -> dict[str, Any]:
    """torchrun of `--gpus` ranks of this script for one loader; what the ranks and the machine measured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0", __file__, "--rank-run", name,
           "--data", str(store.path), "--out", str(args.out), "--max-len", str(args.max_len), "--workers",
           str(args.workers), "--seed", str(args.seed), "--every", str(args.every), "--stall-after",
           str(args.stall_after), *(["--steps", str(args.steps)] if args.steps else []), *(["--cold"] * args.cold)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **NO_MULTICAST}
    log.info("%s: %s", name, " ".join(cmd))
    subprocess.run(cmd, env=env, check=True)
    out = args.out / name
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.gpus)]
    machines = [json.loads(p.read_text()) for p in sorted(out.glob("machine-*.json"))]
    return {"loader": name, "ranks": ranks, "total": totals(ranks, machines), "machines": machines}


def totals(ranks: list[dict[str, Any]], machines: list[dict[str, Any]]) -> dict[str, Any]:
    def values(key: str) -> list[float]:
        return [r[key] for r in ranks if r[key] is not None]

    def mean(key: str) -> float | None:
        v = values(key)
        return sum(v) / len(v) if v else None

    wall = max(r["wall_s"] for r in ranks)
    return {
        "ranks": len(ranks),
        "steps": min(r["steps"] for r in ranks),
        "step_time_s": mean("step_time_s"),
        "data_loading_pct_mean": mean("data_loading_pct"),
        "data_loading_pct_max": max(values("data_loading_pct"), default=None),
        "gpu_idle_pct": mean("gpu_idle_pct"),
        "samples_per_s": sum(values("samples_per_s")),
        "disk_read_GBps": sum(r["disk_read_bytes"] for r in ranks) / wall / 1e9,
        "machine_disk_read_GBps": sum(m["disk_read_bytes"] for m in machines) / wall / 1e9,
        "decoded_GBps": sum(r["decoded_bytes"] for r in ranks) / wall / 1e9,
        "loader_cores": sum(r["loader_cpu_s"] for r in ranks) / wall,
        "wall_s": wall,
    }


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]]) -> str:
    head = ["loader", "rank", "steps", "step time", "data wait %", "GPU idle %", "samples/s", "disk GB/s",
            "decoded GB/s", "loader cores"]
    rows = [head]
    for run in runs:
        for r in run["ranks"]:
            rows.append([run["loader"], str(r["rank"]), str(r["steps"]), _num(r["step_time_s"], ".3f") + " s",
                         _num(r["data_loading_pct"], ".1f"), _num(r["gpu_idle_pct"], ".1f"),
                         _num(r["samples_per_s"], ".2f"), _num(r["disk_read_GBps"], ".2f"),
                         _num(r["decoded_GBps"], ".2f"), _num(r["loader_cores"], ".2f")])
        t = run["total"]
        rows.append([run["loader"], "all", str(t["steps"]), _num(t["step_time_s"], ".3f") + " s",
                     f"{_num(t['data_loading_pct_mean'], '.1f')} (max {_num(t['data_loading_pct_max'], '.1f')})",
                     _num(t["gpu_idle_pct"], ".1f"), _num(t["samples_per_s"], ".2f"),
                     f"{_num(t['disk_read_GBps'], '.2f')} (disk {_num(t['machine_disk_read_GBps'], '.2f')})",
                     _num(t["decoded_GBps"], ".2f"), _num(t["loader_cores"], ".2f")])
    lines = format_ruled_table(rows, right=set(range(1, len(head))))
    for run in runs:
        for m in run["machines"]:
            lines.append(
                f"{run['loader']}: {m['disk']} ({m['disk_model'] or 'model unknown'}) read {m['disk_read_bytes'] / 1e9:.2f} GB "
                f"in {m['seconds']:.1f} s ({m['disk_read_GBps']:.2f} GB/s, busy {m['disk_busy_pct']:.0f}%); page cache "
                f"{m['page_cache_GB_before']:.1f} -> {m['page_cache_GB_after']:.1f} GB of {m['memory_GB']:.0f} GB; CPU "
                f"{m['cpu_busy_cores']:.1f} of {m['cpus']} cores busy, {m['cpu_iowait_cores']:.1f} in iowait; "
                f"cache {m['cache']} ({m['filesystem']})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2,
                   help="ranks, one GPU each (gloo on the CPU without CUDA) (default: every GPU, or 2)")
    add_data_options(p)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers of each rank (default %(default)s)")
    p.add_argument("--steps", type=int, help="stop each rank after this many steps (default: one epoch)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each loader (root; else fadvise)")
    p.add_argument("--loaders", default="h5feed-batch,baseline", help="comma-separated, run in this order (default %(default)s)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between monitor lines")
    p.add_argument("--stall-after", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="folder for train_multi_gpu.json and each loader's files")
    p.add_argument("--rank-run", choices=LOADERS, help=argparse.SUPPRESS)  # set by the launcher for its ranks
    args = p.parse_args(argv)
    unknown = set(args.loaders.split(",")) - set(LOADERS)
    if unknown:
        p.error(f"unknown loader(s) {', '.join(sorted(unknown))}: choose from {', '.join(LOADERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if args.rank_run:
        rank_main(args)
        return 0
    cuda = torch.cuda.is_available()
    if cuda and args.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}, but this machine has {torch.cuda.device_count()} GPU(s)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.make_data:
        lo, hi = (int(x) for x in args.tokens.split(":"))
        store = make_data(args.make_data, args.hidden_size or (7168 if cuda else 64), (lo, hi), args.data_dir,
                          args.convert_workers)
    else:
        store = Store(args.data)
    runs = [launch(name, store, args) for name in args.loaders.split(",")]
    result = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "rank_run"},
                   "store": str(store.path), "samples": len(store),
                   "store_bytes": describe_store(store.path)["stored_bytes"],
                   "backend": "nccl" if cuda else "gloo"},
        "machine": {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "runs": runs,
    }
    (args.out / "train_multi_gpu.json").write_text(json.dumps(result, indent=2))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
