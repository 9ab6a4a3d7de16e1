"""The run's timeline: `monitor(trace=True)` has the trainer and every DataLoader worker write their spans, and
`h5feed trace` merges them into one Chrome/Perfetto trace; NVTX ranges where asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_a_traced_run_is_one_trace_of_the_trainer_and_its_workers(store, tmp_path, traced, capsys) -> None:
    loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48, num_workers=2, shuffle=False)
    with loader:
        batches = sum(1 for _ in h5feed.monitor(loader, log_dir=tmp_path, trace=True))
    assert batches == SAMPLES
    assert not tracing.tracing()  # on for the traced pass only
    after = tmp_path / "after"
    with h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48, threads=1, shuffle=False) as later:
        assert sum(1 for _ in h5feed.monitor(later, log_dir=after)) == SAMPLES
    assert not list(after.glob(f"{tracing.TRACE_PREFIX}*"))
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path / 'h5feed-trace.json'}: ") and "open it in https://ui.perfetto.dev" in out
    events = _events(tmp_path / "h5feed-trace.json")
    for event in events:  # the Trace Event Format's fields, as Perfetto reads them
        assert event["ph"] in ("X", "M", "i") and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] > 0 and isinstance(event["tid"], int)
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
    loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48, threads=2, shuffle=False)
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
    loader = h5feed.BatchLoader(store.path, flavor="speculators-legacy", max_len=48, threads=1, shuffle=False)
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
