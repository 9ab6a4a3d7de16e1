"""Trusting `h5feed convert`: its worker processes die with it however it is killed, even while they start, and
leave no semaphore behind; a code-carrying pickle of any protocol is refused as what it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from h5feed.conversion.converter import convert
from h5feed.synthetic import write_synthetic

H = 32
CHUNK = 16


# --------------------------------------------------------------------------- SIGKILL while the workers start


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _marked(marker: str) -> set[int]:
    """The living processes whose environment holds `marker`: the converter's descendants, wherever reparented."""
    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("H5FEED_TEST_RUN") == marker and _alive(proc):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _mapped_shm_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files (named semaphores among them) that a process maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in maps.splitlines() if " /dev/shm/" in line}


def _semaphore_inodes() -> set[int]:
    inodes = set()
    for path in Path("/dev/shm").glob("sem.*"):
        try:
            inodes.add(path.stat().st_ino)
        except FileNotFoundError:
            continue
    return inodes


# after the converter's first child (its resource tracker, then its first worker) appears: workers are starting
KILL_AFTER_S = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.25, 1.5)


def test_a_sigkill_while_workers_start_leaves_no_process_and_no_semaphore(tmp_path: Path, assert_same_tree) -> None:
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, "speculators-legacy-pt", 24, H, lengths=(20, 60), seed=6)
    convert(src, ref, workers=0, chunk_tokens=CHUNK, progress=False)
    args = ["-q", "convert", str(src), str(dst), "--workers", "2", "--chunk-tokens", str(CHUNK)]
    script = Path(sys.executable).with_name("h5feed")  # the `h5feed` command: its workers re-run it before h5feed's code
    commands = [[sys.executable, "-m", "h5feed", *args], [sys.executable, str(script), *args]]
    for run, delay in enumerate(KILL_AFTER_S):
        command = commands[run % 2]
        marker = uuid.uuid4().hex
        log = tmp_path / "run.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "H5FEED_TEST_RUN": marker})
        converter = psutil.Process(proc.pid)
        children: set[psutil.Process] = set()
        deadline = time.monotonic() + 120
        while not children:
            assert proc.poll() is None, f"the conversion ended before it started a worker:\n{log.read_text()}"
            assert time.monotonic() < deadline, "timed out waiting for the converter's first worker"
            children.update(converter.children())
            time.sleep(0.002)
        kill_at = time.monotonic() + delay
        while time.monotonic() < kill_at:
            children.update(converter.children())
            time.sleep(0.002)
        semaphores = _mapped_shm_inodes(proc.pid)
        children.update(converter.children())
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        gone_by = time.monotonic() + 1.0
        psutil.wait_procs(children, timeout=1.0)
        time.sleep(max(0.0, gone_by - time.monotonic()))
        survivors = {p.pid for p in children if _alive(p)} | _marked(marker)
        assert survivors == set(), f"{len(survivors)} process(es) of a converter killed {delay} s into start-up"
        assert semaphores & _semaphore_inodes() == set(), delay  # the resource tracker removed them, and ended
    done = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_tree(dst, ref)
