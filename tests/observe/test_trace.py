"""The run's timeline: `monitor(trace=True)` has the trainer and every DataLoader worker write their spans, and
`h5feed trace` merges them into one Chrome/Perfetto trace; NVTX ranges where asked for."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import h5feed
from h5feed import tracing
from h5feed.cli import main
from h5feed.observe.trace import merge_traces

H = 32
LENGTHS = (20, 40)
SAMPLES = 6


@pytest.fixture(scope="module")
def store(synthetic_store):
    return synthetic_store("trace", "speculators-legacy-pt", SAMPLES, H, LENGTHS, chunk_tokens=16)


@pytest.fixture
def traced(monkeypatch):
    """Tracing left as it was found: configure() writes the environment, which this test's processes inherit."""
    for name in (tracing.TRACE_DIR_ENV, tracing.NVTX_ENV):
        monkeypatch.delenv(name, raising=False)
    yield
    for name in (tracing.TRACE_DIR_ENV, tracing.NVTX_ENV):
        os.environ.pop(name, None)
    tracing.configure()


def _events(path: Path) -> list[dict[str, Any]]:
    trace = json.loads(path.read_text())
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    return trace["traceEvents"]


@dataclass(frozen=True)
class TracedRun:
    """A monitored, traced pass of a 2-worker BatchLoader, merged by `h5feed trace`: its folder and what it said."""

    log_dir: Path
    said: str
    later_files: list[Path]  # trace files a later, untraced pass wrote (none)
    tracing_after: bool

    @property
    def trace(self) -> Path:
        return self.log_dir / "h5feed-trace.json"


@pytest.fixture(scope="module")
def traced_run(store, tmp_path_factory) -> TracedRun:
    log_dir = tmp_path_factory.mktemp("traced")
    saved = {name: os.environ.pop(name, None) for name in (tracing.TRACE_DIR_ENV, tracing.NVTX_ENV)}
    tracing.configure()
    try:
        loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48, num_workers=2,
                                    schedule=h5feed.ScheduleOptions(shuffle=False))
        with loader:
            batches = sum(1 for _ in h5feed.monitor(loader, log_dir=log_dir, trace=True))
        assert batches == SAMPLES
        tracing_after = tracing.tracing()  # on for the traced pass only
        after = log_dir.parent / "after"
        with h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48,
                                schedule=h5feed.ScheduleOptions(shuffle=False),
                                decode=h5feed.ThreadsOptions(threads=1)) as later:
            assert sum(1 for _ in h5feed.monitor(later, log_dir=after)) == SAMPLES
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["trace", str(log_dir)]) == 0
    finally:
        for name, value in saved.items():
            if value is not None:
                os.environ[name] = value
        tracing.configure()
    return TracedRun(log_dir, out.getvalue(), list(after.glob(f"{tracing.TRACE_PREFIX}*")), tracing_after)


def check_trace_event_format(events: list[dict[str, Any]]) -> None:
    """Each event has exactly the fields the Trace Event Format documents for its phase, of their types: complete
    events (X) name, cat, ts and dur in microseconds, pid, tid, args; instants (i) a scope s; metadata (M) a
    process_name with args.name."""
    fields = {"X": {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"},
              "i": {"name", "cat", "ph", "ts", "s", "pid", "tid", "args"}, "M": {"name", "ph", "pid", "args"}}
    for event in events:
        assert event["ph"] in fields and set(event) == fields[event["ph"]], event
        assert isinstance(event["name"], str) and event["name"] and isinstance(event["pid"], int), event
        assert isinstance(event["args"], dict), event
        if event["ph"] == "M":
            assert event["name"] == "process_name" and isinstance(event["args"]["name"], str), event
            continue
        assert isinstance(event["cat"], str) and isinstance(event["tid"], int), event
        assert isinstance(event["ts"], (int, float)) and event["ts"] > 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        else:
            assert event["s"] in ("g", "p", "t"), event


def test_a_traced_run_is_one_trace_of_the_trainer_and_its_workers(traced_run) -> None:
    assert not traced_run.tracing_after and traced_run.later_files == []  # a later loader is not traced unasked
    out = traced_run.said
    assert out.startswith(f"{traced_run.trace}: ") and "open it in https://ui.perfetto.dev" in out
    events = _events(traced_run.trace)
    check_trace_event_format(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    trainer = [pid for pid, name in names.items() if name == "trainer"]
    workers = sorted(name for name in names.values() if name.startswith("DataLoader worker"))
    assert trainer == [os.getpid()] and workers == ["DataLoader worker 0", "DataLoader worker 1"]
    spans = [e for e in events if e["ph"] == "X"]
    by_name = lambda name: [e for e in spans if e["name"] == name]  # noqa: E731
    waits = by_name("h5feed: wait for a batch")
    assert len(waits) == SAMPLES + 1 and len(by_name("step")) == SAMPLES  # the last wait finds the loader's end
    assert [e["args"]["batch"] for e in waits] == list(range(1, SAMPLES + 2))
    assert [e["args"]["batch"] for e in by_name("step")] == list(range(1, SAMPLES + 1))
    samples = by_name("sample")
    assert sorted(e["args"]["sample"] for e in samples) == list(range(SAMPLES))  # each sample once, in a worker
    assert {e["pid"] for e in samples} == {pid for pid, name in names.items() if name.startswith("DataLoader")}
    assert by_name("read") and by_name("decode") and all(e["args"]["bytes"] > 0 for e in by_name("read"))
    first_wait = waits[0]
    assert any(s["ts"] >= first_wait["ts"] and s["ts"] + s["dur"] <= first_wait["ts"] + first_wait["dur"]
               for s in samples)  # one clock: the first sample was decoded while the trainer waited for it


READER = Path(__file__).parent / "trace_reader"


@pytest.fixture(scope="module")
def devtools_trace_engine() -> Path:
    """Chrome DevTools' trace engine (the reader its Performance panel opens trace files with, published on npm as
    @paulirish/trace_engine), installed at the version tests/observe/trace_reader/package-lock.json pins.  Perfetto's
    trace processor needs a binary that its Python package (`perfetto`) downloads from outside the package
    registries, and Debian's Chromium serves no chrome://tracing viewer: this is the real reader CI can have."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("needs Node.js and npm (apt install nodejs npm; .ci/run installs them)")
    if not (READER / "node_modules" / "@paulirish" / "trace_engine").is_dir():
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=READER, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, f"npm ci in {READER} failed:\n{done.stderr}"
    return READER / "read_trace.mjs"


def test_chrome_devtools_trace_engine_reads_every_span_nested_as_it_ran(traced_run, devtools_trace_engine) -> None:
    """The merged trace as a real reader sees it: its processes by name, every event taken, and each thread's slices
    nested as they ran (each worker's reads and decodes inside the sample they belong to; the trainer's waits and
    steps one after another)."""
    read = subprocess.run(["node", str(devtools_trace_engine), str(traced_run.trace)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert read.returncode == 0, read.stderr
    seen = json.loads(read.stdout)
    assert seen["generic"]  # not a browser's trace: every process is shown
    processes = {int(pid): name for pid, name in seen["processes"].items()}
    assert sorted(processes.values()) == ["DataLoader worker 0", "DataLoader worker 1", "trainer"]
    threads = {(t["pid"], t["tid"]): t["slices"] for t in seen["threads"]}
    assert sum(map(len, threads.values())) + len(processes) == seen["events"]  # nothing left out
    assert all(s["in_tree"] for slices in threads.values() for s in slices)  # no slice overlaps its parent's end
    trainer = next(pid for pid, name in processes.items() if name == "trainer")
    assert [tid for pid, tid in threads if pid == trainer] == [trainer]  # its waits and steps: the main thread
    steps = threads[(trainer, trainer)]
    assert [s["name"] for s in steps] == ["h5feed: wait for a batch", "step"] * SAMPLES + ["h5feed: wait for a batch"]
    assert all(s["depth"] == 0 for s in steps)
    assert [s["args"]["batch"] for s in steps] == [n for batch in range(1, SAMPLES + 1) for n in (batch, batch)] + \
        [SAMPLES + 1]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(steps, steps[1:]))  # one after another, in order
    delivered = []
    for pid in (pid for pid, name in processes.items() if name.startswith("DataLoader worker")):
        [slices] = [slices for (p, _), slices in threads.items() if p == pid]  # one thread a worker
        roots = [s for s in slices if s["depth"] == 0]
        assert roots and all(s["name"] == "sample" and s["parent"] is None for s in roots)
        inner = [s for s in slices if s["depth"] != 0]
        assert {s["name"] for s in inner} == {"read", "decode"}
        assert all(s["depth"] == 1 and slices[s["parent"]]["name"] == "sample" for s in inner)
        for k, root in enumerate(slices):
            if root["depth"] == 0:
                children = [s["name"] for s in inner if s["parent"] == k]
                assert "read" in children and "decode" in children, root
                delivered.append(root["args"]["sample"])
    assert sorted(delivered) == list(range(SAMPLES))  # every sample read and decoded once, in one worker


def test_merge_leaves_out_incomplete_lines_and_says_what_is_missing(tmp_path, caplog) -> None:
    good = {"name": "sample", "cat": "worker", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 7, "tid": 7, "args": {}}
    meta = {"name": "process_name", "ph": "M", "pid": 7, "args": {"name": "DataLoader worker 0"}}
    (tmp_path / f"{tracing.TRACE_PREFIX}host-7.jsonl").write_text(
        json.dumps(meta) + "\n" + json.dumps(good) + "\n" + '{"name": "sample", "ph": "X", "ts": 3' + "\n"
        + json.dumps({"ph": "B", "name": "x"}) + "\n[1, 2]\n")
    merged = merge_traces(tmp_path, tmp_path / "out.json")
    assert merged.unreadable_lines == 3 and merged.events == {"sample": 1} and merged.processes == {7: "DataLoader worker 0"}
    assert _events(tmp_path / "out.json") == [meta, good]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["trace", str(empty)]) == 1
    assert "no trace files (h5feed-trace-*.jsonl) here; run the training with" in caplog.text


def test_trace_needs_a_log_dir() -> None:
    with pytest.raises(ValueError, match="trace=True writes the timeline into log_dir: give one"):
        h5feed.monitor([1, 2], trace=True)


def test_without_tracing_nothing_is_written_and_a_section_is_no_work(store, tmp_path, traced) -> None:
    assert not tracing.tracing() and tracing.section("x", "y") is tracing.section("z", "w")  # one shared no-op
    loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48,
                                schedule=h5feed.ScheduleOptions(shuffle=False), decode=h5feed.ThreadsOptions(threads=2))
    with loader:
        assert sum(1 for _ in h5feed.monitor(loader, log_dir=tmp_path)) == SAMPLES
    assert not list(tmp_path.glob(f"{tracing.TRACE_PREFIX}*"))


def test_nvtx_ranges_wrap_the_waits_and_each_samples_decode(store, monkeypatch, traced) -> None:
    """Where CUDA is (faked here: NVTX itself needs a CUDA build), each wait and each sample's decode is one
    NVTX range, pushed and popped in pairs."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    tracing.configure(nvtx=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the loader itself runs as on this machine
    loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48,
                                schedule=h5feed.ScheduleOptions(shuffle=False), decode=h5feed.ThreadsOptions(threads=1))
    with loader:
        assert sum(1 for _ in h5feed.monitor(loader)) == SAMPLES
    pushes = [c for c in calls if c.startswith("push")]
    assert pushes.count("push h5feed: wait for a batch") == SAMPLES + 1  # the last wait finds the loader's end
    assert pushes.count("push h5feed: decode a sample") == SAMPLES
    assert calls.count("pop") == len(pushes)


def test_spawned_workers_inherit_the_trace(tmp_path, traced) -> None:
    """A process started after `configure` (spawn, as DataLoader's "spawn" context) writes its own file."""
    tracing.configure(trace_dir=tmp_path)
    code = ("import time; from h5feed import tracing; t = time.perf_counter(); "
            "tracing.span('child', 'test', t, t + 0.001)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = list(tmp_path.glob(f"{tracing.TRACE_PREFIX}*.jsonl"))
    assert len(files) == 1 and '"name": "child"' in files[0].read_text()
