"""Multi-rank training for real: `torchrun` ranks (gloo, CPU) train a tiny DDP model on HiddenStatesStream.

The file is both the test and the trainer: torchrun runs it as a script (`rank_main`), each rank
writes what it saw (store indices, told apart by their input_ids) to a JSON file, and the tests
check the ranks' files against each other.  A rank short of a step would hang at DDP's gradient
all-reduce, so equal step counts are also checked by the subprocess ending within its timeout.

Three launches: 2 ranks (two shuffled epochs through DataLoader workers, one rank slowed on
purpose and both monitored; a padded epoch; an epoch stopped and its state saved after 3 steps),
3 ranks (resume that state; save another after 2 steps), 2 ranks (resume that one).  Last, a
smoke run of bench/loader/train_multi_gpu.py with 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import LAUNCH_TIMEOUT_S, REPO, make_stream, torchrun
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import h5feed
from h5feed import HiddenStatesStream, StreamLoader

pytestmark = pytest.mark.slow  # the launches' ranks take ~25 s together, the bench's ~20 s
SEED = 7
SAMPLES = 12  # divisible by 2 and 3: every rank of either world size gets the same share
SLOW_RANK, SLOW_S = 1, 0.2  # that rank's loader sleeps this long per sample


# --- the trainer, run by torchrun -----------------------------------------------------------------


class Delay:
    """A transform that makes one rank's input pipeline slow (it runs in that rank's DataLoader workers)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        time.sleep(self.seconds)
        return item


def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--launch", required=True)
    p.add_argument("--resume", type=Path, help="a saved state to continue from (JSON)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--save-epoch", type=int)
    p.add_argument("--save-after", type=int)
    args = p.parse_args(argv)

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = h5feed.Store(args.store)
    index_of = {tuple(store.read_sample(i).input_ids.tolist()): i for i in range(len(store))}
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(store.num_aux_layers * store.hidden_size, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def stream(**kwargs: Any) -> HiddenStatesStream:
        return make_stream(store, seed=SEED, **kwargs)

    def train(loader: StreamLoader, stop_after: int | None = None, log_dir: Path | None = None) -> list[list[int]]:
        """One pass (or `stop_after` steps); the store indices of each step's batch."""
        steps = []
        for batch in h5feed.monitor(loader, every=0.2, log_dir=log_dir) if log_dir else loader:
            steps.append([index_of[tuple(item["input_ids"].tolist())] for item in batch])
            loss = model(torch.cat([item["hidden_states"] for item in batch]).float()).square().mean()
            loss.backward()  # the all-reduce: every rank must take this step
            opt.step()
            opt.zero_grad()
            if len(steps) == stop_after:
                break
        return steps

    out: dict[str, Any] = {"rank": rank, "world_size": world}
    if args.resume is None:
        shuffled = stream(equal_per_rank=False, transform=Delay(SLOW_S) if rank == SLOW_RANK else None)
        loader = StreamLoader(shuffled, batch_size=2, num_workers=2, collate_fn=list)
        out["epochs"] = []
        for epoch in (0, 1):
            shuffled.set_epoch(epoch)
            out["epochs"].append({"order": shuffled.epoch_order(), "steps": train(loader, log_dir=args.out / "monitor")})
        padded = stream(samples=range(SAMPLES - 1))  # equal_per_rank=True: 11 samples, 2 ranks
        out["padded"] = {"order": padded.epoch_order(),
                         "steps": train(StreamLoader(padded, batch_size=1, collate_fn=list))}
    else:
        resumed = stream(equal_per_rank=False)
        loader = StreamLoader(resumed, batch_size=1, num_workers=args.workers, collate_fn=list)
        loader.load_state_dict(json.loads(args.resume.read_text()))
        out["resumed"] = {"order": resumed.epoch_order(), "steps": train(loader)}
    if args.save_epoch is not None:
        saving = stream(equal_per_rank=False)
        saving.set_epoch(args.save_epoch)
        loader = StreamLoader(saving, batch_size=1, num_workers=args.workers, collate_fn=list)
        out["saved"] = {"order": saving.epoch_order(), "steps": train(loader, stop_after=args.save_after),
                        "state": loader.state_dict()}
    dist.barrier()  # every rank got here: nobody hangs at the end of an epoch
    (args.out / f"{args.launch}-rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# --- the tests ------------------------------------------------------------------------------------


def rank_files(out: Path, launch: str, ranks: int) -> list[dict[str, Any]]:
    seen = [json.loads((out / f"{launch}-rank{r}.json").read_text()) for r in range(ranks)]
    assert [(s["rank"], s["world_size"]) for s in seen] == [(r, ranks) for r in range(ranks)]
    return seen


def flat(steps: list[list[int]]) -> list[int]:
    return [i for batch in steps for i in batch]


def same_on_every_rank(seen: list[dict[str, Any]], key: str, field: str) -> Any:
    values = [s[key][field] for s in seen]
    assert all(v == values[0] for v in values), f"{key}.{field} differs between ranks"
    return values[0]


def one_step_count(seen: list[dict[str, Any]], key: str) -> int:
    counts = {len(s[key]["steps"]) for s in seen}
    assert len(counts) == 1, f"ranks took different numbers of steps in {key}: {counts}"
    return counts.pop()


@pytest.fixture(scope="module")
def launches(synthetic_store, tmp_path_factory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """The three launches (2 ranks, 3 ranks resuming, 2 ranks resuming), each rank's record of what it saw."""
    store = synthetic_store("ddp", "speculators-legacy-pt", SAMPLES, 16, (20, 40)).path
    out = tmp_path_factory.mktemp("ddp")
    torchrun(Path(__file__), 2, "--store", store, "--out", out, "--launch", "two", "--save-epoch", 2, "--save-after", 3)
    two = rank_files(out, "two", 2)
    (out / "two.state.json").write_text(json.dumps(two[0]["saved"]["state"]))
    torchrun(Path(__file__), 3, "--store", store, "--out", out, "--launch", "three", "--resume", out / "two.state.json",
             "--workers", 1, "--save-epoch", 3, "--save-after", 2)
    three = rank_files(out, "three", 3)
    (out / "three.state.json").write_text(json.dumps(three[0]["saved"]["state"]))
    torchrun(Path(__file__), 2, "--store", store, "--out", out, "--launch", "back", "--resume", out / "three.state.json",
             "--workers", 2)
    return out, {"two": two, "three": three, "back": rank_files(out, "back", 2)}


def test_each_epoch_is_shared_exactly_and_reshuffled_identically_on_every_rank(launches):
    _, runs = launches
    two = runs["two"]
    orders = []
    for epoch in range(2):
        order = same_on_every_rank([{"e": s["epochs"][epoch]} for s in two], "e", "order")
        assert sorted(order) == list(range(SAMPLES))
        assert {len(s["epochs"][epoch]["steps"]) for s in two} == {3}  # 6 samples a rank, batches of 2
        for rank, seen in enumerate(two):
            assert flat(seen["epochs"][epoch]["steps"]) == order[rank::2]  # rank r takes every 2nd sample
        delivered = Counter(i for s in two for i in flat(s["epochs"][epoch]["steps"]))
        assert delivered == Counter(range(SAMPLES))  # the epoch, each sample once
        orders.append(order)
    assert orders[0] != orders[1]  # set_epoch reshuffled


def test_a_padded_epoch_repeats_the_first_samples_of_the_order(launches):
    _, runs = launches
    two = runs["two"]
    order = same_on_every_rank(two, "padded", "order")
    assert sorted(order) == list(range(SAMPLES - 1))
    assert one_step_count(two, "padded") == 6  # 11 samples padded to 12: equal steps, no hang
    padded = order + order[:1]  # as DistributedSampler pads (README "Sharding and resuming")
    assert [flat(s["padded"]["steps"]) for s in two] == [padded[0::2], padded[1::2]]


def test_a_state_saved_on_2_ranks_resumes_exactly_on_3(launches):
    _, runs = launches
    two, three = runs["two"], runs["three"]
    state = same_on_every_rank(two, "saved", "state")
    assert state == {"epoch": 2, "seed": SEED, "position": 6}  # 3 steps x 2 ranks x batch 1
    order = same_on_every_rank(two, "saved", "order")
    assert same_on_every_rank(three, "resumed", "order") == order
    before = [i for s in two for i in flat(s["saved"]["steps"])]
    assert sorted(before) == sorted(order[:6])
    assert one_step_count(three, "resumed") == 2
    after = [flat(s["resumed"]["steps"]) for s in three]
    assert after == [order[6:][r::3] for r in range(3)]
    assert Counter(before + [i for a in after for i in a]) == Counter(range(SAMPLES))  # the rest, each once


def test_a_state_saved_on_3_ranks_resumes_exactly_on_2(launches):
    _, runs = launches
    three, back = runs["three"], runs["back"]
    state = same_on_every_rank(three, "saved", "state")
    assert state == {"epoch": 3, "seed": SEED, "position": 6}  # 2 steps x 3 ranks
    order = same_on_every_rank(three, "saved", "order")
    assert order != same_on_every_rank(runs["two"], "saved", "order")  # epoch 3, not 2
    assert same_on_every_rank(back, "resumed", "order") == order
    before = [i for s in three for i in flat(s["saved"]["steps"])]
    assert one_step_count(back, "resumed") == 3
    after = [flat(s["resumed"]["steps"]) for s in back]
    assert after == [order[6:][0::2], order[6:][1::2]]  # through 2 workers a rank: still in order
    assert Counter(before + [i for a in after for i in a]) == Counter(range(SAMPLES))


def test_monitor_writes_a_file_per_rank_and_watch_names_the_slow_rank(launches):
    out, _ = launches
    run_dir = out / "monitor"
    assert sorted(p.name for p in run_dir.iterdir()) == ["h5feed-monitor-train-rank0.jsonl",
                                                         "h5feed-monitor-train-rank1.jsonl"]
    ends = []
    for rank in range(2):
        records = [json.loads(line) for line in (run_dir / f"h5feed-monitor-train-rank{rank}.jsonl").open()]
        assert {(r["rank"], r["world_size"]) for r in records} == {(rank, 2)}
        assert [r["kind"] for r in records].count("start") == 2  # one iteration an epoch
        ends.append(records[-1])
    assert [(e["kind"], e["step"]) for e in ends] == [("end", 3), ("end", 3)]

    done = subprocess.run([sys.executable, "-m", "h5feed.cli", "watch", "--once", str(run_dir)], cwd=REPO / "src",
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"== train  {run_dir}  (2 of 2 ranks;")
    rank_rows = [line.split() for line in lines[3:5]]
    assert [(row[0], row[-1]) for row in rank_rows] == [("0", "finished"), ("1", "finished")]
    # under DDP the fast rank waits in the all-reduce, not for data: the slow rank's data wait stands out
    assert f"slowest rank: rank {SLOW_RANK} waits {ends[SLOW_RANK]['data_loading(s)']:.3f} s per step" in done.stdout
    worker_rows = [line.split()[:2] for line in lines if line.split()[:1] in (["0"], ["1"])][2:]
    assert worker_rows == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]  # a row per rank and worker



def test_multi_gpu_bench_smoke(tmp_path):
    """bench/loader/train_multi_gpu.py end to end with 2 gloo ranks at tiny shapes: both loaders, every figure there."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "loader" / "train_multi_gpu.py"), "--gpus", "2", "--make-data", "4",
           "--hidden-size", "16", "--tokens", "20:30", "--max-len", "32", "--workers", "1", "--convert-workers", "0",
           "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "train_multi_gpu.json").read_text())
    assert result["config"]["backend"] == "gloo" and [r["loader"] for r in result["runs"]] == ["h5feed-batch", "baseline"]
    store = h5feed.Store(result["config"]["store"])
    decoded = {}
    for run in result["runs"]:
        assert [(r["rank"], r["world_size"], r["samples"], r["steps"]) for r in run["ranks"]] == [(0, 2, 2, 2),
                                                                                                  (1, 2, 2, 2)]
        for r in run["ranks"]:
            assert r["data_loading_pct"] is not None and r["gpu_idle_pct"] is None and r["loader_cpu_s"] > 0
        decoded[run["loader"]] = [r["decoded_bytes"] for r in run["ranks"]]
        assert run["total"]["samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in run["ranks"]))
        assert [m["filesystem"] for m in run["machines"]] == [result["runs"][0]["machines"][0]["filesystem"]]
        assert sorted(p.name for p in (out / run["loader"]).glob("*.jsonl")) == [
            f"h5feed-monitor-{run['loader']}-w1-rank0.jsonl", f"h5feed-monitor-{run['loader']}-w1-rank1.jsonl"]
    # max_len 32 > 30: the baseline decodes each rank's files in full; BatchLoader decodes only the rows the
    # trainer's batch holds: the shift leaves one token of each array out of every sample
    assert sum(decoded["baseline"]) == int(store.sample_lengths.sum()) * store.token_nbytes
    assert [b - h for b, h in zip(decoded["baseline"], decoded["h5feed-batch"])] == [2 * store.token_nbytes] * 2
    assert [line.split()[:2] for line in done.stdout.splitlines()[2:8]] == [
        [loader, rank] for loader in ("h5feed-batch", "baseline") for rank in ("0", "1", "all")]


if __name__ == "__main__":  # a rank under torchrun
    rank_main(sys.argv[1:])
