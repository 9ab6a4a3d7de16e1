"""What limits loading, said in each verdict (the storage, the CPU, too few or too many workers, the hand-over),
the samples ready ahead of the trainer, and the headspace: how much faster the step would be if data cost nothing."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import SlowDataset

import h5feed
from h5feed.observe.renderer import format_line
from h5feed.observe.watchdog import Diagnosis, LoaderSetup, LoaderWork, advice, diagnose


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the diagnosis, on counters typed in -------------------------------------------------------------------


def test_a_disk_bound_loader_is_told_the_storage_is_the_limit_and_what_fewer_bytes_would_give():
    setup = LoaderSetup(workers=4, cores=16, fp8=False)
    work = LoaderWork(seconds=10.0, read_s=32.0, decode_s=8.0, bytes_read=11_000_000_000)
    assert diagnose(setup, work) == Diagnosis(
        "storage", "reading takes 80% of 4 workers' time at 1.10 GB/s: the storage is the limit, so more workers "
                   "will not help; an FP8 store (`h5feed convert --precision fp8`, lossy) reads half the bytes: "
                   "about 1.7x the samples per second")
    fp8 = diagnose(LoaderSetup(workers=4, cores=16, fp8=True), work)
    assert fp8 is not None and fp8.text.endswith(
        "the store is FP8 already: a faster disk, or a copy of the store on local NVMe, is what helps")
    remote = diagnose(LoaderSetup(workers=4, cores=16, remote=True, fp8=True), work)
    assert remote is not None and remote.limit == "network" and "the network is the limit" in remote.text
    assert remote.text.endswith("a node cache (cache_dir=) on a local disk reads each object from the network once")


def test_a_decode_bound_loader_with_idle_cores_is_told_how_many_workers_and_what_they_would_give():
    work = LoaderWork(seconds=10.0, read_s=2.0, decode_s=18.0, bytes_read=1_000_000_000)
    assert diagnose(LoaderSetup(workers=2, cores=16), work) == Diagnosis(
        "workers", "decoding takes 90% of 2 workers' time on 16 cores: 4 workers would roughly double the rate")
    assert diagnose(LoaderSetup(workers=2, cores=3), work) == Diagnosis(
        "workers", "decoding takes 90% of 2 workers' time on 3 cores: 3 workers would raise the rate about 1.5x")
    one = LoaderWork(seconds=10.0, read_s=1.0, decode_s=9.0, bytes_read=1_000_000_000)
    assert diagnose(LoaderSetup(workers=1, cores=8), one) == Diagnosis(
        "workers", "decoding takes 90% of 1 worker's time on 8 cores: 2 workers would roughly double the rate")
    assert diagnose(LoaderSetup(workers=0, cores=8), one) == Diagnosis(  # reading in the trainer's process
        "workers", "decoding takes 90% of the reading threads' time on 8 cores: 2 DataLoader worker processes "
                   "(num_workers=2) would roughly double the rate")
    mixed = LoaderWork(seconds=10.0, read_s=9.0, decode_s=11.0, bytes_read=1_000_000_000)
    assert diagnose(LoaderSetup(workers=2, cores=16), mixed) == Diagnosis(
        "workers", "reading takes 45% and decoding 55% of 2 workers' time on 16 cores: 4 workers would roughly "
                   "double the rate")


def test_a_decode_bound_loader_on_busy_cores_is_told_the_cpu_is_the_limit():
    work = LoaderWork(seconds=10.0, read_s=2.0, decode_s=18.0, bytes_read=1_000_000_000)
    assert diagnose(LoaderSetup(workers=2, cores=2), work) == Diagnosis(
        "cpu", "decoding takes 90% of 2 workers' time, keeping 1.8 of 2 cores busy: the CPU is the limit, so more "
               "workers will not help; BatchLoader(decode='cuda') decodes on the GPU instead and leaves the cores to "
               "the trainer")
    mixed = LoaderWork(seconds=10.0, read_s=9.0, decode_s=11.0, bytes_read=1_000_000_000)  # 1.1 cores decoding
    assert diagnose(LoaderSetup(workers=2, cores=2), mixed) == Diagnosis(
        "cpu", "reading takes 45% and decoding 55% of 2 workers' time, with as many workers as cores (2): more would "
               "only take turns on them; BatchLoader(decode='cuda') decodes on the GPU instead and leaves the cores "
               "to the trainer")


def test_an_oversubscribed_loader_is_told_to_use_as_many_workers_as_cores_counters_or_not():
    busy = LoaderWork(seconds=10.0, read_s=2.0, decode_s=18.0, bytes_read=1_000_000_000)
    expected = Diagnosis("oversubscribed", "32 workers on 2 cores: use 2; workers beyond the cores only take turns "
                                           "on them, and each one started delays the first batch")
    assert diagnose(LoaderSetup(workers=32, cores=2), busy) == expected
    assert diagnose(LoaderSetup(workers=32, cores=2), None) == expected
    one = diagnose(LoaderSetup(workers=2, cores=1), None)
    assert one is not None and one.text.startswith("2 workers on 1 core: use 1; ")


def test_idle_workers_point_past_themselves_and_an_idle_window_says_nothing():
    idle = LoaderWork(seconds=10.0, read_s=1.0, decode_s=3.0, bytes_read=1_000_000)  # 4 workers, 10% busy
    found = diagnose(LoaderSetup(workers=4, cores=16), idle)
    assert found is not None and found.limit == "handover"
    assert found.text.startswith("the workers read or decoded only 10% of the time, so they are not what the "
                                 "trainer waits for: handing their batches over is")
    assert diagnose(LoaderSetup(workers=4, cores=16), LoaderWork(10.0, 0.0, 0.0, 0)) is None
    assert diagnose(LoaderSetup(workers=4, cores=16), None) is None


def test_stall_advice_is_grammatical_and_a_bottleneck_gets_the_diagnosis():
    none_started = advice("stuck", [])
    assert none_started == ("no worker has started yet: one may still be starting (spawn imports take seconds), or "
                            "a worker died and its error is in this process's log; DataLoader(timeout=...) turns a "
                            "worker that never answers into an error")
    idle_row = {"sample": None, "pid": 7}
    assert advice("stuck", [idle_row]).startswith(
        "no worker holds a sample, so none is reading: the batch may be held up after the workers, or a worker died "
        "and its error is in this process's log; ")
    storage = Diagnosis("storage", "reading takes 80% of 4 workers' time at 1.10 GB/s: the storage is the limit")
    assert advice("bottleneck", [idle_row], storage) == storage.text
    assert "more DataLoader workers" not in advice("bottleneck", [idle_row])
    many = diagnose(LoaderSetup(workers=32, cores=2), None)
    assert advice("stuck", [], many) == f"{none_started}; {many.text}"
    assert advice("writer", [], many).endswith("nothing is wrong with the loader")


# --- end to end: a monitored loader says what limits it -------------------------------------------------------


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_a_monitored_disk_bound_loader_names_the_storage(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    for _ in h5feed.monitor(DataLoader(SlowDataset(10, 0.03, "read")), every=60.0, log_dir=tmp_path, name="disk"):
        pass
    end = records(tmp_path / "h5feed-monitor-disk.jsonl")[-1]
    assert end["kind"] == "end" and end["limit"] == "storage"
    assert end["diagnosis"].startswith("reading takes 100% of the reading threads' time at ")
    [line] = [m for m in caplog.messages if "batches in" in m]
    assert "loading held training back; reading takes 100% of the reading threads' time" in line
    assert "the storage is the limit, so more workers will not help" in line and "may help" not in line
    shown = h5feed_watch_once(tmp_path)  # what `h5feed watch` shows of it
    assert f"   what limits loading: {end['diagnosis']}" in shown.splitlines()


def h5feed_watch_once(log_dir: Path) -> str:
    """`h5feed watch LOG_DIR --once`, as a user runs it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "h5feed", "watch", str(log_dir), "--once"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_monitored_decode_bound_loader_asks_for_more_workers_in_its_lines_and_its_end(tmp_path, caplog,
                                                                                        monkeypatch):
    _cores(monkeypatch, 16)
    caplog.set_level(logging.INFO, logger="h5feed")
    loader = DataLoader(SlowDataset(40, 0.03, "decode"), num_workers=1)
    for _ in h5feed.monitor(loader, every=0.3, log_dir=tmp_path, name="decode"):
        time.sleep(0.005)
    recs = records(tmp_path / "h5feed-monitor-decode.jsonl")
    end = recs[-1]
    expected = "of 1 worker's time on 16 cores: 2 workers would roughly double the rate"
    assert end["limit"] == "workers" and end["diagnosis"].startswith("decoding takes") and expected in end["diagnosis"]
    hinted = [r for r in recs if r["kind"] == "report" and r.get("limit") == "workers"]
    assert hinted and any(f"of this window: {hinted[0]['diagnosis']}" in m for m in caplog.messages)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # torch says so too
def test_a_monitored_oversubscribed_loader_is_told_to_use_fewer_workers(tmp_path, caplog, monkeypatch):
    _cores(monkeypatch, 1)
    caplog.set_level(logging.INFO, logger="h5feed")
    for _ in h5feed.monitor(DataLoader(SlowDataset(8, 0.02, "decode"), num_workers=2), every=60.0,
                            log_dir=tmp_path, name="many"):
        pass
    end = records(tmp_path / "h5feed-monitor-many.jsonl")[-1]
    assert end["limit"] == "oversubscribed"
    [line] = [m for m in caplog.messages if "batches in" in m]
    assert "2 workers on 1 core: use 1; " in line


# --- the samples ready ahead of the trainer ------------------------------------------------------------------


def test_samples_ready_ahead_move_with_the_loader_and_replace_the_constant_queue(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    fast = DataLoader(SlowDataset(24, 0.0, "decode"), num_workers=2, batch_size=2, prefetch_factor=2)
    for _ in h5feed.monitor(fast, every=0.05, log_dir=tmp_path, name="ahead"):
        time.sleep(0.03)  # a slow trainer: the workers fill their prefetch
    loaders = [r["loader"] for r in records(tmp_path / "h5feed-monitor-ahead.jsonl") if r["kind"] == "report"]
    ahead = [loader["samples_ahead"] for loader in loaders]
    assert max(ahead) >= 4 and all(loader["queue_depth"] == loader["samples_ahead"] for loader in loaders)
    assert all(a <= 24 for a in ahead)
    assert any("samples ready ahead of the trainer" in m for m in caplog.messages)
    assert not any(" queue " in m for m in caplog.messages)

    for _ in h5feed.monitor(DataLoader(SlowDataset(6, 0.02, "read")), every=0.02, log_dir=tmp_path, name="none"):
        pass  # reading in the trainer's process: nothing is read ahead, but the sample being handed over
    recs = [r for r in records(tmp_path / "h5feed-monitor-none.jsonl") if r["kind"] in ("report", "end")]
    assert recs and all(r["loader"]["samples_ahead"] <= 1 for r in recs)
    assert "0 samples ready ahead of the trainer" in format_line(recs[-1])


def test_samples_ahead_are_unknown_where_a_batch_sampler_makes_the_batches(tmp_path):
    sampler = torch.utils.data.BatchSampler(range(6), batch_size=3, drop_last=False)
    for _ in h5feed.monitor(DataLoader(SlowDataset(6, 0.0, "read"), batch_sampler=sampler), log_dir=tmp_path,
                            name="sampled"):
        pass
    end = records(tmp_path / "h5feed-monitor-sampled.jsonl")[-1]
    assert end["loader"]["samples_ahead"] is None and "ready ahead" not in format_line(end)


# --- headspace: the step without the loader -------------------------------------------------------------------


class Sleepy:
    """A plain iterable of batches, each made in `delay` seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.delay)
            yield torch.zeros(4)


def _train(monitored, step_s: float) -> list[torch.Tensor]:
    seen = []
    for batch in monitored:
        time.sleep(step_s)
        seen.append(batch)
    return seen


def test_headspace_of_a_slow_loader_is_large_and_the_replayed_batch_is_the_last_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    monitored = h5feed.monitor(Sleepy(12, 0.05), every=60.0, log_dir=tmp_path, name="slow", headspace=5)
    seen = _train(monitored, 0.005)
    assert len(seen) == 12 + 5  # the replayed steps come on top of the loader's batches
    assert all(b is seen[5] for b in seen[6:11]) and seen[11] is not seen[5]  # after 1 + 5 loaded: 5 replays
    end = records(tmp_path / "h5feed-monitor-slow.jsonl")[-1]
    assert end["replayed_steps"] == 5 and end["step"] == 17
    # ~55 ms a loaded step against ~5 ms a replayed one: ~1000%; loosely, a loaded machine oversleeps
    assert end["step_loaded(s)"] == pytest.approx(0.055, rel=0.5) and end["step_replayed(s)"] < 0.03
    expected = 100 * (end["step_loaded(s)"] / end["step_replayed(s)"] - 1)
    assert end["headspace(%)"] == pytest.approx(expected) and end["headspace(%)"] > 200
    assert monitored.summary()["headspace(%)"] == pytest.approx(end["headspace(%)"])
    [line] = [m for m in caplog.messages if "batches in" in m]
    assert f"training would run {end['headspace(%)']:.0f}% faster if data cost nothing: a step took " in line
    assert any("headspace: the next 5 steps train on batch 6 again, without the loader" in m for m in caplog.messages)


def test_headspace_of_a_fast_loader_is_about_nothing_and_is_measured_once_a_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    loader = Sleepy(10, 0.0)
    assert len(_train(h5feed.monitor(loader, every=60.0, log_dir=tmp_path, name="fast", headspace=4), 0.02)) == 14
    assert len(_train(h5feed.monitor(loader, every=60.0, log_dir=tmp_path, name="fast", headspace=4), 0.0)) == 10
    first, second = [r for r in records(tmp_path / "h5feed-monitor-fast.jsonl") if r["kind"] == "end"]
    assert first["headspace(%)"] == pytest.approx(0.0, abs=15.0) and first["replayed_steps"] == 4
    assert second["headspace(%)"] is None and second["replayed_steps"] == 0
    assert any("headspace measured in an earlier pass of this run" in m for m in caplog.messages)

    short = h5feed.monitor(Sleepy(3, 0.0), log_dir=tmp_path, name="short", headspace=4)
    assert len(_train(short, 0.0)) == 3
    assert any("headspace not measured: the pass had 3 batches, and the replay begins after 5" in m
               for m in caplog.messages)
