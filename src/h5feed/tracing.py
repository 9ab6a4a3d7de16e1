"""h5feed's work on a timeline: NVTX ranges for Nsight Systems and the PyTorch profiler, and a Chrome/Perfetto trace.

Why: the monitor's figures say how long the trainer waited; a timeline says what every process
was doing meanwhile, beside the GPU's kernels.  Both are off unless asked for, and cost one
check of a module flag when off:

- `H5FEED_NVTX=1` (or `configure(nvtx=True)`): NVTX ranges around the trainer's waits for a
  batch, each sample's decode, the copy of a batch to the GPU and the GPU decoder's calls, so
  that they show in `nsys profile` next to the step's kernels.
- `H5FEED_TRACE_DIR=DIR` (or `configure(trace_dir=DIR)`, which `h5feed.monitor(..., trace=True)`
  calls with its log_dir): every process appends its spans, as Chrome trace events, to a file
  of its own there (`h5feed-trace-<host>-<pid>.jsonl`); `h5feed trace DIR` merges them into one
  JSON file that https://ui.perfetto.dev and chrome://tracing open.

Both settings travel in the environment, so DataLoader worker processes started afterwards
(fork or spawn) trace too.  Times are the monotonic clock `time.perf_counter` reads, one
clock for every process of a machine, so the processes' spans line up.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

TRACE_DIR_ENV = "H5FEED_TRACE_DIR"
NVTX_ENV = "H5FEED_NVTX"
TRACE_PREFIX = "h5feed-trace-"


class _Tracer:
    """This process's trace settings and its file (opened at its first span, reopened in a forked child)."""

    def __init__(self) -> None:
        self.trace_dir: Path | None = None
        self.nvtx = False
        self.lock = threading.Lock()
        self.file: TextIO | None = None
        self.pid = -1

    def load(self) -> None:
        """The settings as the environment has them (a worker process inherits its trainer's)."""
        where = os.environ.get(TRACE_DIR_ENV)
        self.trace_dir = Path(where) if where else None
        self.nvtx = os.environ.get(NVTX_ENV, "") not in ("", "0") and torch.cuda.is_available()

    def write(self, event: dict[str, Any]) -> None:
        with self.lock:
            if self.file is None or self.pid != os.getpid():  # a forked child writes a file of its own
                self.pid = os.getpid()
                assert self.trace_dir is not None
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                path = self.trace_dir / f"{TRACE_PREFIX}{socket.gethostname()}-{self.pid}.jsonl"
                self.file = open(path, "a", buffering=1)  # noqa: SIM115: open for the process's life, a line a span
                self.file.write(json.dumps({"name": "process_name", "ph": "M", "pid": self.pid,
                                            "args": {"name": _process_name()}}) + "\n")
            self.file.write(json.dumps(event) + "\n")


_TRACER = _Tracer()
_TRACER.load()


def configure(trace_dir: str | os.PathLike[str] | None = None, nvtx: bool | None = None) -> None:
    """Turn the trace (spans into `trace_dir`) and NVTX ranges on for this process and the processes it starts
    from now on; None leaves a setting as it is."""
    if trace_dir is not None:
        os.environ[TRACE_DIR_ENV] = str(Path(trace_dir).resolve())
    if nvtx is not None:
        os.environ[NVTX_ENV] = "1" if nvtx else "0"
    _TRACER.load()


def stop_trace() -> None:
    """Stop writing spans, in this process and the processes it starts from now on (a monitor that turned the
    trace on turns it off when its pass ends, so a later loader is not traced unasked)."""
    os.environ.pop(TRACE_DIR_ENV, None)
    _TRACER.load()


def tracing() -> bool:
    """Whether spans are written (a trace directory is set)."""
    return _TRACER.trace_dir is not None


@contextlib.contextmanager
def _live_section(name: str, category: str, args: dict[str, Any]) -> Iterator[None]:
    start = time.perf_counter()
    if _TRACER.nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        if _TRACER.nvtx:
            torch.cuda.nvtx.range_pop()
        if _TRACER.trace_dir is not None:
            span(name, category, start, time.perf_counter(), **args)


_NOTHING = contextlib.nullcontext()


def section(name: str, category: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    """A range of work as it runs: an NVTX range and a span of the trace, where they are on; else nothing."""
    if not _TRACER.nvtx and _TRACER.trace_dir is None:
        return _NOTHING
    return _live_section(name, category, args)


@contextlib.contextmanager
def _nvtx_only(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(name: str) -> contextlib.AbstractContextManager[None]:
    """An NVTX range alone, where NVTX is on: for work whose span the trace has from elsewhere (a sample's, from
    its worker's counters)."""
    return _nvtx_only(name) if _TRACER.nvtx else _NOTHING


def span(name: str, category: str, start: float, end: float, **args: Any) -> None:
    """A span of the trace from `start` to `end` (`time.perf_counter` seconds), where the trace is on."""
    if _TRACER.trace_dir is None:
        return
    _TRACER.write({"name": name, "cat": category, "ph": "X", "ts": round(start * 1e6, 3),
                   "dur": round(max(end - start, 0.0) * 1e6, 3), "pid": os.getpid(), "tid": threading.get_native_id(),
                   "args": args})


def instant(name: str, category: str, **args: Any) -> None:
    """A moment on the trace (a stall reported, a pass's end), where the trace is on."""
    if _TRACER.trace_dir is None:
        return
    _TRACER.write({"name": name, "cat": category, "ph": "i", "s": "p", "ts": round(time.perf_counter() * 1e6, 3),
                   "pid": os.getpid(), "tid": threading.get_native_id(), "args": args})


def _process_name() -> str:
    from torch.utils.data import get_worker_info

    worker = get_worker_info()
    rank = os.environ.get("RANK")
    where = f" (rank {rank})" if rank is not None else ""
    return f"DataLoader worker {worker.id}{where}" if worker is not None else f"trainer{where}"
