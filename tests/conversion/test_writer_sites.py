"""One conformance suite over every `WriterSite` (where an `open_writer` store can live): a local folder and a
bucket (moto's S3 server on loopback).  Each site must give a writer the same store for the same samples, refuse a
second process with a writer's id, give each commit of a shared step the state the last one left, and hold a
sample's shards in the store by the time `sample_written` returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WRITER_CHUNK, WRITER_SHARD, check_sample, make_sample, name_of
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed import BucketOptions, StoreError, StoreSettings, WriteOptions, open_writer
from h5feed.conversion.samples import array_rows, grow_arrays
from h5feed.conversion.writer_sites import BucketSite, LocalSite, WriterSite, open_site
from h5feed.io.local import PARTIAL_SUFFIX
from h5feed.store import Store
from h5feed.store.layout import object_key
from h5feed.store.writer_state import ROWS_LOCK, WriterFiles

SITES = ["local", "bucket"]


class Place:
    """A store's location on one site, and how to open writers, sites and readers of it."""

    def __init__(self, kind: str, tmp_path: Path, s3: S3 | None, bucket: str | None) -> None:
        self.kind, self.tmp_path = kind, tmp_path
        self.options = s3.storage_options if s3 is not None else None
        self.location = str(tmp_path / "hs.zarr") if kind == "local" else f"s3://{bucket}/hs.zarr"

    def site(self, writer: str | None, staging: str = "staging") -> WriterSite:
        return open_site(self.location, writer, self.options, self.tmp_path / staging)

    def writer(self, staging: str = "staging", **options):
        return open_writer(self.location, **options,
                           bucket=BucketOptions(storage_options=self.options, staging_dir=self.tmp_path / staging),
                           settings=StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD))

    def store(self) -> Store:
        return Store(self.location, storage_options=self.options)

    def holds(self, key: str) -> bool:
        if self.kind == "local":
            return (Path(self.location) / key).is_file()
        from h5feed.io import open_url

        return open_url(self.location, self.options).exists(key)


@pytest.fixture(params=SITES)
def place(request, tmp_path) -> Iterator[Place]:
    if request.param == "local":
        yield Place("local", tmp_path, None, None)
        return
    s3 = request.getfixturevalue("s3")
    yield Place("bucket", tmp_path, s3, request.getfixturevalue("bucket"))


def test_the_registry_gives_each_place_its_site(place):
    assert isinstance(place.site(None), {"local": LocalSite, "bucket": BucketSite}[place.kind])
    assert place.site(None).location == place.location


def test_a_writer_on_each_site_makes_a_store_that_reads_back_every_sample_exactly(place):
    with place.writer(writing=WriteOptions(publish_every=2)) as writer:
        for i in range(5):
            assert writer.append(make_sample(1, i), name=name_of(1, i)) == i
    assert writer.report.store == place.location and writer.report.published == 5
    store = place.store()
    assert [check_sample(store, j) for j in range(len(store))] == [name_of(1, i) for i in range(5)]


def test_a_second_process_with_a_writers_id_is_refused_on_each_site(place):
    with place.writer(writer="a") as first:
        first.append(make_sample(0, 0), name="a0")
        with pytest.raises(StoreError, match="is writing this store as writer 'a': give each writer"):
            place.writer(staging="other", writer="a")


def test_each_sites_commits_give_each_step_the_state_the_last_commit_left(place):
    with place.writer() as first:  # the store, with its arrays
        first.append(make_sample(1, 0), name=name_of(1, 0))
    base = array_rows(Path(first.path))
    sites = [place.site(f"w{k}", staging=f"staging-{k}") for k in range(2)]
    starts, rounds = [], 6

    def take_steps(site: WriterSite, k: int) -> None:
        def reserve() -> int:  # a rows step: the rows where the arrays end, taken by growing them
            start = array_rows(site.staging)
            time.sleep(0.01)  # the other writer's step runs meanwhile, or waits
            grow_arrays(site.staging, start + WRITER_SHARD, durable=False)
            return start

        with site.hold(WriterFiles(site.staging, f"w{k}")):
            for _ in range(rounds):
                starts.append(site.commit(ROWS_LOCK, reserve))

    threads = [threading.Thread(target=take_steps, args=(site, k)) for k, site in enumerate(sites)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    taken = sorted(starts)  # no rows given twice (in a bucket, rows a losing step grew may be left as holes)
    assert len(taken) == 2 * rounds and taken[0] >= base
    assert all(b - a >= WRITER_SHARD for a, b in zip(taken, taken[1:]))


def test_a_samples_shards_are_in_the_store_once_sample_written_returns(place, monkeypatch):
    seen: list[bool] = []
    with place.writer(writer="a") as writer:
        site = writer.site
        original = site.sample_written

        def check_after(info, start, rows):
            original(info, start, rows)
            seen.append(all(place.holds(object_key(info, name, start // WRITER_SHARD)) for name in info.array_names))

        monkeypatch.setattr(site, "sample_written", check_after)
        writer.append(make_sample(0, 0), name="a0")
        writer.append(make_sample(0, 1), name="a1")
    assert seen == [True, True]


def test_each_site_removes_the_partial_files_a_kill_left_when_the_writer_is_alone(place):
    site = place.site("a")
    with site.hold(WriterFiles(site.staging, "a")):
        left = site.staging / "aux_hidden_states" / "c" / "3" / f"0.1234{PARTIAL_SUFFIX}"
        left.parent.mkdir(parents=True)
        left.write_bytes(b"cut short")
        site.remove_partial_writes("a", own=list)
        assert not left.exists()
