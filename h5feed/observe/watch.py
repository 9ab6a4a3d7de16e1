"""`h5feed watch`: the figures of a monitored run, live, from another shell (read from the monitor's JSON lines)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from h5feed.errors import H5feedError
from h5feed.observe.monitor import JSONL_PREFIX
from h5feed.observe.renderer import Record, format_line, format_workers


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