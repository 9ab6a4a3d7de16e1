"""What slows a GPU-bound drafter step beside a loader: Python work in the trainer's process (when in the step it
runs), a copy to the GPU, and processes copying memory on the trainer's cores, each against the step alone.

    PYTHONPATH=/tmp/site:src python3 bench/loader/step_interference.py --steps 30

The step is `h5feed bench`'s Kimi-shaped EAGLE-3 drafter step (its batch already on the GPU, the step's stream
waited on every step, as a trainer that logs its loss waits).  Each row runs the step `--steps` times with one
disturbance cued as each step begins; "launch" is the time the trainer's thread takes to queue the step's kernels.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from h5feed.bench.step import DrafterStep, Shape, on_device, warm_batch


def hold_the_gil(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Cued:
    """A thread of the trainer's process that runs `work` once each time it is cued."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.cue, self.work = threading.Semaphore(0), work
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.cue.acquire()
            self.work()

    def __call__(self) -> None:
        self.cue.release()


def copy_memory(stop: multiprocessing.synchronize.Event) -> None:
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    while not stop.is_set():
        np.copyto(b, a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=1900)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = Shape.for_hidden(args.hidden_size, 3)
    step = DrafterStep(shape, device)
    host = warm_batch(shape, args.tokens)
    batch = on_device(host, device)

    def row(name: str, cue: Callable[[], None] | None = None) -> None:
        periods, launches = [], []
        for i in range(args.steps + 3):
            t0 = time.perf_counter()
            if cue is not None:
                cue()
            step(batch)
            t1 = time.perf_counter()
            torch.cuda.current_stream(device).synchronize()
            if i >= 3:
                periods.append(time.perf_counter() - t0)
                launches.append(t1 - t0)
        print(f"{name:42s} step {1e3 * statistics.mean(periods):7.2f} ms  launch {1e3 * statistics.median(launches):6.2f} ms",
              flush=True)

    row("alone")
    for delay in (0, 40):
        for ms in (1, 3):
            row(f"{ms} ms of Python at +{delay} ms", Cued(lambda d=delay, w=ms: (time.sleep(d / 1e3), hold_the_gil(w))))
    pinned, side = host["hidden_states"].pin_memory(), torch.cuda.Stream()
    target = torch.empty_like(pinned, device=device)

    def copy_to_gpu() -> None:
        with torch.cuda.stream(side):
            target.copy_(pinned, non_blocking=True)

    row("a batch's hidden states copied to the GPU at +0", Cued(copy_to_gpu))
    fork = multiprocessing.get_context("fork")
    stop = fork.Event()
    copiers = [fork.Process(target=copy_memory, args=(stop,)) for _ in range(4)]
    for p in copiers:
        p.start()
    row("4 processes copying memory")
    stop.set()
    for p in copiers:
        p.join()
    row("alone, again")


if __name__ == "__main__":
    main()
