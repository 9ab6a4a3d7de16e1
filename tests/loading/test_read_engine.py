"""The read engine (h5feed.loading): one public schedule, one read-ahead loop and one placement behind every loader."""

from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import h5feed
from h5feed import BatchLoader, HiddenStatesStream, StreamLoader, gpu, trainer_collate
from h5feed.loading.delivery import Delivery, Pacing
from h5feed.loading.readahead import ReadAhead
from h5feed.loading.schedule import SampleSchedule

H = 32
LENGTHS = [1, 5, 16, 17, 33, 64, 100, 3, 48, 31, 2, 90, 16, 7]
TORCH_PRIVATE = {"_shutdown_workers"}  # the DataLoader iterator's only way to stop its workers at once


@pytest.fixture(scope="module")
def legacy_store(synthetic_store):
    return synthetic_store("en_legacy", "speculators-legacy-pt", len(LENGTHS), H, LENGTHS, chunk_tokens=16, seed=11)


def test_the_loaders_use_no_private_member_of_another_object():
    package = Path(h5feed.__file__).parent
    files = sorted([*(package / "loading").rglob("*.py"), *(package / "gpu").glob("*.py")])
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("h5feed"):
                found += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in TORCH_PRIVATE):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_schedule_worker_shares_in_turn_are_the_rank_sequence(workers):
    schedule = SampleSchedule(list(range(23)), shuffle=True, seed=3, batch_size=4, rank=1, world_size=2)
    shares = [schedule.worker_batches(False, w, workers) for w in range(workers)]
    in_turn = [b for j in range(max(map(len, shares))) for share in shares if j < len(share) for b in [share[j]]]
    assert [s for batch in in_turn for s in batch] == schedule.rank_sequence()


def test_schedule_counts_skipped_samples_as_passed_and_resumes_there():
    schedule = SampleSchedule(list(range(10)), shuffle=False, batch_size=3, rank=0, world_size=2)
    schedule.note_consumed(3)  # a batch of 3, one of them damaged and skipped: still 3 passed
    assert schedule.state_dict() == {"epoch": 0, "seed": 0, "position": 6}
    resumed = SampleSchedule(list(range(10)), shuffle=False, batch_size=3, rank=0, world_size=2)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.rank_sequence() == [6, 8]
    resumed.set_epoch(1)
    assert resumed.state_dict() == {"epoch": 1, "seed": 0, "position": 0}


def test_stream_and_batch_loader_share_one_position(legacy_store):
    stream = HiddenStatesStream(legacy_store.path, "speculators-legacy", 64, schedule=h5feed.ScheduleOptions(seed=5))
    loader = BatchLoader(stream, batch_size=2, decode=h5feed.ThreadsOptions(threads=2))
    assert loader.dataset.schedule.progress is stream.schedule.progress
    batches = iter(loader)
    next(batches)
    next(batches)
    assert stream.state_dict()["position"] == 4 == loader.state_dict()["position"]
    loader.close()


def test_loaders_leave_the_stream_they_are_given_as_it_was(legacy_store, assert_same_batch):
    """A stream handed to a BatchLoader and a StreamLoader keeps its own batch_size and counting: a plain DataLoader
    over it afterwards yields what it did before.  Each loader deals its own batches, and resumes exactly."""

    def fresh() -> HiddenStatesStream:
        return HiddenStatesStream(legacy_store.path, "speculators-legacy", 64, schedule=h5feed.ScheduleOptions(seed=5))

    def ids(items) -> list[list[int]]:
        return [item["input_ids"].tolist() for item in items]

    stream = fresh()
    items = [{k: v.clone() for k, v in item.items()} for item in DataLoader(stream, batch_size=None)]
    assert len(items) == len(LENGTHS)
    batch_loader = BatchLoader(stream, batch_size=3, decode=h5feed.ThreadsOptions(threads=2))
    stream_loader = StreamLoader(stream, batch_size=2, num_workers=2, collate_fn=list)
    for loader, batch_size in ((batch_loader, 3), (stream_loader, 2)):
        view = loader.dataset
        assert (view.schedule.batch_size, view.schedule.counted_by_loader) == (batch_size, True)
        assert view.store is stream.store and view.counters is stream.counters
    assert (stream.schedule.batch_size, stream.schedule.counted_by_loader, stream.stands_in_for_skips) == (1, False,
                                                                                                          False)

    collate = trainer_collate("speculators-legacy", 64, hidden_states_dtype=stream.hidden_states_dtype)
    want = [collate(items[j : j + 3]) for j in range(0, len(items), 3)]
    got = [{k: v.clone() for k, v in batch.items()} for batch in batch_loader]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert_same_batch(g, w)
    paired = list(stream_loader)  # two workers, each dealing whole batches of 2
    assert [len(batch) for batch in paired] == [2] * 7
    assert ids(item for batch in paired for item in batch) == ids(items)

    again = list(DataLoader(stream, batch_size=None, num_workers=2))  # workers deal the stream's batches of 1
    assert ids(again) == ids(items)
    for g, w in zip(again, items):
        assert_same_batch(g, w)

    it = iter(batch_loader)
    next(it), next(it)
    state = batch_loader.state_dict()
    assert state == stream.state_dict() == {"epoch": 0, "seed": 5, "position": 6}
    resumed = BatchLoader(fresh(), batch_size=3, decode=h5feed.ThreadsOptions(threads=2))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(want) - 2
    for g, w in zip(rest, want[2:]):
        assert_same_batch(g, w)
    batch_loader.close()
    resumed.close()

    it = iter(stream_loader)
    next(it), next(it), next(it)
    state = stream_loader.state_dict()
    del it
    assert state == stream.state_dict() == {"epoch": 0, "seed": 5, "position": 6}
    resumed_items = StreamLoader(fresh(), batch_size=2, num_workers=2, collate_fn=list)
    resumed_items.load_state_dict(state)
    rest = list(resumed_items)
    assert [len(batch) for batch in rest] == [2] * 4
    assert ids(item for batch in rest for item in batch) == ids(items[6:])


def test_read_ahead_hands_back_in_order_and_draws_work_only_depth_ahead():
    drawn = []

    def work():
        for i in range(8):
            drawn.append(i)
            yield i

    def read(i):
        time.sleep(0.02 * (i % 3 == 0))  # every third one finishes last
        return i * 10

    with ReadAhead(work(), read, threads=3, depth=3) as reads:
        assert drawn == [0, 1, 2]
        assert reads.take() == 0
        assert drawn == [0, 1, 2, 3]
        assert list(reads) == [10, 20, 30, 40, 50, 60, 70]


def test_read_ahead_announces_on_a_thread_of_its_own_that_holds_back_no_other_read():
    """Announcing a cold file blocks (the kernel queues its reads): the consumer must not wait for it, nor
    any read but the announced piece's own."""
    announced, release, consumer = [], threading.Event(), threading.current_thread()
    others_read = threading.Barrier(3)

    def announce(i):
        assert threading.current_thread() is not consumer
        announced.append(i)
        if i == 0:
            assert release.wait(10)  # the disk is slow to take this one's reads

    def read(i):
        if i in (1, 2):
            others_read.wait(10)  # both read while the announcement of 0 is stuck
        return i * 10

    with ReadAhead(range(6), read, threads=3, depth=3, announce=announce) as reads:
        others_read.wait(10)
        assert reads.ready() is None  # 0's read waits for its own announcement
        release.set()
        assert [reads.take() for _ in range(6)] == [0, 10, 20, 30, 40, 50]
    assert announced[0] == 0 and 1 not in announced and 2 not in announced  # read before announced: skipped


def test_read_ahead_announces_each_piece_before_its_read_or_not_at_all():
    """A late announcement would ask for a piece already read (a bucket's reader fetches it again)."""
    events, lock = [], threading.Lock()

    def announce(i):
        time.sleep(0.001 * (i % 4))  # the announcer falls behind now and then
        with lock:
            events.append(("announced", i))

    def read(i):
        with lock:
            events.append(("read", i))
        return i

    with ReadAhead(range(200), read, threads=4, depth=4, announce=announce) as reads:
        assert list(reads) == list(range(200))
    for i in range(200):
        assert ("announced", i) not in events or events.index(("announced", i)) < events.index(("read", i))
    assert sum(kind == "announced" for kind, _ in events) > 0


def test_delivery_runs_on_take_on_the_trainers_thread_while_its_thread_waits():
    """What the trainer's thread does as it takes a batch (a CUDA stream's wait, which lets the GIL go) runs
    while the delivery thread is parked, so that the thread cannot take the GIL from the trainer then."""
    produced, seen, trainer = [], [], threading.current_thread()

    def source():
        for i in range(5):
            produced.append(i)
            yield i

    def on_take(i):
        assert threading.current_thread() is trainer
        seen.append((i, list(produced)))

    delivery = Delivery(source, on_take=on_take)
    try:
        assert list(delivery) == [0, 1, 2, 3, 4]
    finally:
        delivery.close()
    assert seen == [(i, list(range(i + 1))) for i in range(5)]  # the next one is made only after on_take


def test_pacing_waits_half_a_step_after_a_take_unless_the_trainer_waited_or_the_work_would_be_late():
    pacing = Pacing()
    assert pacing.pause(0.0) == 0.0  # nothing learnt yet
    for now in (10.0, 10.1, 10.2):
        pacing.took(now, waited=False)  # the trainer takes a ready batch every 100 ms
    assert pacing.pause(10.2) == pytest.approx(0.05)
    assert pacing.pause(10.23) == pytest.approx(0.02)  # what has passed since the take counts
    assert pacing.pause(10.3) == 0.0
    pacing.made(0.04)  # the work takes 40 ms: starting at 20 ms leaves it twice its time
    assert pacing.pause(10.2) == pytest.approx(0.02)
    pacing.made(0.06)
    assert pacing.pause(10.2) == 0.0
    pacing.made(0.0)
    pacing.took(70.2, waited=False)  # a minute's checkpoint between two takes: the step is still 100 ms
    assert pacing.pause(70.2) == pytest.approx(0.05)
    for now in (71.0, 72.0, 73.0):
        pacing.took(now, waited=False)  # a step of a second: the pause stops at MAX_PAUSE
    assert pacing.pause(73.0) == pytest.approx(Pacing.MAX_PAUSE)
    pacing.took(73.1, waited=True)  # the trainer waited for its batch: the loader is behind, no pause
    assert pacing.pause(73.1) == 0.0


def test_delivery_starts_the_next_batch_half_a_step_after_a_take_while_the_trainer_is_ahead():
    """While the trainer finds its batch ready, the delivery thread's work on the next one begins halfway
    into the trainer's step, not as the trainer launches it; a trainer that waited gets the next at once."""
    step = 0.2
    started = []

    def source():
        for i in range(6):
            started.append(time.perf_counter())
            yield i

    delivery = Delivery(source)
    takes = []
    try:
        for i in delivery:
            takes.append(time.perf_counter())
            time.sleep(step)
    finally:
        delivery.close()
    # started[k + 1] follows the take of k; from the third take on the trainer has found its batch ready
    # at the take before and the interval between takes is known
    for k in range(2, 5):
        assert started[k + 1] - takes[k] == pytest.approx(step / 2, abs=0.05)
    assert started[1] - takes[0] < 0.05  # nothing learnt yet: at once


def functions_called_in(call):
    """The names of the Python functions `call()` runs on this thread (other threads are not profiled)."""
    names = set()

    def profile(frame, event, arg):
        if event == "call":
            names.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, names


@pytest.mark.parametrize("kind", ["threads", "workers"])
def test_next_only_hands_over_a_batch_the_delivery_thread_made_ready(legacy_store, assert_same_batch, kind):
    """Taking the filled slot from the workers, wrapping it and the slot ring's bookkeeping all run on the
    delivery thread: the trainer's next() calls none of them."""
    backend = (h5feed.WorkersOptions(num_workers=1, multiprocessing_context="fork") if kind == "workers"
               else h5feed.ThreadsOptions(threads=1))
    with BatchLoader(legacy_store.path, flavor="speculators-legacy", max_len=64, batch_size=1, decode=backend,
                     schedule=h5feed.ScheduleOptions(shuffle=False)) as loader:
        batches = iter(loader)
        next(batches)  # the first batch, dropped at once
        got = []
        for _ in range(3):
            time.sleep(0.3)  # the step: the next batch is made ready meanwhile
            batch, called = functions_called_in(lambda: next(batches))
            got.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            assert not called & {"_next_data", "_get_data", "batch_memory", "views", "write", "take", "_deliver"}
        del batch
    stream = HiddenStatesStream(legacy_store.path, "speculators-legacy", 64,
                                schedule=h5feed.ScheduleOptions(shuffle=False))
    want = list(StreamLoader(stream, batch_size=1, collate_fn=trainer_collate("speculators-legacy", 64)))
    for g, w in zip(got, want[1:4]):
        assert_same_batch(g, w)


def test_decode_auto_without_the_gpu_is_the_cpu_loader_and_its_batches(legacy_store, assert_same_batch, monkeypatch):
    monkeypatch.setattr("h5feed.loading.auto.cores_per_gpu", lambda: None)  # as on a box without a GPU
    with BatchLoader(legacy_store.path, decode="auto", flavor="speculators-legacy", max_len=64,
                     schedule=h5feed.ScheduleOptions(shuffle=False)) as loader:
        assert loader.backend.name == "threads"
        got = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]
    stream = HiddenStatesStream(legacy_store.path, "speculators-legacy", 64,
                                schedule=h5feed.ScheduleOptions(shuffle=False))
    want = list(StreamLoader(stream, batch_size=1, collate_fn=trainer_collate("speculators-legacy", 64)))
    assert len(got) == len(want) == len(LENGTHS)
    for g, w in zip(got, want):
        assert_same_batch(g, w)


def test_decode_cuda_says_what_it_needs(legacy_store):
    with pytest.raises(ValueError, match="decode must be 'cpu', 'cuda', 'auto' or a backend's options, not 'gpu'"):
        BatchLoader(legacy_store.path, decode="gpu", max_len=64)
    with pytest.raises(ValueError, match=r"num_workers belongs to decode='cpu'; decode='cuda' reads with threads"):
        BatchLoader(legacy_store.path, decode="cuda", max_len=64, num_workers=2)
    if gpu.available():
        assert BatchLoader(legacy_store.path, decode="cuda", max_len=64).backend.name == "cuda"
    else:
        with pytest.raises(RuntimeError, match=r"decode on the GPU is not available \(.+\); use h5feed.BatchLoader"):
            BatchLoader(legacy_store.path, decode="cuda", max_len=64)


def test_read_ahead_held_keeps_the_taken_result_in_its_place_until_the_next_take():
    drawn = []

    def work():
        for i in range(4):
            drawn.append(i)
            yield i

    with ReadAhead(work(), lambda i: i, threads=1, depth=2, held=True) as reads:
        assert reads.take() == 0
        assert drawn == [0, 1]  # the slot of 0 is still the consumer's: nothing new started
        assert reads.take() == 1
        assert drawn == [0, 1, 2]
        assert list(reads) == [2, 3]


