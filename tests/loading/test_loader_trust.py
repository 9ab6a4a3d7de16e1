"""The loaders under damage, drops and kills: BatchLoader's ring goes back with the loader, on_corrupt="skip"
keeps every loader's batches to the schedule (order and resume exact), and a dead worker names itself."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    DAMAGE_FLAVOR,
    DAMAGE_LENGTHS,
    DAMAGE_MAX_LEN,
    DAMAGED,
    assert_a_killed_worker_is_named,
    make_batch_loader,
)

import h5feed
from h5feed import (
    BatchLoader,
    HiddenStatesDataset,
    HiddenStatesStream,
    StreamLoader,
    trainer_collate,
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

LENGTHS, FLAVOR, MAX_LEN = DAMAGE_LENGTHS, DAMAGE_FLAVOR, DAMAGE_MAX_LEN
N = len(LENGTHS)
RING = "/memfd:h5feed-batch-slots"  # how /proc names the file


# --------------------------------------------------------------------------- the ring goes with the loader


def ring_memory() -> tuple[int, int, int]:
    """(file descriptors, maps, resident kB) of this process's BatchLoader rings."""
    fds = sum(target.startswith(RING) for target in fd_targets())
    maps = rss = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's first line
            inside = line.endswith(RING + " (deleted)")
            maps += inside
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return fds, maps, rss


def fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile, by a reader thread that is ending
            pass
    return targets


def open_fds() -> int:
    return len(fd_targets())


def settle() -> None:
    gc.collect()
    time.sleep(0.05)  # a DataLoader's pipes close as its workers are joined
    gc.collect()


def within(seconds: float, condition: Callable[[], bool]) -> bool:
    """Whether `condition()` holds within `seconds`: with CUDA, a slot goes back (and the last one takes the
    ring's memory with it) on the thread that waits for its copy's event, not on the caller's."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fifty_loaders_made_and_dropped_leave_no_memory_behind(damaged_and_sound, num_workers):
    _damaged, sound = damaged_and_sound

    def use_one() -> None:
        loader = make_batch_loader(sound, flavor=FLAVOR, max_len=MAX_LEN, batch_size=2, num_workers=num_workers,
                                   threads=2)
        batches = iter(loader)
        batch = next(batches)  # a pass left midway, its batch held, then everything dropped
        assert batch["input_ids"].shape[0] == 1
        assert ring_memory()[1] > 0

    use_one()  # torch opens what it keeps for later on first use (the workers' queues' machinery)
    settle()
    fds = open_fds()
    assert ring_memory() == (0, 0, 0)
    for _ in range(50):
        use_one()
    settle()
    assert ring_memory() == (0, 0, 0)
    # A leak grows it for good; a reader thread still ending may hold its file a moment longer, and what
    # earlier tests left open may be collected meanwhile.
    assert within(5, lambda: open_fds() <= fds), (open_fds(), fds)


def test_close_and_with_give_the_ring_back_once_the_trainer_drops_its_batches(damaged_and_sound):
    _, sound = damaged_and_sound
    loader = BatchLoader(sound, flavor=FLAVOR, max_len=MAX_LEN, batch_size=2,
                         decode=h5feed.WorkersOptions(num_workers=1, multiprocessing_context="spawn"))
    batches = iter(loader)
    held = next(batches)
    want = copied(held)
    loader.close()
    assert ring_memory()[1] > 0  # the trainer still holds a batch in it
    assert all(torch.equal(held[key], want[key]) for key in want if isinstance(want[key], torch.Tensor))  # intact
    del held
    gc.collect()
    assert within(10, lambda: ring_memory() == (0, 0, 0))
    with pytest.raises(ValueError, match="this BatchLoader is closed \\(its batch memory was given back\\): make a "
                                         "new one"):
        iter(loader)

    with BatchLoader(sound, flavor=FLAVOR, max_len=MAX_LEN, batch_size=2,
                     decode=h5feed.ThreadsOptions(threads=2)) as loader:
        assert sum(1 for _ in loader) == N // 2
        assert ring_memory()[1] > 0
    assert within(10, lambda: ring_memory() == (0, 0, 0))


# --------------------------------------------------------------------------- skip: the schedule less the damage


def expected(sound: Path, sequence: list[int], batch_size: int) -> list[dict]:
    """The schedule's batches, each collated from its sound samples (read from the sound copy); none for a batch
    of damaged samples only."""
    items = HiddenStatesDataset(sound, FLAVOR, MAX_LEN)
    collate = trainer_collate(FLAVOR, MAX_LEN, hidden_states_dtype=items.hidden_states_dtype)
    batches = [sequence[j : j + batch_size] for j in range(0, len(sequence), batch_size)]
    return [collate([items[i] for i in b if i not in DAMAGED]) for b in batches if set(b) - set(DAMAGED)]


def skipping_loader(kind: str, path: Path, seed: int, batch_size: int, workers: int):
    stream = HiddenStatesStream(path, FLAVOR, MAX_LEN, on_corrupt="skip", schedule=h5feed.ScheduleOptions(seed=seed),
                                reading=h5feed.ReadOptions(threads=2))
    if kind == "batch":
        return make_batch_loader(stream, batch_size=batch_size, num_workers=workers, threads=2)
    if kind == "cuda":
        from h5feed import CudaBatchLoader

        return CudaBatchLoader(stream, h5feed.CudaOptions(threads=2, prefetch=3, decode_group=2), batch_size=batch_size)
    collate = trainer_collate(FLAVOR, MAX_LEN, hidden_states_dtype=stream.hidden_states_dtype)
    return StreamLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=collate)


def copied(batch: dict) -> dict:
    """The batch's tensors copied out of the loader's memory, onto the CPU."""
    return {key: value.clone().cpu() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


@pytest.mark.parametrize("kind, workers", [("batch", 0), ("batch", 2), ("stream", 0), ("stream", 2), ("stream", 3),
                                           pytest.param("cuda", 0, marks=pytest.mark.gpu)])
def test_skip_delivers_the_schedule_less_the_damaged_samples_with_exact_resume(damaged_and_sound, assert_same_batch,
                                                                               kind, workers):
    damaged, sound = damaged_and_sound
    for seed, batch_size in ((0, 1), (1, 2), (2, 3), (3, 2)):
        loader = skipping_loader(kind, damaged, seed, batch_size, workers)
        sequence = loader.dataset.rank_sequence()
        want = expected(sound, sequence, batch_size)
        got, states = [], []
        for batch in loader:
            got.append(copied(batch))
            states.append(loader.state_dict())
        assert len(got) == len(want), (seed, batch_size)
        for g, w in zip(got, want):
            assert_same_batch(g, w)
        snapshot = loader.dataset.counters.snapshot()
        assert snapshot.total("corrupt") == len(DAMAGED)
        assert snapshot.total("bytes_delivered") > 0  # the monitor's "decoded" figure, on every backend

        # resume from right after the first batch that came after a skip: exactly the rest
        schedule = [j for j in range(0, len(sequence), batch_size) if set(sequence[j : j + batch_size]) - set(DAMAGED)]
        first_skip = min(sequence.index(i) for i in DAMAGED) // batch_size * batch_size
        m = next(n for n, j in enumerate(schedule) if j > first_skip)
        assert states[m] == {"epoch": 0, "seed": seed, "position": min(schedule[m] + batch_size, N)}
        resumed = skipping_loader(kind, damaged, seed, batch_size, workers)
        resumed.load_state_dict(states[m])
        rest = [copied(b) for b in resumed]
        assert len(rest) == len(want) - m - 1
        for g, w in zip(rest, want[m + 1 :]):
            assert_same_batch(g, w)


def test_skip_is_counted_and_logged_once_per_damaged_sample(damaged_and_sound, caplog):
    damaged, _sound = damaged_and_sound
    caplog.set_level(logging.ERROR, logger="h5feed")
    loader = BatchLoader(HiddenStatesStream(damaged, FLAVOR, MAX_LEN, on_corrupt="skip",
                                            schedule=h5feed.ScheduleOptions(shuffle=False)),
                         decode=h5feed.ThreadsOptions(threads=2))
    assert sum(1 for _ in loader) == N - len(DAMAGED)
    skips = sorted(r.getMessage() for r in caplog.records if "skipping a damaged sample" in r.getMessage())
    assert len(skips) == len(DAMAGED)  # the threads fill batches side by side: in any order
    for sample, message in zip(DAMAGED, skips):
        assert message.startswith("skipping a damaged sample (on_corrupt='skip'): ")
        assert f"sample {sample} (converted from data_{sample}.pt): inner chunk 0 fails its checksum" in message
    snapshot = loader.dataset.counters.snapshot()
    assert (snapshot.total("corrupt"), snapshot.total("samples")) == (len(DAMAGED), N - len(DAMAGED))


def test_a_stream_read_directly_leaves_the_damaged_samples_out(damaged_and_sound):
    damaged, _sound = damaged_and_sound
    stream = HiddenStatesStream(damaged, FLAVOR, MAX_LEN, on_corrupt="skip", schedule=h5feed.ScheduleOptions(seed=4),
                                reading=h5feed.ReadOptions(threads=2))
    order = stream.rank_sequence()
    assert [len(item["input_ids"]) for item in stream] == [min(LENGTHS[i], MAX_LEN) for i in order
                                                           if i not in DAMAGED]


def test_without_skip_the_first_damaged_sample_ends_every_loader(damaged_and_sound):
    damaged, _ = damaged_and_sound
    for workers in (0, 2):
        with pytest.raises(Exception, match="sample 2 \\(converted from data_2.pt\\): inner chunk 0 fails its checksum"):
            list(BatchLoader(damaged, flavor=FLAVOR, max_len=MAX_LEN, num_workers=workers, schedule=h5feed.ScheduleOptions(shuffle=False)))


def test_the_dataset_serves_the_next_sound_sample_in_a_damaged_ones_place(damaged_and_sound, assert_same_batch):
    damaged, sound = damaged_and_sound
    dataset = HiddenStatesDataset(damaged, FLAVOR, MAX_LEN, on_corrupt="skip")
    reference = HiddenStatesDataset(sound, FLAVOR, MAX_LEN)
    got = list(torch.utils.data.DataLoader(dataset, num_workers=2, collate_fn=list))
    stand_in = {0: 0, 1: 1, 2: 3, 3: 3, 7: 9, 8: 9}  # a map-style index must give an item: the next sound one
    for i, (item,) in enumerate(got):
        assert_same_batch(item, reference[stand_in.get(i, i)])
    assert dataset.counters.snapshot().total("corrupt") == 4  # 2, and 7 then 8 for index 7, 8 for index 8


# --------------------------------------------------------------------------- a dead worker names itself


def test_a_killed_worker_is_named_with_its_pid_and_sample(damaged_and_sound, monkeypatch):
    """StreamLoader's workers; BatchLoader's backends with worker processes: test_decode_backends.py."""
    _, sound = damaged_and_sound
    assert_a_killed_worker_is_named(monkeypatch, sound, "read_sample", lambda stream: StreamLoader(
        stream, num_workers=2, collate_fn=list, multiprocessing_context="fork"))
