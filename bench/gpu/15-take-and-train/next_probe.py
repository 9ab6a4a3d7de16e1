"""Where `next()` of the GPU backend spends its ~0.25 ms on the training thread, under bench/train_step.py's 65 ms
step, warm (RESULTS: the read engine, `next()`).

    python3 bench/gpu/15-take-and-train/next_probe.py --work /tmp/np --samples 48

For each `next()`: its wall time and the training thread's CPU time (`time.thread_time`): CPU well under wall
means the thread waited (for the GIL, held by a reader or the delivery thread), CPU near wall means Python work.
Also timed: `TrainerStream.take` and `torch.cuda.Event.query` inside it.  Rows: CudaBatchLoader with 4 reader
threads; the same with the interpreter's switch interval at 0.2 ms (a diagnostic of GIL waits, not a setting
h5feed makes); and `Delivery` alone, over batches already on the GPU (no readers, no decode): the mechanism's floor.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: train_step's drafter step
import train_step as ts

import h5feed
from h5feed.loading import delivery as delivery_module
from h5feed import CudaBatchLoader
from h5feed.synthetic import write_synthetic

TIMES: dict[str, list[float]] = {"take": [], "query": []}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)
    return wrapper


def ms(values: list[float], q: float = 0.5) -> str:
    return f"{sorted(values)[int(q * (len(values) - 1))] * 1e3:.3f}" if values else "-"


def run(name: str, batches, trainer) -> str:
    for values in TIMES.values():
        values.clear()
    walls, cpus = [], []
    it = iter(batches)
    while True:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            batch = next(it)
        except StopIteration:
            break
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
        trainer.step(batch).item()
    walls, cpus = walls[1:], cpus[1:]
    take, query = TIMES["take"][1:], TIMES["query"][1:]
    return (f"{name}: next() wall median {ms(walls)} ms (p90 {ms(walls, 0.9)}), thread CPU median {ms(cpus)} ms "
            f"(p90 {ms(cpus, 0.9)}); take() median {ms(take)} ms (p90 {ms(take, 0.9)}); Event.query median "
            f"{ms(query)} ms (p90 {ms(query, 0.9)}); {len(walls)} batches")


def pieces(calls: int = 2000) -> str:
    """Each call that taking a batch may make, timed alone on this thread (microseconds a call)."""
    device, index = torch.device("cuda"), torch.cuda.current_device()
    stream, other = torch.cuda.current_stream(index), torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record()
    tensor = torch.empty(1 << 20, device=device)
    torch.cuda.synchronize()
    candidates = {
        "current_stream(torch.device('cuda'))": lambda: torch.cuda.current_stream(device),
        "current_stream(index)": lambda: torch.cuda.current_stream(index),
        "torch._C._cuda_getCurrentStream(index)": lambda: torch._C._cuda_getCurrentStream(index),
        "torch.cuda.is_available()": torch.cuda.is_available,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "stream != other": lambda: stream != other,
        "event.query() (completed)": event.query,
        "tensor.record_stream(stream)": lambda: tensor.record_stream(stream),
    }
    lines = []
    for name, call in candidates.items():
        call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        lines.append(f"  {name}: {(time.perf_counter() - start) / calls * 1e6:.2f} us")
    return "each call alone:\n" + "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, default=Path("/tmp/next_probe"))
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args()
    src, store = args.work / "src", args.work / "store"
    if not store.exists():
        write_synthetic(src, "speculators-legacy-pt", args.samples, 7168, lengths=(1500, 1900), seed=0)
        h5feed.convert(src, store, workers=16, progress=False)
    print(pieces(), flush=True)
    delivery_module.TrainerStream.take = timed("take", delivery_module.TrainerStream.take)
    torch.cuda.Event.query = timed("query", torch.cuda.Event.query)
    shape = ts.Shape.for_hidden(7168, 3)
    trainer, shape, alone_ms = ts.calibrate(shape, torch.device("cuda"), ts.warm_batch(shape, 2048), 65)
    print(f"the step alone: {alone_ms:.1f} ms", flush=True)

    def gpu_loader():
        return CudaBatchLoader(store, flavor="speculators-legacy", max_len=2048, hidden_states_dtype=torch.bfloat16,
                               threads=4)

    for _ in range(args.passes):
        loader = gpu_loader()
        print(run("CudaBatchLoader threads=4", loader, trainer), flush=True)
        loader.close()
        default = sys.getswitchinterval()
        sys.setswitchinterval(0.0002)
        loader = gpu_loader()
        print(run("CudaBatchLoader threads=4, switch interval 0.2 ms", loader, trainer), flush=True)
        loader.close()
        sys.setswitchinterval(default)
        ready = [dict(b) for b in CudaBatchLoader(store, flavor="speculators-legacy", max_len=2048,
                                                  hidden_states_dtype=torch.bfloat16, threads=4, samples=range(8))]
        torch.cuda.synchronize()
        events = []
        for _b in ready:
            event = torch.cuda.Event()
            event.record()
            events.append(event)
        torch.cuda.synchronize()
        on_take = functools.partial(lambda held, pair: held.take(*pair),
                                    delivery_module.TrainerStream(torch.device("cuda")))

        def source(ready=ready, events=events):
            for k in range(args.samples):
                yield ready[k % len(ready)], events[k % len(events)]

        alone = delivery_module.Delivery(source, on_take=on_take, name="probe-delivery")
        print(run("Delivery alone, batches on the GPU", (pair[0] for pair in alone), trainer), flush=True)
        alone.close()


if __name__ == "__main__":
    main()
