"""`h5feed report`: a monitored run as one self-contained HTML page (and a PNG), from the monitor's JSON lines.

Why: "how long did the GPU wait for data, over the whole run, per rank and per worker, and when
did it stall?" is a time series; the log lines and `h5feed watch` show one moment.  The page puts
the run's summary on top, then the data wait and the step rate of every rank over time, and every
worker's samples/s, stalls marked.  Plots are drawn with matplotlib (`pip install h5feed[report]`)
and embedded, so the page is one file to copy or attach.

The page is the run's record, so it draws all of it: every window the monitor wrote and every
pass's end (a pass shorter than `every` may have no other record), each pass's start marked on
the time axis, each pass's own figures drawn across its time, and stalls over the time they held
the trainer.  A folder above several runs gets a section per run, told apart as `h5feed watch`
tells them (`runlog.RunId`); a script run again into the same log_dir is a new attempt, shown on
its own, for its steps and epochs count from 0 again.
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h5feed.errors import H5feedError
from h5feed.io.local import write_atomically
from h5feed.observe.watchdog import BOTTLENECK_PCT
from h5feed.observe.page import Section, bullets, figure_png, image, links, page_html, pyplot, table
from h5feed.observe.renderer import Record, num, slowest_worker
from h5feed.observe.runlog import RunId, RunLog, RunLogError, monitor_files

if TYPE_CHECKING:  # matplotlib is optional (h5feed[report])
    from matplotlib.figure import Figure


MAX_POINTS = 2000  # per plotted line: a longer series is thinned evenly (the plot is 990 pixels wide)
MAX_PASSES = 1000  # rows of the page's table of passes: the last ones (the summary counts them all)
NAMED_STALLS = 5  # stalls the summary names (it counts them all)
MAX_MARKS = 200  # passes marked on the time axis: a run of more has every k-th marked
MAX_LABELS = 20  # of those, the ones whose epoch is written above the plots
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


def summary_lines(attempt: Attempt) -> list[str]:
    """The attempt in a few sentences: steps and epochs, the data wait, the slowest rank and worker, the stalls."""
    tracks, lines = attempt.tracks, []
    last = attempt.number == attempt.of
    for t in tracks:
        share = f"{t.wait_share:.1f}%" if t.wait_share is not None else "n/a"
        lines.append(f"{t.name} rank {t.rank}: {t.steps} steps over {t.epochs} epoch(s), {t.state(last)}; the "
                     f"trainer waited for data {share} of the time ({t.waited_s:.1f} s of {t.elapsed_s:.1f} s, "
                     f"{t.first_batches_s:.1f} s of it for the first batch of each pass)")
    waits = {t.rank: t.wait_share for t in tracks}
    if len(tracks) > 1 and all(w is not None for w in waits.values()):
        slow = max(waits, key=lambda r: waits[r] or 0.0)
        lines.append(f"slowest rank: rank {slow}, {waits[slow]:.1f}% data wait (under DDP it sets every rank's pace)")
    worker = _slowest_worker(tracks)
    if worker is not None:
        lines.append(worker)
    stalls = sum(t.stalls for t in tracks)
    named = [(t, r) for t in tracks for r in t.named_stalls][:NAMED_STALLS]
    lines.append(f"{stalls} stall report(s)" + (": " + "; ".join(
        f"rank {t.rank} at step {r.get('global_step', r.get('step'))}: {r['verdict']}" for t, r in named)
        if stalls else ""))
    return lines


def reading_notes(runs: list[Run], refused: Sequence[str]) -> list[str]:
    """What the reader skipped or refused, a line per file."""
    logs = {t.log.path: t.log for run in runs for attempt in run.attempts for t in attempt.tracks}
    return [*(text for log in logs.values() if (text := log.skipped_text()) is not None),
            *(f"refused {reason}" for reason in refused)]


@dataclass
class WorkerFigures:
    """One DataLoader worker of one rank over the attempt: its windows' mean rates and the samples it read."""

    rank: int
    worker: int
    samples_per_s: float
    busy_s_per_sample: float | None  # reading and decoding seconds per sample: the worker's own pace
    read_MBps: float | None
    samples: int


def worker_figures(tracks: list[Track]) -> list[WorkerFigures]:
    """Each worker's mean rates over the windows that had them, and its samples, by rank and worker."""
    return sorted((WorkerFigures(t.rank, worker, w.samples_per_s.value or 0.0, w.busy_s_per_sample.value,
                                 w.read_MBps.value, w.samples) for t in tracks for worker, w in t.workers.items()),
                  key=lambda f: (f.rank, f.worker))


def _slowest_worker(tracks: list[Track]) -> str | None:
    return slowest_worker({f"rank {f.rank} worker {f.worker}": f.busy_s_per_sample for f in worker_figures(tracks)
                           if f.busy_s_per_sample is not None})


def plot_figure(attempt: Attempt) -> Figure:
    """The attempt's time series: data wait % and samples/s per rank (each window a point, each pass's own
    figure a bar across its time), samples/s per worker; every axis from 0, each pass's start marked and its
    epoch written above, stalls shaded over the time they held the trainer.

    The data wait's axis reaches BOTTLENECK_PCT at least: a wait the monitor does not call a bottleneck is
    drawn as the small thing it is, not stretched over the height of the plot."""
    plt = pyplot("h5feed report")
    t0 = attempt.began
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, constrained_layout=True)
    wait_ax, rate_ax, worker_ax = axes

    def line(ax: Any, series: Series, label: str) -> Any:
        x, y = series.thinned()
        return ax.plot([v - t0 for v in x], y, marker=".", label=label, gid="windows")[0]

    def bars(ax: Any, spans: Spans, colour: str) -> None:
        begin, end, value = spans.thinned()
        ax.hlines(value, [v - t0 for v in begin], [v - t0 for v in end], colors=colour, linewidth=4, alpha=0.35,
                  gid="pass figures")

    several = len(attempt.tracks) > 1
    for t in attempt.tracks:
        label = f"rank {t.rank}" if several else t.name
        bars(wait_ax, t.pass_waits, line(wait_ax, t.waits, label).get_color())
        bars(rate_ax, t.pass_rates, line(rate_ax, t.rates, label).get_color())
        for worker, w in sorted(t.workers.items()):
            line(worker_ax, w.rates, f"{label} worker {worker}")
        for when in t.stall_times.thinned()[0]:
            for ax in axes:
                ax.axvline(when - t0, color="red", alpha=0.5, linestyle="--", gid="stall report")
        begin, end, _ = t.stall_spans.thinned()
        for b, e in zip(begin, end):
            for ax in axes:
                ax.axvspan(b - t0, e - t0, color="red", alpha=0.12, gid="stall")
    _mark_passes(wait_ax, axes, attempt.tracks[0], t0)
    if not worker_ax.lines:
        worker_ax.text(0.5, 0.5, "no per-worker counters: the loader is not one of h5feed's", ha="center",
                       va="center", transform=worker_ax.transAxes)
    wait_ax.set_ylabel("data wait, % of the step")
    rate_ax.set_ylabel("trainer samples/s")
    worker_ax.set_ylabel("worker samples/s")
    worker_ax.set_xlabel("seconds since the attempt's first record (dots: windows; bars: each pass as a whole; "
                         "red: stalls)")
    wait_ax.set_ylim(0, max(wait_ax.get_ylim()[1], BOTTLENECK_PCT))
    for ax in (rate_ax, worker_ax):
        ax.set_ylim(bottom=0)
    wait_ax.set_xlim(0, max(max(t.last_time for t in attempt.tracks) - t0, 1e-3))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize="small")
    return fig


def _mark_passes(top: Any, axes: Sequence[Any], track: Track, t0: float) -> None:
    """A dotted line at each pass's start (of the lowest rank: the ranks' passes start together), on every
    axis, and its epoch written above the `top` axis."""
    starts, epochs = track.pass_starts.thinned(MAX_MARKS)
    for when in starts:
        for ax in axes:
            ax.axvline(when - t0, color="grey", linestyle=":", linewidth=0.9, gid="pass")
    every = max(1, math.ceil(len(starts) / MAX_LABELS))
    labelled = [(when - t0, "?" if math.isnan(epoch) else str(int(epoch)))
                for when, epoch in zip(starts[::every], epochs[::every])]
    epoch_axis = top.secondary_xaxis("top")
    epoch_axis.set_xticks([x for x, _ in labelled], [text for _, text in labelled])
    epoch_axis.set_xlabel("epoch: each pass's start (dotted)")


def plot_png(attempt: Attempt) -> bytes:
    """The attempt's plots as one PNG (see `plot_figure`)."""
    return figure_png(plot_figure(attempt))


def pass_rows(attempt: Attempt) -> list[list[str]]:
    """A row per pass of each rank (its last MAX_PASSES), header first: its end's figures, when it began (in
    seconds from the attempt's first record), how long it lasted and how it ended."""
    rows = [["rank", "epoch", "steps", "first batch", "step", "data wait", "GPU idle", "samples/s", "began at",
             "lasted", "ended"]]
    for t in attempt.tracks:
        for p in t.all_passes():
            r = p.end or {}
            ended = ("finished" if r.get("complete", True) else "left early") if p.end else "no end record"
            rows.append([str(t.rank), str(p.epoch if p.epoch is not None else ""), str(r.get("step", "")),
                         num(r.get("first_batch(s)"), ".2f", " s"), num(r.get("step_time(s)"), ".3f", " s"),
                         num(r.get("data_loading(%)"), ".1f", "%"), num(r.get("gpu_idle(%)"), ".1f", "%"),
                         num(r.get("throughput(samples/s)"), ".2f"), f"{p.began - attempt.began:.1f} s",
                         num(r.get("elapsed(s)"), ".1f", " s"), ended])
    return rows


def attempt_sections(attempt: Attempt, png: bytes, suffix: str, level: int, notes: Sequence[str] = ()
                     ) -> list[Section]:
    """The summary (`notes` after it), plots and tables of one attempt; `suffix` keeps the element ids of a page
    of several apart, and `level` is their headings' level."""
    workers = [["rank", "worker", "samples", "samples/s", "s reading per sample", "read MB/s"]]
    workers += [[str(f.rank), str(f.worker), str(f.samples), f"{f.samples_per_s:.2f}", num(f.busy_s_per_sample, ".3f"),
                 num(f.read_MBps, ".1f")] for f in worker_figures(attempt.tracks)]
    sections = [
        Section(None, bullets([*summary_lines(attempt), *notes], f"summary{suffix}")),
        Section(None, image(png, f"plots{suffix}", "data wait, samples/s per rank and per worker over time")),
        Section("Each pass", table(pass_rows(attempt), f"passes{suffix}"), level),
    ]
    if len(workers) > 1:  # h5feed's loaders count what each worker does
        sections.append(Section("Each worker (samples: as its counters had them at the last record; rates: mean "
                                "over the windows)", table(workers, f"workers{suffix}"), level))
    return sections


def report_html(runs: list[Run], pngs: Sequence[bytes], refused: Sequence[str] = (), folder: str | Path = "") -> str:
    """The page: the summary, the plots (embedded), and a table of every pass and of every worker, of each
    attempt of each run (`pngs`: their plots, in that order).  A page of one attempt is as plain as that; a
    page of several opens with a list of links to a section per run, each of its attempts under it."""
    attempts = [a for run in runs for a in run.attempts]
    notes = reading_notes(runs, refused)
    if len(attempts) == 1:
        track = attempts[0].tracks[0]
        return page_html(f"h5feed run {track.name}: {track.log.path.parent}",
                         attempt_sections(attempts[0], pngs[0], "", 2, notes))
    contents = [(run.title() + (f" ({len(run.attempts)} attempts)" if len(run.attempts) > 1 else ""), f"run-{i}")
                for i, run in enumerate(runs, 1)]
    opening = (links(contents, "runs") if len(runs) > 1 else "") + (bullets(notes, "notes") if notes else "")
    sections = [Section(None, opening)] if opening else []
    shown = iter(enumerate(pngs, 1))
    for i, run in enumerate(runs, 1):
        sections.append(Section(run.title(), "", 2, f"run-{i}"))
        for attempt in run.attempts:
            n, png = next(shown)
            if attempt.of > 1:
                sections.append(Section(attempt.title(), "", 3, f"run-{i}-attempt-{attempt.number}"))
            sections += attempt_sections(attempt, png, f"-{n}", 4 if attempt.of > 1 else 3)
    what = f"{len(runs)} runs" if len(runs) > 1 else f"run {runs[0].id.name}, {len(attempts)} attempts"
    return page_html(f"h5feed report of {what}: {folder}", sections)


def png_paths(png: Path, count: int) -> list[Path]:
    """Where the plots of `count` attempts go: `png` itself for one, else `png` numbered as the page's sections
    are (run.png: run-1.png, run-2.png, ...)."""
    if count == 1:
        return [png]
    return [png.with_name(f"{png.stem}-{n}{png.suffix}") for n in range(1, count + 1)]


def write_report(folder: str | Path, out: str | Path | None = None, png: str | Path | None = None) -> Path:
    """Write the runs' page (default: `report.html` in `folder`), and their plots as PNGs if asked (see
    `png_paths`); returns the page.

    Each file is written under a temporary name and renamed into place: a link planted at its name (in a
    shared run folder) is replaced, never written through."""
    runs, refused = load_runs(folder)
    images = [plot_png(attempt) for run in runs for attempt in run.attempts]
    page = Path(out) if out is not None else Path(folder) / "report.html"
    write_atomically(page, report_html(runs, images, refused, folder).encode("utf-8"), durable=False)
    if png is not None:
        for path, data in zip(png_paths(Path(png), len(images)), images):
            write_atomically(path, data, durable=False)
    return page


def _cmd_report(args: argparse.Namespace) -> int:
    page = write_report(args.log_dir, args.output, args.png)
    print(page)
    return 0


def add_report_parser(subparsers: Any) -> None:
    """`h5feed report LOG_DIR`."""
    p = subparsers.add_parser(
        "report", help="an HTML page (and PNG) of a monitored run: data wait and samples/s over time, per rank and "
                       "worker, stalls marked",
        description=textwrap.fill("Read the JSON lines h5feed.monitor(loader, log_dir=...) wrote (every rank's, "
                                  "in LOG_DIR and its sub-folders) and write one self-contained HTML page: the run's "
                                  "summary, its data wait and samples/s over time per rank and per worker, each "
                                  "pass marked, stalls shaded, and a table of every pass and worker. A folder above "
                                  "several runs gets a section per run (as h5feed watch tells them apart), and a "
                                  "script run again into the same log_dir a section per attempt. Needs matplotlib "
                                  "(pip install 'h5feed[report]').", 100),
        epilog="examples:\n  h5feed report runs/drafter                     # writes runs/drafter/report.html\n"
               "  h5feed report runs/drafter -o run.html --png run.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dir", help="the monitor's log_dir (or a folder above several runs' log_dirs)")
    p.add_argument("-o", "--output", help="the page to write (default: LOG_DIR/report.html)")
    p.add_argument("--png", help="also write the plots as this PNG file (numbered, run-1.png, run-2.png, ..., when "
                                 "the page holds several runs or attempts)")
    p.set_defaults(func=_cmd_report)
