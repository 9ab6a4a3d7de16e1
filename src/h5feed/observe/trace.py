"""`h5feed trace LOG_DIR`: the spans every process wrote (`h5feed.tracing`) as one Chrome/Perfetto trace file.

Each process of a traced run (the trainer and each DataLoader worker, on every rank that
shares LOG_DIR) appended its spans to a file of its own; this reads them all and writes one
JSON object in the Trace Event Format, which https://ui.perfetto.dev and chrome://tracing
open: one row a process and thread, the trainer's waits and steps, each worker's samples,
reads and decodes, the copies and decodes on the GPU, stalls as marks.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h5feed.errors import H5feedError
from h5feed.tracing import TRACE_PREFIX

REQUIRED = {"X": ("name", "ts", "dur", "pid", "tid"), "i": ("name", "ts", "pid", "tid"), "M": ("name", "pid", "args")}


@dataclass
class MergedTrace:
    """What `merge_traces` wrote: the file, its events by name, the processes, the lines it could not use."""

    path: Path
    events: Counter[str] = field(default_factory=Counter)
    processes: dict[int, str] = field(default_factory=dict)
    unreadable_lines: int = 0


def merge_traces(folder: str | Path, out: str | Path | None = None) -> MergedTrace:
    """Every `h5feed-trace-*.jsonl` under `folder` as one trace file (default: `folder/h5feed-trace.json`).  A line
    that is not a complete event (a process killed while writing it, a foreign file) is counted and left out."""
    root = Path(folder)
    files = sorted(root.rglob(f"{TRACE_PREFIX}*.jsonl")) if root.is_dir() else []
    if not files:
        raise H5feedError(f"{root}: no trace files ({TRACE_PREFIX}*.jsonl) here; run the training with "
                          "h5feed.monitor(loader, log_dir=..., trace=True), or H5FEED_TRACE_DIR set")
    merged = MergedTrace(Path(out) if out is not None else root / "h5feed-trace.json")
    events: list[dict[str, Any]] = []
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                event = _event(line)
                if event is None:
                    merged.unreadable_lines += 1
                    continue
                events.append(event)
                if event["ph"] == "M":
                    merged.processes[event["pid"]] = str(event["args"].get("name", event["pid"]))
                else:
                    merged.events[event["name"]] += 1
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    merged.path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return merged


def _event(line: str) -> dict[str, Any] | None:
    """A line as a trace event, or None when it is not one of the kinds h5feed writes, complete."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("ph") not in REQUIRED:
        return None
    if any(key not in event for key in REQUIRED[event["ph"]]):
        return None
    return event


def _cmd_trace(args: argparse.Namespace) -> int:
    merged = merge_traces(args.log_dir, args.output)
    counts = ", ".join(f"{n} {name}" for name, n in merged.events.most_common())
    print(f"{merged.path}: {sum(merged.events.values())} spans of {len(merged.processes)} processes ({counts}); "
          "open it in https://ui.perfetto.dev")
    if merged.unreadable_lines:
        print(f"({merged.unreadable_lines} incomplete lines left out)", file=sys.stderr)
    return 0


def add_trace_parser(subparsers: Any) -> None:
    """Register `h5feed trace` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "trace", help="a traced run's timeline as one Chrome/Perfetto trace file",
        description=textwrap.fill("Merge the spans every process of a traced run wrote into LOG_DIR "
                                  "(h5feed.monitor(loader, log_dir=LOG_DIR, trace=True)) into one trace file that "
                                  "ui.perfetto.dev and chrome://tracing open.", 100),
        epilog="examples:\n  h5feed trace runs/drafter                 # writes runs/drafter/h5feed-trace.json"
               "\n  h5feed trace runs/drafter -o /tmp/run.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_dir", type=Path, help="the monitor's log_dir (every rank's and worker's files under it)")
    p.add_argument("-o", "--output", type=Path, help="the trace file (default: LOG_DIR/h5feed-trace.json)")
    p.set_defaults(func=_cmd_trace)
