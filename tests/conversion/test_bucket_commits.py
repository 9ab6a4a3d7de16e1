"""Writers of a bucket store commit by compare-and-swap (moto's S3 server on loopback): a writer frozen inside a
shared step (SIGSTOP) while another commits many times, then resumed, finds out from the server and commits
again, every sample reported published reading back exact and no reader ever seeing a damaged index; a writer
whose clock is minutes fast takes over no live lock and loses nothing; a staging folder is one writer's."""

from __future__ import annotations

import multiprocessing.synchronize
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SPAWN, WRITER_CHUNK, WRITER_SHARD, bucket_objects, check_sample, make_sample, name_of
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed import BucketOptions, StoreError, StoreSettings, WriteOptions, open_writer
from h5feed.store import Store
from h5feed.store.writer_state import bucket_writers

FAST_BY_S = 90.0  # a client clock this far ahead of the bucket's (S3 accepts clients 15 minutes off)


def options() -> dict[str, Any]:
    return {"settings": StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD),
            "writing": WriteOptions(block_shards=1, publish_every=1)}


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): its state in /proc is 'T'."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


def freezing_writer(url: str, storage_options: dict, staging: str, step: str, count: int) -> None:
    """Writer 'a' (a process of its own): it stops itself (SIGSTOP) once, inside its first `step` ("rows" or
    "publish") after fetching the store's state and before committing; then appends the rest."""
    from h5feed.conversion.writer import StoreWriter
    from h5feed.conversion.writer_sites.bucket import BucketSite

    in_step, frozen = [False], [False]
    method = "_reserve" if step == "rows" else "_publish"
    original_step, original_fetch = getattr(StoreWriter, method), BucketSite._fetch

    def step_marked(self: Any, *args: Any) -> Any:
        in_step[0] = True
        try:
            return original_step(self, *args)
        finally:
            in_step[0] = False

    def fetch_then_freeze(self: Any, *args: Any, **kwargs: Any) -> Any:
        fetched = original_fetch(self, *args, **kwargs)
        if in_step[0] and not frozen[0]:
            frozen[0] = True
            os.kill(os.getpid(), signal.SIGSTOP)  # a VM frozen, a long pause: the test resumes it
        return fetched

    setattr(StoreWriter, method, step_marked)
    BucketSite._fetch = fetch_then_freeze
    with open_writer(url, writer="a", **options(),
                     bucket=BucketOptions(storage_options=storage_options, staging_dir=staging)) as writer:
        for i in range(count):
            writer.append(make_sample(0, i), name=name_of(0, i))
    assert writer.report.published == count


def read_meanwhile(url: str, s3: S3, done: threading.Event, failures: list[BaseException]) -> None:
    """A reader opening the store afresh again and again, reading every sample: none may fail."""
    while not done.is_set():
        try:
            store = Store(url, storage_options=s3.storage_options)
            for j in range(len(store)):
                check_sample(store, j)
        except BaseException as exc:  # noqa: BLE001 (the test raises it)
            failures.append(exc)
            return
        time.sleep(0.02)


@pytest.mark.parametrize("step", ["rows", "publish"])
def test_a_bucket_writer_frozen_inside_a_step_while_another_commits_loses_and_damages_nothing(
        s3, bucket, tmp_path, step, monkeypatch):
    url, mine, theirs = f"s3://{bucket}/hs.zarr", 3, 6
    other = open_writer(url, writer="b", **options(),
                        bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "b"))
    other.append(make_sample(1, 0), name=name_of(1, 0))  # the store exists, one sample published
    frozen = SPAWN.Process(target=freezing_writer, args=(url, s3.storage_options, str(tmp_path / "a"), step, mine))
    frozen.start()
    done, failures = threading.Event(), []
    reader = threading.Thread(target=read_meanwhile, args=(url, s3, done, failures), daemon=True)
    try:
        deadline = time.monotonic() + 120
        while not stopped(frozen.pid):
            assert frozen.is_alive() and time.monotonic() < deadline, "the writer never reached its step"
            time.sleep(0.02)
        reader.start()
        for i in range(1, theirs):  # each append reserves rows and publishes: commits while 'a' is frozen in its step
            other.append(make_sample(1, i), name=name_of(1, i))
        os.kill(frozen.pid, signal.SIGCONT)
        frozen.join(120)
        assert frozen.exitcode == 0  # it says its samples are published: they must be
        assert other.close().published == theirs
    finally:
        done.set()
        if frozen.is_alive():
            os.kill(frozen.pid, signal.SIGCONT)
            frozen.kill()
        other.close()
    reader.join(60)
    if failures:
        raise failures[0]
    store = Store(url, storage_options=s3.storage_options)
    names = [check_sample(store, j) for j in range(len(store))]
    assert sorted(names) == sorted([name_of(0, i) for i in range(mine)] + [name_of(1, i) for i in range(theirs)])


def clock_fast_writer(url: str, storage_options: dict, staging: str, writer: str, w: int, count: int,
                      opened: multiprocessing.synchronize.Barrier) -> None:
    """A writer process whose clock is `FAST_BY_S` ahead of the bucket's."""
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + FAST_BY_S  # type: ignore[assignment]
    time.time_ns = lambda: real_time_ns() + int(FAST_BY_S * 1e9)  # type: ignore[assignment]
    with open_writer(url, writer=writer, **options(),
                     bucket=BucketOptions(storage_options=storage_options, staging_dir=staging)) as out:
        opened.wait(120)
        for i in range(count):
            out.append(make_sample(w, i), name=name_of(w, i))
            time.sleep(0.01)
    assert out.report.published == count


def test_a_writer_whose_clock_is_fast_takes_over_no_live_lock_and_loses_nothing(s3, bucket, tmp_path, caplog):
    url, counts = f"s3://{bucket}/hs.zarr", {0: 8, 1: 8}
    opened = SPAWN.Barrier(len(counts))
    fast = SPAWN.Process(target=clock_fast_writer, args=(url, s3.storage_options, str(tmp_path / "fast"), "fast", 1,
                                                         counts[1], opened))
    fast.start()
    caplog.set_level("WARNING", logger="h5feed")
    with open_writer(url, writer="slow", **options(),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "slow")) as slow:
        opened.wait(120)
        for i in range(counts[0]):
            slow.append(make_sample(0, i), name=name_of(0, i))
            time.sleep(0.01)
        fast.join(120)
    assert fast.exitcode == 0 and slow.report.published == counts[0]
    assert "taking over" not in caplog.text
    store = Store(url, storage_options=s3.storage_options)
    names = [check_sample(store, j) for j in range(len(store))]
    assert sorted(names) == sorted(name_of(w, i) for w, n in counts.items() for i in range(n))


def test_a_live_writer_is_live_to_an_observer_whose_clock_is_minutes_fast(s3, bucket, tmp_path, monkeypatch):
    url = f"s3://{bucket}/hs.zarr"
    with open_writer(url, writer="a", **options(),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "a")) as writer:
        writer.append(make_sample(0, 0), name=name_of(0, 0))
        real_time, real_time_ns = time.time, time.time_ns
        monkeypatch.setattr(time, "time", lambda: real_time() + 400)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + 400_000_000_000)
        assert [holder["writer"] for holder in bucket_writers(writer.site.objects)] == ["a"]
        with pytest.raises(StoreError, match="is writing this store as writer 'a'"):
            open_writer(url, writer="a", **options(),
                        bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "a2"))


def test_a_second_bucket_writer_on_one_staging_folder_is_refused_naming_the_first(s3, bucket, tmp_path):
    url = f"s3://{bucket}/hs.zarr"
    with open_writer(url, writer="a", **options(),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging")) as first:
        first.append(make_sample(0, 0), name=name_of(0, 0))
        with pytest.raises(StoreError, match=r"staging: is the staging folder of writer 'a' \(host [^,]+, pid "
                                             rf"{os.getpid()}, started at [^)]+\), which is writing now: give each "
                                             "writer its own staging_dir"):
            open_writer(url, writer="b", **options(),
                        bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging"))
        first.append(make_sample(0, 1), name=name_of(0, 1))
    store = Store(url, storage_options=s3.storage_options)
    assert [check_sample(store, j) for j in range(len(store))] == [name_of(0, 0), name_of(0, 1)]


def test_verify_opens_the_index_the_root_of_a_bucket_writers_store_names(s3, bucket, tmp_path):
    from h5feed.verify import verify_store

    url = f"s3://{bucket}/hs.zarr"
    with open_writer(url, writer="a", **options(),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "a")) as writer:
        for i in range(3):
            writer.append(make_sample(0, i), name=name_of(0, i))
    report = verify_store(url, progress=False, storage_options=s3.storage_options)
    assert report.ok and report.samples_checked == 3


def test_index_versions_superseded_long_enough_are_deleted_and_the_store_reads_on(s3, bucket, tmp_path, monkeypatch):
    import h5feed.conversion.writer_sites.bucket as bucket_site

    monkeypatch.setattr(bucket_site, "OLD_INDEX_AFTER_S", 0.0)  # "long enough": at once, for the test
    url = f"s3://{bucket}/hs.zarr"
    with open_writer(url, writer="a", **options(),
                     bucket=BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "a")) as writer:
        for i in range(5):
            writer.append(make_sample(0, i), name=name_of(0, i))
    versions = {key.split("/")[1] for key in bucket_objects(s3, bucket, "hs.zarr") if key.startswith("index-v/")}
    assert len(versions) == 2  # the one the root names and the one before it (commit n+2 witnesses n's end)
    store = Store(url, storage_options=s3.storage_options)
    assert [check_sample(store, j) for j in range(len(store))] == [name_of(0, i) for i in range(5)]
