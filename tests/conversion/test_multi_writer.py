"""Several `h5feed.open_writer` writers appending to one store at once: every sample published exactly once and
equal to what was appended (its shards the bytes one writer writes), readers meanwhile see only whole samples, a
kill -9 of one writer loses only its unjournaled samples and its id resumes them, a store one writer of an earlier
h5feed left resumes, and `h5feed convert` and the writers keep excluding each other."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.synchronize
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    SPAWN,
    WRITER_CHUNK,
    WRITER_H,
    WRITER_SHARD,
    check_sample,
    join_all,
    make_sample,
    name_of,
    writer_options,
)

import h5feed
from h5feed import Follow, HiddenStatesStream, StoreError, StoreSettings, WriteOptions, convert, open_writer
from h5feed.conversion.lock import WriterLock
from h5feed.conversion.samples import array_rows, grow_arrays, rows_taken
from h5feed.store import Store
from h5feed.store.journal import JOURNAL_FILE, journal_records, read_journal
from h5feed.store.layout import object_key
from h5feed.store.writer_state import (
    LOCK_FILE,
    WRITERS_DIR,
    WriterFiles,
    being_converted,
    current_writer,
)
from h5feed.testing.synthetic import write_synthetic

H, CHUNK, SHARD = WRITER_H, WRITER_CHUNK, WRITER_SHARD  # the writers' samples and stores, as in conftest


def append_samples(store: str, w: int, count: int, pause: float, opened: multiprocessing.synchronize.Barrier) -> None:
    """A writer process: writer `w{w}` appends its samples, once every writer has opened the store."""
    with open_writer(store, writer=f"w{w}", **writer_options(w)) as writer:
        opened.wait(120)
        for i in range(count):
            assert writer.append(make_sample(w, i), name=name_of(w, i)) == i
            time.sleep(pause)


class Writers(dict):
    """Writer processes by writer number, and the barrier they start appending at (kept: a process started
    lets go of its arguments, and a barrier collected meanwhile is gone before the children unpickle it)."""

    def __init__(self, dst: Path, counts: dict[int, int], pause: float) -> None:
        self.opened = SPAWN.Barrier(len(counts))
        super().__init__({w: SPAWN.Process(target=append_samples, args=(str(dst), w, n, pause, self.opened))
                          for w, n in counts.items()})


def start_writers(dst: Path, counts: dict[int, int], pause: float = 0.0) -> Writers:
    processes = Writers(dst, counts, pause)
    for process in processes.values():
        process.start()
    return processes


def check_store(dst: Path, counts: dict[int, int]) -> Store:
    """Every sample of every writer exactly once, each equal to what was appended."""
    store = Store(dst)
    names = [check_sample(store, j) for j in range(len(store))]
    assert sorted(names) == sorted(name_of(w, i) for w, n in counts.items() for i in range(n))
    assert h5feed.verify_store(dst, progress=False).ok
    return store


class Reader(threading.Thread):
    """Opens the store afresh and reloads an open one while the writers append, checking every published sample
    (exactly the tensors appended) and that the published samples only grow, in the order first published."""

    def __init__(self, dst: Path) -> None:
        super().__init__(daemon=True)
        self.dst, self.stop, self.seen, self.failure = dst, threading.Event(), [], None

    def run(self) -> None:
        try:
            followed, order = None, []
            while True:
                last_look = self.stop.is_set()  # after the writers ended: what is published now is all
                try:
                    fresh = Store(self.dst)
                except (StoreError, FileNotFoundError):  # nothing published yet
                    fresh = None
                for store in filter(None, (fresh, followed)):
                    if store is followed:
                        store.reload()
                    assert store.source_paths[:len(order)] == order  # published rows never change
                    for j in range(len(order), len(store)):
                        order.append(check_sample(store, j))
                    self.seen.append(len(store))
                followed = followed or fresh
                if last_look:
                    return
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 (the test thread raises it)
            self.failure = exc


def single_writer_store(dst: Path, counts: dict[int, int]) -> Store:
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        for w, n in counts.items():
            for i in range(n):
                writer.append(make_sample(w, i), name=name_of(w, i))
    return Store(dst)


def sample_shards(store: Store, j: int) -> list[bytes]:
    """The bytes of every shard that holds sample j (each array's)."""
    start, taken = int(store.sample_starts[j]), rows_taken(int(store.sample_lengths[j]), SHARD)
    return [(Path(store.path) / object_key(store.info, name, shard)).read_bytes()
            for name in store.info.array_names for shard in range(start // SHARD, (start + taken) // SHARD)]


@pytest.mark.parametrize("writers", [2, 4])
def test_writers_appending_together_publish_each_sample_once_as_appended_and_readers_see_only_whole_ones(
        tmp_path, writers):
    dst = tmp_path / "store"
    counts = {w: 10 + 2 * w for w in range(writers)}
    reader = Reader(dst)
    reader.start()
    processes = start_writers(dst, counts)
    try:
        join_all(processes)
    finally:
        reader.stop.set()
        reader.join(120)
    if reader.failure is not None:
        raise reader.failure
    total = sum(counts.values())
    assert reader.seen[-1] == total  # it followed the writers, and read each sample
    store = check_store(dst, counts)
    assert current_writer(dst) is None  # let go

    reference = single_writer_store(tmp_path / "one", counts)
    assert (reference.sample_starts[1:] > reference.sample_starts[:-1]).all()  # one writer: back to back, in order
    by_name = {name: j for j, name in enumerate(reference.source_paths)}
    for j, name in enumerate(store.source_paths):  # each sample's shards: the bytes one writer writes
        assert sample_shards(store, j) == sample_shards(reference, by_name[name]), name
        assert (store.checksums[j] == reference.checksums[by_name[name]]).all()


def test_a_follower_reads_every_sample_of_all_writers_once_and_stops_when_the_last_lets_go(tmp_path):
    dst, counts = tmp_path / "store", {0: 8, 1: 6}
    processes = start_writers(dst, counts, pause=0.05)
    try:
        deadline = time.monotonic() + 120
        while True:  # the trainer starts on the first published sample
            try:
                Store(dst)
                break
            except (StoreError, FileNotFoundError):
                assert time.monotonic() < deadline
                time.sleep(0.02)
        stream = HiddenStatesStream(dst, max_len=256,
                                    schedule=h5feed.ScheduleOptions(shuffle=False, follow=Follow(poll_s=0.02)))
        got = [tuple(item["input_ids"].tolist()) for item in stream]
    finally:
        join_all(processes)
    want = [tuple(make_sample(w, i)["input_ids"][1:].tolist())  # the trainer's items: the ids after the first
            for w, n in counts.items() for i in range(n)]
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_of_one_writer_loses_only_its_unjournaled_samples_and_its_id_resumes_them(tmp_path, seed, caplog):
    dst, counts = tmp_path / "store", {0: 12, 1: 40, 2: 12}
    processes = start_writers(dst, counts, pause=0.02)
    victim = WriterFiles(dst, "w1")
    try:
        deadline = time.monotonic() + 120
        while not read_journal(dst, victim.journal):
            assert time.monotonic() < deadline and processes[1].is_alive()
            time.sleep(0.005)
        time.sleep(random.Random(seed).uniform(0.0, 0.4))  # anywhere: writing shards, journaling, publishing
    finally:
        os.kill(processes[1].pid, signal.SIGKILL)
    processes[1].join(60)
    assert processes.pop(1).exitcode == -signal.SIGKILL
    join_all(processes)  # the others went on

    kept = len(read_journal(dst, victim.journal))
    assert 1 <= kept < counts[1]
    survivors = {0: counts[0], 2: counts[2]}
    published = [name for name in Store(dst).source_paths if name.startswith("w1-")]
    assert published == [name_of(1, i) for i in range(len(published))] and len(published) <= kept
    check_store_of = Store(dst)  # the others' samples all there, every sample sound
    for j in range(len(check_store_of)):
        check_sample(check_store_of, j)
    assert sorted(n for n in check_store_of.source_paths if not n.startswith("w1-")) == sorted(
        name_of(w, i) for w, n in survivors.items() for i in range(n))

    caplog.set_level("INFO", logger="h5feed")
    with open_writer(dst, writer="w1", **writer_options(1)) as resumed:  # publishes every journaled sample
        assert sorted(Store(dst).source_paths) == sorted([*(name_of(w, i) for w, n in survivors.items()
                                                            for i in range(n)), *(name_of(1, i) for i in range(kept))])
        resuming = f"resuming writer 'w1': {kept} samples kept, the last one {name_of(1, kept - 1)!r}; "
        lost = [f"{resuming}samples appended after it were lost",
                f"{resuming}{name_of(1, kept)!r}, being appended when the writer stopped, was lost: append it again"]
        assert any(line in caplog.text for line in lost), caplog.text
        for i in range(kept, counts[1]):
            assert resumed.append(make_sample(1, i), name=name_of(1, i)) == i
    assert not list(dst.rglob("*.partial"))  # what the kill left mid-write was removed
    check_store(dst, counts)


def legacy_store(tmp_path: Path, n: int, published: int) -> Path:
    """A store as one writer of an earlier h5feed leaves it when killed: its journal at the top in that writer's
    records, no writers' folder, `published` of the n journaled samples in the index, the arrays grown past them."""
    work = tmp_path / "work"
    with open_writer(work, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                     writing=WriteOptions(publish_every=published)) as writer:
        for i in range(published):
            writer.append(make_sample(0, i), name=name_of(0, i))
    shutil.copytree(work, tmp_path / "published")  # its index then
    with open_writer(work, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        for i in range(published, n):
            writer.append(make_sample(0, i), name=name_of(0, i))
    dst = tmp_path / "legacy"
    shutil.copytree(work, dst)
    shutil.rmtree(dst / "index")
    shutil.copytree(tmp_path / "published" / "index", dst / "index")
    shutil.copy(tmp_path / "published" / "zarr.json", dst / "zarr.json")
    shutil.rmtree(dst / WRITERS_DIR)
    records = [dataclasses.replace(r, block_end=None)
               for r in journal_records(dst / JOURNAL_FILE) if r.i is not None]  # an earlier writer's: samples only
    (dst / JOURNAL_FILE).write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    grow_arrays(dst, 2 * array_rows(dst), durable=False)  # it doubled them when outgrown
    (dst / LOCK_FILE).write_text(json.dumps({"by": "`h5feed.open_writer`", "host": "gone", "pid": 1,
                                             "started_at": "then", "semaphores": []}))  # its kill left the lock file
    return dst


def test_a_store_one_writer_of_an_earlier_h5feed_left_resumes_and_takes_new_writers_beside_it(tmp_path, caplog):
    dst = legacy_store(tmp_path, 7, published=4)
    assert len(Store(dst)) == 4
    caplog.set_level("INFO", logger="h5feed")
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as old, \
            open_writer(dst, writer="w1", **writer_options(1)) as new:
        assert f"resuming: 7 samples kept, the last one {name_of(0, 6)!r}; samples appended after it were lost" \
            in caplog.text
        assert Store(dst).source_paths == [name_of(0, i) for i in range(7)]  # the unpublished three published
        for i in range(6):  # in turn: each writer's blocks among the other's
            assert new.append(make_sample(1, i), name=name_of(1, i)) == i
            assert old.append(make_sample(0, 7 + i), name=name_of(0, 7 + i)) == 7 + i
    check_store(dst, {0: 13, 1: 6})


def test_convert_and_the_writers_exclude_each_other_and_readers_are_told_who_writes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, "speculators-legacy-pt", 2, H, lengths=(4, 8), seed=1)
    a = open_writer(dst, writer="a", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                    writing=WriteOptions(publish_every=100))
    assert being_converted(dst) == (f"it is being written now by `h5feed.open_writer` (writer 'a', host "
                                    f"{os.uname().nodename}, pid {os.getpid()}, started at "
                                    f"{current_writer(dst)['started_at']}): no sample written yet; wait for it to finish")
    b = open_writer(dst, writer="b", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                    writing=WriteOptions(publish_every=100))
    a.append(make_sample(0, 0), name="a0")
    b.append(make_sample(0, 1), name="b0")
    b.append(make_sample(0, 2), name="b1")
    host = r"host [^,]+, pid \d+, started at [^)]+"
    with pytest.raises(StoreError, match=rf"another `h5feed.open_writer` \(2 writers: a \({host}\), b \({host}\)\) is "
                                         "writing this store; wait for it to finish, or stop it and run this command "
                                         "again"):
        convert(src, dst, workers=0, progress=False)
    with pytest.raises(StoreError, match=rf"it is being written now by `h5feed.open_writer` \(2 writers: a \({host}\), "
                                         rf"b \({host}\)\): 3 samples written so far; wait for it to finish"):
        Store(dst)
    with pytest.raises(StoreError, match=rf"another `h5feed.open_writer` \(writer 'a', {host}\) is writing this store "
                                         "as writer 'a': give each writer that appends at the same time an id of its "
                                         "own"):
        open_writer(dst, writer="a")
    with pytest.raises(StoreError, match=r"was written with shard tokens 64, not shard tokens 128: open every writer "
                                         "of a store with its settings"):
        open_writer(dst, writer="c", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=128))
    assert [w["writer"] for w in current_writer(dst)["writers"]] == ["a", "b"]
    a.close()
    assert current_writer(dst)["writer"] == "b" and "writers" not in current_writer(dst)
    b.close()
    assert current_writer(dst) is None and not (dst / LOCK_FILE).exists()
    assert Store(dst).source_paths == ["a0", "b0", "b1"]

    with WriterLock.acquire(dst):  # a converter holds it: writers and a second converter are refused
        for refused in (lambda: open_writer(dst, writer="a"), lambda: WriterLock.acquire(dst)):
            with pytest.raises(StoreError, match=rf"another `h5feed convert` \({host}\) is writing this store"):
                refused()
    with open_writer(dst, writer="a", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)):  # let go: writers may take it
        pass
