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
its own, for its steps and epochs count from 0 again.  The records are folded into those runs, attempts
and tracks by `tracks`; this module draws them.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h5feed.io.local import write_atomically
from h5feed.observe.page import Section, bullets, figure_png, image, links, page_html, pyplot, table
from h5feed.observe.renderer import num, slowest_worker
from h5feed.observe.tracks import NAMED_STALLS, Attempt, Run, Series, Spans, Track, load_runs
from h5feed.observe.watchdog import BOTTLENECK_PCT

if TYPE_CHECKING:  # matplotlib is optional (h5feed[report])
    from matplotlib.figure import Figure


MAX_MARKS = 200  # passes marked on the time axis: a run of more has every k-th marked
MAX_LABELS = 20  # of those, the ones whose epoch is written above the plots


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
