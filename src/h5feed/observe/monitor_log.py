"""Where the monitor's words go: its lines to the trainer's log (or to stderr when the trainer set up no logging),
its records to the run's JSON-lines file.

Why apart from the monitor: both must never stop the training they describe.  A line is still seen when the
trainer configured nothing; a record that cannot be written (a full disk, a folder this user cannot write, a
link planted at the file's name) is reported once, in words that name the file and say what to do, and the
file is left alone for the rest of the run while the lines go on.
"""

from __future__ import annotations

import errno
import json
import logging
import sys
import threading
import time
from pathlib import Path

from h5feed.observe.renderer import Record
from h5feed.observe.runlog import RunLogError, append_line

log = logging.getLogger("h5feed.observe.monitor")  # the monitor's own: the logger name its users configure


def say(level: int, line: str) -> None:
    """Log the line; if the trainer configured no logging, still write it to stderr: that is the point of it."""
    if log.hasHandlers():
        if log.level == logging.NOTSET and log.getEffectiveLevel() > level:
            log.setLevel(logging.INFO)  # an unconfigured level (WARNING) would drop the reports
        log.log(level, line)
    else:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


def why_unwritable(exc: OSError | RunLogError, path: Path) -> str:
    """Why the log could not be written, and what to do, in a sentence naming the file."""
    if isinstance(exc, RunLogError):
        return f"{exc}; remove it, or give the monitor another log_dir"
    what = f"{path}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{what}; free space under {path.parent}, or give the monitor a log_dir on another disk"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{what}; give the monitor a log_dir this user can write"
    return f"{what}; check {path.parent}, or give the monitor another log_dir"


class RecordFile:
    """One run's JSON-lines file, shared by the monitors of the run: a record a line, appended whole; after a
    failed write, reported once as `label`'s, nothing more is written to it."""

    def __init__(self, path: Path, label: str) -> None:
        self.path, self.label = path, label
        self.failed = False
        self._lock = threading.Lock()  # the trainer's thread and the reporting thread both write

    def append(self, rec: Record) -> None:
        with self._lock:
            if self.failed:
                return
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                append_line(self.path, json.dumps(rec) + "\n")
            except (OSError, RunLogError) as exc:  # watching a run must never stop it
                self.failed = True
                say(logging.WARNING, f"{self.label} cannot write its log: {why_unwritable(exc, self.path)}; training "
                                     "goes on without that file (these lines still go to the trainer's log)")
