"""h5feed.monitor: figures that match a known truth, a stall report that names the stuck worker, `h5feed watch`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, SlowDataset
from torch.utils.data import DataLoader, get_worker_info

import h5feed
from h5feed.cli import main as cli_main
from h5feed.observe.renderer import format_line, format_workers
from h5feed.observe.watchdog import StallEpisode, classify_stall

STALLED_SAMPLE = 3  # with 2 workers and batch_size 1, DataLoader worker 1 reads it
STALL_S = 2.5


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("workers", "load_s", "compute_s"),
    [
        (0, 0.02, 0.04),  # loading in the trainer's process: wait = load, step = load + compute
        (1, 0.06, 0.02),  # a worker loads while the trainer computes: step = load, wait = load - compute
    ],
)
def test_data_wait_and_step_rate_match_the_truth(tmp_path, workers, load_s, compute_s):
    loader = DataLoader(SlowDataset(25, load_s), num_workers=workers)
    monitored = h5feed.monitor(loader, every=0.25, log_dir=tmp_path, name="truth")
    computed = []  # the trainer's own stopwatch: the truth, sleep overshoot included
    began = time.perf_counter()
    for _ in monitored:
        entered = time.perf_counter()
        time.sleep(compute_s)
        computed.append(time.perf_counter() - entered)
    elapsed = time.perf_counter() - began
    s = monitored.summary()
    assert s["batches"] == s["steps"] == 25  # the first batch, worker start-up and all, is a step like the others
    step_s = elapsed / 25
    wait_pct = 100 * (1 - sum(computed) / elapsed)
    assert s["step_time(s)"] == pytest.approx(step_s, rel=0.03)
    assert s["throughput(steps/s)"] == pytest.approx(1 / step_s, rel=0.03)
    assert s["data_loading(%)"] == pytest.approx(wait_pct, abs=2.0)
    # and the scenario is the one intended (loosely: a loaded machine oversleeps)
    expected_step = load_s + compute_s if workers == 0 else max(load_s, compute_s)
    expected_wait = load_s if workers == 0 else load_s - compute_s
    assert s["step_time(s)"] == pytest.approx(expected_step, rel=0.25)
    assert s["data_loading(%)"] == pytest.approx(100 * expected_wait / expected_step, abs=10.0)
    assert s["gpu_idle(%)"] is None  # no CUDA here
    end = records(tmp_path / "h5feed-monitor-truth.jsonl")[-1]
    assert end["kind"] == "end" and end["data_loading(%)"] == pytest.approx(s["data_loading(%)"])
    assert end["loader"]["samples_per_s"] > 0 and [w["samples"] for w in end["workers"]] == [25]
    assert "GPU idle n/a" in format_line(end)


def _stall_one_sample(worker_id: int) -> None:
    """In the worker: once the first chunk of STALLED_SAMPLE's hidden states is read, hang for STALL_S."""
    store = get_worker_info().dataset.store
    frames = store._frames

    def slow(i, name, *args, **kwargs):
        for k, frame in enumerate(frames(i, name, *args, **kwargs)):
            if i == STALLED_SAMPLE and name == "aux_hidden_states" and k == 0:
                time.sleep(STALL_S)
            yield frame

    store._frames = slow


@pytest.fixture
def small_store(synthetic_store):
    return synthetic_store("monitor", "speculators-legacy-pt", 8, 32, (40, 60))


def test_watchdog_names_the_stalled_worker_and_its_sample(tmp_path, caplog, capsys, small_store):
    dataset = h5feed.HiddenStatesDataset(small_store.path, max_len=32)
    loader = DataLoader(dataset, num_workers=2, worker_init_fn=_stall_one_sample)
    caplog.set_level(logging.INFO, logger="h5feed.monitor")
    for _ in h5feed.monitor(loader, every=10.0, stall_after=0.5, log_dir=tmp_path, name="stall"):
        pass
    stalls = [r for r in records(tmp_path / "h5feed-monitor-stall.jsonl") if r["kind"] == "stall"]
    stuck = next(r for r in stalls if r["verdict"] == "stuck")
    assert stuck["step"] == STALLED_SAMPLE and stuck["waiting(s)"] > 0.5
    worker = next(w for w in stuck["workers"] if w["sample"] == STALLED_SAMPLE)
    shard = h5feed.Store(small_store.path).sample_object(STALLED_SAMPLE)  # the store's object, not the .pt
    assert Path(shard).is_file() and Path(shard).is_relative_to(small_store.path)
    assert worker["worker"] == 1 and worker["object"] == shard
    assert worker["sample_MB"] > 0 and worker["since_progress_s"] > 0.5 and worker["state"] != "gone"
    text = next(m for m in caplog.messages if "STUCK" in m)
    assert f"worker 1 (pid {worker['pid']}" in text and f"sample {STALLED_SAMPLE} ({shard})" in text
    assert "no worker has made progress" in text
    assert f"what to do: to see where a worker is blocked: `py-spy dump --pid {worker['pid']}`" in text
    assert stuck["advice"] in text
    [resumed] = [r for r in records(tmp_path / "h5feed-monitor-stall.jsonl") if r["kind"] == "resumed"]
    assert resumed["step"] == STALLED_SAMPLE and resumed["waited(s)"] == pytest.approx(STALL_S, abs=0.5)
    assert f"resumed: the trainer got batch {STALLED_SAMPLE + 1} after " in caplog.text

    assert cli_main(["watch", str(tmp_path), "--once"]) == 0  # the stall is shown as over, and for how long
    frame = capsys.readouterr().out
    assert f"{stuck['message']}; over: the trainer got batch {STALLED_SAMPLE + 1} after {resumed['waited(s)']:.1f} s" in frame


def test_jsonl_log_and_watch_show_the_same_figures(tmp_path, caplog, capsys, small_store):
    stream = h5feed.HiddenStatesStream(small_store.path, max_len=32, schedule=h5feed.ScheduleOptions(shuffle=False))
    loader = h5feed.StreamLoader(stream, num_workers=2)
    caplog.set_level(logging.INFO, logger="h5feed.monitor")
    for _ in h5feed.monitor(loader, every=0.1, log_dir=tmp_path, name="watched"):
        time.sleep(0.1)
    recs = records(tmp_path / "h5feed-monitor-watched.jsonl")
    assert recs[0]["kind"] == "start" and recs[-1]["kind"] == "end"
    assert "first_batch" in {r["kind"] for r in recs}  # "workers_started" too, unless the first batch came first
    assert str(small_store.path) in recs[0]["what"] and "2 DataLoader workers (" in recs[0]["what"]
    reports = [r for r in recs if r["kind"] == "report"]
    # the pass's last window is written just before the end record, whose line says more: it is not logged
    logged = [r for r in recs[:-2] if r["kind"] == "report"]
    assert reports and all(any(m.startswith(format_line(r)) for m in caplog.messages) for r in logged)
    end = recs[-1]
    assert sorted(w["worker"] for w in end["workers"]) == [0, 1] and end["loader"]["samples_per_s"] > 0

    assert cli_main(["watch", str(tmp_path), "--once"]) == 0
    frame = capsys.readouterr().out
    assert "finished" in frame and format_line(end) in frame
    assert all(row in frame for row in format_workers(end["workers"]))


def test_one_file_per_rank_and_watch_names_the_slowest_rank(tmp_path, capsys, monkeypatch):
    """Under torchrun (RANK, WORLD_SIZE set) each rank writes its own file; watch shows every rank and names
    the one that waits longest for data.  (tests/loading/test_distributed.py does the same with real ranks.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, delay in ((0, 0.0), (1, 0.05)):
        monkeypatch.setenv("RANK", str(rank))
        monitored = h5feed.monitor(DataLoader(SlowDataset(6, delay)), every=10.0, log_dir=tmp_path, name="ddp")
        assert monitored.jsonl_path == tmp_path / f"h5feed-monitor-ddp-rank{rank}.jsonl"
        for _ in monitored:
            pass
    ends = {rank: records(tmp_path / f"h5feed-monitor-ddp-rank{rank}.jsonl")[-1] for rank in (0, 1)}
    assert [(e["kind"], e["rank"], e["world_size"], e["steps"]) for e in ends.values()] == [("end", 0, 2, 6),
                                                                                          ("end", 1, 2, 6)]
    assert format_line(ends[1]).startswith("h5feed[ddp rank 1/2] epoch 0 step 6 |")

    assert cli_main(["watch", str(tmp_path), "--once"]) == 0
    frame = capsys.readouterr().out
    assert frame.startswith(f"== ddp  {tmp_path}  (2 of 2 ranks;") and frame.count("== ") == 1
    table = frame.splitlines()[2:5]
    assert table[0].split()[:8] == ["rank", "host", "pid", "step", "epoch", "first", "batch", "s"]
    assert [line.split()[0] for line in table[1:]] == ["0", "1"] and all("finished" in line for line in table[1:])
    assert f"slowest rank: rank 1 waits {ends[1]['data_loading(s)']:.3f} s per step" in frame
    workers = [{"rank": rank, **w} for rank, end in ends.items() for w in end["workers"]]
    assert all(row in frame for row in format_workers(workers)) and len(workers) == 2


def test_stall_verdicts():
    assert classify_stall(None, [0.1, 0.2], stall_after=1.0) is None
    assert classify_stall(5.0, [0.1, 3.0], stall_after=1.0) == "bottleneck"  # trainer waits, a worker progresses
    assert classify_stall(5.0, [2.0, 3.0], stall_after=1.0) == "stuck"  # trainer waits, nobody progresses
    assert classify_stall(5.0, [], stall_after=1.0) == "stuck"  # trainer waits, no worker ever started
    assert classify_stall(None, [2.0, 3.0], stall_after=1.0) == "idle"  # trainer busy elsewhere, queues full
    assert classify_stall(0.5, [2.0, 3.0], stall_after=1.0) is None  # the trainer asks: not idle, and not yet a stall
    assert classify_stall(0.5, [], stall_after=1.0) is None  # workers still starting
    assert classify_stall(5.0, None, stall_after=1.0) == "waiting"  # a loader without counters
    assert classify_stall(5.0, [2.0, 3.0], stall_after=1.0, waiting_for_writer=True) == "writer"  # a following stream
    # not idle: waits for samples
    assert classify_stall(None, [2.0, 3.0], stall_after=1.0, waiting_for_writer=True) is None


class StutteringDataset(SlowDataset):
    """Sample STALLED_SAMPLE is read in `pieces` slow pieces, progress counted after each, as a worker on a
    failing disk reads a chunk now and then."""

    def __init__(self, n: int, pieces: int, piece_s: float) -> None:
        super().__init__(n, 0.0)
        self.pieces, self.piece_s = pieces, piece_s

    def __getitem__(self, i: int) -> torch.Tensor:
        counters = self.counters.worker()
        counters.begin_sample(i)
        for _ in range(self.pieces if i == STALLED_SAMPLE else 0):
            time.sleep(self.piece_s)
            counters.add_read(1_000, self.piece_s)
        counters.end_sample(i, 100)
        return torch.zeros(10)


def test_a_worker_that_moves_now_and_then_is_reported_once_and_never_flips_between_verdicts(tmp_path):
    """Quiet for longer than stall_after, then a chunk, then quiet again: the wait is one episode."""
    loader = DataLoader(StutteringDataset(6, pieces=5, piece_s=0.35), num_workers=1)
    for _ in h5feed.monitor(loader, every=60.0, stall_after=0.25, log_dir=tmp_path, name="stutter"):
        pass
    kinds = [(r["kind"], r.get("verdict")) for r in records(tmp_path / "h5feed-monitor-stutter.jsonl")
             if r["kind"] in ("stall", "resumed")]
    assert kinds == [("stall", "stuck"), ("resumed", None)]


def test_a_stall_episode_reports_each_verdict_once_and_a_stuck_one_is_not_then_called_a_bottleneck():
    episode = StallEpisode(waiting_since=10.0, step=3)
    assert not episode.should_report(None)
    assert episode.should_report("bottleneck") and not episode.should_report("bottleneck")
    assert episode.should_report("stuck")  # the workers stopped too: worse, said
    assert not episode.should_report("bottleneck") and not episode.should_report("stuck")
    assert episode.reported == ["bottleneck", "stuck"] and episode.held_the_trainer
    idle = StallEpisode(waiting_since=None, step=3)
    assert idle.should_report("idle") and not idle.held_the_trainer


def test_scalars_go_to_the_trainers_wandb_run_against_their_own_step_without_moving_the_runs(tmp_path, monkeypatch):
    """A real W&B run, offline: the trainer logs with step= of its own each step; h5feed's scalars join its rows."""
    import wandb

    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    run = wandb.init(project="h5feed-test", dir=tmp_path)
    try:
        loader = DataLoader(SlowDataset(12, 0.03))
        for step, _ in enumerate(h5feed.monitor(loader, every=0.05, log_dir=tmp_path, name="wb")):
            run.log({"loss": 1.0 / (step + 1)}, step=step, commit=True)
        trainers = dict(run.summary)
        run.log({}, commit=True)  # commits the row h5feed's last scalars joined
        summary = dict(run.summary)
    finally:
        run.finish()
    last = [r for r in records(tmp_path / "h5feed-monitor-wb.jsonl") if r["kind"] == "report" and r["steps"]][-1]
    assert trainers["_step"] == 11 and trainers["loss"] == 1 / 12  # no row of the trainer's was dropped
    assert summary["wb/global_step"] == last["global_step"]
    assert summary["wb/time_metrics/data_loading(%)"] == pytest.approx(last["data_loading(%)"])
    assert summary["wb/loader/samples_per_s"] == pytest.approx(last["loader"]["samples_per_s"])
    assert len(list(h5feed.monitor(loader, name="after"))) == 12  # no active run: "auto" logs nowhere
    with pytest.raises(ValueError, match=r"call wandb.init\(\) before it"):
        h5feed.monitor(loader, wandb=True)


def test_without_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    loader = DataLoader(SlowDataset(3, 0.0))
    assert [b.shape for b in h5feed.monitor(loader, tensorboard="auto", log_dir=tmp_path)] == [(1, 1000)] * 3
    with pytest.raises(ImportError, match="pip install tensorboard"):
        h5feed.monitor(loader, tensorboard=True, log_dir=tmp_path)


def test_train_step_bench_smoke(tmp_path):
    """bench/loader/train_step.py end to end on CPU with tiny sizes: every loader, monitored, JSON written; the GPU
    decode path, which needs CUDA, is recorded as failed with the reason, and the other runs go on."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "loader" / "train_step.py"), "--make-data", "3", "--hidden-size", "16",
           "--tokens", "20:30", "--max-len", "32", "--workers", "1", "--convert-workers", "0",
           "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "train_step.json").read_text())
    names = ["baseline", "h5feed-stream", "h5feed-batch", "h5feed-batch-threads", "h5feed-gpu"]
    assert [r["loader"] for r in result["runs"]] == names
    for run in result["runs"][:-1]:
        assert run["batches"] == run["steps"] == 3 and run["data_loading_pct"] is not None
        assert run["gpu_idle_pct"] is None and run["loss_last"] > 0 and run["loading_cpu_s_per_sample"] >= 0
    assert "decode on the GPU is not available" in result["runs"][-1]["error"]
    assert "h5feed[h5feed-batch-w1] first batch after" in done.stderr
    assert {p.name for p in out.glob("h5feed-monitor-*.jsonl")} == {f"h5feed-monitor-{n}-w1.jsonl" for n in names[:-1]}


def test_a_run_re_wrapped_each_epoch_counts_one_global_step_and_one_tensorboard_file(tmp_path):
    """The README's loop wraps the loader afresh each epoch: the run's step goes on, in the JSON lines, the
    report lines and one TensorBoard events file whose steps only increase."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loader = DataLoader(SlowDataset(5, 0.02))
    for _ in range(3):
        monitored = h5feed.monitor(loader, every=0.05, log_dir=tmp_path, tensorboard=True, name="epochs")
        for _ in monitored:
            time.sleep(0.02)
    lines = records(tmp_path / "h5feed-monitor-epochs.jsonl")
    ends = [r for r in lines if r["kind"] == "end"]
    assert [(r["epoch"], r["step"], r["global_step"], r["complete"]) for r in ends] == [
        (0, 5, 5, True), (1, 5, 10, True), (2, 5, 15, True)]
    reports = [r for r in lines if r["kind"] == "report"]
    assert {r["epoch"] for r in reports} == {0, 1, 2}
    assert [r["global_step"] for r in reports] == sorted(r["global_step"] for r in reports)
    assert format_line(ends[2]).startswith("h5feed[epochs] epoch 2 step 15 |")

    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    steps = [e.step for e in accumulator.Scalars("epochs/time_metrics/data_loading(%)")]
    assert steps == sorted(steps) and steps[-1] > 5  # past the first epoch's 5 batches, never back


def test_a_pass_left_early_is_not_called_finished_and_a_slow_loader_is_named_the_bottleneck(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="h5feed")
    monitored = h5feed.monitor(DataLoader(SlowDataset(10, 0.03)), every=60.0, log_dir=tmp_path, name="left")
    for step, _ in enumerate(monitored, 1):
        if step == 4:
            break
    del monitored  # the loop's iterator is closed: the pass ends
    end = records(tmp_path / "h5feed-monitor-left.jsonl")[-1]
    assert (end["kind"], end["step"], end["complete"]) == ("end", 4, False)
    [line] = [r.getMessage() for r in caplog.records if "batches in" in r.getMessage()]
    assert "| stopped before the loader's end (interrupted, or the loop was left): 4 batches in " in line
    assert "finished" not in line
    assert "the step waited for data" in line and "loading held training back" in line


def test_watch_waits_for_a_run_folder_not_made_yet_and_finds_runs_below_a_parent(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli_main(["watch", str(runs / "drafter"), "--once"]) == 1  # before the run starts
    assert "does not exist yet; waiting for the run to create it" in capsys.readouterr().out

    monitored = h5feed.monitor(DataLoader(SlowDataset(12, 0.02)), every=0.05, log_dir=runs / "drafter", name="below")
    for _ in monitored:
        pass
    assert cli_main(["watch", str(runs), "--once"]) == 0  # the parent: the run is found in its sub-folder
    frame = capsys.readouterr().out
    assert frame.startswith(f"== below  {runs / 'drafter' / 'h5feed-monitor-below.jsonl'}  (finished;")
    assert "   epoch 0, " in frame and " min into the pass" in frame
    history = next(line for line in frame.splitlines() if "data wait over the last" in line)
    reports = [r for r in records(runs / "drafter" / "h5feed-monitor-below.jsonl")  # those in which a step finished
               if r["kind"] == "report" and r["data_loading(%)"] is not None]
    assert f"over the last {len(reports)} reports: " in history
    sparks = history.split("reports: ")[1].split(" ")[0]
    assert len(sparks) == len(reports) and set(sparks) <= set("▁▂▃▄▅▆▇█")
