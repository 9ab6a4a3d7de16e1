"""Why the GPU backend's reader threads fall behind from a cold disk (RESULTS: the GPU backend from a cold disk).

Run from the repository root as root (it drops the page cache), with a store made by
`bench/train_step.py --make-data N`:  python3 bench/gpu/11-cold-reads/cold_read_probe.py STORE [--cuda]
  A. the disk alone: the store's shard files read whole by N threads, with pread and with mmap(MAP_POPULATE) + copy;
  B. the GPU backend's staging without CUDA (Store.copy_frames_into into host memory, through ReadAhead), the files
     announced by the consumer (as CudaBatchLoader does), by the reader itself, or not at all;
  C. with --cuda, CudaBatchLoader alone: where its reader threads and its delivery thread spend the pass;
  D. with --cuda, next() on the training thread under bench/train_step.py's 65 ms step, warm, no monitor.
"""
import argparse
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from h5feed.bench import drop_page_cache
from h5feed.loading.readahead import ReadAhead
from h5feed.store import Store

PIECE = 16 << 20


def cold() -> None:
    why = drop_page_cache()
    if why:
        raise SystemExit(why)


def disk(files: list[Path], threads: int, how: str) -> str:
    local = threading.local()

    def read(path: Path) -> int:
        if not hasattr(local, "buf"):
            local.buf = np.empty(256 << 20, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if how == "pread":
                view, done = memoryview(local.buf), 0
                while done < size:
                    done += os.preadv(fd, [view[done : done + PIECE]], done)
            else:
                with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ) as m:
                    local.buf[:size] = np.frombuffer(m, dtype=np.uint8)
            return size
        finally:
            os.close(fd)

    cold()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    el = time.perf_counter() - t0
    return f"disk {how:6s} threads={threads:2d}: {total / el / 1e9:5.2f} GB/s ({total / 1e9:.2f} GB in {el:.1f} s)"


def staging(store: Store, threads: int, depth: int, announce: str, warm: bool = False) -> str:
    buffers = [np.empty(256 << 20, dtype=np.uint8) for _ in range(depth + 1)]
    for b in buffers:
        b[::4096] = 0
    spans: list[tuple[float, float]] = []

    def stage(i: int) -> int:
        t0 = time.perf_counter()
        if announce == "reader":
            store.will_need(i)
        out, position = buffers[i % len(buffers)], 0
        for array in store.info.array_names:
            placed = store.copy_frames_into(i, array, int(store.sample_lengths[i]), out[position:])
            position += placed[-1][1] + placed[-1][2]
        spans.append((t0, time.perf_counter()))
        return position

    if not warm:
        cold()
    t0, cpu0 = time.perf_counter(), time.process_time()
    total = 0
    with ReadAhead(range(len(store)), stage, threads=threads, depth=depth,
                   announce=store.will_need if announce == "consumer" else None) as ahead:
        for _ in range(len(store)):
            total += ahead.take()
    el, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    busy = sum(b - a for a, b in spans) / (el * threads)
    median = statistics.median(b - a for a, b in spans)
    return (f"staging announce={announce:8s} threads={threads:2d} depth={depth:2d}: {len(store) / el:5.1f} samples/s "
            f"{total / el / 1e9:5.2f} GB/s, readers busy {busy:4.0%}, a sample {median * 1e3:5.0f} ms median, "
            f"{cpu / len(store):.4f} CPU s/sample")


def cuda_loader(store: Store, threads: int, prefetch: int) -> str:
    import torch

    from h5feed import CudaBatchLoader
    from h5feed.loading.backends.cuda import CudaBackend as cls
    from h5feed.loading.readahead import ReadAhead as RA
    record: dict[str, list[float]] = {}

    def timed(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record.setdefault(key, []).append(time.perf_counter() - t)
        setattr(owner, name, wrapper)
        return original

    originals = [(cls, "_stage", timed(cls, "_stage", "reader: _stage")),
                 (cls, "_decode", timed(cls, "_decode", "delivery: _decode")),
                 (RA, "take", timed(RA, "take", "delivery: take (waits for a staged batch)")),
                 (Store, "will_need", timed(Store, "will_need", "delivery: will_need (announce)"))]
    sync = torch.cuda.Event.synchronize

    def timed_sync(self):
        t = time.perf_counter()
        sync(self)
        if threading.current_thread().name.startswith("h5feed-gpu-read"):
            record.setdefault("reader: region's copy event", []).append(time.perf_counter() - t)
    torch.cuda.Event.synchronize = timed_sync
    try:
        loader = CudaBatchLoader(store, flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16,
                     threads=threads, prefetch=prefetch)
        cold()
        t0, cpu0 = time.perf_counter(), time.process_time()
        n = 0
        for _ in loader:
            torch.cuda.current_stream().synchronize()
            n += 1
        el, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        loader.close()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        torch.cuda.Event.synchronize = sync
    lines = [f"CudaBatchLoader threads={threads} prefetch={prefetch}: {n / el:5.1f} samples/s over {el:.1f} s, "
             f"{cpu / n:.4f} CPU s/sample"]
    for key, values in record.items():
        share = sum(values) / (el * (threads if key.startswith("reader") else 1))
        lines.append(f"    {key:45s} calls {len(values):4d}  median {statistics.median(values) * 1e3:7.2f} ms  "
                     f"total {sum(values):6.2f} s  ({share:4.0%} of each such thread's time)")
    return "\n".join(lines)


def next_under_step(store: Store) -> str:
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import train_step as ts  # bench/train_step.py: its drafter step

    from h5feed import CudaBatchLoader

    shape = ts.Shape.for_hidden(store.hidden_size, store.num_aux_layers)
    trainer, shape, alone_ms = ts.calibrate(shape, torch.device("cuda"), ts.warm_batch(shape, 2048), 65)
    lines = [f"the step alone: {alone_ms:.1f} ms"]
    for threads in (4, 8):
        loader = CudaBatchLoader(store, flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16,
                                 threads=threads)
        waits, steps, asked = [], [], time.perf_counter()
        for batch in loader:
            got = time.perf_counter()
            trainer.step(batch).item()
            waits.append(got - asked)
            asked = time.perf_counter()
            steps.append(asked - got)
        loader.close()
        lines.append(f"CudaBatchLoader threads={threads}, warm: next() median {statistics.median(waits[1:]) * 1e3:.2f} ms, "
                     f"p90 {sorted(waits[1:])[int(0.9 * (len(waits) - 1))] * 1e3:.2f} ms; step median "
                     f"{statistics.median(steps) * 1e3:.1f} ms; wait {sum(waits[1:]) / (sum(waits[1:]) + sum(steps[1:])):.1%}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", type=Path)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--parts", default="ABC")
    p.add_argument("--warm", action="store_true", help="part B from the page cache (read once first)")
    args = p.parse_args()
    store = Store(args.store)
    files = sorted((f for f in args.store.rglob("*") if f.is_file() and "/c/" in str(f)),
                   key=lambda f: [int(x) if x.isdigit() else x for x in f.relative_to(args.store).parts])
    for dev in sorted(Path("/sys/block").iterdir()):
        q = dev / "queue"
        if (q / "nr_requests").exists() and not dev.name.startswith(("loop", "ram", "zram")):
            print(dev.name + ": " + ", ".join(f"{k} {(q / k).read_text().strip()}" for k in
                                              ("read_ahead_kb", "nr_requests", "max_sectors_kb", "rotational")))
    print(f"{len(store)} samples, {len(files)} shard files, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB", flush=True)
    if "A" in args.parts:
        for how, threads in (("pread", 1), ("pread", 4), ("pread", 8), ("pread", 16), ("mmap", 4), ("mmap", 8)):
            print(disk(files, threads, how), flush=True)
    if "B" in args.parts:
        for announce, threads, depth in (("consumer", 4, 8), ("none", 4, 8), ("reader", 4, 8), ("consumer", 8, 16),
                                         ("none", 8, 16), ("reader", 8, 16)):
            print(staging(store, threads, depth, announce, args.warm), flush=True)
    if "C" in args.parts and args.cuda:
        for threads, prefetch in ((4, 8), (8, 16)):
            print(cuda_loader(store, threads, prefetch), flush=True)
    if "D" in args.parts and args.cuda:
        print(next_under_step(store), flush=True)


if __name__ == "__main__":
    main()
