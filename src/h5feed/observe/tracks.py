"""A monitored run's records, folded as they are streamed into what `h5feed report` draws: a track per rank and
attempt, the attempts of a run, the runs under a folder.

Why apart from the page: the folding is the report's memory model and its reading of the monitor's records (a
log that lost its start, a script run again into the same log_dir, an older monitor's records); the page only
draws what the tracks hold.  A track keeps figures and arrays of plotted points, never the records: memory does
not grow with a long run's reports but for 16 to 24 bytes a point and the last MAX_PASSES passes.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from h5feed.errors import H5feedError
from h5feed.observe.renderer import Record
from h5feed.observe.runlog import RunId, RunLog, RunLogError, monitor_files

MAX_POINTS = 2000  # per plotted line: a longer series is thinned evenly (the plot is 990 pixels wide)
MAX_PASSES = 1000  # rows of the page's table of passes: the last ones (the summary counts them all)
NAMED_STALLS = 5  # stalls the summary names (it counts them all)
HELD = 64  # a pass's records held until one says its epoch (start, first batch, workers started: a few)


@dataclass
class Series:
    """Points of one plotted line, held as two arrays of floats (a long run's reports stay small)."""

    x: array = field(default_factory=lambda: array("d"))
    y: array = field(default_factory=lambda: array("d"))

    def add(self, x: float, y: float | None) -> None:
        self.x.append(x)
        self.y.append(math.nan if y is None else y)  # a gap in the line

    def thinned(self, most: int = MAX_POINTS) -> tuple[array, array]:
        step = max(1, math.ceil(len(self.x) / most))
        return self.x[::step], self.y[::step]


@dataclass
class Spans:
    """Stretches of time, each with a figure (a pass's own data wait from its start to its end; a stall's
    stretch), held as three arrays of floats."""

    begin: array = field(default_factory=lambda: array("d"))
    end: array = field(default_factory=lambda: array("d"))
    value: array = field(default_factory=lambda: array("d"))

    def add(self, begin: float, end: float, value: float | None = None) -> None:
        self.begin.append(begin)
        self.end.append(end)
        self.value.append(math.nan if value is None else value)

    def thinned(self) -> tuple[array, array, array]:
        step = max(1, math.ceil(len(self.begin) / MAX_POINTS))
        return self.begin[::step], self.end[::step], self.value[::step]


@dataclass
class Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: float | None) -> None:
        if value is not None:
            self.total, self.count = self.total + value, self.count + 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class WorkerTrack:
    """One DataLoader worker of one track: its samples/s over time, the means of its windows' rates, and the
    samples it read."""

    rates: Series = field(default_factory=Series)
    samples_per_s: Mean = field(default_factory=Mean)
    busy_s_per_sample: Mean = field(default_factory=Mean)
    read_MBps: Mean = field(default_factory=Mean)
    counted: int = 0  # its counter's value at the newest record
    before: int = 0  # what counters since replaced had counted

    def count(self, samples: int) -> None:
        """Its counter at a record: the loader's counters count from the dataset's making, so this is what
        `h5feed watch` shows; a count lower than the last is a new dataset's, and the old one's is kept."""
        if samples < self.counted:
            self.before += self.counted
        self.counted = samples

    @property
    def samples(self) -> int:
        return self.before + self.counted


@dataclass
class Pass:
    """One pass over the loader (an epoch) of one rank: when it began, its end record, its windows."""

    epoch: int | None
    began: float
    end: Record | None = None  # None: no end record (under way, or the process was killed)
    windows: int = 0  # window records written in it


@dataclass
class Track:
    """One rank of one attempt (the records one process wrote to its file), folded record by record as it is
    streamed: what the page shows of it, in memory that does not grow with the number of records (but for the
    plotted points, 16 to 24 bytes each, and the last MAX_PASSES passes)."""

    log: RunLog
    name: str = ""
    rank: int = 0
    world_size: int = 1
    pid: int | None = None  # of its process, and the host, as its first start record says
    host: str | None = None
    records: int = 0
    first_time: float = math.inf
    last_time: float = -math.inf
    last_epoch: int | None = None  # the epoch the newest record that says one is of
    epochs: int = 0  # passes begun
    steps: int = 0
    waited_s: float = 0.0  # the trainer's data wait, over every pass that ended
    elapsed_s: float = 0.0  # those passes' time, from iter() to their end
    first_batches_s: float = 0.0  # their first batches' waits (part of waited_s)
    passes: deque[Pass] = field(default_factory=lambda: deque(maxlen=MAX_PASSES))
    current: Pass | None = None  # the pass begun and not ended
    last_complete: bool | None = None  # the last end: ran to the loader's end, or None: no end yet
    stalls: int = 0
    named_stalls: list[Record] = field(default_factory=list)
    stall_times: Series = field(default_factory=Series)  # every stall report
    stall_spans: Spans = field(default_factory=Spans)  # each wait that became a stall: from its start to its batch
    stall_began: float | None = None  # the start of the trainer's wait a stall report is about, until its batch
    pass_starts: Series = field(default_factory=Series)  # each pass's start, and its epoch
    pass_waits: Spans = field(default_factory=Spans)  # each pass's data wait %, over its time
    pass_rates: Spans = field(default_factory=Spans)  # and its samples/s
    waits: Series = field(default_factory=Series)  # data wait % and samples/s of each window, by its time
    rates: Series = field(default_factory=Series)
    workers: dict[int, WorkerTrack] = field(default_factory=dict)

    def add(self, r: Record) -> None:
        self.records += 1
        self.name, self.rank, self.world_size = r["name"], r["rank"], r["world_size"]
        self.first_time, self.last_time = min(self.first_time, r["time"]), max(self.last_time, r["time"])
        self.steps = max(self.steps, r.get("global_step", r.get("step", 0)))
        if r.get("epoch") is not None:
            self.last_epoch = r["epoch"]
        kind = r["kind"]
        if kind == "start":
            self._close_stall(r["time"])
            self._begin(r["time"])
            if self.pid is None:
                self.pid, self.host = r.get("pid"), r.get("host")
        elif kind in ("report", "end"):
            current = self.current or self._begin(r["time"] - r["elapsed(s)"])  # a log that lost the start
            if current.epoch is None and r.get("epoch") is not None:
                current.epoch = self.pass_starts.y[-1] = r["epoch"]
            for w in r["workers"]:
                self.workers.setdefault(w["worker"], WorkerTrack()).count(w["samples"])
            if kind == "report":
                current.windows += 1
                self._window(r)
            else:
                if not current.windows:  # no window written (an older monitor's short pass): its end is one
                    self._window(r)
                self._end(current, r)
        elif kind == "stall":
            self.stalls += 1
            self.stall_times.add(r["time"], 0.0)
            if len(self.named_stalls) < NAMED_STALLS:
                self.named_stalls.append(r)
            if r.get("waiting(s)") is not None and self.stall_began is None:
                self.stall_began = r["time"] - r["waiting(s)"]
        elif kind == "resumed":
            self._close_stall(r["time"])

    def _begin(self, when: float) -> Pass:
        if self.current is not None:  # begun and never ended: kept as it is
            self.passes.append(self.current)
        self.epochs += 1
        self.current = Pass(None, when)
        self.pass_starts.add(when, None)  # its epoch once a record says it
        return self.current

    def _window(self, r: Record) -> None:
        self.waits.add(r["time"], r["data_loading(%)"])
        self.rates.add(r["time"], r["throughput(samples/s)"])
        for w in r["workers"]:
            if w["samples_per_s"] is not None:
                worker = self.workers[w["worker"]]
                worker.rates.add(r["time"], w["samples_per_s"])
                worker.samples_per_s.add(w["samples_per_s"])
                worker.busy_s_per_sample.add(w["busy_s_per_sample"])
                worker.read_MBps.add(w["read_MBps"])

    def _end(self, current: Pass, r: Record) -> None:
        current.end, self.current = r, None
        self.passes.append(current)
        self._close_stall(r["time"])
        self.last_complete = r.get("complete", True)
        first = r.get("first_batch(s)") or 0.0
        waited = r.get("data_wait(s)")
        if waited is None:  # a log of a monitor whose steps left the first batch out: it is added back
            waited = (r["data_loading(s)"] or 0.0) * r["steps"] + first
        self.waited_s += waited
        self.elapsed_s += r["elapsed(s)"]
        self.first_batches_s += first
        self.pass_waits.add(current.began, r["time"], r["data_loading(%)"])
        self.pass_rates.add(current.began, r["time"], r["throughput(samples/s)"])

    def _close_stall(self, when: float) -> None:
        if self.stall_began is not None:
            self.stall_spans.add(self.stall_began, when)
            self.stall_began = None

    def all_passes(self) -> list[Pass]:
        """The passes kept (the last MAX_PASSES), the one under way last."""
        return [*self.passes, *([self.current] if self.current is not None else [])]

    def is_another_process(self, start: Record) -> bool:
        """Whether a start record is of another process than the one this track follows: another pid or host."""
        pid = start.get("pid")
        return self.pid is not None and pid is not None and (pid, start.get("host")) != (self.pid, self.host)

    def state(self, last_attempt: bool) -> str:
        """How its last pass ended, in words."""
        if self.current is None and self.last_complete is not None:
            return "finished" if self.last_complete else "stopped before the loader's end (the loop was left)"
        if last_attempt:
            return "still running, or stopped without a last record (the process was killed)"
        return "stopped without a last record (the process was killed or crashed), then run again"

    @property
    def wait_share(self) -> float | None:
        """The share of the time the trainer waited for data, in %, over every pass that ended: each first
        batch's wait (the loader's start-up) is the GPU's idle time as much as any other."""
        return 100 * self.waited_s / self.elapsed_s if self.elapsed_s else None


def read_attempts(log: RunLog) -> list[Track]:
    """One monitor's file, streamed (see `runlog`), as one track per attempt: each process that wrote to it.

    A script run again into its log_dir appends to the same file.  Its first start record names another
    pid or host; where it names the same (a container's trainer is often pid 1, a restarted pod keeps its
    hostname), its passes count their epochs from 0 again, which one process's never do.  So a pass's
    first records are held until one says its epoch, and a pass whose epoch is not past the last one's
    begins a new attempt."""
    tracks = [Track(log)]
    held: list[Record] = []

    def settle(new_attempt: bool) -> None:
        if new_attempt:
            tracks.append(Track(log))
        for rec in held:
            tracks[-1].add(rec)
        held.clear()

    for rec in log.records():
        if rec["kind"] == "start":
            settle(False)
            if tracks[-1].records and tracks[-1].is_another_process(rec):
                tracks.append(Track(log))
            held.append(rec)
        elif held and (rec.get("epoch") is not None or rec["kind"] in ("report", "end") or len(held) >= HELD):
            epoch, last = rec.get("epoch"), tracks[-1].last_epoch
            settle(epoch is not None and last is not None and epoch <= last)
            tracks[-1].add(rec)
        elif held:
            held.append(rec)
        else:
            tracks[-1].add(rec)
    settle(False)
    return [track for track in tracks if track.records]


@dataclass
class Attempt:
    """One attempt of a run: the tracks of its ranks (one each), by rank."""

    tracks: list[Track]
    number: int  # 1-based, in the run
    of: int  # the run's attempts

    @property
    def began(self) -> float:
        """When its first record was written: the plots' time 0."""
        return min(t.first_time for t in self.tracks)

    def title(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.began))
        [only] = self.tracks if len(self.tracks) == 1 else [None]
        process = f" by pid {only.pid} on {only.host}" if only is not None and only.pid is not None else ""
        return f"attempt {self.number} of {self.of}: began {when}{process}"


@dataclass
class Run:
    """One run (`runlog.RunId`): its attempts, the latest last."""

    id: RunId
    attempts: list[Attempt]

    def title(self) -> str:
        ranks = f", {self.id.world_size} ranks" if self.id.world_size > 1 else ""
        return f"run {self.id.name}: {self.id.where}{ranks}"


def load_runs(folder: str | Path) -> tuple[list[Run], list[str]]:
    """The runs whose monitors' files are in `folder` and its sub-folders, each file streamed, and why any file
    was refused.  The ranks of a run of several are matched attempt by attempt, in the order they began."""
    files: dict[RunId, list[list[Track]]] = {}
    refused = []
    for path in monitor_files(Path(folder)):
        log = RunLog(path)
        try:
            attempts = read_attempts(log)
        except RunLogError as exc:
            refused.append(str(exc))
            continue
        if attempts:
            last = attempts[-1]
            files.setdefault(RunId.of(path, last.name, last.world_size), []).append(attempts)
        elif (skipped := log.skipped_text()) is not None:
            refused.append(skipped)
    if not files:
        why = "".join(f"; {reason}" for reason in refused)
        raise H5feedError(f"{folder}: no h5feed-monitor*.jsonl with records here or in its sub-folders "
                          f"(is it the log_dir given to h5feed.monitor?){why}")
    runs = []
    for run_id, ranks in files.items():
        count = max(len(attempts) for attempts in ranks)
        runs.append(Run(run_id, [Attempt(sorted((a[i] for a in ranks if i < len(a)), key=lambda t: t.rank), i + 1,
                                         count) for i in range(count)]))
    return sorted(runs, key=lambda run: run.attempts[0].began), refused
