"""`h5feed.open_writer` into a bucket (moto's S3 server on loopback, behind the test proxy): a sample appended
there is the objects a local writer writes, several writer processes append together with every sample published
exactly once and readers of the bucket seeing only whole samples, a kill -9 loses only unjournaled samples and
the writer's id resumes from its staging folder (or, without one, keeps what it published), and writers, a
second process with one id, `h5feed convert` and a prefix that holds something else are refused, naming whom."""

from __future__ import annotations

import json
import multiprocessing.synchronize
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    CRASHED,
    SAFETY_S,
    SPAWN,
    WRITER_CHUNK,
    WRITER_SHARD,
    bucket_objects,
    check_sample,
    join_all,
    kill_9,
    make_sample,
    name_of,
    restarted_once_seen_gone,
    writer_options,
    writer_process,
)
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

import h5feed
from h5feed import (
    BucketOptions,
    Follow,
    HiddenStatesDataset,
    HiddenStatesStream,
    StoreError,
    StoreSettings,
    StreamLoader,
    WriteOptions,
    open_writer,
)
from h5feed.conversion.publish import is_shard
from h5feed.conversion.writer_sites.bucket import BucketSite
from h5feed.store import Store
from h5feed.store.journal import JOURNAL_FILE, read_journal
from h5feed.store.layout import COMMIT_KEY, Commit
from h5feed.store.writer_state import LOCK_FILE, WRITERS_DIR, bucket_writers
from h5feed.testing.synthetic import write_synthetic


def store_files(root: Path) -> dict[str, bytes]:
    """A local store's files, but the writers' bookkeeping (journal, locks), which a bucket store keeps locally."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (JOURNAL_FILE, LOCK_FILE) and WRITERS_DIR not in p.parts}


def as_one_writers_layout(objects: dict[str, bytes]) -> dict[str, bytes]:
    """A bucket store's objects laid out as a local writer's store: the index the root's commit names at `index/`
    (writers in a bucket publish each index under a prefix of its own), older ones left out, the root without
    its commit record."""
    root = json.loads(objects["zarr.json"])
    index = Commit.of_root(root).index
    del root["attributes"][COMMIT_KEY]
    laid = {"zarr.json": json.dumps(root, indent=2).encode()}
    for key, data in objects.items():
        if key.startswith(f"{index}/"):
            laid["index" + key[len(index):]] = data
        elif key != "zarr.json" and not key.startswith(("index/", "index-v/")):
            laid[key] = data
    return dict(sorted(laid.items()))


def bucket_writer(url: str, s3: S3, staging: Path, **options: Any) -> h5feed.StoreWriter:
    return open_writer(url, **options, bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=staging),
                       settings=StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD))


def append_into_bucket(url: str, storage_options: dict, staging: str, w: int, count: int, pause: float,
                       opened: multiprocessing.synchronize.Barrier) -> None:
    """A writer process: writer `w{w}` appends its samples into the bucket store, once every writer has opened it."""
    with open_writer(url, writer=f"w{w}", **writer_options(w),
                     bucket=BucketOptions(storage_options=storage_options, staging_dir=staging)) as writer:
        opened.wait(120)
        for i in range(count):
            assert writer.append(make_sample(w, i), name=name_of(w, i)) == i
            time.sleep(pause)


def start_bucket_writers(url: str, s3: S3, tmp_path: Path, counts: dict[int, int], pause: float = 0.0) -> dict:
    opened = SPAWN.Barrier(len(counts))
    processes = {w: SPAWN.Process(target=append_into_bucket, args=(url, s3.storage_options,
                                                                  str(tmp_path / f"staging-w{w}"), w, n, pause, opened))
                 for w, n in counts.items()}
    processes["barrier"] = opened  # kept alive until the children have unpickled it
    for w, process in processes.items():
        if w != "barrier":
            process.start()
    return processes


def check_bucket_store(url: str, s3: S3, counts: dict[int, int]) -> Store:
    store = Store(url, storage_options=s3.storage_options)
    names = [check_sample(store, j) for j in range(len(store))]
    assert sorted(names) == sorted(name_of(w, i) for w, n in counts.items() for i in range(n))
    return store


def test_a_bucket_store_holds_the_objects_a_local_writer_writes_and_reads_back_exactly(s3, bucket, tmp_path):
    url, local = f"s3://{bucket}/hs.zarr", tmp_path / "local"
    with bucket_writer(url, s3, tmp_path / "staging", writing=WriteOptions(publish_every=3)) as remote, \
            open_writer(local, settings=StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD),
                        writing=WriteOptions(publish_every=3)) as here:
        for i in range(7):
            sample = make_sample(1, i)  # 60-140 tokens: some span two or three shards
            assert remote.append(sample, name=name_of(1, i)) == here.append(sample, name=name_of(1, i)) == i
        assert bucket_writers(remote.site.objects)[0]["writer"] is None  # the unnamed writer holds it meanwhile
    assert remote.report.store == url and remote.report.samples == remote.report.published == 7
    assert as_one_writers_layout(bucket_objects(s3, bucket, "hs.zarr")) == store_files(local)  # byte for byte
    check_bucket_store(url, s3, {1: 7})
    staging = tmp_path / "staging" / "store"
    assert not [p for p in staging.rglob("*") if p.is_file() and is_shard(p.relative_to(staging).as_posix())]
    assert len(read_journal(staging)) == 7  # the journal stays in the staging folder


@pytest.mark.slow
def test_writers_appending_into_a_bucket_together_publish_each_sample_once_and_readers_see_whole_ones(
        s3, bucket, tmp_path):
    url, counts = f"s3://{bucket}/hs.zarr", {0: 10, 1: 6, 2: 8}
    seen, failure, done = [], [], threading.Event()

    def read_meanwhile() -> None:  # a reader opening the bucket store afresh, again and again
        try:
            order: list[str] = []
            while not done.is_set():
                try:
                    store = Store(url, storage_options=s3.storage_options)
                except StoreError:  # nothing published yet
                    time.sleep(0.05)
                    continue
                assert store.source_paths[:len(order)] == order  # published rows never change
                order += [check_sample(store, j) for j in range(len(order), len(store))]
                seen.append(len(store))
        except BaseException as exc:  # noqa: BLE001 (raised by the test thread)
            failure.append(exc)

    reader = threading.Thread(target=read_meanwhile, daemon=True)
    reader.start()
    processes = start_bucket_writers(url, s3, tmp_path, counts)
    try:
        join_all({w: p for w, p in processes.items() if w != "barrier"})
    finally:
        done.set()
        reader.join(120)
    if failure:
        raise failure[0]
    assert seen and max(seen) <= sum(counts.values())
    store = check_bucket_store(url, s3, counts)
    assert not bucket_writers(open_url_of(url, s3))  # every writer let go: their lock objects are gone
    objects = bucket_objects(s3, bucket, "hs.zarr")
    assert not [key for key in objects if key.startswith(WRITERS_DIR)]
    assert len(store) == sum(counts.values())


def open_url_of(url: str, s3: S3) -> Any:
    from h5feed.io import open_url

    return open_url(url, s3.storage_options)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_kill_9_of_a_bucket_writer_loses_only_unjournaled_samples_and_its_staging_folder_resumes_them(
        s3, bucket, tmp_path, seed, caplog):
    url, counts = f"s3://{bucket}/hs.zarr", {0: 6, 1: 30}
    processes = start_bucket_writers(url, s3, tmp_path, counts, pause=0.02)
    journal = tmp_path / "staging-w1" / "store" / WRITERS_DIR / "id-w1.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not journal.exists() or not read_journal(journal.parent, journal):
            assert time.monotonic() < deadline and processes[1].is_alive()
            time.sleep(0.005)
        time.sleep(random.Random(seed).uniform(0.0, 0.4))  # anywhere: writing, uploading, journaling, publishing
    finally:
        os.kill(processes[1].pid, signal.SIGKILL)
    processes[1].join(60)
    assert processes[1].exitcode == -signal.SIGKILL
    join_all({0: processes[0]})

    kept = len(read_journal(journal.parent, journal))
    assert 1 <= kept < counts[1]
    published = [n for n in Store(url, storage_options=s3.storage_options).source_paths if n.startswith("w1-")]
    assert published == [name_of(1, i) for i in range(len(published))] and len(published) <= kept

    caplog.set_level("INFO", logger="h5feed")
    with open_writer(url, writer="w1", **writer_options(1),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging-w1")) as resumed:  # the same pid is gone: its lock object is taken over
        assert f"resuming writer 'w1': {kept} samples kept, the last one {name_of(1, kept - 1)!r}" in caplog.text
        for i in range(kept, counts[1]):
            assert resumed.append(make_sample(1, i), name=name_of(1, i)) == i
    check_bucket_store(url, s3, counts)


def test_a_writer_without_its_staging_folder_keeps_what_it_published_and_appends_after_it(s3, bucket, tmp_path):
    url = f"s3://{bucket}/hs.zarr"
    with bucket_writer(url, s3, tmp_path / "first", writer="a", writing=WriteOptions(publish_every=2)) as writer:
        for i in range(5):
            writer.append(make_sample(0, i), name=name_of(0, i))
    with bucket_writer(url, s3, tmp_path / "elsewhere", writer="a") as writer:  # another machine, say
        assert writer.append(make_sample(0, 5), name=name_of(0, 5)) == 0  # its numbering starts again
    store = Store(url, storage_options=s3.storage_options)
    assert store.source_paths == [name_of(0, i) for i in range(6)]
    assert store.source_indices.tolist() == [0, 1, 2, 3, 4, 0]
    for j in range(5):
        check_sample(store, j)
    want = make_sample(0, 5)
    assert torch.equal(store.read_sample(5).aux_hidden_states, torch.cat(want["hidden_states"][:-1], dim=1))


def test_bucket_writers_refuse_what_they_must_and_name_it(s3, bucket, tmp_path):
    url = f"s3://{bucket}/hs.zarr"
    first = bucket_writer(url, s3, tmp_path / "a1", writer="a")
    try:
        first.append(make_sample(0, 0), name="a0")  # journaled, not yet published (every 16)
        with pytest.raises(StoreError, match=r"conversion has not finished \(status 'converting'\); it is being "
                                             r"written now by `h5feed.open_writer` \(writer 'a', host [^,]+, pid \d+, "
                                             r"started at [^)]+\); wait for it to finish"):
            Store(url, storage_options=s3.storage_options)
        with pytest.raises(StoreError, match=r"another `h5feed.open_writer` \(writer 'a', host [^,]+, pid \d+, started "
                                             r"at [^,]+, last heartbeat [^)]+\) is writing this store as writer 'a': "
                                             "give each writer"):
            bucket_writer(url, s3, tmp_path / "a2", writer="a")
        with pytest.raises(StoreError, match="is the staging folder of s3://.*/hs.zarr, not of s3://.*/other.zarr"):
            bucket_writer(f"s3://{bucket}/other.zarr", s3, tmp_path / "a1", writer="b")
        src = tmp_path / "src"
        write_synthetic(src, "speculators-legacy-pt", 2, 32, lengths=(4, 8), seed=1)
        with pytest.raises(StoreError, match=r"another `h5feed.open_writer` \(writer 'a', host .*\) is writing this "
                                             "store; wait for it to finish"):
            h5feed.convert(src, url, workers=0, progress=False,
                           bucket=h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "convert"))
    finally:
        first.close()
    assert len(Store(url, storage_options=s3.storage_options)) == 1

    s3.client.put_object(Bucket=bucket, Key="notes/readme.txt", Body=b"hello")
    with pytest.raises(StoreError, match=r"s3://.*/notes: exists and is not an h5feed store \(1 objects, no zarr.json\)"):
        bucket_writer(f"s3://{bucket}/notes", s3, tmp_path / "n")
    with pytest.raises(StoreError, match="the bucket does not exist: create it first"):
        bucket_writer("s3://no-such-bucket-h5feed/hs.zarr", s3, tmp_path / "x")


def test_a_converter_holding_the_bucket_store_refuses_a_writer(s3, bucket, tmp_path):
    from h5feed.conversion.lock import BucketLock

    url = f"s3://{bucket}/hs.zarr"
    refused = r"another `h5feed convert` \(host [^,]+, pid \d+, .*\) is writing this store; wait for it to finish, or " \
              "write into another store"
    with BucketLock.acquire(open_url_of(url, s3)), pytest.raises(StoreError, match=refused):
        bucket_writer(url, s3, tmp_path / "w")


def test_the_site_registry_gives_a_bucket_site_for_a_url_and_refuses_a_read_only_one(s3, bucket, tmp_path):
    from h5feed.conversion.writer_sites import LocalSite, open_site

    assert isinstance(open_site(f"s3://{bucket}/x", None, s3.storage_options, tmp_path), BucketSite)
    assert isinstance(open_site(tmp_path / "x", None, None, None), LocalSite)
    assert open_site(f"file://{tmp_path}/x", None, None, None).staging == tmp_path / "x"
    with pytest.raises(StoreError, match="cannot be written"):
        open_site("https://example.invalid/x", None, None, None)


def test_a_follower_of_a_bucket_store_reads_every_sample_once_as_published_and_stops_when_the_writers_let_go(
        s3, bucket, tmp_path):
    url, counts = f"s3://{bucket}/hs.zarr", {0: 8, 1: 6}
    processes = start_bucket_writers(url, s3, tmp_path, counts, pause=0.05)
    try:  # the trainer starts once the writers hold the store, likely before the first sample is published
        deadline = time.monotonic() + 120
        while len(bucket_writers(open_url_of(url, s3))) < len(counts):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stream = HiddenStatesStream(h5feed.StoreOptions(url, storage_options=s3.storage_options), max_len=256,
                                    schedule=h5feed.ScheduleOptions(shuffle=False, follow=Follow(poll_s=0.02)))
        loader = StreamLoader(stream, batch_size=1, num_workers=2)
        got = [tuple(batch["input_ids"][0].tolist()) for batch in loader]
    finally:
        join_all({w: p for w, p in processes.items() if w != "barrier"})
    want = [tuple(make_sample(w, i)["input_ids"][1:].tolist())  # the trainer's items: the ids after the first
            for w, n in counts.items() for i in range(n)]
    assert sorted(got) == sorted(want)
    published = Store(url, storage_options=s3.storage_options)  # in the order published
    assert got == [tuple(make_sample(*map(int, name.removeprefix("w").split("-")))["input_ids"][1:].tolist())
                   for name in published.source_paths]
    assert stream.counters.snapshot().total("writer_wait_seconds") > 0  # it waited for the writers, and said so


@pytest.mark.parametrize("restarted", [False, True], ids=["no restart", "restarted"])
def test_a_bucket_follower_of_a_killed_writer_raises_naming_it_unless_its_id_comes_back(s3, bucket, tmp_path, caplog,
                                                                                          restarted):
    """Writer 'w0' killed with 3 samples published and a fourth journaled in its staging folder: the follower
    waits for the same id up to its idle_timeout, then names the writer; restarted, it reads every sample once."""
    url, n = f"s3://{bucket}/hs.zarr", 8
    samples = [make_sample(0, i) for i in range(n)]
    options = {"storage_options": s3.storage_options, "staging_dir": str(tmp_path / "staging")}
    writer = writer_process(url, tmp_path, samples, upto=4, unpublished=1, options=options)
    follow = Follow(samples=n, idle_timeout=SAFETY_S if restarted else 1.0, poll_s=0.02)
    it = iter(HiddenStatesStream(h5feed.StoreOptions(url, storage_options=s3.storage_options), flavor="speculators", schedule=h5feed.ScheduleOptions(shuffle=False, follow=follow)))
    got = [next(it) for _ in range(3)]
    kill_9(writer)
    if not restarted:
        since = time.monotonic()
        with pytest.raises(StoreError, match=CRASHED + r".*restart it with writer='w0'.*3 samples were read"):
            next(it)
        assert time.monotonic() - since >= 1.0
        return
    thread = restarted_once_seen_gone(caplog, url, tmp_path, samples, options)
    got += list(it)
    thread.join()
    want = HiddenStatesDataset(h5feed.StoreOptions(url, storage_options=s3.storage_options), flavor="speculators")
    assert [tuple(item["input_ids"].tolist()) for item in got] == [tuple(s["input_ids"].tolist()) for s in samples]
    for i, item in enumerate(got):  # each once, in order, bit for bit
        assert list(item) == list(want[i]) and all(torch.equal(item[k], want[i][k]) for k in item)


def test_a_follower_of_a_bucket_prefix_no_writer_holds_is_told_there_is_no_store(s3, bucket):
    with pytest.raises(StoreError, match=r"s3://.*/nothing.zarr: not an h5feed store \(no zarr.json\)"):
        HiddenStatesStream(h5feed.StoreOptions(f"s3://{bucket}/nothing.zarr", storage_options=s3.storage_options),
                           schedule=h5feed.ScheduleOptions(shuffle=False, follow=Follow(poll_s=0.01)))


def test_a_damaged_converter_lock_in_the_bucket_still_refuses_a_writer(s3, bucket, tmp_path):
    s3.client.put_object(Bucket=bucket, Key=f"hs.zarr/{LOCK_FILE}", Body=b"\x00not json")
    with pytest.raises(StoreError, match=r"another `h5feed convert` \(its lock object is unreadable\) is writing"):
        bucket_writer(f"s3://{bucket}/hs.zarr", s3, tmp_path / "w")
