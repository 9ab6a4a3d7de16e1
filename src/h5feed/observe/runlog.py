"""Reading the monitor's JSON-lines files back: the one reader of `h5feed watch` and `h5feed report`.

Why: a run folder is often shared, and logs are copied around as tarballs, so what is read may not be
what the monitor wrote.  The reader holds every file to the same rules:

- only a regular file is read (a FIFO would block forever, a link to /dev/zero never ends);
- lines are streamed, never the whole file, and one longer than `MAX_LINE_BYTES` is passed over
  (a record is a few kB), so memory stays bounded whatever the file's size;
- `h5feed watch` reads a fixed window from the end (`WATCH_WINDOW_BYTES`), and says when the pass it
  shows began before it;
- a line that is not a record of the monitor's shape (not JSON, not an object, a field of the wrong
  type, a number not finite or beyond 2**53, nesting too deep, text that is not UTF-8) is skipped and
  counted, so one bad line costs a count, never the command;
- every string of a record is made printable (`h5feed.text.printable`) as it is read.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from h5feed.errors import H5feedError
from h5feed.observe.renderer import Record
from h5feed.text import printable

JSONL_PREFIX = "h5feed-monitor"  # the monitor's files are h5feed-monitor-{name}[-rank{rank}].jsonl
MAX_LINE_BYTES = 1 << 20
WATCH_WINDOW_BYTES = 8 << 20  # about a day of reports every 30 s
_LIMIT = 2**53  # larger numbers are no figure the monitor writes (and no float holds them exactly)


class RunLogError(H5feedError):
    """A run log that cannot be read (not a regular file, unreadable)."""


@dataclass(frozen=True)
class RunId:
    """Which run a monitor's file is of: the one rule by which `h5feed watch` and `h5feed report` tell runs apart
    in a folder above several.  The monitor writes a run of several ranks as one file per rank
    (`...-{name}-rank{r}.jsonl`) in its log_dir, so those files share a folder, a name and a world size; a run of
    one rank is its file alone (`jsonl=` may name it anything, anywhere)."""

    where: Path  # the log_dir of a run of several ranks, the file of a run of one
    name: str
    world_size: int

    @classmethod
    def of(cls, path: Path, name: str, world_size: int) -> RunId:
        """The run of the file at `path`, whose records say `name` and `world_size`."""
        return cls(path.parent if world_size > 1 else path, name, world_size)


def monitor_files(path: Path) -> list[Path]:
    """The monitors' files: the one given, or those in the folder and its sub-folders (a parent of several runs);
    none while the folder does not exist yet (the run creates it)."""
    if path.is_dir():
        return sorted(path.rglob(f"{JSONL_PREFIX}*.jsonl"), key=lambda p: p.lstat().st_mtime)
    if path.exists() or path.is_symlink():
        return [path]  # reading it says what is wrong with it, if anything
    return []


def open_log(path: Path) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file (checked on the open file, so it cannot
    be swapped in between; opened without blocking, so a FIFO with no writer cannot hang the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RunLogError(f"{path}: cannot be read ({exc.strerror})") from None
    _refuse_unless_regular(fd, path)
    return os.fdopen(fd, "rb")


def append_line(path: Path, line: str) -> None:
    """Append `line` to the log at `path` (created if need be), never through a symbolic link and only to a
    regular file: a link planted in a shared run folder must not make the run grow a file it points at.
    Raises OSError when the write fails (a full disk), RunLogError for a link or a file of another kind."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RunLogError(f"{path}: a symbolic link; the monitor does not write through links (one planted in "
                              "a shared folder could point at any file of yours)") from None
        raise
    try:
        _refuse_unless_regular(fd, path)
        data = memoryview(line.encode("utf-8"))
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def _refuse_unless_regular(fd: int, path: Path) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunLogError(f"{path}: not a regular file (a FIFO, a device or a link to one); h5feed reads and "
                          "writes only plain files as run logs, so it is left alone")


@dataclass
class RunLog:
    """One monitor's file as read: how many of its lines were skipped, and whether a window read from its end
    began after the start of the pass it shows."""

    path: Path
    skipped: int = 0  # lines that are not records of the monitor's shape
    began_before: bool = False  # a window read from the end holds no start record: the pass began before it

    def records(self, window: int | None = None) -> Iterator[Record]:
        """The file's records in order, streamed; with `window`, those of its last `window` bytes."""
        with open_log(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            lines = _lines(f)
            if window is not None and size > window:
                f.seek(size - window)
                next(lines, None)  # the rest of a line cut by the window's start
                self.began_before = True  # until a start record is read
            for line in lines:
                rec = parse_record(line) if line is not None else None
                if rec is None:
                    self.skipped += 1
                else:
                    yield rec

    def last_pass(self, window: int = WATCH_WINDOW_BYTES) -> list[Record]:
        """The records of the file's current pass (since its last "start"), from its last `window` bytes."""
        kept: list[Record] = []
        for rec in self.records(window):
            if rec["kind"] == "start":
                kept, self.began_before = [], False
            kept.append(rec)
        return kept

    def skipped_text(self) -> str | None:
        """What the reader passed over, in words; None when nothing."""
        if not self.skipped:
            return None
        lines = "1 line" if self.skipped == 1 else f"{self.skipped} lines"
        return f"{lines} skipped in {printable(str(self.path))}: not records of h5feed.monitor's shape"


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The file's whole lines, None for one longer than MAX_LINE_BYTES; a last line not ended yet (still
    being written) is not one."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if line.endswith(b"\n"):
            yield line
        elif len(line) <= MAX_LINE_BYTES:
            return
        else:  # too long: pass over the rest of it
            while line and not line.endswith(b"\n"):
                line = f.readline(MAX_LINE_BYTES + 1)
            yield None


def parse_record(line: bytes) -> Record | None:
    """The record of one line, its strings printable; None when the line is not one of the monitor's records."""
    try:
        value = json.loads(line.decode("utf-8"))
        return _record(value)
    except (ValueError, RecursionError, KeyError, TypeError):  # TypeError: a value of the wrong type
        return None


# --- the shape of a record: each check returns the value (strings printable) or raises ---------------------------

Check = Callable[[Any], Any]


def _integer(value: Any) -> int:
    if type(value) is int and -_LIMIT <= value <= _LIMIT:
        return value
    raise TypeError(value)


def _number(value: Any) -> float:
    if type(value) is float and math.isfinite(value) and abs(value) <= _LIMIT:
        return value
    return _integer(value)


def _text(value: Any) -> str:
    if type(value) is str:
        value.encode("utf-8")  # UnicodeEncodeError (a ValueError) for half a UTF-16 pair: bad UTF-16 escapes
        return printable(value)
    raise TypeError(value)


def _flag(value: Any) -> bool:
    if type(value) is bool:
        return value
    raise TypeError(value)


def _ranks(value: Any) -> int:
    if _integer(value) >= 1:
        return value
    raise TypeError(value)


def _or_none(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def _fields(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """An object with every `required` key and any of the `optional` ones, each of its type (other keys
    are left as they are: nothing shows them).  Checked in place: the object is the parser's own."""
    needed, maybe = tuple(required.items()), tuple((optional or {}).items())

    def check(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise TypeError(value)
        for key, of in needed:
            item = value[key]
            if (checked := of(item)) is not item:
                value[key] = checked
        for key, of in maybe:
            if key in value and (checked := of(item := value[key])) is not item:
                value[key] = checked
        return value

    return check


def _list_of(check: Check) -> Check:
    def rows(value: Any) -> list[Any]:
        if type(value) is not list:
            raise TypeError(value)
        for item in value:
            check(item)  # an object: checked in place
        return value

    return rows


_MAYBE = _or_none(_number)

_WORKER = _fields(  # `renderer.worker_rows`; a stall report's rows add state and CPU seconds
    {"worker": _integer, "pid": _integer, "samples": _integer, "queue_depth": _integer, "sample": _or_none(_integer),
     "object": _or_none(_text), **dict.fromkeys(("samples_per_s", "busy_s_per_sample", "read_MBps", "sample_s",
                                                 "sample_MB", "since_progress_s"), _MAYBE)},
    {**dict.fromkeys(("corrupt", "requests", "retries", "cache_hits", "cache_misses"), _integer), "state": _text,
     **dict.fromkeys(("decoded_MBps", "network_MBps", "requests_per_s", "writer_wait_s", "waiting_for_writer_s",
                      "cpu_s"), _MAYBE)})

_LOADER = _fields(  # `renderer.loader_figures`
    {"samples_per_s": _MAYBE, "read_GBps": _MAYBE, "decoded_GBps": _MAYBE, "queue_depth": _integer,
     "workers": _integer, "reading": _integer},
    {**dict.fromkeys(("corrupt", "requests", "retries", "cache_hits", "cache_misses", "waiting_for_writer"), _integer),
     "network_GBps": _MAYBE, "requests_per_s": _MAYBE, "writer_wait_s": _number})

_PLACE = {"epoch": _or_none(_integer), "global_step": _integer}  # where in the run a record is

_FIGURES = _fields(  # a report's and a pass's end: `renderer.step_figures` and the window's
    {"step": _integer, "steps": _integer, "elapsed(s)": _number, "window(s)": _number, "workers": _list_of(_WORKER),
     "loader": _or_none(_LOADER),
     **dict.fromkeys(("throughput(steps/s)", "step_time(s)", "data_loading(s)", "data_loading(%)", "gpu_idle(s)",
                      "gpu_idle(%)", "throughput(samples/s)", "batches(GB/s)"), _MAYBE)},
    {**_PLACE, "waiting(s)": _MAYBE, "data_wait(s)": _number, "cuda": _flag, "first_batch(s)": _MAYBE,
     "complete": _flag})

_KINDS: dict[str, Check] = {
    "start": _fields({"what": _text}, {"every(s)": _number, "stall_after(s)": _number, "pid": _integer,
                                       "host": _text}),
    "first_batch": _fields({"first_batch(s)": _number}, {"batch_bytes": _integer}),
    "workers_started": _fields({}, {"workers": _integer, "after(s)": _number}),
    "report": _FIGURES,
    "end": _FIGURES,
    "stall": _fields({"message": _text, "verdict": _text}, {**_PLACE, "step": _integer, "advice": _or_none(_text),
                                                            "waiting(s)": _MAYBE, "workers": _list_of(_WORKER)}),
    "resumed": _fields({"step": _integer}, {**_PLACE, "waited(s)": _MAYBE}),
}

_COMMON = _fields({"kind": _text, "name": _text, "time": _number, "rank": _integer, "world_size": _ranks})


def _record(value: Any) -> Record:
    rec = _COMMON(value)
    kind = _KINDS.get(rec["kind"])  # a kind of a later monitor: its common fields are all that is shown
    return kind(rec) if kind is not None else rec
