"""Where each training step's time goes, live: data wait, GPU idle, loader throughput, and stall reports.

Why: a trainer whose GPU waits on its input says nothing, and people fall back
on `nvidia-smi`, `ps` and `strace` to guess whether it computes, loads or hangs.
`monitor(loader)` wraps the loader the trainer iterates and measures, per step,
how long `next()` blocked (torchtitan's `data_loading(s)` and `data_loading(%)`)
and, with CUDA, how long the GPU had no work meanwhile (the stream's `query()` at
each `next()` call, and CUDA events where the CPU runs ahead of the GPU, read once
complete: nothing waits on the GPU in the hot path).  A thread adds the workers' shared counters
(`h5feed.metrics`) and writes a line every `every` seconds, a JSON-lines record
for `h5feed watch`, TensorBoard scalars if asked, and a stall report that says
what every worker is doing when the trainer or the workers stop moving.

A step is the time between two successive `next()` calls; the first batch,
which includes worker start-up, is reported on its own and left out of the step
figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, Literal, TextIO, TypeVar

import psutil
import torch

from h5feed.errors import H5feedError
from h5feed.metrics import LoaderCounters, LoaderSnapshot, WorkerSnapshot
from h5feed.store import Store

log = logging.getLogger(__name__)

JSONL_PREFIX = "h5feed-monitor"
RECENT_S = 10.0  # the window of a stall report's "recent" throughput
MAX_PENDING_STEPS = 1024  # CUDA event triples kept while the CPU runs ahead of the GPU

T = TypeVar("T")
Record = dict[str, Any]


def monitor(
    loader: Iterable[T],
    *,
    every: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
    jsonl: str | os.PathLike[str] | None = None,
    stall_after: float = 60.0,
    tensorboard: bool | Literal["auto"] = False,
    name: str = "train",
) -> Monitor[T]:
    """Wrap `loader` so that iterating it reports where the time goes: `for batch in monitor(loader): ...`.

    Args:
        every: seconds between report lines (and JSON-lines records).
        log_dir: folder for the JSON-lines file (`h5feed-monitor-{name}.jsonl`) and TensorBoard events.
        jsonl: the JSON-lines file, if not the default one in `log_dir`; None and no log_dir: no file.
        stall_after: seconds the trainer may wait for a batch, or all workers go without progress,
            before a stall report.
        tensorboard: True writes scalars to `log_dir` (tensorboard must be installed); "auto" does
            when it is installed and `log_dir` is given.
        name: tells several monitors apart in lines, files and scalars.
    """
    return Monitor(loader, every=every, log_dir=log_dir, jsonl=jsonl, stall_after=stall_after,
                   tensorboard=tensorboard, name=name)


# --- per-step bookkeeping ---------------------------------------------------------------------


@dataclass
class _Totals:
    """Running sums over completed steps; a window is the difference of two copies."""

    steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    samples: int = 0
    batch_bytes: int = 0
    gpu_steps: int = 0  # steps whose GPU idle time is known (events complete)
    gpu_step_s: float = 0.0
    gpu_idle_s: float = 0.0

    def copy(self) -> _Totals:
        return _Totals(**self.__dict__)

    def __sub__(self, other: _Totals) -> _Totals:
        return _Totals(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def add_gpu(self, steps: list[tuple[float, float]]) -> None:
        for idle, step in steps:
            self.gpu_steps += 1
            self.gpu_step_s += step
            self.gpu_idle_s += idle


class _GpuTimer:
    """How long the GPU had no work while the trainer waited for each batch, without waiting on the GPU.

    When the trainer asks for a batch, either its stream has finished all queued
    work (`query()`; e.g. after a `loss.item()`), and the GPU then idles exactly as
    long as `next()` blocks; or work is still queued (the CPU runs ahead), and CUDA
    events recorded at the call (C) and at hand-off (H) give the GPU's idle gap,
    read once H has completed.  Host time is the better clock in the first case:
    an event recorded while the pin-memory thread holds the driver (allocating
    pinned memory) gets a late timestamp.
    """

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, float]] = deque()
        self._mode: Literal["off", "host", "events"] = "off"  # how the current step is timed
        self._call: torch.cuda.Event | None = None
        self._handoff: torch.cuda.Event | None = None

    def _record(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def called(self) -> None:
        """The trainer asks for the next batch: everything of its step so far is queued."""
        if torch.cuda.current_stream().query():
            self._mode = "host"
        else:
            self._mode, self._call = "events", self._record()

    def handed_off(self) -> None:
        if self._mode == "events":
            self._handoff = self._record()

    def step_done(self, wait_s: float, step_s: float) -> list[tuple[float, float]]:
        """(idle, step) seconds of the steps known by now, the one that just ended included if it can be."""
        if self._mode == "host":
            return [(wait_s, step_s)]
        if self._mode == "events" and self._call is not None and self._handoff is not None:
            self._pending.append((self._call, self._handoff, step_s))
            if len(self._pending) > MAX_PENDING_STEPS:
                self._pending.popleft()
        return self.collect()

    def collect(self, wait: bool = False) -> list[tuple[float, float]]:
        """Steps whose events have completed; `wait` blocks (end of iteration only)."""
        done = []
        while self._pending and (wait or self._pending[0][1].query()):
            call, handoff, step_s = self._pending.popleft()
            handoff.synchronize()
            done.append((call.elapsed_time(handoff) / 1e3, step_s))
            self._free += [call, handoff]
        return done


@dataclass
class _Report:
    """Where a window starts: the time (perf_counter), the step sums and the loader counters then."""

    time: float
    totals: _Totals
    snap: LoaderSnapshot | None


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0


# --- figures ------------------------------------------------------------------------------------


def _step_figures(t: _Totals) -> Record:
    """The trainer-side figures of a window, named as torchtitan names them."""
    return {
        "steps": t.steps,
        "throughput(steps/s)": t.steps / t.step_s if t.step_s else None,
        "step_time(s)": t.step_s / t.steps if t.steps else None,
        "data_loading(s)": t.wait_s / t.steps if t.steps else None,
        "data_loading(%)": 100 * t.wait_s / t.step_s if t.step_s else None,
        "gpu_idle(s)": t.gpu_idle_s / t.gpu_steps if t.gpu_steps else None,
        "gpu_idle(%)": 100 * t.gpu_idle_s / t.gpu_step_s if t.gpu_step_s else None,
        "throughput(samples/s)": t.samples / t.step_s if t.step_s else None,
        "batches(GB/s)": t.batch_bytes / t.step_s / 1e9 if t.step_s else None,
    }


def _worker_rows(
    snap: LoaderSnapshot, before: LoaderSnapshot | None, path_of: Callable[[int], str | None]
) -> list[Record]:
    """One row per started worker; rates against `before` (None: no rates yet)."""
    old = {w.worker: w for w in before.workers} if before is not None else {}
    dt = snap.time - before.time if before is not None else 0.0
    rows = []
    for w in snap.workers:
        o = old.get(w.worker)
        rows.append({
            "worker": w.worker,
            "pid": w.pid,
            "samples": w.samples,
            "samples_per_s": (w.samples - (o.samples if o else 0)) / dt if dt > 0 else None,
            "read_MBps": (w.bytes_read - (o.bytes_read if o else 0)) / dt / 1e6 if dt > 0 else None,
            "decoded_MBps": (w.bytes_delivered - (o.bytes_delivered if o else 0)) / dt / 1e6 if dt > 0 else None,
            "queue_depth": w.queue_depth,
            "sample": w.current_sample,
            "path": path_of(w.current_sample) if w.current_sample is not None else None,
            "sample_s": w.current_seconds if w.current_sample is not None else None,
            "sample_MB": w.current_bytes / 1e6 if w.current_sample is not None else None,
            "since_progress_s": w.seconds_since_progress,
        })
    return rows


def _loader_figures(rows: list[Record]) -> Record:
    def total(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) if values else None

    read, decoded = total("read_MBps"), total("decoded_MBps")
    return {
        "samples_per_s": total("samples_per_s"),
        "read_GBps": read / 1e3 if read is not None else None,
        "decoded_GBps": decoded / 1e3 if decoded is not None else None,
        "queue_depth": sum(r["queue_depth"] for r in rows),
        "workers": len(rows),
        "reading": sum(r["sample"] is not None for r in rows),
    }


def _num(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def format_line(rec: Record) -> str:
    """The one-line report shared by the log, `h5feed watch` and the tests."""
    head = f"h5feed[{rec['name']}]"
    waiting = rec.get("waiting(s)")
    loader = rec.get("loader")
    if rec["step"] == 0:
        line = f"{head} waiting for the first batch ({_num(waiting, '.0f', ' s')} so far)"
        if loader is None:
            return line + "; this loader has no h5feed counters"
        if not loader["workers"]:
            return line + "; no worker has started reading yet"
        return line + f"; {loader['workers']} worker(s) started, {loader['reading']} reading a sample"
    if rec["steps"]:
        line = (
            f"{head} step {rec['step']} | {_num(rec['throughput(steps/s)'], '.2f')} steps/s, "
            f"step {_num(rec['step_time(s)'], '.3f', ' s')} | data_loading {_num(rec['data_loading(s)'], '.3f', ' s')} "
            f"({_num(rec['data_loading(%)'], '.1f', '%')}) | GPU idle {_num(rec['gpu_idle(%)'], '.1f', '%')}"
        )
    else:
        line = f"{head} step {rec['step']} | no step finished in the last {rec['window(s)']:.1f} s"
    if loader is not None:
        line += (
            f" | loader {_num(loader['samples_per_s'], '.1f')} samples/s, {_num(loader['read_GBps'], '.2f')} GB/s read, "
            f"{_num(loader['decoded_GBps'], '.2f')} GB/s decoded, queue {loader['queue_depth']}"
        )
    elif rec["steps"]:
        line += f" | batches {_num(rec['batches(GB/s)'], '.2f')} GB/s (no loader counters)"
    if waiting is not None and waiting >= 1.0:
        line += f" | waiting {waiting:.0f} s for batch {rec['step'] + 1}"
    return line


_TABLE = [  # (heading, key, format)
    ("worker", "worker", "d"), ("pid", "pid", "d"), ("samples", "samples", "d"), ("samples/s", "samples_per_s", ".2f"),
    ("read MB/s", "read_MBps", ".1f"), ("queue", "queue_depth", "d"), ("sample", "sample", "d"),
    ("for s", "sample_s", ".1f"), ("MB so far", "sample_MB", ".1f"), ("no progress s", "since_progress_s", ".1f"),
]


def format_workers(rows: list[Record]) -> list[str]:
    """Per-worker rows as an aligned table (the sample's source path last)."""
    if not rows:
        return []
    cells = [[h for h, _, _ in _TABLE] + ["path"]]
    cells += [[_num(r[key], spec) if r[key] is not None else "-" for _, key, spec in _TABLE] + [r["path"] or "-"]
              for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_TABLE))]
    return ["  ".join(c[i].rjust(widths[i]) for i in range(len(_TABLE))) + "  " + c[-1] for c in cells]


# --- stalls -------------------------------------------------------------------------------------

Verdict = Literal["bottleneck", "stuck", "idle", "waiting"]


def classify(trainer_wait_s: float | None, worker_quiet_s: list[float] | None, stall_after: float) -> Verdict | None:
    """What a stall is, from how long the trainer has waited and how long each worker has gone without progress.

    `worker_quiet_s` is None when the loader has no counters.  None: no stall.
    """
    waited = trainer_wait_s is not None and trainer_wait_s > stall_after
    if worker_quiet_s is None:
        return "waiting" if waited else None
    quiet = all(q > stall_after for q in worker_quiet_s)  # no worker started counts as quiet
    if waited:
        return "stuck" if quiet else "bottleneck"
    if quiet and worker_quiet_s:
        return "idle"
    return None


def _verdict_text(verdict: Verdict, wait: float | None, quiet: float | None, step: int, recent: Record | None) -> str:
    batch = f"batch {step + 1}"
    if verdict == "stuck":
        progress = "no worker has started" if quiet is None else f"no worker has made progress for {quiet:.0f} s"
        return f"the input pipeline is STUCK: the trainer has waited {wait:.0f} s for {batch} and {progress}"
    if verdict == "bottleneck":
        rates = ""
        if recent is not None:
            rates = (f" ({_num(recent['samples_per_s'], '.2f')} samples/s, {_num(recent['read_GBps'], '.3f')} GB/s "
                     f"over the last {RECENT_S:.0f} s)")
        return (f"the input pipeline is the BOTTLENECK: the trainer has waited {wait:.0f} s for {batch} while "
                f"workers are still reading{rates}")
    if verdict == "idle":
        return (f"the input pipeline is IDLE: no worker has made progress for {quiet:.0f} s and the trainer is not "
                "asking for batches (queues full or workers done: the trainer is busy elsewhere)")
    return (f"the trainer has waited {wait:.0f} s for {batch}; this loader has no h5feed counters, so what its "
            "workers do cannot be seen")


def _process_state(pid: int) -> tuple[str, float | None]:
    """The worker's process state (running, sleeping, disk-sleep...) and CPU seconds, as `ps` would say."""
    try:
        proc = psutil.Process(pid)
        cpu = proc.cpu_times()
        return proc.status(), cpu.user + cpu.system
    except (psutil.Error, OSError):
        return "gone", None


def _worker_sentence(row: Record) -> str:
    state = f"pid {row['pid']}, {row['state']}" + (f", {row['cpu_s']:.1f} s CPU" if row.get("cpu_s") is not None else "")
    if row["sample"] is not None:
        where = f" ({row['path']})" if row["path"] else ""
        doing = (f"sample {row['sample']}{where} for {row['sample_s']:.1f} s, {row['sample_MB']:.1f} MB read so far, "
                 f"no progress for {_num(row['since_progress_s'], '.1f', ' s')}")
    else:
        doing = f"no sample in hand, last progress {_num(row['since_progress_s'], '.1f', ' s')} ago"
    return (f"  worker {row['worker']} ({state}): {doing}; {row['samples']} samples done, recent "
            f"{_num(row['samples_per_s'], '.2f')} samples/s, {_num(row['read_MBps'], '.1f')} MB/s, "
            f"queue {row['queue_depth']}")


# --- the monitor --------------------------------------------------------------------------------


def _say(level: int, line: str) -> None:
    """Log the line; if the trainer configured no logging, still write it to stderr: that is the point of it."""
    if log.hasHandlers():
        if log.level == logging.NOTSET and log.getEffectiveLevel() > level:
            log.setLevel(logging.INFO)  # an unconfigured level (WARNING) would drop the reports
        log.log(level, line)
    else:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _tensorboard_writer(tensorboard: bool | Literal["auto"], log_dir: Path | None) -> Any:
    if not tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if tensorboard == "auto":
            return None
        raise ImportError("h5feed.monitor(tensorboard=True) needs the tensorboard package: pip install tensorboard") from None
    if log_dir is None:
        if tensorboard == "auto":
            return None
        raise ValueError("h5feed.monitor(tensorboard=True) needs log_dir")
    return SummaryWriter(log_dir=str(log_dir))


class Monitor(Generic[T]):
    """An iterable over `loader`'s batches that measures and reports each step (see `monitor`)."""

    def __init__(
        self,
        loader: Iterable[T],
        *,
        every: float,
        log_dir: str | os.PathLike[str] | None,
        jsonl: str | os.PathLike[str] | None,
        stall_after: float,
        tensorboard: bool | Literal["auto"],
        name: str,
    ) -> None:
        if every <= 0 or stall_after <= 0:
            raise ValueError("every and stall_after must be positive numbers of seconds")
        self.loader = loader
        self.every, self.stall_after, self.name = every, stall_after, name
        self.dataset = getattr(loader, "dataset", None)
        counters = getattr(self.dataset, "counters", None)
        self.counters = counters if isinstance(counters, LoaderCounters) else None
        self._store = getattr(self.dataset, "store", None)
        log_path = Path(log_dir) if log_dir is not None else None
        if jsonl is not None:
            self.jsonl_path: Path | None = Path(jsonl)
        else:
            self.jsonl_path = log_path / f"{JSONL_PREFIX}-{name}.jsonl" if log_path is not None else None
        self._tb = _tensorboard_writer(tensorboard, log_path)
        self._batch_size = getattr(loader, "batch_size", None) or 1
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._totals = _Totals()
        self._batches = 0
        self._t0 = time.perf_counter()
        self._first_batch_s: float | None = None
        self._waiting_since: float | None = None
        self._step_call: float | None = None  # when the trainer asked for the batch it now holds
        self._open_wait = 0.0
        self._open_bytes = 0
        self._gpu: _GpuTimer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = _Report(self._t0, _Totals(), None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    # --- the hot path: clock reads, one lock; with CUDA a stream query (and two events if the CPU runs ahead)
    def __iter__(self) -> Iterator[T]:
        self._begin()
        try:
            t_call = self._t0
            batches = iter(self.loader)  # starts the workers
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                self._got(t_call, time.perf_counter(), batch)
                yield batch
                t_call = time.perf_counter()
                self._asked(t_call)
        finally:
            self._finish()

    def _got(self, t_call: float, t_got: float, batch: Any) -> None:
        if self._gpu is None and torch.cuda.is_initialized():
            self._gpu = _GpuTimer()
        if self._gpu is not None:
            self._gpu.handed_off()
        nbytes = _nbytes(batch)
        with self._lock:
            self._waiting_since = None
            self._batches += 1
            self._open_wait, self._open_bytes = t_got - t_call, nbytes
        if self._batches == 1:
            self._first_batch_s = t_got - self._t0
            self._emit({"kind": "first_batch", "first_batch(s)": self._first_batch_s, "batch_bytes": nbytes},
                       f"h5feed[{self.name}] first batch after {self._first_batch_s:.2f} s ({nbytes / 1e6:.1f} MB)")

    def _asked(self, t_call: float) -> None:
        gpu_steps = []
        if self._step_call is not None and self._gpu is not None:
            gpu_steps = self._gpu.step_done(self._open_wait, t_call - self._step_call)
        if self._gpu is not None:
            self._gpu.called()
        with self._lock:
            self._waiting_since = t_call
            t = self._totals
            if self._step_call is not None:  # the step that began at the previous call is complete
                t.steps += 1
                t.step_s += t_call - self._step_call
                t.wait_s += self._open_wait
                t.samples += self._batch_size
                t.batch_bytes += self._open_bytes
            self._step_call = t_call
            t.add_gpu(gpu_steps)

    # --- start and end --------------------------------------------------------------------------
    def _begin(self) -> None:
        self._reset()
        self._waiting_since = self._t0
        self._start = _Report(self._t0, _Totals(), self.counters.snapshot() if self.counters is not None else None)
        what = self._describe()
        self._emit({"kind": "start", "every(s)": self.every, "stall_after(s)": self.stall_after, "what": what,
                    "pid": os.getpid()}, f"h5feed[{self.name}] iterating {what}; waiting for the first batch")
        self._thread = threading.Thread(target=self._watch, name=f"h5feed-monitor-{self.name}", daemon=True)
        self._thread.start()

    def _describe(self) -> str:
        if isinstance(self._store, Store):
            s = self._store
            parts = [f"store {s.path} ({len(s)} samples, H={s.hidden_size}, K={s.num_aux_layers})"]
        else:
            source = self.loader if self.dataset is None else self.dataset
            size = f" of {len(source)} samples" if hasattr(source, "__len__") else ""  # type: ignore[arg-type]
            parts = [f"{type(source).__name__}{size}"]
        workers = getattr(self.loader, "num_workers", 0)
        if workers:
            context = getattr(self.loader, "multiprocessing_context", None)
            method = context.get_start_method() if context is not None else torch.multiprocessing.get_start_method(True)
            plural = "s" if workers > 1 else ""
            parts.append(f"{workers} DataLoader worker{plural} starting ({method or 'default start method'})")
        else:
            parts.append("reading in this process")
        parts.append(f"batch_size {self._batch_size}")
        if self.counters is None:
            parts.append("no h5feed counters: worker activity cannot be seen")
        return ", ".join(parts)

    def _finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._gpu is not None:
            gpu_steps = self._gpu.collect(wait=True)
            with self._lock:
                self._totals.add_gpu(gpu_steps)
        with self._lock:
            self._waiting_since = None
        rec = self._record("end", time.perf_counter(), self._start)
        rec["first_batch(s)"] = self._first_batch_s
        self._emit(rec, f"{format_line(rec)} | finished: {self._batches} batches in {rec['elapsed(s)']:.1f} s, "
                        f"first batch after {_num(self._first_batch_s, '.2f', ' s')}")
        if self._tb is not None:
            self._tb.flush()

    def summary(self) -> Record:
        """The step figures over the iteration so far (from the second batch on), plus the first batch's wait."""
        with self._lock:
            totals = self._totals.copy()
        return {"batches": self._batches, "first_batch(s)": self._first_batch_s, **_step_figures(totals)}

    # --- the reporting thread -------------------------------------------------------------------
    def _watch(self) -> None:
        tick = max(0.02, min(1.0, self.every / 4, self.stall_after / 4))
        last = self._start
        recent: deque[LoaderSnapshot] = deque()
        announced = failed = False
        stalled: Verdict | None = None
        while not self._stop.wait(tick):
            try:
                now = time.perf_counter()
                snap = self.counters.snapshot() if self.counters is not None else None
                if snap is not None:
                    recent.append(snap)
                    while len(recent) > 1 and snap.time - recent[1].time >= RECENT_S:
                        recent.popleft()
                    if not announced and snap.workers and self._batches == 0:
                        self._announce_workers(snap, now)
                        announced = True
                stalled = self._check_stall(now, snap, recent[0] if recent else None, stalled)
                if now - last.time >= self.every:
                    rec = self._record("report", now, last, snap)
                    self._emit(rec, format_line(rec))
                    self._scalars(rec)
                    last = _Report(now, self._totals_copy(), snap)
            except Exception:  # a broken report must never stop the training, nor flood its log
                if not failed:
                    log.exception("h5feed[%s] monitor thread (reported once)", self.name)
                failed = True

    def _totals_copy(self) -> _Totals:
        with self._lock:
            return self._totals.copy()

    def _announce_workers(self, snap: LoaderSnapshot, now: float) -> None:
        reading = [f"worker {w.worker} sample {w.current_sample}" + (f" ({p})" if (p := self._path_of(w.current_sample)) else "")
                   for w in snap.workers if w.current_sample is not None]
        doing = "; reading " + ", ".join(reading) if reading else ""
        self._emit({"kind": "workers_started", "workers": len(snap.workers), "after(s)": now - self._t0},
                   f"h5feed[{self.name}] loader started after {now - self._t0:.1f} s: {len(snap.workers)} "
                   f"worker(s) up{doing}")

    def _path_of(self, index: int | None) -> str | None:
        """The source file of a store index, for h5feed datasets."""
        if index is None or not isinstance(self._store, Store) or not 0 <= index < len(self._store):
            return None
        return str(Path(self._store.info.source_root) / self._store.source_paths[index])

    def _record(self, kind: str, now: float, since: _Report, snap: LoaderSnapshot | None = None) -> Record:
        """The figures of the window since `since` (a report) or of the whole iteration (`since` = its start)."""
        with self._lock:
            totals, waiting_since, batches = self._totals.copy(), self._waiting_since, self._batches
        if snap is None and self.counters is not None:
            snap = self.counters.snapshot()
        rec: Record = {
            "kind": kind,
            "name": self.name,
            "time": time.time(),
            "step": batches,
            "elapsed(s)": now - self._t0,
            "window(s)": now - since.time,
            **_step_figures(totals - since.totals),
            "waiting(s)": now - waiting_since if waiting_since is not None else None,
            "cuda": self._gpu is not None,
        }
        if snap is not None:
            rows = _worker_rows(snap, since.snap, self._path_of)
            rec["loader"], rec["workers"] = _loader_figures(rows), rows
        else:
            rec["loader"], rec["workers"] = None, []
        return rec

    def _check_stall(
        self, now: float, snap: LoaderSnapshot | None, recent: LoaderSnapshot | None, stalled: Verdict | None
    ) -> Verdict | None:
        """Report a stall once per episode (again if its kind changes); returns the current verdict."""
        waiting_since = self._waiting_since
        wait = now - waiting_since if waiting_since is not None else None
        quiet = None
        if snap is not None:
            quiet = [self._quiet_s(w, now - self._t0) for w in snap.workers]
        verdict = classify(wait, quiet, self.stall_after)
        if verdict is None or verdict == stalled:
            return verdict
        rows = _worker_rows(snap, recent, self._path_of) if snap is not None else []
        for row in rows:
            row["state"], row["cpu_s"] = _process_state(row["pid"])
        text = _verdict_text(verdict, wait, min(quiet) if quiet else None, self._batches,
                             _loader_figures(rows) if recent is not None else None)
        lines = [f"h5feed[{self.name}] STALL: {text}", *(_worker_sentence(r) for r in rows)]
        if snap is not None and not rows:
            lines.append("  no worker has started: a worker still starting (spawn imports take seconds) or one that died")
        self._emit({"kind": "stall", "verdict": verdict, "message": text, "step": self._batches, "waiting(s)": wait,
                    "workers": rows}, "\n".join(lines), level=logging.WARNING)
        return verdict

    @staticmethod
    def _quiet_s(w: WorkerSnapshot, since_start: float) -> float:
        """How long a worker has gone without progress (a chunk read or a sample finished) in this iteration."""
        if w.seconds_since_progress is not None and w.seconds_since_progress < since_start:
            return w.seconds_since_progress
        return w.current_seconds if w.current_sample is not None else since_start

    # --- sinks ----------------------------------------------------------------------------------
    def _emit(self, rec: Record, line: str, level: int = logging.INFO) -> None:
        _say(level, line)
        if self.jsonl_path is None:
            return
        rec = {"kind": rec["kind"], "name": self.name, "time": time.time()} | rec
        with self._write_lock:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def _scalars(self, rec: Record) -> None:
        if self._tb is None or not rec["steps"]:
            return
        step = rec["step"]
        names = {"time_metrics/data_loading(s)": "data_loading(s)", "time_metrics/data_loading(%)": "data_loading(%)",
                 "time_metrics/step_time(s)": "step_time(s)", "time_metrics/gpu_idle(%)": "gpu_idle(%)",
                 "throughput(steps/s)": "throughput(steps/s)", "throughput(samples/s)": "throughput(samples/s)"}
        for tag, key in names.items():
            if rec[key] is not None:
                self._tb.add_scalar(f"{self.name}/{tag}", rec[key], step)
        if rec["loader"] is not None:
            for key in ("samples_per_s", "read_GBps", "decoded_GBps", "queue_depth"):
                if rec["loader"][key] is not None:
                    self._tb.add_scalar(f"{self.name}/loader/{key}", rec["loader"][key], step)
            for row in rec["workers"]:
                if row["samples_per_s"] is not None:
                    self._tb.add_scalar(f"{self.name}/loader/worker{row['worker']}/samples_per_s", row["samples_per_s"], step)


# --- h5feed watch ---------------------------------------------------------------------------------


def _tail_records(path: Path, chunk: int = 1 << 16) -> list[Record]:
    """The records of the file's current run (since its last "start"), read from the end of the file."""
    size = path.stat().st_size
    span = chunk
    while True:
        with open(path, "rb") as f:
            f.seek(max(0, size - span))
            lines = f.read(span).split(b"\n")
        if size > span:
            lines = lines[1:]  # cut mid-line
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # empty, or a line still being written
        starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
        if starts or span >= size:
            return records[starts[-1]:] if starts else records
        span *= 4


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(path.glob(f"{JSONL_PREFIX}*.jsonl"), key=lambda p: p.stat().st_mtime)
    raise H5feedError(f"{path}: no such run directory or JSON-lines file")


def render(path: Path, now: float | None = None) -> str:
    """One frame of `h5feed watch` for one JSON-lines file: status, the report line, per-worker rows."""
    now = time.time() if now is None else now
    records = _tail_records(path)
    if not records:
        return f"{path}: no records yet"
    last = records[-1]
    start = records[0] if records[0].get("kind") == "start" else {}
    figures = next((r for r in reversed(records) if r.get("kind") in ("report", "end")), None)
    age = now - last["time"]
    if last["kind"] == "end":
        state = "finished"
    elif age > 2 * start.get("every(s)", 30.0) + 5:
        state = f"no record for {age:.0f} s: is the run still alive (pid {start.get('pid', '?')})?"
    else:
        state = "running"
    out = [f"== {last['name']}  {path}  ({state}; last record {age:.0f} s ago)"]
    if start:
        out.append(f"   {start['what']}")
    first = next((r for r in records if r.get("kind") == "first_batch"), None)
    if first is not None:
        out.append(f"   first batch after {first['first_batch(s)']:.2f} s")
    stalls = [r for r in records if r.get("kind") == "stall"]
    if stalls:
        out.append(f"   last stall ({now - stalls[-1]['time']:.0f} s ago): {stalls[-1]['message']}")
    if figures is None:
        out.append("   no report yet")
        return "\n".join(out)
    out.append(format_line(figures))
    out += format_workers(figures["workers"])
    return "\n".join(out)


def watch(path: str | os.PathLike[str], *, once: bool = False, interval: float = 1.0, out: TextIO | None = None) -> int:
    """Show the figures of a monitored run from another shell, refreshed every `interval` seconds."""
    out = out or sys.stdout
    target = Path(path)
    while True:
        files = _jsonl_files(target)
        if files:
            frame = "\n\n".join(render(f) for f in files)
        else:
            frame = f"{target}: no {JSONL_PREFIX}*.jsonl yet (is the monitor given log_dir={target}?)"
        if once:
            out.write(frame + "\n")
            return 0 if files else 1
        if out.isatty():
            out.write("\x1b[H\x1b[2J")
        out.write(frame + "\n")
        out.flush()
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    return watch(args.path, once=args.once, interval=args.interval)


def add_watch_parser(subparsers: Any) -> None:
    """`h5feed watch RUN_DIR_OR_JSONL`."""
    p = subparsers.add_parser("watch", help="live view of a monitored training run: step rate, data wait, GPU idle, "
                                            "per-worker rows (from h5feed.monitor's JSON-lines file)")
    p.add_argument("path", help="the monitor's log_dir (its h5feed-monitor*.jsonl files) or one .jsonl file")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default: %(default)s)")
    p.set_defaults(func=_cmd_watch)
