"""What writes and reads a run's logs is safe and bounded: `report` and the monitor never write through a
planted link, a full disk under `log_dir` never stops training, nothing printed carries terminal control
sequences, and `watch` and `report` refuse FIFOs and devices, stream huge logs and skip mistyped records."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from torch.utils.data import DataLoader, Dataset

import h5feed
from h5feed.cli import main as cli_main
from h5feed.observe.report import write_report

HOSTILE = "evil\x1b]0;owned title\x07\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\x9b31m\x9d8;;x\x9c\x07\x00name"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # every C0 but the newline, DEL and C1


class Counted(Dataset):
    """`n` small tensors, no workers: a trainer's loop in this process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.zeros(8)


def train(log_dir: Path, steps: int = 20, name: str = "train") -> int:
    """A training loop over a monitored loader; returns the steps it completed."""
    done = 0
    for _ in h5feed.monitor(DataLoader(Counted(steps)), every=0.01, log_dir=log_dir, name=name, wandb=False):
        done += 1
    return done


@pytest.fixture(scope="module")
def run_log(tmp_path_factory) -> list[str]:
    """The lines of a real monitored run's log (start, reports, end)."""
    folder = tmp_path_factory.mktemp("run")
    train(folder, steps=30)
    lines = (folder / "h5feed-monitor-train.jsonl").read_text().splitlines()
    assert {json.loads(line)["kind"] for line in lines} >= {"start", "report", "end"}
    return lines


def write_log(folder: Path, lines: list[str], name: str = "train") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"h5feed-monitor-{name}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return path


# --------------------------------------------------------------------------- links planted in a run folder


def test_report_replaces_a_planted_page_link_and_leaves_its_target_alone(tmp_path, run_log, cli):
    folder = tmp_path / "run"
    write_log(folder, run_log)
    victim, png_victim = tmp_path / "victim.txt", tmp_path / "victim.png"
    victim.write_text("precious")
    png_victim.write_text("precious too")
    (folder / "report.html").symlink_to(victim)
    (folder / "plots.png").symlink_to(png_victim)
    result = cli("report", folder, "--png", folder / "plots.png")
    assert result.status == 0, result.output
    assert victim.read_text() == "precious" and png_victim.read_text() == "precious too"
    page = folder / "report.html"
    assert not page.is_symlink() and "<html>" in page.read_text()
    assert not (folder / "plots.png").is_symlink() and (folder / "plots.png").read_bytes()[:4] == b"\x89PNG"


def test_the_monitor_does_not_append_through_a_planted_log_link_and_says_so(tmp_path, caplog):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "h5feed-monitor-train.jsonl").symlink_to(victim)
    caplog.set_level(logging.INFO, logger="h5feed.observe.monitor")
    assert train(tmp_path) == 20  # the loop went on
    assert victim.read_text() == "precious"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(tmp_path / "h5feed-monitor-train.jsonl") in warnings[0] and "link" in warnings[0]


@pytest.fixture
def full_dir(tmp_path, monkeypatch):
    """A folder on a full file system: a 64 kB tmpfs filled up where one can be mounted (root), else a folder
    where every write of a file under it raises ENOSPC."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0
    try:
        if mounted:
            with open(folder / "filler", "wb", buffering=0) as f:
                with pytest.raises(OSError) as raised:
                    while True:
                        f.write(b"\0" * 4096)
                assert raised.value.errno == errno.ENOSPC
        else:
            real_write = os.write

            def full_write(fd: int, data: bytes) -> int:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", full_write)
        yield folder / "logs"
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_under_log_dir_never_stops_training_and_is_reported_once(full_dir, caplog):
    caplog.set_level(logging.INFO, logger="h5feed.observe.monitor")
    assert train(full_dir, steps=40) == 40  # every step ran
    assert train(full_dir, steps=5) == 5  # and the next pass too
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(full_dir / "h5feed-monitor-train.jsonl") in warnings[0], warnings
    assert "No space left on device" in warnings[0] and "training goes on" in warnings[0]


# --------------------------------------------------------------------------- control sequences


def test_watch_and_report_print_no_control_sequences_from_a_log(tmp_path, run_log, capsys):
    train(tmp_path, steps=10, name=HOSTILE.replace("\x00", ""))  # a file's name holds no NUL
    path = next(tmp_path.glob("h5feed-monitor-*.jsonl"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]["host"], records[0]["what"] = HOSTILE, HOSTILE  # as a shared folder's writer could set them
    records.insert(-1, {**records[-1], "kind": "stall", "verdict": HOSTILE, "message": HOSTILE, "advice": HOSTILE})
    for rec in records:
        for row in rec.get("workers") or []:
            row["object"] = HOSTILE
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli_main(["watch", str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert "evil" in out and "name" in out and not CONTROL.search(out), repr(out)
    page = write_report(tmp_path)
    text = page.read_text()
    assert "evil" in text and not CONTROL.search(text)


def test_inspect_prints_no_control_sequences_from_a_lock_holder(tmp_path, cli):
    store = tmp_path / "store"
    store.mkdir()
    lock = store / "h5feed-writer.lock"
    lock.write_text(json.dumps({"by": "`h5feed convert`", "host": HOSTILE, "pid": 1, "started_at": HOSTILE}))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = cli("inspect", store)
    assert result.status == 1 and "is being written now" in result.output
    assert "evil" in result.output and not CONTROL.search(result.output), repr(result.output)


# --------------------------------------------------------------------------- what is not a log file


def h5feed_cli(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "h5feed", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_watch_and_report_refuse_a_log_that_is_not_a_regular_file_promptly(tmp_path, kind):
    bad = tmp_path / "h5feed-monitor-bad.jsonl"
    if kind == "fifo":
        os.mkfifo(bad)
    else:
        bad.symlink_to("/dev/zero")
    for args in (("watch", tmp_path, "--once"), ("watch", bad, "--once"), ("report", tmp_path)):
        started = time.monotonic()
        result = h5feed_cli(*args, timeout=30)  # the old code hung here, or read until memory ran out
        assert time.monotonic() - started < 30
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"{bad}: not a regular file" in result.stdout + result.stderr


# --------------------------------------------------------------------------- a huge log

MEASURE = """
import json, os, resource, sys, time
from h5feed.cli.main import main
from h5feed.observe.page import pyplot
pyplot("the test")  # imported once, before the forks: each command's peak is then its own work's
for args in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        started = time.monotonic()
        status = main(args)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("MEASURED", peak, time.monotonic() - started, status, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def measured(*commands: list[object]) -> list[tuple[float, float]]:
    """(peak RSS in MB, seconds) of each `h5feed` command, each run in a process forked from one that imported
    h5feed (so the figures are of the command's own work, and torch is imported once)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = json.dumps([[str(a) for a in command] for command in commands])
    result = subprocess.run([sys.executable, "-c", MEASURE, argv], capture_output=True, text=True, timeout=120,
                            env=env, check=False)
    found = re.findall(r"MEASURED (\d+) ([\d.]+) (\d+)", result.stdout)
    assert len(found) == len(commands) and all(status == "0" for _, _, status in found), result.stdout + result.stderr
    return [(int(peak) / 1024, float(seconds)) for peak, seconds, _ in found]


def test_watch_and_report_stream_a_huge_log_in_bounded_memory_and_time(tmp_path, run_log, capsys):
    small, huge = tmp_path / "small", tmp_path / "huge"
    write_log(small, run_log)
    start, report = run_log[0], next(line for line in run_log if json.loads(line)["kind"] == "report")
    huge.mkdir()
    size = 24 << 20
    with open(huge / "h5feed-monitor-train.jsonl", "w") as f:
        f.write(start + "\n")
        block = (report + "\n") * 1000
        for _ in range(size // len(block) + 1):
            f.write(block)
        f.write(run_log[-1] + "\n")
    figures = measured(["watch", small, "--once"], ["watch", huge, "--once"], ["report", small], ["report", huge])
    (watch_base, _), (watch_peak, watch_s), (report_base, _), (report_peak, report_s) = figures
    # the old code held the whole file and its records: over 100 MB more than the small log's
    assert watch_peak - watch_base < 48 and report_peak - report_base < 48, figures
    assert watch_s < 10 and report_s < 30, figures
    assert cli_main(["watch", str(huge), "--once"]) == 0
    assert "this pass began before the last 8 MiB" in capsys.readouterr().out


# --------------------------------------------------------------------------- mistyped records

MISTYPED = {
    "a number as a line": "42",
    "a list as a line": "[1, 2, 3]",
    "a string time": '{"kind": "report", "name": "train", "time": "soon"}',
    "huge integers": '{"kind": "end", "name": "train", "time": 1, "step": ' + "9" * 400 + "}",
    "deep nesting": '{"kind": "report", "name": "train", "time": 1, "workers": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "no time": '{"kind": "end", "name": "train"}',
    "a line over the 1 MiB cap": '{"kind": "start", "name": "train", "time": 1, "what": "' + "x" * (2 << 20) + '"}',
    "NaN": None,  # a real report record with data_loading(%) NaN: made from the run's own
    "bad UTF-16": None,  # a real start record with a lone surrogate in its name
}


@pytest.mark.parametrize("kind", list(MISTYPED))
def test_a_mistyped_record_is_skipped_and_counted_never_a_traceback(tmp_path, run_log, kind, capsys):
    bad = MISTYPED[kind]
    if kind == "NaN":
        rec = json.loads(next(line for line in run_log if json.loads(line)["kind"] == "report"))
        bad = json.dumps({**rec, "data_loading(%)": float("nan")})
    elif kind == "bad UTF-16":
        bad = run_log[-1].replace('"name": "train"', '"name": "train\\ud800"')
    lines = [*run_log[:-1], bad, run_log[-1]]
    folder = tmp_path / "run"
    write_log(folder, lines)
    assert cli_main(["watch", str(folder), "--once"]) == 0
    out = capsys.readouterr().out
    assert "1 line skipped" in out, out
    page = write_report(folder)
    assert "1 line skipped" in page.read_text()
