"""The first batch of every pass counts in the data wait: the monitor's records and summary, its TensorBoard
scalars, `h5feed watch` and `h5feed report` all put the wait for it in the numerator and the whole pass in the
denominator, and still give the time to the first batch on its own."""

from __future__ import annotations

import json
import time
from itertools import accumulate
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import h5feed
from h5feed.observe.report import write_report

FIRST_S = 0.5  # the first batch of each pass: a loader's worker start-up
NEXT_S = 0.01  # each later batch
COMPUTE_S = 0.02  # the trainer's step
BATCHES = 10
PASSES = 2


class SlowFirstBatch:
    """A plain iterable of batches (no DataLoader, no GPU): its first batch comes after FIRST_S, the others
    after NEXT_S."""

    def __iter__(self):
        for i in range(BATCHES):
            time.sleep(FIRST_S if i == 0 else NEXT_S)
            yield torch.zeros(4)


@dataclass
class Pass:
    summary: dict
    waited_s: float  # the trainer's own stopwatch: the pass's time less its steps' compute


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[Pass]]:
    folder = tmp_path_factory.mktemp("slow-first")
    passes = []
    for _ in range(PASSES):  # wrapped afresh each epoch, as the README's loop does
        monitored = h5feed.monitor(SlowFirstBatch(), every=0.05, log_dir=folder, name="slow", tensorboard="auto",
                                   wandb=False)
        computed, began = 0.0, time.perf_counter()
        for _ in monitored:
            entered = time.perf_counter()
            time.sleep(COMPUTE_S)
            computed += time.perf_counter() - entered
        passes.append(Pass(monitored.summary(), time.perf_counter() - began - computed))
    return folder, passes


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "h5feed-monitor-slow.jsonl").read_text().splitlines()]


def ends(folder: Path) -> list[dict]:
    return [r for r in records(folder) if r["kind"] == "end"]


def waited(rec: dict) -> float:
    """The seconds of data wait a record's figures stand for."""
    return rec["data_loading(s)"] * rec["steps"]


def test_the_end_record_and_the_summary_count_each_passs_first_batch(run):
    folder, passes = run
    assert len(ends(folder)) == PASSES
    for end, done in zip(ends(folder), passes):
        assert end["step"] == end["steps"] == BATCHES  # the first batch is a step like the others
        assert end["first_batch(s)"] >= FIRST_S
        assert waited(end) >= end["first_batch(s)"] + (BATCHES - 1) * NEXT_S
        assert waited(end) == pytest.approx(done.waited_s, abs=0.05)  # the trainer's stopwatch agrees
        assert end["data_wait(s)"] == pytest.approx(waited(end))
        assert end["data_loading(%)"] == pytest.approx(100 * waited(end) / end["elapsed(s)"], rel=1e-9)
        assert end["step_time(s)"] * end["steps"] == pytest.approx(end["elapsed(s)"], rel=1e-9)
        s = done.summary
        assert s["batches"] == s["steps"] == BATCHES and s["first_batch(s)"] == end["first_batch(s)"]
        assert s["data_loading(s)"] * s["steps"] >= FIRST_S
        assert s["data_loading(%)"] == pytest.approx(end["data_loading(%)"])
        assert s["data_loading(s)"] == pytest.approx(end["data_loading(s)"])


def test_the_periodic_records_count_the_first_batch_and_say_when_it_came(run):
    folder, _ = run
    recs = records(folder)
    for epoch, end in enumerate(ends(folder)):
        reports = [r for r in recs if r["kind"] == "report" and r["epoch"] == epoch]
        before = [r for r in reports if r["step"] == 0]
        assert before, "no report while the first batch was awaited"
        for r in before:  # all of the pass so far was a wait, and no first batch yet
            assert r["first_batch(s)"] is None and r["data_wait(s)"] == pytest.approx(r["elapsed(s)"], rel=1e-9)
        after = [r for r in reports if r["step"] > 0]
        assert all(r["first_batch(s)"] == end["first_batch(s)"] for r in after)
        stepped = [r for r in reports if r["steps"]]
        assert waited(stepped[0]) >= FIRST_S and stepped[0]["data_loading(%)"] > 50  # the window with step 1
        # the windows cover the pass: their waits add up to the pass's, the last window's report included
        assert sum(waited(r) for r in stepped) == pytest.approx(waited(end), abs=1e-3)
        assert sum(r["steps"] for r in stepped) == BATCHES
        waits = [r["data_wait(s)"] for r in reports] + [end["data_wait(s)"]]
        assert waits == sorted(waits)


def test_the_tensorboard_scalars_count_the_first_batch(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = run
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    sent = [(e.step, e.value) for e in accumulator.Scalars("slow/time_metrics/data_loading(%)")]
    stepped = [r for r in records(folder) if r["kind"] == "report" and r["steps"]]
    assert [step for step, _ in sent] == list(accumulate(r["steps"] for r in stepped))  # the steps completed
    assert [value for _, value in sent] == pytest.approx([r["data_loading(%)"] for r in stepped], rel=1e-5)
    firsts = [next(r for r in stepped if r["epoch"] == epoch) for epoch in range(PASSES)]
    assert all(r["data_loading(%)"] > 50 for r in firsts)  # each pass's first window holds its first batch


def test_watch_shows_the_passs_wait_with_its_first_batch(run, cli):
    folder, _ = run
    end = ends(folder)[-1]
    result = cli("watch", folder, "--once")
    assert result.status == 0, result.output
    assert f"first batch after {end['first_batch(s)']:.2f} s" in result.output
    assert (f"data wait in this pass: {end['data_wait(s)']:.2f} s of {end['elapsed(s)']:.2f} s "
            f"({end['data_loading(%)']:.1f}%), the first batch {end['first_batch(s)']:.2f} s of it") in result.output


def test_the_report_counts_every_first_batch_and_shows_each(run, tmp_path):
    folder, _ = run
    passes = ends(folder)
    text = write_report(folder, tmp_path / "page.html").read_text()
    wait, elapsed = sum(waited(e) for e in passes), sum(e["elapsed(s)"] for e in passes)
    first = sum(e["first_batch(s)"] for e in passes)
    assert first >= PASSES * FIRST_S
    assert (f"slow rank 0: {PASSES * BATCHES} steps over {PASSES} epoch(s), finished; the trainer waited for data "
            f"{100 * wait / elapsed:.1f}% of the time ({wait:.1f} s of {elapsed:.1f} s, {first:.1f} s of it for "
            "the first batch of each pass)") in text
    for end in passes:
        assert f"<td>{end['epoch']}</td><td>{end['step']}</td><td>{end['first_batch(s)']:.2f} s</td>" in text
