"""`h5feed report`: a monitored run as one self-contained HTML page (and a PNG), from the monitor's JSON lines.

Why: "how long did the GPU wait for data, over the whole run, per rank and per worker, and when
did it stall?" is a time series; the log lines and `h5feed watch` show one moment.  The page puts
the run's summary on top, then the data wait and the step rate of every rank over time, and every
worker's samples/s, stalls marked.  Plots are drawn with matplotlib (`pip install h5feed[report]`)
and embedded, so the page is one file to copy or attach.
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h5feed.errors import H5feedError
from h5feed.observe.page import Section, bullets, figure_png, image, page_html, pyplot, table
from h5feed.observe.renderer import Record, num, slowest_worker
from h5feed.observe.watch import monitor_files, parse_records


@dataclass
class Track:
    """One monitor's file: every record of every epoch it wrote, in order."""

    path: Path
    records: list[Record] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.records[-1]["name"])

    @property
    def rank(self) -> int:
        return int(self.records[-1].get("rank", 0))

    def of(self, kind: str) -> list[Record]:
        return [r for r in self.records if r.get("kind") == kind]


def load_tracks(folder: str | Path) -> list[Track]:
    """The monitors' files in `folder` and its sub-folders, each read whole (a line cut short is passed over)."""
    tracks = [Track(path, parse_records(path.read_text().splitlines())) for path in monitor_files(Path(folder))]
    tracks = [t for t in tracks if t.records]
    if not tracks:
        raise H5feedError(f"{folder}: no h5feed-monitor*.jsonl with records here or in its sub-folders "
                          "(is it the log_dir given to h5feed.monitor?)")
    return sorted(tracks, key=lambda t: (t.name, t.rank))


def summary_lines(tracks: list[Track]) -> list[str]:
    """The run in a few sentences: steps and epochs, the data wait, the slowest rank and worker, the stalls."""
    lines = []
    for t in tracks:
        ends = t.of("end")
        steps = max((r.get("global_step", r.get("step", 0)) for r in t.records if "step" in r), default=0)
        epochs = len(t.of("start"))
        waited, stepped = _wait_and_step_s(t)
        share = f"{100 * waited / stepped:.1f}%" if stepped else "n/a"
        state = "finished" if ends and ends[-1].get("complete", True) else "stopped early or still running"
        lines.append(f"{t.name} rank {t.rank}: {steps} steps over {epochs} epoch(s), {state}; the step waited for "
                     f"data {share} of the time ({waited:.1f} s of {stepped:.1f} s)")
    waits = {t.rank: _wait_share(t) for t in tracks}
    if len(tracks) > 1 and all(w is not None for w in waits.values()):
        slow = max(waits, key=lambda r: waits[r] or 0.0)
        lines.append(f"slowest rank: rank {slow}, {waits[slow]:.1f}% data wait (under DDP it sets every rank's pace)")
    worker = _slowest_worker(tracks)
    if worker is not None:
        lines.append(worker)
    stalls = [(t, r) for t in tracks for r in t.of("stall")]
    lines.append(f"{len(stalls)} stall report(s)" + (": " + "; ".join(
        f"rank {t.rank} at step {r.get('global_step', r.get('step'))}: {r.get('verdict')}" for t, r in stalls[:5])
        if stalls else ""))
    return lines


def _wait_and_step_s(t: Track) -> tuple[float, float]:
    """Seconds the trainer waited for data and seconds of steps, over every pass the track ended."""
    ends = t.of("end")
    waited = sum((r.get("data_loading(s)") or 0.0) * (r.get("steps") or 0) for r in ends)
    stepped = sum((r.get("step_time(s)") or 0.0) * (r.get("steps") or 0) for r in ends)
    return waited, stepped


def _wait_share(t: Track) -> float | None:
    waited, stepped = _wait_and_step_s(t)
    return 100 * waited / stepped if stepped else None


@dataclass
class WorkerFigures:
    """One DataLoader worker of one rank over the run: its reports' mean rates and the samples it read."""

    rank: int
    worker: int
    samples_per_s: float
    busy_s_per_sample: float | None  # reading and decoding seconds per sample: the worker's own pace
    read_MBps: float | None
    samples: int


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def worker_figures(tracks: list[Track]) -> list[WorkerFigures]:
    """Each worker's mean rates over the reports that had them, by rank and worker."""
    rows: dict[tuple[int, int], list[Record]] = {}
    for t in tracks:
        for r in t.of("report"):
            for w in r.get("workers") or []:
                if w.get("samples_per_s") is not None:
                    rows.setdefault((t.rank, int(w["worker"])), []).append(w)

    def mean(seen: list[Record], key: str) -> float | None:
        return _mean([float(w[key]) for w in seen if w.get(key) is not None])

    return [WorkerFigures(rank, worker, mean(seen, "samples_per_s") or 0.0, mean(seen, "busy_s_per_sample"),
                          mean(seen, "read_MBps"), max(int(w["samples"]) for w in seen))
            for (rank, worker), seen in sorted(rows.items())]


def _slowest_worker(tracks: list[Track]) -> str | None:
    return slowest_worker({f"rank {f.rank} worker {f.worker}": f.busy_s_per_sample for f in worker_figures(tracks)
                           if f.busy_s_per_sample is not None})


def plot_png(tracks: list[Track]) -> bytes:
    """The run's time series as one PNG: data wait % and samples/s per rank, samples/s per worker; stalls marked."""
    plt = pyplot("h5feed report")
    t0 = min(r["time"] for t in tracks for r in t.records if "time" in r)
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, constrained_layout=True)
    wait_ax, rate_ax, worker_ax = axes
    for t in tracks:
        reports = t.of("report")
        x = [r["time"] - t0 for r in reports]
        label = f"rank {t.rank}" if len(tracks) > 1 else t.name
        wait_ax.plot(x, [r.get("data_loading(%)") for r in reports], marker=".", label=label)
        rate_ax.plot(x, [r.get("throughput(samples/s)") for r in reports], marker=".", label=label)
        workers: dict[int, list[tuple[float, float]]] = {}
        for r in reports:
            for w in r.get("workers") or []:
                if w.get("samples_per_s") is not None:
                    workers.setdefault(int(w["worker"]), []).append((r["time"] - t0, w["samples_per_s"]))
        for worker, points in sorted(workers.items()):
            worker_ax.plot(*zip(*points), marker=".", label=f"{label} worker {worker}")
        for stall in t.of("stall"):
            for ax in axes:
                ax.axvline(stall["time"] - t0, color="red", alpha=0.5, linestyle="--")
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


def report_html(tracks: list[Track], png: bytes) -> str:
    """The page: the summary, the plots (embedded), and a table of every pass's end figures."""
    rows = [["rank", "epoch", "steps", "step", "data wait", "GPU idle", "samples/s"]]
    for t in tracks:
        for r in t.of("end"):
            rows.append([str(t.rank), str(r.get("epoch", "")), str(r.get("step", "")),
                         num(r.get("step_time(s)"), ".3f", " s"), num(r.get("data_loading(%)"), ".1f", "%"),
                         num(r.get("gpu_idle(%)"), ".1f", "%"), num(r.get("throughput(samples/s)"), ".2f")])
    workers = [["rank", "worker", "samples", "samples/s", "s reading per sample", "read MB/s"]]
    workers += [[str(f.rank), str(f.worker), str(f.samples), f"{f.samples_per_s:.2f}", num(f.busy_s_per_sample, ".3f"),
                 num(f.read_MBps, ".1f")] for f in worker_figures(tracks)]
    sections = [
        Section(None, bullets(summary_lines(tracks), "summary")),
        Section(None, image(png, "plots", "data wait, samples/s per rank and per worker over time")),
        Section("Each pass", table(rows, "passes")),
    ]
    if len(workers) > 1:  # h5feed's loaders count what each worker does
        sections.append(Section("Each worker (mean over the reports)", table(workers, "workers")))
    return page_html(f"h5feed run {tracks[0].name}: {tracks[0].path.parent}", sections)


def write_report(folder: str | Path, out: str | Path | None = None, png: str | Path | None = None) -> Path:
    """Write the run's page (default: `report.html` in `folder`), and its plots as a PNG if asked; returns the page."""
    tracks = load_tracks(folder)
    image = plot_png(tracks)
    page = Path(out) if out is not None else Path(folder) / "report.html"
    page.write_text(report_html(tracks, image))
    if png is not None:
        Path(png).write_bytes(image)
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
