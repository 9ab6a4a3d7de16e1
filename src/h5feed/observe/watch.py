"""`h5feed watch`: the figures of a monitored run, live, from another shell (read from the monitor's JSON lines)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

from h5feed.observe.renderer import Column, Record, format_line, format_record_table, format_workers, num
from h5feed.observe.runlog import JSONL_PREFIX, WATCH_WINDOW_BYTES, RunId, RunLog, RunLogError, monitor_files
from h5feed.text import printable


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float = 100.0) -> str:
    """One character per value, from ▁ (0) to █ (`top` or more)."""
    return "".join(SPARKS[min(len(SPARKS) - 1, int(len(SPARKS) * max(v, 0.0) / top))] for v in values)


def _history(records: list[Record], last: int = 40) -> str | None:
    """The data wait of the pass's last reports, as a sparkline (0 to 100% of the step)."""
    waits = [r["data_loading(%)"] for r in records if r.get("kind") == "report" and r.get("data_loading(%)") is not None]
    if not waits:
        return None
    return (f"data wait over the last {len(waits[-last:])} reports: {sparkline(waits[-last:])} "
            f"(the last {waits[-1]:.1f}%)")


def _state(records: list[Record], now: float) -> str:
    last = records[-1]
    start = records[0] if records[0].get("kind") == "start" else {}
    age = now - last["time"]
    if last["kind"] == "end":
        return "finished"
    if age > 2 * start.get("every(s)", 30.0) + 5:
        return f"no record for {age:.0f} s: is the run still alive (pid {start.get('pid', '?')})?"
    return "running"


def _figures(records: list[Record]) -> Record | None:
    """The newest record with step figures: a report, or the end of the iteration."""
    return next((r for r in reversed(records) if r.get("kind") in ("report", "end")), None)


def _first_batch(records: list[Record]) -> float | None:
    """When the pass's first batch came: said by every record with figures, and by its own record (which a
    window read from the end of a long log may have passed over)."""
    figures = _figures(records)
    if figures is not None and figures.get("first_batch(s)") is not None:
        return figures["first_batch(s)"]
    return next((r["first_batch(s)"] for r in records if r.get("kind") == "first_batch"), None)


def _pass_wait(figures: Record) -> str | None:
    """The pass's data wait so far against its elapsed time, the first batch's share named; None for a record
    of a monitor that did not write it."""
    waited, elapsed = figures.get("data_wait(s)"), figures["elapsed(s)"]
    if waited is None or elapsed <= 0:
        return None
    first = figures.get("first_batch(s)")
    of_it = f"the first batch {first:.2f} s of it" if first is not None else "still waiting for the first batch"
    return f"data wait in this pass: {waited:.2f} s of {elapsed:.2f} s ({100 * waited / elapsed:.1f}%), {of_it}"


def _last_stall(records: list[Record], now: float) -> str | None:
    """The last stall report, and whether it is over (a `resumed` record after it)."""
    at = next((i for i in range(len(records) - 1, -1, -1) if records[i].get("kind") == "stall"), None)
    if at is None:
        return None
    stall = records[at]
    text = f"last stall ({now - stall['time']:.0f} s ago): {stall['message']}"
    resumed = next((r for r in records[at + 1:] if r.get("kind") == "resumed"), None)
    if resumed is not None:
        after = f" after {resumed['waited(s)']:.1f} s" if resumed.get("waited(s)") is not None else ""
        text += f"; over: the trainer got batch {resumed['step'] + 1}{after}"
    return text


def _notes(log: RunLog) -> list[str]:
    """What the reader did not show of a file: a pass begun before its window, lines skipped."""
    notes = []
    if log.began_before:
        notes.append(f"   this pass began before the last {WATCH_WINDOW_BYTES >> 20} MiB of {log.path}, which is all "
                     "watch reads: its start and its earliest records are not shown")
    if (skipped := log.skipped_text()) is not None:
        notes.append(f"   {skipped}")
    return notes


def render(log: RunLog, records: list[Record], now: float) -> str:
    """The frame of one monitor's file: status, the report line, per-worker rows."""
    if not records:
        return "\n".join([f"{log.path}: no records yet", *_notes(log)])
    last = records[-1]
    out = [f"== {last['name']}  {log.path}  ({_state(records, now)}; last record {now - last['time']:.0f} s ago)",
           *_notes(log)]
    if records[0].get("kind") == "start":
        out.append(f"   {records[0]['what']}")
    if (first := _first_batch(records)) is not None:
        out.append(f"   first batch after {first:.2f} s")
    if (stall := _last_stall(records, now)) is not None:
        out.append(f"   {stall}")
    figures = _figures(records)
    if figures is None:
        out.append("   no report yet")
        return "\n".join(out)
    when = f"epoch {figures['epoch']}, " if figures.get("epoch") is not None else ""
    out.append(f"   {when}{figures['elapsed(s)'] / 60:.1f} min into the pass")
    if (wait := _pass_wait(figures)) is not None:
        out.append(f"   {wait}")
    if (history := _history(records)) is not None:
        out.append(f"   {history}")
    if figures.get("diagnosis"):
        out.append(f"   what limits loading: {figures['diagnosis']}")
    out.append(format_line(figures))
    out += format_workers(figures["workers"])
    return "\n".join(out)


_RANK_COLUMNS: list[Column] = [
    ("rank", "rank", "d"), ("host", "host", "s"), ("pid", "pid", "d"), ("step", "step", "d"), ("epoch", "epoch", "d"),
    ("first batch s", "first_batch(s)", ".2f"), ("steps/s", "throughput(steps/s)", ".2f"),
    ("step s", "step_time(s)", ".3f"),
    ("data wait s", "data_loading(s)", ".3f"), ("data wait %", "data_loading(%)", ".1f"),
    ("GPU idle %", "gpu_idle(%)", ".1f"), ("loader samples/s", "samples_per_s", ".1f"),
    ("read GB/s", "read_GBps", ".2f"), ("decoded GB/s", "decoded_GBps", ".2f"), ("ready ahead", "queue_depth", "d"),
]


def _rank_row(records: list[Record], now: float) -> Record:
    start = records[0] if records[0].get("kind") == "start" else {}
    figures = _figures(records) or {}
    loader = figures.get("loader") or {}
    return {
        "rank": records[-1]["rank"], "host": start.get("host"), "pid": start.get("pid"),
        "step": figures.get("global_step", figures.get("step")), "epoch": figures.get("epoch"),
        "first_batch(s)": _first_batch(records),
        **{key: figures.get(key) for key in ("throughput(steps/s)", "step_time(s)", "data_loading(s)",
                                             "data_loading(%)", "gpu_idle(%)")},
        **{key: loader.get(key) for key in ("samples_per_s", "read_GBps", "decoded_GBps", "queue_depth")},
        "state": _state(records, now),
    }


def slowest_rank(rows: list[Record]) -> str | None:
    """The rank that waits longest for its data, which under DDP sets the pace of every rank."""
    timed = [r for r in rows if r["data_loading(s)"] is not None]
    if len(timed) < 2:
        return None
    slow = max(timed, key=lambda r: r["data_loading(s)"])
    others = max(r["data_loading(s)"] for r in timed if r is not slow)
    return (f"slowest rank: rank {slow['rank']} waits {slow['data_loading(s)']:.3f} s per step for data "
            f"({num(slow['data_loading(%)'], '.1f', '%')} of its step), the other ranks {others:.3f} s at most; "
            "under DDP every rank waits for it at each gradient all-reduce, so its input pipeline sets the pace of all")


def render_ranks(run: list[tuple[RunLog, list[Record]]], now: float) -> str:
    """The frame of one run of several ranks: a row per rank, the slowest rank named, a row per rank and worker."""
    run = sorted(run, key=lambda track: track[1][-1]["rank"])
    newest = max(records[-1]["time"] for _, records in run)
    first = run[0][1]
    name, world = first[-1]["name"], first[-1]["world_size"]
    ranks = [records[-1]["rank"] for _, records in run]
    found = f"{len(run)} of {world} ranks" + ("" if len(run) == world else f" (files of ranks {ranks} only)")
    out = [f"== {name}  {run[0][0].path.parent}  ({found}; last record {now - newest:.0f} s ago)"]
    out += [note for log, _ in run for note in _notes(log)]
    if first[0].get("kind") == "start":
        out.append(f"   rank {ranks[0]}: {first[0]['what']}")
    rows = [_rank_row(records, now) for _, records in run]
    out += format_record_table(_RANK_COLUMNS, rows, ("state", "state"))
    if (sentence := slowest_rank(rows)) is not None:
        out.append(sentence)
    for rank, (_, records) in zip(ranks, run):
        if (stall := _last_stall(records, now)) is not None:
            out.append(f"   rank {rank} {stall}")
    workers = [{"rank": rank, **w} for rank, (_, records) in zip(ranks, run)
               for w in (_figures(records) or {}).get("workers", [])]
    out += format_workers(workers)
    return "\n".join(out)


def frame(target: Path, now: float | None = None) -> str | None:
    """What `h5feed watch` shows for a run folder or one file: a block per monitor, one per run of several ranks,
    and a line per file refused; None while there is no file.  Raises RunLogError when every file is refused."""
    now = time.time() if now is None else now
    runs: dict[RunId, list[tuple[RunLog, list[Record]]]] = {}
    refused = []
    for path in monitor_files(target):
        log = RunLog(path)
        try:
            records = log.last_pass()
        except RunLogError as exc:
            refused.append(str(exc))
            continue
        key = RunId.of(path, records[-1]["name"], records[-1]["world_size"]) if records else RunId(path, "", 1)
        runs.setdefault(key, []).append((log, records))
    if not runs:
        if refused:
            raise RunLogError("\n".join(refused))
        return None
    return "\n\n".join([*(render_ranks(run, now) if key.world_size > 1 else render(*run[0], now)
                           for key, run in runs.items()), *refused])


def watch(path: str | os.PathLike[str], *, once: bool = False, interval: float = 1.0, out: TextIO | None = None) -> int:
    """Show the figures of a monitored run from another shell, refreshed every `interval` seconds.  Everything
    shown is made printable: a log's strings carry no terminal control sequence to the screen."""
    out = out or sys.stdout
    target = Path(path)
    while True:
        if once:
            text = frame(target)  # a file refused is the command's error
            out.write(printable(text or _nothing(target), lines=True) + "\n")
            return 0 if text is not None else 1
        try:
            text = frame(target) or _nothing(target)
        except RunLogError as exc:  # one may yet appear that can be read
            text = str(exc)
        if out.isatty():
            out.write("\x1b[H\x1b[2J")
        out.write(printable(text, lines=True) + "\n")
        out.flush()
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def _nothing(target: Path) -> str:
    if not target.exists():
        return f"{target}: does not exist yet; waiting for the run to create it (h5feed.monitor(..., log_dir=...))"
    return f"{target}: no {JSONL_PREFIX}*.jsonl here or in its sub-folders yet (is the monitor given log_dir={target}?)"


def _cmd_watch(args: argparse.Namespace) -> int:
    return watch(args.path, once=args.once, interval=args.interval)


def add_watch_parser(subparsers: Any) -> None:
    """`h5feed watch RUN_DIR_OR_JSONL`."""
    p = subparsers.add_parser("watch", help="live view of a monitored training run: step rate, data wait, GPU idle, "
                                            "per-worker rows (from h5feed.monitor's JSON-lines file)",
                              description=textwrap.fill(
                                  "Show, refreshed every --interval seconds, what h5feed.monitor(loader, log_dir=...) "
                                  "writes while a run trains: step rate, data wait, GPU idle, per-worker rows and "
                                  "stalls, per rank.", 100),
                              epilog="examples:\n  h5feed watch runs/drafter            # in a second terminal\n"
                              "  h5feed watch runs/drafter --once     # one frame, e.g. from a script",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="the monitor's log_dir (its h5feed-monitor*.jsonl files, one per rank in a "
                                "multi-rank run) or one .jsonl file")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default: %(default)s)")
    p.set_defaults(func=_cmd_watch)