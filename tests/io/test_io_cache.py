"""The node-local cache in front of a real S3 API: reuse, LRU eviction that spares objects in use,
processes racing for one object, and a reader killed mid-download."""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed.io import PART_BYTES, CachedStore, IOStats, NodeCache, S3Store, cache_state, open_url

BIG = np.random.default_rng(2).bytes(2 * PART_BYTES + 5)  # three parts
SMALL = {name: np.random.default_rng(i).bytes(1_000_000) for i, name in enumerate("abcd")}


def cached_store(s3: S3, bucket: str, cache_dir: Path, limit: int | None = None) -> CachedStore:
    store = CachedStore(S3Store(f"s3://{bucket}", s3.storage_options, concurrency=4), NodeCache(cache_dir, limit))
    store.stats = IOStats()
    return store


def gets(s3: S3, key: str) -> int:
    return len(s3.proxy.requests("GET", f"/{key}"))


def test_the_second_read_is_local(s3: S3, bucket: str, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=bucket, Key="big", Body=BIG)
    store = cached_store(s3, bucket, tmp_path / "cache")
    ranges = [(0, 10), (PART_BYTES - 5, PART_BYTES + 5), (len(BIG) - 3, len(BIG))]
    assert [bytes(b) for b in store.get_ranges("big", ranges)] == [BIG[a:b] for a, b in ranges]
    assert gets(s3, "big") == 3 and len(s3.proxy.requests("HEAD", "/big")) == 1  # its size, then three parts at once
    assert [bytes(b) for b in store.get_ranges("big", ranges)] == [BIG[a:b] for a, b in ranges]
    with store.open_cached("big") as obj, mmap.mmap(obj.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert mapped[:] == BIG
    assert gets(s3, "big") == 3 and len(s3.proxy.requests()) == 4  # nothing more from the bucket
    stats = store.stats.snapshot()  # type: ignore[attr-defined]
    assert (stats["cache_hits"], stats["cache_misses"], stats["requests"], stats["bytes"]) == (2, 1, 4, len(BIG))
    state = cache_state(tmp_path / "cache")
    assert (state.objects, state.bytes, state.hits, state.misses, state.downloaded_bytes, state.partial) == (
        1, len(BIG), 2, 1, len(BIG), 0)


def test_open_url_with_a_cache_and_what_inspect_shows(s3: S3, bucket: str, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=bucket, Key="hs.zarr/a", Body=SMALL["a"])
    store = open_url(f"s3://{bucket}/hs.zarr", s3.storage_options, cache_dir=tmp_path / "c", cache_limit=3_000_000)
    assert isinstance(store, CachedStore) and store.get_large("a") == SMALL["a"] == store.get_large("a")
    assert cache_state(tmp_path / "c").summary() == (
        f"cache {tmp_path / 'c'}: 1 objects, 0.00 GB (limit 0.00 GB); 50% hits "
        "(1 hits, 1 misses, 0.00 GB downloaded, 0 evicted)")
    assert cache_state(tmp_path / "c").limit_bytes == 3_000_000


def test_least_recently_used_objects_are_evicted(s3: S3, bucket: str, tmp_path: Path) -> None:
    for key, data in SMALL.items():
        s3.client.put_object(Bucket=bucket, Key=key, Body=data)
    store = cached_store(s3, bucket, tmp_path / "cache", limit=2_500_000)  # room for two
    for key in "aba":
        assert store.get_large(key) == SMALL[key]
    assert store.get_large("c") == SMALL["c"]  # b was used longest ago
    assert [gets(s3, k) for k in "abc"] == [1, 1, 1]
    assert store.get_large("a") == SMALL["a"] and gets(s3, "a") == 1  # still cached
    assert store.get_large("b") == SMALL["b"] and gets(s3, "b") == 2  # fetched again; c goes
    state = cache_state(tmp_path / "cache")
    assert (state.objects, state.bytes, state.evictions) == (2, 2_000_000, 2)


def test_an_object_in_use_is_never_evicted(s3: S3, bucket: str, tmp_path: Path) -> None:
    for key, data in SMALL.items():
        s3.client.put_object(Bucket=bucket, Key=key, Body=data)
    store = cached_store(s3, bucket, tmp_path / "cache", limit=1_500_000)  # room for one
    with store.open_cached("a") as held:
        assert store.get_large("b") == SMALL["b"]  # a is in use: the cache goes over its limit rather than evict it
        assert cache_state(tmp_path / "cache").objects == 2
        assert store.get_large("c") == SMALL["c"]  # evicts b, not the older a
        assert held.read() == SMALL["a"] and store.get_large("a") == SMALL["a"] and gets(s3, "a") == 1
        assert cache_state(tmp_path / "cache").evictions == 1
    assert store.get_large("d") == SMALL["d"]  # a is free again, and the least recently used
    assert [gets(s3, k) for k in "abcd"] == [1, 1, 1, 1]
    assert store.get_large("c") == SMALL["c"] and store.get_large("a") == SMALL["a"] and gets(s3, "a") == 2


def test_metadata_and_rewritten_objects_are_never_stale(s3: S3, bucket: str, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=bucket, Key="zarr.json", Body=b'{"status": "converting"}')
    s3.client.put_object(Bucket=bucket, Key="a", Body=SMALL["a"])
    store = cached_store(s3, bucket, tmp_path / "cache")
    assert store.get("zarr.json") == b'{"status": "converting"}'  # get: metadata, never cached
    s3.client.put_object(Bucket=bucket, Key="zarr.json", Body=b'{"status": "complete"}')
    assert store.get("zarr.json") == b'{"status": "complete"}' and cache_state(tmp_path / "cache").objects == 0
    assert store.get_large("a") == SMALL["a"]
    store.put_atomic("a", SMALL["b"])  # a write through the store forgets this node's copy
    assert store.get_large("a") == SMALL["b"]
    s3.client.put_object(Bucket=bucket, Key="a", Body=SMALL["c"])  # rewritten by someone else:
    assert store.get_large("a") == SMALL["b"]  # cached objects are taken to be immutable,
    assert CachedStore(store.inner, store.cache, namespace="conversion 2").get_large("a") == SMALL["c"]  # hence this
    store.delete("a")
    assert not store.exists("a") and cache_state(tmp_path / "cache").objects == 1  # only conversion 2's copy is left


def _open_in_race(store: CachedStore, start: Any, queue: Any) -> None:
    start.wait()
    with store.open_cached("big") as obj:
        digest = hashlib.sha256(obj.read()).hexdigest()
    queue.put((digest, store.stats.cache_hits, store.stats.cache_misses))  # type: ignore[attr-defined]


def test_processes_racing_for_one_object_download_it_once(s3: S3, bucket: str, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=bucket, Key="big", Body=BIG)
    store = cached_store(s3, bucket, tmp_path / "cache")
    s3.proxy.delay = 0.2  # a download long enough for every process to arrive while it runs
    ctx = mp.get_context("fork")
    start, queue = ctx.Barrier(4), ctx.Queue()
    children = [ctx.Process(target=_open_in_race, args=(store, start, queue)) for _ in range(4)]
    for child in children:
        child.start()
    results = sorted(queue.get(timeout=120) for _ in children)
    for child in children:
        child.join(30)
    assert results == [(hashlib.sha256(BIG).hexdigest(), 0, 1)] + [(hashlib.sha256(BIG).hexdigest(), 1, 0)] * 3
    assert gets(s3, "big") == 3 and len(s3.proxy.requests("HEAD", "/big")) == 1  # one download
    state = cache_state(tmp_path / "cache")
    assert (state.objects, state.hits, state.misses, state.partial) == (1, 3, 1, 0)


def _download(storage_options: dict[str, Any], bucket: str, cache_dir: Path) -> None:
    store = CachedStore(S3Store(f"s3://{bucket}", storage_options, concurrency=4), NodeCache(cache_dir))
    store.get_large("big")


def test_a_reader_killed_mid_download_is_cleaned_up(s3: S3, bucket: str, tmp_path: Path) -> None:
    s3.client.put_object(Bucket=bucket, Key="big", Body=BIG)
    cache_dir = tmp_path / "cache"
    s3.proxy.gate(4, path="/big", timeout=60)  # holds the three part requests: the download cannot finish
    child = mp.get_context("fork").Process(target=_download, args=(s3.storage_options, bucket, cache_dir))
    child.start()
    deadline = time.monotonic() + 60
    while not (cache_dir / "partial").is_dir() or not os.listdir(cache_dir / "partial"):
        assert time.monotonic() < deadline and child.is_alive(), "the download never started"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join()
    assert len(os.listdir(cache_dir / "partial")) == 1 and len(os.listdir(cache_dir / "locks")) == 1
    s3.proxy.reset()

    store = cached_store(s3, bucket, cache_dir)  # this process's first use of the cache: it cleans up
    assert os.listdir(cache_dir / "partial") == os.listdir(cache_dir / "locks") == os.listdir(cache_dir / "objects") == []
    assert store.get_large("big") == BIG and gets(s3, "big") == 3
    assert cache_state(cache_dir).misses == 1


def test_without_a_cache_dir_nothing_is_cached(s3: S3, bucket: str) -> None:
    s3.client.put_object(Bucket=bucket, Key="a", Body=SMALL["a"])
    store = open_url(f"s3://{bucket}", s3.storage_options)
    assert not isinstance(store, CachedStore)
    assert store.get("a") == SMALL["a"] and store.get("a") == SMALL["a"] and gets(s3, "a") == 2


@pytest.mark.parametrize("limit", [None, 10])
def test_a_missing_object_leaves_nothing_behind(s3: S3, bucket: str, tmp_path: Path, limit: int | None) -> None:
    from h5feed.io import ObjectNotFound

    store = cached_store(s3, bucket, tmp_path / "cache", limit)
    with pytest.raises(ObjectNotFound, match=f"^s3://{bucket}/nothing: no such object"):
        store.get_large("nothing")
    assert os.listdir(tmp_path / "cache" / "partial") == os.listdir(tmp_path / "cache" / "objects") == []
