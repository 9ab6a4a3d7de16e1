"""`h5feed report`: a monitored run as one self-contained HTML page (and a PNG), from the monitor's JSON lines.

Why: "how long did the GPU wait for data, over the whole run, per rank and per worker, and when
did it stall?" is a time series; the log lines and `h5feed watch` show one moment.  The page puts
the run's summary on top, then the data wait and the step rate of every rank over time, and every
worker's samples/s, stalls marked.  Plots are drawn with matplotlib (`pip install h5feed[report]`)
and embedded, so the page is one file to copy or attach.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h5feed.errors import H5feedError
from h5feed.io.local import write_atomically
from h5feed.observe.page import Section, bullets, figure_png, image, page_html, pyplot, table
from h5feed.observe.renderer import Record, num, slowest_worker
from h5feed.observe.runlog import RunLog, RunLogError, monitor_files


MAX_POINTS = 2000  # per plotted line: a longer series is thinned evenly (the plot is 990 pixels wide)
MAX_PASSES = 1000  # rows of the page's table of passes: the last ones (the summary counts them all)
NAMED_STALLS = 5  # stalls the summary names (it counts them all)


@dataclass
class Series:
    """Points of one plotted line, held as two arrays of floats (a long run's reports stay small)."""

    x: array = field(default_factory=lambda: array("d"))
    y: array = field(default_factory=lambda: array("d"))

    def add(self, x: float, y: float | None) -> None:
        self.x.append(x)
        self.y.append(math.nan if y is None else y)  # a gap in the line

    def thinned(self) -> tuple[array, array]:
        step = max(1, math.ceil(len(self.x) / MAX_POINTS))
        return self.x[::step], self.y[::step]


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
    """One DataLoader worker of one track: its samples/s over time and the means of its reports' rates."""

    rates: Series = field(default_factory=Series)
    samples_per_s: Mean = field(default_factory=Mean)
    busy_s_per_sample: Mean = field(default_factory=Mean)
    read_MBps: Mean = field(default_factory=Mean)
    samples: int = 0


@dataclass
class Track:
    """One monitor's file, folded record by record as it is streamed: what the page shows of it, in memory
    that does not grow with the number of records (but for the plotted points, 16 bytes each)."""

    log: RunLog
    name: str = ""
    rank: int = 0
    records: int = 0
    first_time: float = math.inf
    epochs: int = 0  # passes begun
    steps: int = 0
    waited_s: float = 0.0  # the trainer's data wait, over every pass that ended
    elapsed_s: float = 0.0  # those passes' time, from iter() to their end
    first_batches_s: float = 0.0  # their first batches' waits (part of waited_s)
    ends: deque[Record] = field(default_factory=lambda: deque(maxlen=MAX_PASSES))
    passes: int = 0
    last_complete: bool | None = None  # the last pass's end: ran to the loader's end, or None: no end yet
    stalls: int = 0
    named_stalls: list[Record] = field(default_factory=list)
    stall_times: Series = field(default_factory=Series)
    waits: Series = field(default_factory=Series)  # data wait % and samples/s of each report, by its time
    rates: Series = field(default_factory=Series)
    workers: dict[int, WorkerTrack] = field(default_factory=dict)

    def add(self, r: Record) -> None:
        self.records += 1
        self.name, self.rank = r["name"], r.get("rank", 0)
        self.first_time = min(self.first_time, r["time"])
        self.steps = max(self.steps, r.get("global_step", r.get("step", 0)))
        kind = r["kind"]
        if kind == "start":
            self.epochs += 1
        elif kind == "end":
            self.passes += 1
            self.ends.append(r)
            self.last_complete = r.get("complete", True)
            first = r.get("first_batch(s)") or 0.0
            waited = r.get("data_wait(s)")
            if waited is None:  # a log of a monitor whose steps left the first batch out: it is added back
                waited = (r["data_loading(s)"] or 0.0) * r["steps"] + first
            self.waited_s += waited
            self.elapsed_s += r["elapsed(s)"]
            self.first_batches_s += first
        elif kind == "stall":
            self.stalls += 1
            self.stall_times.add(r["time"], 0.0)
            if len(self.named_stalls) < NAMED_STALLS:
                self.named_stalls.append(r)
        elif kind == "report":
            self.waits.add(r["time"], r["data_loading(%)"])
            self.rates.add(r["time"], r["throughput(samples/s)"])
            for w in r["workers"]:
                if w["samples_per_s"] is not None:
                    worker = self.workers.setdefault(w["worker"], WorkerTrack())
                    worker.rates.add(r["time"], w["samples_per_s"])
                    worker.samples_per_s.add(w["samples_per_s"])
                    worker.busy_s_per_sample.add(w["busy_s_per_sample"])
                    worker.read_MBps.add(w["read_MBps"])
                    worker.samples = max(worker.samples, w["samples"])

    @property
    def wait_share(self) -> float | None:
        """The share of the time the trainer waited for data, in %, over every pass that ended: each first
        batch's wait (the loader's start-up) is the GPU's idle time as much as any other."""
        return 100 * self.waited_s / self.elapsed_s if self.elapsed_s else None


def read_track(path: Path) -> Track:
    """One monitor's file, streamed (see `runlog`)."""
    track = Track(RunLog(path))
    for rec in track.log.records():
        track.add(rec)
    return track


def load_tracks(folder: str | Path) -> tuple[list[Track], list[str]]:
    """The monitors' files in `folder` and its sub-folders, each streamed, and why any file was refused."""
    tracks, refused = [], []
    for path in monitor_files(Path(folder)):
        try:
            track = read_track(path)
        except RunLogError as exc:
            refused.append(str(exc))
            continue
        if track.records:
            tracks.append(track)
        elif track.log.skipped:
            refused.append(track.log.skipped_text() or "")
    if not tracks:
        why = "".join(f"; {reason}" for reason in refused)
        raise H5feedError(f"{folder}: no h5feed-monitor*.jsonl with records here or in its sub-folders "
                          f"(is it the log_dir given to h5feed.monitor?){why}")
    return sorted(tracks, key=lambda t: (t.name, t.rank)), refused


def summary_lines(tracks: list[Track], refused: Sequence[str] = ()) -> list[str]:
    """The run in a few sentences: steps and epochs, the data wait, the slowest rank and worker, the stalls;
    then what the reader skipped or refused."""
    lines = []
    for t in tracks:
        share = f"{t.wait_share:.1f}%" if t.wait_share is not None else "n/a"
        state = "finished" if t.last_complete else "stopped early or still running"
        lines.append(f"{t.name} rank {t.rank}: {t.steps} steps over {t.epochs} epoch(s), {state}; the trainer "
                     f"waited for data {share} of the time ({t.waited_s:.1f} s of {t.elapsed_s:.1f} s, "
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
    lines += [skipped for t in tracks if (skipped := t.log.skipped_text()) is not None]
    lines += [f"refused {reason}" for reason in refused]
    return lines


@dataclass
class WorkerFigures:
    """One DataLoader worker of one rank over the run: its reports' mean rates and the samples it read."""

    rank: int
    worker: int
    samples_per_s: float
    busy_s_per_sample: float | None  # reading and decoding seconds per sample: the worker's own pace
    read_MBps: float | None
    samples: int


def worker_figures(tracks: list[Track]) -> list[WorkerFigures]:
    """Each worker's mean rates over the reports that had them, by rank and worker."""
    return sorted((WorkerFigures(t.rank, worker, w.samples_per_s.value or 0.0, w.busy_s_per_sample.value,
                                 w.read_MBps.value, w.samples) for t in tracks for worker, w in t.workers.items()),
                  key=lambda f: (f.rank, f.worker))


def _slowest_worker(tracks: list[Track]) -> str | None:
    return slowest_worker({f"rank {f.rank} worker {f.worker}": f.busy_s_per_sample for f in worker_figures(tracks)
                           if f.busy_s_per_sample is not None})


def plot_png(tracks: list[Track]) -> bytes:
    """The run's time series as one PNG: data wait % and samples/s per rank, samples/s per worker; stalls marked."""
    plt = pyplot("h5feed report")
    t0 = min(t.first_time for t in tracks)
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, constrained_layout=True)
    wait_ax, rate_ax, worker_ax = axes

    def line(ax: Any, series: Series, label: str) -> None:
        x, y = series.thinned()
        ax.plot([v - t0 for v in x], y, marker=".", label=label)

    for t in tracks:
        label = f"rank {t.rank}" if len(tracks) > 1 else t.name
        line(wait_ax, t.waits, label)
        line(rate_ax, t.rates, label)
        for worker, w in sorted(t.workers.items()):
            line(worker_ax, w.rates, f"{label} worker {worker}")
        for when in t.stall_times.thinned()[0]:
            for ax in axes:
                ax.axvline(when - t0, color="red", alpha=0.5, linestyle="--")
    if not worker_ax.lines:
        worker_ax.text(0.5, 0.5, "no per-worker counters: the loader is not one of h5feed's", ha="center",
                       va="center", transform=worker_ax.transAxes)
    wait_ax.set_ylabel("data wait, % of the step")
    rate_ax.set_ylabel("trainer samples/s")
    worker_ax.set_ylabel("worker samples/s")
    worker_ax.set_xlabel("seconds since the run's first record (red dashes: stall reports)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize="small")
    return figure_png(fig)


def report_html(tracks: list[Track], png: bytes, refused: Sequence[str] = ()) -> str:
    """The page: the summary, the plots (embedded), and a table of every pass's end figures (the last
    MAX_PASSES of each track)."""
    rows = [["rank", "epoch", "steps", "first batch", "step", "data wait", "GPU idle", "samples/s"]]
    for t in tracks:
        for r in t.ends:
            rows.append([str(t.rank), str(r.get("epoch", "")), str(r.get("step", "")),
                         num(r.get("first_batch(s)"), ".2f", " s"), num(r.get("step_time(s)"), ".3f", " s"),
                         num(r.get("data_loading(%)"), ".1f", "%"),
                         num(r.get("gpu_idle(%)"), ".1f", "%"), num(r.get("throughput(samples/s)"), ".2f")])
    workers = [["rank", "worker", "samples", "samples/s", "s reading per sample", "read MB/s"]]
    workers += [[str(f.rank), str(f.worker), str(f.samples), f"{f.samples_per_s:.2f}", num(f.busy_s_per_sample, ".3f"),
                 num(f.read_MBps, ".1f")] for f in worker_figures(tracks)]
    sections = [
        Section(None, bullets(summary_lines(tracks, refused), "summary")),
        Section(None, image(png, "plots", "data wait, samples/s per rank and per worker over time")),
        Section("Each pass", table(rows, "passes")),
    ]
    if len(workers) > 1:  # h5feed's loaders count what each worker does
        sections.append(Section("Each worker (mean over the reports)", table(workers, "workers")))
    return page_html(f"h5feed run {tracks[0].name}: {tracks[0].log.path.parent}", sections)


def write_report(folder: str | Path, out: str | Path | None = None, png: str | Path | None = None) -> Path:
    """Write the run's page (default: `report.html` in `folder`), and its plots as a PNG if asked; returns the page.

    Each file is written under a temporary name and renamed into place: a link planted at its name (in a
    shared run folder) is replaced, never written through."""
    tracks, refused = load_tracks(folder)
    image = plot_png(tracks)
    page = Path(out) if out is not None else Path(folder) / "report.html"
    write_atomically(page, report_html(tracks, image, refused).encode("utf-8"), durable=False)
    if png is not None:
        write_atomically(Path(png), image, durable=False)
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
                                  "summary, its data wait and samples/s over time per rank and per worker, stalls "
                                  "marked. Needs matplotlib (pip install 'h5feed[report]').", 100),
        epilog="examples:\n  h5feed report runs/drafter                     # writes runs/drafter/report.html\n"
               "  h5feed report runs/drafter -o run.html --png run.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dir", help="the monitor's log_dir (or a folder above several runs' log_dirs)")
    p.add_argument("-o", "--output", help="the page to write (default: LOG_DIR/report.html)")
    p.add_argument("--png", help="also write the plots as this PNG file")
    p.set_defaults(func=_cmd_report)
