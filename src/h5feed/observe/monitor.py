"""Where each training step's time goes, live: data wait, GPU idle, loader throughput, and stall reports.

Why: a trainer whose GPU waits on its input says nothing, and people fall back
on `nvidia-smi`, `ps` and `strace` to guess whether it computes, loads or hangs.
`monitor(loader)` wraps the loader the trainer iterates and measures, per step,
how long `next()` blocked (torchtitan's `data_loading(s)` and `data_loading(%)`)
and, with CUDA, how long the GPU had no work meanwhile (the stream's `query()` at
each `next()` call, and CUDA events where the CPU runs ahead of the GPU, read once
complete: nothing waits on the GPU in the hot path).  A thread adds the workers' shared counters
(`h5feed.observe.metrics`) and writes a line every `every` seconds, a JSON-lines record
for `h5feed watch`, TensorBoard and Weights & Biases scalars if asked, and a stall report that says
what every worker is doing when the trainer or the workers stop moving.

Every second of a pass is counted, for the GPU idles while the trainer waits for
its first batch as much as for any other.  A pass runs from `iter()` to the
loader's end; a step runs from the call that asked for its batch to the next call
(the first step from `iter()`, so its wait is the first batch's, worker start-up
and all).  The wait in the call that gets the loader's end counts with the last
step, and a pass left early ends its last step when the loop is left.  So the
steps' waits add up to the pass's data wait, their times to its elapsed time, and
`data_loading(%)` is the share of the pass the trainer waited for data.  Every
record with figures also says how long the first batch took (`first_batch(s)`)
and how long the trainer has waited in the pass so far (`data_wait(s)`, a wait
under way included).  Reports are windows of the steps that ended in them; the
last window of a pass is written (and sent to TensorBoard and W&B) at its end,
so the windows together cover the pass.  The GPU's idle time is known from the
first step on when CUDA is up at `iter()` (else from the first step begun after
it is), and `gpu_idle(%)` is over the steps where it is known.

Where loading holds the step back (a pass, or a report's window, whose steps waited for data
`BOTTLENECK_PCT` of their time, and every stall) the monitor says what limits it, from the
workers' counters (`watchdog.diagnose`): the storage, the CPU, too few workers or more than the
cores.  Its line says how many samples the workers have finished that the trainer has not
taken yet: ready ahead of it.  `headspace=N` measures what data costs the step: N steps on a
replayed batch, without the loader, against the loaded steps (SPDL's headspace analysis).

Each pass over the loader is an epoch of one run: monitors of the same
name and files in one process (a loop that wraps its loader afresh each epoch, or
one monitor iterated per epoch) count the run's `global_step` on, write one
TensorBoard events file with increasing steps, and say which epoch a line is of.

This module is the measurement: the hot path, the passes and the reporting thread.  What it reads of the loader
is `loader_view`'s, the verdicts on loading `watchdog`'s, the headspace's sums and sentence `headspace`'s, and
where its lines and records go `monitor_log`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch

from h5feed import tracing
from h5feed.observe.headspace import Headspace, StepKind, headspace_text
from h5feed.observe.loader_view import LoaderView, distributed_rank
from h5feed.observe.metrics import LoaderSnapshot, WorkerSnapshot
from h5feed.observe.monitor_log import RecordFile, say
from h5feed.observe.renderer import (
    Record,
    format_line,
    label,
    loader_figures,
    num,
    slowest_worker,
    step_figures,
    worker_rows,
)
from h5feed.observe.runlog import JSONL_PREFIX
from h5feed.observe.scalars import ScalarSink, TensorBoardSink, report_scalars, tensorboard_sink, wandb_sink
from h5feed.observe.timers import GpuSpan, GpuTimer, StepTotals
from h5feed.observe.watchdog import (
    BOTTLENECK_PCT,
    RECENT_S,
    StallEpisode,
    advice,
    classify_stall,
    diagnose_between,
    note_diagnosis,
    process_state,
    verdict_text,
    wait_cause,
    window_verdict,
    worker_sentence,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def monitor(
    loader: Iterable[T],
    *,
    every: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
    jsonl: str | os.PathLike[str] | None = None,
    stall_after: float = 60.0,
    tensorboard: bool | Literal["auto"] = False,
    wandb: bool | Literal["auto"] = "auto",
    name: str = "train",
    trace: bool = False,
    headspace: int = 0,
) -> Monitor[T]:
    """Wrap `loader` so that iterating it reports where the time goes: `for batch in monitor(loader): ...`.

    Args:
        every: seconds between report lines (and JSON-lines records).
        log_dir: folder for the JSON-lines file and TensorBoard events.  The file is
            `h5feed-monitor-{name}.jsonl`, or `h5feed-monitor-{name}-rank{rank}.jsonl` in a run of several
            ranks (torch.distributed, or torchrun's RANK and WORLD_SIZE), so ranks can share the folder and
            `h5feed watch` shows them side by side.
        jsonl: the JSON-lines file, if not the default one in `log_dir`; None and no log_dir: no file.
        stall_after: seconds the trainer may wait for a batch, or all workers go without progress,
            before a stall report.
        tensorboard: True writes scalars to `log_dir` (tensorboard must be installed); "auto" does
            when it is installed and `log_dir` is given.
        wandb: "auto" (the default) logs the same scalars to the trainer's Weights & Biases run when
            it has called `wandb.init()`, against their own step metric `{name}/global_step` and
            without moving the run's step; True insists on it; False never.
        name: tells several monitors apart in lines, files and scalars.
        trace: also write the run's timeline into `log_dir` (`h5feed.tracing`): the trainer's waits and steps,
            each worker's samples, reads and decodes, the copies to the GPU; `h5feed trace LOG_DIR` makes one
            Chrome/Perfetto trace of it.  Each span is a line of a file, so leave it off for long runs.
        headspace: for a measurement run, not a real one: after the pass's first batch and `headspace` batches
            more, the monitor hands the trainer the batch it just had `headspace` times again without asking the
            loader, so those steps cost no data, and the end line and `end` record say how much faster training
            would run if data cost nothing (the loaded steps' mean time, the first batch's step left out, against
            the replayed steps').  The replayed steps TRAIN ON ONE BATCH REPEATED, and the pass has `headspace`
            steps more than the loader's batches; done once per run.  0 (the default): never.
    """
    if trace and log_dir is None:
        raise ValueError("trace=True writes the timeline into log_dir: give one")
    return Monitor(loader, every=every, log_dir=log_dir, jsonl=jsonl, stall_after=stall_after,
                   tensorboard=tensorboard, wandb=wandb, name=name, trace=trace, headspace=headspace)


@dataclass
class _Run:
    """What outlives one pass over the loader: the run's batches and epochs so far, its JSON-lines file and its
    TensorBoard writer."""

    steps_before: int = 0  # batches handed over in the passes that ended
    epochs: int = 0  # passes begun
    tensorboard: TensorBoardSink | None = None
    records: RecordFile | None = None  # the JSON-lines file, once the first monitor of the run is made
    headspace_measured: bool = False  # the replayed steps of `headspace=` were run (once a run)


_RUNS: dict[tuple[str, int, str, str], _Run] = {}  # by (name, rank, JSON-lines file, log_dir): one per run


@dataclass
class _Report:
    """Where a window starts: the time (perf_counter), the step sums and the loader counters then."""

    time: float
    totals: StepTotals
    snap: LoaderSnapshot | None


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0


# --- the monitor --------------------------------------------------------------------------------


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
        wandb: bool | Literal["auto"],
        name: str,
        trace: bool = False,
        headspace: int = 0,
    ) -> None:
        if every <= 0 or stall_after <= 0:
            raise ValueError("every and stall_after must be positive numbers of seconds")
        if headspace < 0:
            raise ValueError(f"headspace is a number of steps to replay, not {headspace}")
        self.loader = loader
        self.every, self.stall_after, self.name, self.headspace = every, stall_after, name, headspace
        self.rank, self.world_size = distributed_rank()
        self._label = label(name, self.rank, self.world_size)
        self._view = LoaderView.of(loader)
        self.dataset, self.counters = self._view.dataset, self._view.counters
        log_path = Path(log_dir) if log_dir is not None else None
        self._trace_dir = log_path if trace else None
        if jsonl is not None:
            self.jsonl_path: Path | None = Path(jsonl)
        else:
            suffix = f"-rank{self.rank}" if self.world_size > 1 else ""
            self.jsonl_path = log_path / f"{JSONL_PREFIX}-{name}{suffix}.jsonl" if log_path is not None else None
        self._run = _RUNS.setdefault((name, self.rank, str(self.jsonl_path), str(log_path)), _Run())
        if self._run.records is None and self.jsonl_path is not None:
            self._run.records = RecordFile(self.jsonl_path, self._label)
        if self._run.tensorboard is None:
            self._run.tensorboard = tensorboard_sink(tensorboard, log_path)
        sinks = [self._run.tensorboard if tensorboard else None, wandb_sink(wandb)]
        self._sinks: list[ScalarSink] = [sink for sink in sinks if sink is not None]
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._totals = StepTotals()
        self._batches = 0
        self._t0 = time.perf_counter()
        self._first_batch_s: float | None = None
        self._waiting_since: float | None = None
        self._step_call = self._t0  # when the step under way began: the call that asked for its batch, or iter()
        self._open_wait = 0.0  # the wait and size of the batch of the step under way, not yet in the totals
        self._open_bytes = 0
        self._open_kind: StepKind = "first"
        self._replayed = 0  # batches handed over again (headspace=), not the loader's
        self._headspace = Headspace()
        self._stalled_batch: int | None = None  # the batch (1-based) a stall was reported for, and its wait
        self._stalled_batch_wait: float | None = None
        self._gpu: GpuTimer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = _Report(self._t0, StepTotals(), None)
        self._last_report = self._start  # where the reporting thread's current window began
        self._epoch = self._run.epochs - 1  # the pass being iterated (0-based)
        self._ran_out = False  # the loader came to its end (not a pass left early)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    # --- the hot path: clock reads, one lock; with CUDA a stream query (and two events if the CPU runs ahead)
    def __iter__(self) -> Iterator[T]:
        self._begin()
        try:
            t_call = self._t0
            replay_after = self.headspace + 1 if self.headspace and not self._run.headspace_measured else None
            batches = iter(self.loader)  # starts the workers
            loaded = 0
            while True:
                if loaded == replay_after:
                    t_call = yield from self._replay(batch, t_call)
                try:
                    with tracing.section("h5feed: wait for a batch", "trainer", batch=self._batches + 1):
                        batch = next(batches)
                except StopIteration:
                    self._ran_out = True
                    return
                loaded += 1
                t_got = time.perf_counter()
                self._got(t_call, t_got, batch)
                yield batch
                t_call = time.perf_counter()
                tracing.span("step", "trainer", t_got, t_call, batch=self._batches)
                self._asked(t_call)
        finally:
            self._finish()

    def _replay(self, batch: T, t_call: float) -> Generator[T, None, float]:
        """Hand the trainer `batch` again `headspace` times without asking the loader (see `monitor`); returns
        when the trainer asked for the batch after them."""
        self._run.headspace_measured = True
        self._emit({"kind": "headspace", "epoch": self._epoch, "step": self._batches, "replays": self.headspace},
                   f"{self._label} headspace: the next {self.headspace} steps train on batch {self._batches} again, "
                   "without the loader, to time the step when data costs nothing")
        for _ in range(self.headspace):
            self._got(t_call, time.perf_counter(), batch, replayed=True)
            yield batch
            t_call = time.perf_counter()
            self._asked(t_call)
        return t_call

    def _got(self, t_call: float, t_got: float, batch: Any, replayed: bool = False) -> None:
        if self._gpu is None and torch.cuda.is_initialized():
            self._gpu = GpuTimer()
        if self._gpu is not None:
            self._gpu.handed_off()
        nbytes = _nbytes(batch)
        with self._lock:
            self._waiting_since = None
            self._batches += 1
            self._replayed += replayed
            self._open_kind = "replayed" if replayed else "first" if self._batches == 1 else "loaded"
            self._open_wait, self._open_bytes = t_got - t_call, nbytes
            if self._batches == self._stalled_batch:
                self._stalled_batch_wait = t_got - t_call
        if self._batches == 1:
            self._first_batch_s = t_got - self._t0
            self._emit({"kind": "first_batch", "first_batch(s)": self._first_batch_s, "batch_bytes": nbytes},
                       f"{self._label} first batch after {self._first_batch_s:.2f} s ({nbytes / 1e6:.1f} MB)")

    def _asked(self, t_call: float) -> None:
        """The trainer asks for the next batch: the step of the batch it held is complete."""
        gpu = self._gpu.step_done(self._open_wait, t_call - self._step_call) if self._gpu is not None else []
        if self._gpu is not None:
            self._gpu.called()
        with self._lock:
            self._waiting_since = t_call
            self._count_step(t_call, 1, gpu)

    def _ended(self, t_end: float) -> None:
        """The pass is over at `t_end`.  Left early, the trainer held a batch: its step ends here.  Otherwise
        the trainer was in a call that got the loader's end (or its error): that wait, with no batch, counts
        with the last step, so that the steps' times add up to the pass's."""
        with self._lock:
            waiting = self._waiting_since is not None
            if waiting:
                self._open_wait = t_end - self._step_call
        if waiting and self._gpu is not None:
            self._gpu.handed_off()
        steps = 0 if waiting else 1
        gpu = self._gpu.step_done(self._open_wait, t_end - self._step_call, steps) if self._gpu is not None else []
        if self._gpu is not None:
            gpu += self._gpu.collect(wait=True)
        with self._lock:
            self._waiting_since = None
            self._count_step(t_end, steps, gpu)

    def _count_step(self, t: float, steps: int, gpu: list[GpuSpan]) -> None:
        """Add the step under way, ended at `t`, to the totals, and the GPU's spans known by now (the lock held)."""
        totals = self._totals
        totals.steps += steps
        totals.step_s += t - self._step_call
        totals.wait_s += self._open_wait
        totals.samples += steps * self._view.batch_size
        totals.batch_bytes += self._open_bytes
        totals.add_gpu(gpu)
        if steps:
            self._headspace.add(self._open_kind, t - self._step_call)
        self._step_call, self._open_wait, self._open_bytes = t, 0.0, 0

    # --- start and end --------------------------------------------------------------------------
    def _begin(self) -> None:
        if self._trace_dir is not None:  # before the loader starts its workers: they inherit it
            tracing.configure(trace_dir=self._trace_dir)
        self._run.epochs += 1
        self._reset()
        self._waiting_since = self._t0
        if torch.cuda.is_initialized():  # the GPU's idle time while the first batch is awaited is the first step's
            self._gpu = GpuTimer()
            self._gpu.called()
        self._start = _Report(self._t0, StepTotals(), self.counters.snapshot() if self.counters is not None else None)
        self._last_report = self._start
        what = self._view.describe()
        self._emit({"kind": "start", "every(s)": self.every, "stall_after(s)": self.stall_after, "what": what,
                    "pid": os.getpid(), "host": socket.gethostname()},
                   f"{self._label} iterating {what}; waiting for the first batch")
        self._thread = threading.Thread(target=self._watch, name=f"h5feed-monitor-{self.name}", daemon=True)
        self._thread.start()

    def _finish(self) -> None:
        t_end = time.perf_counter()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._trace_dir is not None:  # on for this pass only: the next pass (or another loader) asks again
            tracing.stop_trace()
        self._ended(t_end)
        snap = self.counters.snapshot() if self.counters is not None else None
        last, _ = self._record("report", t_end, self._last_report, snap)
        if last["steps"]:  # the pass's last window: the end line below follows it at once, so it is not logged
            self._emit(last, None)
            self._scalars(last, self._last_report)
        rec, _ = self._record("end", t_end, self._start, snap)
        rec["complete"] = self._ran_out
        self._run.steps_before += self._batches
        how = "finished" if self._ran_out else "stopped before the loader's end (interrupted, or the loop was left)"
        line = (f"{format_line(rec)} | {how}: {self._batches} batches in {rec['elapsed(s)']:.1f} s, "
                f"first batch after {num(self._first_batch_s, '.2f', ' s')}")
        slowest = slowest_worker({f"worker {row['worker']}": row["busy_s_per_sample"] for row in rec["workers"]
                                  if row["busy_s_per_sample"] is not None})
        if slowest is not None:
            line += f" | {slowest}"
        wait = rec.get("data_loading(%)")
        if wait is not None and wait >= BOTTLENECK_PCT:
            diagnosis = diagnose_between(self._view.setup, self._start.snap, snap)
            note_diagnosis(rec, diagnosis)
            line += (f" | the step waited for data {wait:.1f}% of the time: loading held training back; "
                     f"{wait_cause(self._first_batch_s, rec['data_wait(s)'], diagnosis, self.counters is not None)}")
        if self.headspace:
            rec |= self._headspace.figures()
            line += f" | {headspace_text(rec, self._run.headspace_measured, self._batches, self.headspace)}"
        self._emit(rec, line)
        for sink in self._sinks:
            try:
                sink.flush()
            except OSError as exc:  # TensorBoard's events file on a full disk: the loop goes on all the same
                say(logging.WARNING, f"{self._label} cannot write its scalars: {exc}")

    def summary(self) -> Record:
        """The step figures over the steps of the pass that ended so far (all of it once the pass is over: the
        first batch's wait included), plus the first batch's wait on its own."""
        with self._lock:
            totals, headspace = self._totals.copy(), self._headspace.figures()
        return {"batches": self._batches, "first_batch(s)": self._first_batch_s, **step_figures(totals),
                **(headspace if self.headspace else {})}

    # --- the reporting thread -------------------------------------------------------------------
    def _watch(self) -> None:
        tick = max(0.02, min(1.0, self.every / 4, self.stall_after / 4))
        last = self._start
        recent: deque[LoaderSnapshot] = deque()
        announced = failed = False
        episode = StallEpisode(self._waiting_since, 0)
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
                episode = self._check_stall(now, snap, recent[0] if recent else None, episode)
                if now - last.time >= self.every:
                    rec, totals = self._record("report", now, last, snap)
                    self._emit(rec, format_line(rec) + window_verdict(rec, self._view.setup, last.snap, snap))
                    self._scalars(rec, last)
                    last = self._last_report = _Report(now, totals, snap)
            except Exception:  # a broken report must never stop the training, nor flood its log
                if not failed:
                    log.exception("%s monitor thread (reported once)", self._label)
                failed = True
        if not failed:
            self._end_episode(episode)  # the batch came after the last tick

    def _announce_workers(self, snap: LoaderSnapshot, now: float) -> None:
        reading = [f"worker {w.worker} sample {w.current_sample}"
                   + (f" ({o})" if (o := self._view.object_of(w.current_sample)) else "")
                   for w in snap.workers if w.current_sample is not None]
        doing = "; reading " + ", ".join(reading) if reading else ""
        self._emit({"kind": "workers_started", "workers": len(snap.workers), "after(s)": now - self._t0},
                   f"{self._label} loader started after {now - self._t0:.1f} s: {len(snap.workers)} "
                   f"worker(s) up{doing}")

    def _record(
        self, kind: str, now: float, since: _Report, snap: LoaderSnapshot | None = None
    ) -> tuple[Record, StepTotals]:
        """The figures of the window since `since` (a report) or of the whole iteration (`since` = its start),
        and the totals they were made of: where the next window begins, so that no step falls between two."""
        with self._lock:
            totals, waiting_since, batches = self._totals.copy(), self._waiting_since, self._batches
            open_wait, loaded = self._open_wait, self._batches - self._replayed
        waiting = now - waiting_since if waiting_since is not None else None
        if snap is None and self.counters is not None:
            snap = self.counters.snapshot()
        rec: Record = {
            "kind": kind,
            "name": self.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "time": time.time(),
            "epoch": self._epoch,
            "step": batches,  # in this epoch
            "global_step": self._run.steps_before + batches,  # over the run
            "elapsed(s)": now - self._t0,
            "window(s)": now - since.time,
            **step_figures(totals - since.totals),
            "waiting(s)": waiting,
            "data_wait(s)": totals.wait_s + open_wait + (waiting or 0.0),  # in the pass so far
            "first_batch(s)": self._first_batch_s,
            "cuda": self._gpu is not None,
        }
        if snap is not None:
            rows = worker_rows(snap, since.snap, self._view.object_of)
            rec["loader"], rec["workers"] = loader_figures(rows, self._ahead(snap, loaded)), rows
        else:
            rec["loader"], rec["workers"] = None, []
        return rec, totals

    def _ahead(self, snap: LoaderSnapshot, loaded: int) -> int | None:
        """Samples the workers have finished in this pass (or skipped, damaged) that the trainer has not taken
        yet, out of `loaded` batches taken: what is ready ahead of it.  None where a batch sampler makes the
        batches (how many samples the trainer took is not known)."""
        start = self._start.snap
        if self._view.per_batch is None or start is None:
            return None
        done = sum(snap.total(name) - start.total(name) for name in ("samples", "corrupt"))
        return max(0, int(done) - loaded * self._view.per_batch)  # the last batch may be short

    def _check_stall(
        self, now: float, snap: LoaderSnapshot | None, recent: LoaderSnapshot | None, episode: StallEpisode
    ) -> StallEpisode:
        """Report a stall once per episode and verdict (see `StallEpisode`), and the end of a reported one;
        returns the episode now under way."""
        with self._lock:
            waiting_since, batches = self._waiting_since, self._batches
        if waiting_since != episode.waiting_since:
            self._end_episode(episode)
            episode = StallEpisode(waiting_since, batches)
        wait = now - waiting_since if waiting_since is not None else None
        quiet = None
        if snap is not None:
            quiet = [self._quiet_s(w, now - self._t0) for w in snap.workers]
        for_writer = snap is not None and any(w.waiting_for_writer_s is not None for w in snap.workers)
        verdict = classify_stall(wait, quiet, self.stall_after, for_writer)
        if verdict is None or not episode.should_report(verdict):
            return episode
        if episode.held_the_trainer:
            with self._lock:
                if self._stalled_batch != batches + 1:
                    self._stalled_batch, self._stalled_batch_wait = batches + 1, None
        rows = worker_rows(snap, recent, self._view.object_of) if snap is not None else []
        for row in rows:
            row["state"], row["cpu_s"] = process_state(row["pid"])
        text = verdict_text(verdict, wait, min(quiet) if quiet else None, batches,
                             loader_figures(rows) if recent is not None else None)
        diagnosis = diagnose_between(self._view.setup, recent, snap)
        what_to_do = advice(verdict, rows, diagnosis)
        lines = [f"{self._label} STALL: {text}", *(worker_sentence(r) for r in rows)]
        if what_to_do:
            lines.append(f"  what to do: {what_to_do}")
        tracing.instant("stall", "trainer", verdict=verdict)
        self._emit({"kind": "stall", "verdict": verdict, "message": text, "advice": what_to_do,
                    "limit": diagnosis.limit if diagnosis is not None else None, "epoch": self._epoch,
                    "step": batches, "global_step": self._run.steps_before + batches, "waiting(s)": wait,
                    "workers": rows}, "\n".join(lines), level=logging.WARNING)
        return episode

    def _end_episode(self, episode: StallEpisode) -> None:
        """Say that a stall the trainer waited through is over, once its batch has come."""
        with self._lock:
            batches, waited = self._batches, self._stalled_batch_wait
        if not episode.held_the_trainer or episode.waiting_since is None or batches <= episode.step:
            return
        how_long = f" after {waited:.1f} s" if waited is not None else ""
        self._emit({"kind": "resumed", "epoch": self._epoch, "step": episode.step,
                    "global_step": self._run.steps_before + episode.step, "waited(s)": waited},
                   f"{self._label} resumed: the trainer got batch {episode.step + 1}{how_long}")

    @staticmethod
    def _quiet_s(w: WorkerSnapshot, since_start: float) -> float:
        """How long a worker has gone without progress (a chunk read or a sample finished) in this iteration."""
        if w.seconds_since_progress is not None and w.seconds_since_progress < since_start:
            return w.seconds_since_progress
        return w.current_seconds if w.current_sample is not None else since_start

    # --- sinks ----------------------------------------------------------------------------------
    def _emit(self, rec: Record, line: str | None, level: int = logging.INFO) -> None:
        """Say `line` (None: nothing) and write `rec` to the JSON-lines file."""
        if line is not None:
            say(level, line)
        if self._run.records is None:
            return
        self._run.records.append({"kind": rec["kind"], "name": self.name, "time": time.time(), "rank": self.rank,
                                  "world_size": self.world_size} | rec)

    def _scalars(self, rec: Record, since: _Report) -> None:
        """Send a window's scalars, at the run's count of completed steps: a window with none sends nothing, so
        each one sent is at a later step (the record's `global_step` counts batches handed over, which the
        window at the end of a pass does not move on)."""
        if not self._sinks or not rec["steps"]:
            return
        prefix = self.name if self.world_size == 1 else f"{self.name}/rank{self.rank}"
        scalars = report_scalars(rec)
        step = self._run.steps_before + since.totals.steps + rec["steps"]
        for sink in self._sinks:
            sink.write(prefix, scalars, step)
