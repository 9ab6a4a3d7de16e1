"""A stream that follows its writer: exact resume, equal ranks at the end, waits for its own samples only, a store
with no sample yet, a bucket refused.

The writer runs in the test's own process (its flock is seen by the follower as another holder's), so what is
published when is decided by the test, not by timing.  Samples are told apart by their input_ids.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    CHECKOUT_ENV,
    CRASHED,
    SAFETY_S,
    kill_9,
    make_stream,
    restarted_once_seen_gone,
    torchrun,
    writer_process,
)

import h5feed
from h5feed import (
    Follow,
    HiddenStatesDataset,
    HiddenStatesStream,
    StoreError,
    StoreSettings,
    StreamLoader,
    WriteOptions,
    open_writer,
)
from h5feed.loading import follow as follow_module
from h5feed.loading.follow import FollowedPositions, FollowedShare
from h5feed.observe.metrics import LoaderCounters
from h5feed.testing.synthetic import write_synthetic

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

H, N, CHUNK, SHARD = 32, 12, 16, 64


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("src")
    files = write_synthetic(root, "speculators-legacy-pt", N, H, lengths=(10, 90), seed=4)
    loaded = [torch.load(f, weights_only=True) for f in files]
    assert len({tuple(s["input_ids"].tolist()) for s in loaded}) == N
    return loaded


def writer_for(dst: Path) -> h5feed.StoreWriter:
    return open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                       writing=WriteOptions(publish_every=N))


def published(writer, samples: list[dict], first: int, last: int) -> None:
    """Append samples [first, last) and publish them."""
    for i in range(first, last):
        writer.append(samples[i], name=f"data_{i}.pt")
    writer.publish()


def written(dst: Path, samples: list[dict], count: int = N) -> Path:
    with writer_for(dst) as writer:
        published(writer, samples, 0, count)
    return dst


def follower(dst: Path, **kw) -> HiddenStatesStream:
    kw.setdefault("follow", Follow(idle_timeout=SAFETY_S, poll_s=0.01))
    return make_stream(dst, shuffle=False, **kw)


def ids_of(items, samples: list[dict]) -> list[int]:
    by_key = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(samples)}
    return [by_key[tuple(item["input_ids"].tolist())] for item in items]


def batches_of(loader, count: int | None = None) -> list[list[dict]]:
    """`count` batches (all when None), each a list of items cloned out of the loader's memory."""
    got = []
    for batch in loader:
        got.append([{k: v.clone() for k, v in item.items()} for item in batch])
        if len(got) == count:
            break
    return got


def flat(batches: list[list[dict]]) -> list[dict]:
    return [item for batch in batches for item in batch]


def assert_items_are_the_stores(items: list[dict], dst: Path, indices: list[int]) -> None:
    want = HiddenStatesDataset(dst, flavor="speculators")
    assert len(items) == len(indices)
    for item, i in zip(items, indices):
        assert list(item) == list(want[i]) and all(torch.equal(item[k], want[i][k]) for k in item)


# =========================================================================== 1. resume mid-follow


@pytest.mark.parametrize("workers", [0, 2])
def test_a_follower_resumed_mid_follow_reads_exactly_the_samples_not_yet_consumed(samples, tmp_path, workers):
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, 8)  # enough ahead that no worker's read-ahead waits for more
        loader = StreamLoader(follower(dst), batch_size=2, num_workers=workers, collate_fn=list)
        taken = batches_of(loader, count=2)
        state = loader.state_dict()
        assert state == {"epoch": 0, "seed": 0, "position": 4}
        published(writer, samples, 8, N)  # the writer goes on after the trainer's restart
    resumed = StreamLoader(follower(dst), batch_size=2, num_workers=workers, collate_fn=list)
    resumed.load_state_dict(state)
    rest = batches_of(resumed)
    assert ids_of(flat(taken), samples) == [0, 1, 2, 3] and ids_of(flat(rest), samples) == list(range(4, N))
    assert_items_are_the_stores(flat(rest), dst, list(range(4, N)))
    assert resumed.state_dict()["position"] == N


def test_two_ranks_resumed_mid_follow_read_every_remaining_sample_once(samples, tmp_path):
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, 8)
        taken, states = [], []
        for rank in range(2):
            loader = StreamLoader(follower(dst, rank=rank, world_size=2), batch_size=1, collate_fn=list)
            taken.append(ids_of(flat(batches_of(loader, count=2)), samples))
            states.append(loader.state_dict())
        published(writer, samples, 8, N)
    assert taken == [[0, 2], [1, 3]] and states[0] == states[1] == {"epoch": 0, "seed": 0, "position": 4}
    rest = []
    for rank in range(2):
        loader = StreamLoader(follower(dst, rank=rank, world_size=2), batch_size=1, num_workers=2, collate_fn=list)
        loader.load_state_dict(states[rank])
        rest.append(ids_of(flat(batches_of(loader)), samples))
    assert rest == [[4, 6, 8, 10], [5, 7, 9, 11]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_the_follow_ended_resumes_with_what_the_writer_appends_next(samples, tmp_path, workers):
    """The rank's last batch is short (5 samples, batches of 2): counted whole, the position would skip a sample
    the writer appends later; it is clamped to where the pass ended."""
    dst = written(tmp_path / "store", samples, 5)
    loader = StreamLoader(follower(dst), batch_size=2, num_workers=workers, collate_fn=list)
    assert ids_of(flat(batches_of(loader)), samples) == [0, 1, 2, 3, 4]
    state = loader.state_dict()
    assert state["position"] == 5
    with writer_for(dst) as writer:  # resumes the store: appends after the 5
        published(writer, samples, 5, 8)
    resumed = StreamLoader(follower(dst), batch_size=2, num_workers=workers, collate_fn=list)
    resumed.load_state_dict(state)
    assert ids_of(flat(batches_of(resumed)), samples) == [5, 6, 7]


def test_a_follower_iterated_directly_counts_its_items(samples, tmp_path):
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, 6)
        stream = follower(dst)
        it = iter(stream)
        first = [next(it) for _ in range(3)]
        state = stream.state_dict()
        it.close()
        published(writer, samples, 6, N)
    assert ids_of(first, samples) == [0, 1, 2] and state["position"] == 3
    again = follower(dst)
    again.load_state_dict(state)
    assert ids_of(list(again), samples) == list(range(3, N))


# =========================================================================== 2. equal_per_rank


def rank_batches(dst: Path, world: int, samples: list[dict], num_workers: int = 0,
                 **kw) -> tuple[list[list[list[int]]], list]:
    """Each rank's batches (as sample ids) and its stream."""
    per_rank, streams = [], []
    for rank in range(world):
        stream = follower(dst, rank=rank, world_size=world, **kw)
        loader = StreamLoader(stream, batch_size=2, num_workers=num_workers, collate_fn=list)
        per_rank.append([ids_of(batch, samples) for batch in batches_of(loader)])
        streams.append(stream)
    return per_rank, streams


def test_equal_per_rank_gives_every_rank_as_many_samples_as_rank_0_repeating_its_rounds_first(samples, tmp_path,
                                                                                                caplog):
    dst = written(tmp_path / "store", samples, 11)
    caplog.set_level(logging.INFO, logger="h5feed")
    per_rank, streams = rank_batches(dst, 3, samples)
    # rounds of 3 positions: 0-2, 3-5, 6-8, 9-10 (short): rank 2 repeats position 9, the last round's first
    assert per_rank == [[[0, 3], [6, 9]], [[1, 4], [7, 10]], [[2, 5], [8, 9]]]
    assert [s.counters.snapshot().total("repeated") for s in streams] == [0, 0, 1]
    assert "rank 2 of 3 repeats sample 9: its own sample of the last round (position 11) lies past where the " \
        "stream ends" in caplog.text
    assert {s.state_dict()["position"] for s in streams} == {11}
    unequal, _ = rank_batches(dst, 3, samples, equal_per_rank=False)
    assert unequal == [[[0, 3], [6, 9]], [[1, 4], [7, 10]], [[2, 5], [8]]]  # what DDP would hang on


@pytest.mark.parametrize("workers", [0, 2])
def test_equal_per_rank_with_a_bound_inside_a_round(samples, tmp_path, workers):
    dst = written(tmp_path / "store", samples)
    bound = Follow(samples=7, idle_timeout=SAFETY_S, poll_s=0.01)
    per_rank, streams = rank_batches(dst, 2, samples, follow=bound, num_workers=workers)
    assert per_rank == [[[0, 2], [4, 6]], [[1, 3], [5, 6]]]  # rank 1's position 7 is past the bound: repeats 6
    assert [s.state_dict()["position"] for s in streams] == [7, 7]
    unequal, _ = rank_batches(dst, 2, samples, follow=bound, equal_per_rank=False)
    assert unequal == [[[0, 2], [4, 6]], [[1, 3], [5]]]


def test_equal_per_rank_on_a_whole_last_round_repeats_nothing(samples, tmp_path):
    dst = written(tmp_path / "store", samples)
    per_rank, streams = rank_batches(dst, 2, samples)
    assert [[i for batch in rank for i in batch] for rank in per_rank] == [list(range(0, N, 2)), list(range(1, N, 2))]
    assert [s.counters.snapshot().total("repeated") for s in streams] == [0, 0]


# =========================================================================== 3. a worker waits for its own samples only


def test_a_rank_whose_next_sample_is_past_the_bound_ends_without_waiting_for_another_ranks(samples, tmp_path):
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, N)  # position 12, rank 0's, is never published while the writer holds on
        stream = follower(dst, rank=1, world_size=2, equal_per_rank=False,
                          follow=Follow(samples=N + 1, idle_timeout=SAFETY_S, poll_s=0.01))
        got = ids_of(flat(batches_of(StreamLoader(stream, batch_size=2, collate_fn=list))), samples)
        snapshot = stream.counters.snapshot()
    assert got == list(range(1, N, 2))
    assert snapshot.total("writer_wait_seconds") == 0.0  # it never began to wait


def test_a_worker_reads_its_own_batches_without_waiting_for_another_workers(samples, tmp_path):
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, 6)  # batches of 2: worker 0 reads 0-1 and 4-5, worker 1 reads 2-3 and 6-7
        store = h5feed.Store(dst)
        bound = Follow(samples=8, idle_timeout=SAFETY_S, poll_s=0.01)
        counters = LoaderCounters()
        first, second = counters.worker(0), counters.worker(1)
        first.start()
        second.start()
        share = FollowedShare(rank=0, world_size=1, worker=0, workers=2, batch_size=2)
        assert list(FollowedPositions(store, bound, share, first)) == [0, 1, 4, 5]
        assert counters.snapshot().total("writer_wait_seconds") == 0.0 and counters.follow_end() == 8
        published(writer, samples, 6, 7)
        waiting = FollowedShare(rank=0, world_size=1, worker=1, workers=2, batch_size=2)
        idle = Follow(samples=8, idle_timeout=0.0, poll_s=0.01)
        assert list(FollowedPositions(store, idle, waiting, second)) == [2, 3, 6]  # its 7 is not published
        snapshot = counters.snapshot()
        assert snapshot.workers[0].writer_wait_seconds == 0.0 < snapshot.workers[1].writer_wait_seconds
        assert counters.follow_end() == 7  # the first saw only the bound (8); the second, where the samples end


@pytest.mark.parametrize("prefetch", [1, 4])
def test_a_read_ahead_hands_over_what_is_published_without_waiting_for_what_is_not(samples, tmp_path, prefetch):
    """Reading ahead draws the next sample to read; drawn before the one read was handed over, a sample not yet
    published held back every one before it (the trainer got sample k once k + prefetch was published)."""
    dst = tmp_path / "store"
    with writer_for(dst) as writer:
        published(writer, samples, 0, 4)
        stream = follower(dst, prefetch=prefetch, follow=Follow(idle_timeout=1.0, poll_s=0.01))
        it = iter(stream)
        got = ids_of([next(it) for _ in range(4)], samples)
        snapshot = stream.counters.snapshot()
        it.close()
    assert got == [0, 1, 2, 3] and snapshot.total("writer_wait_seconds") == 0.0


# =========================================================================== 4. a store with no sample yet


def looked_at_by_the_follower(monkeypatch) -> threading.Event:
    """Set once the follower has looked for the writer and found the store holding no published sample."""
    looked = threading.Event()
    real = follow_module.current_writer

    def watched(path):
        holder = real(path)
        looked.set()
        return holder

    monkeypatch.setattr(follow_module, "current_writer", watched)
    return looked


@pytest.mark.parametrize("before_first", ["opened", "appended unpublished"])
def test_a_follower_opens_a_store_whose_writer_has_published_nothing_yet(samples, tmp_path, monkeypatch,
                                                                          before_first):
    dst = tmp_path / "store"
    looked = looked_at_by_the_follower(monkeypatch)
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                     writing=WriteOptions(publish_every=2)) as writer:
        if before_first == "appended unpublished":
            writer.append(samples[0], name="data_0.pt")
            with pytest.raises(StoreError, match=r"conversion has not finished \(status 'converting'\); it is being "
                               r"written now by `h5feed.open_writer` \(host .*\): 1 samples written so far"):
                h5feed.Store(dst)  # a plain reader keeps its refusal, naming the writer
        else:
            with pytest.raises(StoreError, match=r"has no sample yet; it is being written now by "
                               r"`h5feed.open_writer` \(host .*, pid \d+"):
                h5feed.Store(dst)

        def write_when_looked() -> None:
            assert looked.wait(SAFETY_S)
            published(writer, samples, writer.report.samples, 4)

        thread = threading.Thread(target=write_when_looked)
        thread.start()
        stream = follower(dst, follow=Follow(samples=4, idle_timeout=SAFETY_S, poll_s=0.01))
        thread.join()
        got = ids_of(list(stream), samples)
    assert got == [0, 1, 2, 3]


def test_a_store_whose_writer_let_it_go_with_nothing_published_is_refused_saying_so(samples, tmp_path):
    empty = tmp_path / "empty"
    with open_writer(empty):  # appends nothing: an empty folder is left
        pass
    with pytest.raises(StoreError, match=r"empty: nothing was ever published in it \(an open_writer that appended "
                       "no sample leaves an empty folder\\) and no writer holds it"):
        follower(empty)
    killed = tmp_path / "killed"  # a writer that journaled a sample and died before it published one
    script = ("import sys, torch, os, h5feed\nw = h5feed.open_writer(sys.argv[1], settings=h5feed.StoreSettings("
              "chunk_tokens=16, shard_tokens=64), writing=h5feed.WriteOptions(publish_every=5))\n"
              "w.append(torch.load(sys.argv[2], weights_only=True))\nos._exit(0)\n")
    source = tmp_path / "one.pt"
    torch.save(samples[0], source)
    subprocess.run([sys.executable, "-c", script, str(killed), str(source)], check=True, env=CHECKOUT_ENV)
    with pytest.raises(StoreError, match=r"killed: no writer holds it and it has no published sample: its writer "
                       r"\(`h5feed.open_writer`\) let it go before publishing one"):
        follower(killed)
    with pytest.raises(StoreError, match=r"conversion has not finished \(status 'converting'\); its writer "
                       r"\(`h5feed.open_writer`\) let it go before publishing a sample: open_writer on it again"):
        h5feed.Store(killed)
    with open_writer(killed, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)):  # which publishes the journaled sample
        pass
    assert ids_of(list(follower(killed)), samples) == ids_of(list(follower(f"file://{killed}")), samples) == [0]


def test_the_first_sample_waited_for_is_bounded_by_the_idle_timeout(tmp_path):
    dst = tmp_path / "store"
    with open_writer(dst), pytest.raises(StoreError, match=r"its writer published no sample in 0.0 s"):
        follower(dst, follow=Follow(idle_timeout=0.0, poll_s=0.01))


def test_a_batch_loader_refuses_a_following_stream_saying_to_use_stream_loader(samples, tmp_path):
    dst = written(tmp_path / "store", samples, 2)
    with pytest.raises(ValueError, match=r"store: a stream that follows its writer \(follow=\) is read with "
                       "StreamLoader; BatchLoader and CudaBatchLoader deal the batches"):
        h5feed.BatchLoader(follower(dst), batch_size=1)
    with pytest.raises(ValueError, match="is read with StreamLoader"):
        h5feed.BatchLoader(dst, flavor="speculators", batch_size=1,
                           schedule=h5feed.ScheduleOptions(shuffle=False, follow=Follow()))


# =========================================================================== 5. a writer that crashes, a store replaced


@pytest.mark.parametrize("idle_timeout", [None, 0.5])
def test_a_follower_whose_writer_is_killed_raises_naming_it_instead_of_ending(samples, tmp_path, caplog,
                                                                               idle_timeout):
    """With no bound the follower raises as soon as it finds the writer gone; with an idle_timeout, once it passed
    with no writer coming back.  Sample 3 was journaled, never published: the follower cannot have it."""
    dst = tmp_path / "store"
    writer = writer_process(dst, tmp_path, samples, upto=4, unpublished=1)
    it = iter(follower(dst, follow=Follow(idle_timeout=idle_timeout, poll_s=0.01)))
    got = [next(it) for _ in range(3)]
    kill_9(writer)
    since = time.monotonic()
    with pytest.raises(StoreError, match=CRASHED + r".*restart it with writer='w0'.*3 samples were read"):
        next(it)
    assert time.monotonic() - since >= (idle_timeout or 0.0)
    assert ids_of(got, samples) == [0, 1, 2]
    assert re.search(CRASHED + r".*; last seen .*: restart it with writer='w0'", caplog.text)  # said as it was found


@pytest.mark.parametrize("follow", [Follow(samples=N, poll_s=0.01), Follow(idle_timeout=SAFETY_S, poll_s=0.01)],
                         ids=["samples", "idle_timeout"])
def test_a_follower_waits_for_its_killed_writer_restarted_with_its_id_and_reads_every_sample_once(
        samples, tmp_path, caplog, follow):
    dst = tmp_path / "store"
    writer = writer_process(dst, tmp_path, samples, upto=5, unpublished=2)
    it = iter(follower(dst, follow=follow))
    got = [next(it) for _ in range(3)]
    kill_9(writer)
    thread = restarted_once_seen_gone(caplog, dst, tmp_path, samples)
    got += list(it)
    thread.join()
    assert ids_of(got, samples) == list(range(N))  # each once, in order
    assert_items_are_the_stores(got, dst, list(range(N)))


def test_a_follower_of_a_writer_that_closed_ends_without_error_or_warning(samples, tmp_path, caplog):
    dst = tmp_path / "store"
    writer = writer_process(dst, tmp_path, samples, upto=4, end="close")  # closing while the follower starts
    got = list(follower(dst, follow=Follow(poll_s=0.01)))
    assert writer.wait(SAFETY_S) == 0
    assert ids_of(got, samples) == [0, 1, 2, 3] and "went away" not in caplog.text
    assert not (dst / "h5feed-writers" / "id-w0.lock").exists()  # a clean close removes its lock file


def test_a_store_replaced_under_its_follower_is_refused_never_mixed(samples, tmp_path):
    """The follower read samples 0-4 of one store, then another store is put in its place (written beside it, then
    renamed over it) while it waits for sample 5: it raises, never handing out the other store's samples as 5, ..."""
    dst, got, raised = tmp_path / "store", [], []
    first = writer_for(dst)
    published(first, samples, 0, 5)

    def follow() -> None:
        try:
            for item in follower(dst):
                got.append(item)
        except StoreError as exc:
            raised.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    deadline = time.monotonic() + SAFETY_S
    while len(got) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with writer_for(tmp_path / "other") as second:
        for j, i in enumerate(range(N - 1, 3, -1)):  # other samples, more of them
            second.append(samples[i], name=f"other_{j}.pt")
    dst.rename(tmp_path / "old")
    (tmp_path / "other").rename(dst)
    thread.join(SAFETY_S)
    first.close()
    assert ids_of(got, samples) == [0, 1, 2, 3, 4]
    assert len(raised) == 1 and re.search(r"was (replaced|removed) .*while it was read", str(raised[0]))


# =========================================================================== 2. for real: two gloo ranks under DDP


def rank_main(argv: list[str]) -> None:
    """A torchrun rank: follow the store while the writer writes, train a tiny DDP model, write what it took."""
    import argparse
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    p = argparse.ArgumentParser()
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    stream = HiddenStatesStream(args.store, flavor="speculators",
                                schedule=h5feed.ScheduleOptions(shuffle=False, follow=Follow(poll_s=0.02)))
    loader = StreamLoader(stream, batch_size=2, num_workers=1, collate_fn=list)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3 * H, 1))
    steps = []
    for batch in loader:
        steps.append([item["input_ids"].tolist() for item in batch])
        model(torch.cat([item["hidden_states"] for item in batch]).float()).square().mean().backward()  # all-reduce
    dist.barrier()
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"steps": steps, "state": loader.state_dict(), "repeated": stream.counters.snapshot().total("repeated")}))
    dist.destroy_process_group()


SLOW_WRITER = """
import sys, time, torch, h5feed
samples = torch.load(sys.argv[2], weights_only=True)
with h5feed.open_writer(sys.argv[1], settings=h5feed.StoreSettings(chunk_tokens=16, shard_tokens=64), writing=h5feed.WriteOptions(publish_every=1)) as w:
    open(sys.argv[3], "w").close()  # holds the store now
    for i, sample in enumerate(samples):
        w.append(sample, name=f"data_{i}.pt")
        time.sleep(0.1)
"""


def test_two_gloo_ranks_following_a_writer_take_the_same_number_of_steps(samples, tmp_path):
    dst, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    torch.save(samples[:11], tmp_path / "samples.pt")  # 11: the last round of 2 ranks is short
    holding = tmp_path / "holding"
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(dst), str(tmp_path / "samples.pt"),
                               str(holding)], env=CHECKOUT_ENV)
    try:
        while not holding.exists():
            assert writer.poll() is None
            time.sleep(0.01)
        torchrun(Path(__file__), 2, "--store", dst, "--out", out)  # a rank short of a step would hang here
    finally:
        assert writer.wait(120) == 0
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    by_key = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(samples)}
    steps = [[[by_key[tuple(ids)] for ids in batch] for batch in rank["steps"]] for rank in seen]
    assert steps == [[[0, 2], [4, 6], [8, 10]], [[1, 3], [5, 7], [9, 10]]]  # rank 1 repeats position 10
    assert [rank["repeated"] for rank in seen] == [0, 1]
    assert [rank["state"]["position"] for rank in seen] == [11, 11]


if __name__ == "__main__":  # a rank under torchrun
    rank_main(sys.argv[1:])
