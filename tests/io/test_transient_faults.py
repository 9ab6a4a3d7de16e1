"""Transient is not damage, on the read side: bytes corrupted on their way from the bucket (a fault proxy in front
of moto's S3 server flips a byte of chosen responses) are fetched again and read exact; the node cache keeps only
sound objects and replaces a poisoned one; damage that is really in the bucket is still an error after one refetch
(or a counted skip); and a stalled read stops at its deadline, which the error states."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import bits, inner_chunk_span
from s3_server import S3, Fault, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)
from torch.utils.data import DataLoader

from h5feed import HiddenStatesDataset, Store
from h5feed.errors import CorruptSampleError
from h5feed.io import IOStats, ObjectUnavailable, cache_state, open_url
from h5feed.store.layout import object_key, shard_index_nbytes
import h5feed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 6
PREFIX = "hs.zarr"


@pytest.fixture(scope="module")
def local(synthetic_store):
    """6 samples of 22..47 tokens in 16-token inner chunks, 3 to a shard."""
    return synthetic_store("transient", "speculators-legacy-pt", N, 32, (20, 70), chunk_tokens=16, seed=5)


@pytest.fixture
def remote(local, s3: S3, bucket: str) -> str:
    """The local store uploaded to the bucket; its URL."""
    objects = open_url(f"s3://{bucket}/{PREFIX}", s3.storage_options)
    for path in sorted(local.path.rglob("*")):
        if path.is_file():
            objects.put_atomic(path.relative_to(local.path).as_posix(), path.read_bytes())
    s3.proxy.reset()
    return f"s3://{bucket}/{PREFIX}"


def shard_key(store: Store, i: int, name: str = "aux_hidden_states") -> str:
    """The key, under the store's URL, of the first shard of sample i's `name`."""
    return object_key(store.info, name, int(store.sample_starts[i]) // store.info.shard_tokens)


def assert_same_sample(got, want) -> None:
    for field in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b), field


def bucket_bodies(s3: S3, bucket: str) -> set[bytes]:
    listed = s3.client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/")["Contents"]
    return {s3.client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def cached_bodies(cache: Path) -> list[bytes]:
    return [path.read_bytes() for path in sorted((cache / "objects").iterdir())]


def gets(s3: S3, key: str) -> list[str]:
    """The faults of the GETs of one object that reached the proxy, in order ("" for none)."""
    return [r.fault for r in s3.proxy.requests("GET", f"/{PREFIX}/{key}")]


def opened(remote: str, s3: S3, cache: Path | None = None, **kwargs) -> Store:
    store = Store(remote, storage_options=s3.storage_options, cache_dir=cache, **kwargs)
    store.io_stats = IOStats()
    s3.proxy.reset()
    return store


# =========================================================================== corrupted in transit: read exact


@pytest.mark.parametrize("flipped", ["index", "chunk"])
def test_bytes_flipped_in_transit_are_fetched_again_and_read_exact(local, remote, s3, flipped):
    """A shard read directly costs its index (its last bytes), then a range of the sample's chunks: a flipped byte
    in either fails its check, and a fresh request brings sound bytes."""
    reference = Store(local.path)
    store = opened(remote, s3)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    key = shard_key(store, i)
    if flipped == "index":
        s3.proxy.add(Fault(flip_at=3, path=key))
    else:  # the index's GET (shorter than 100 bytes: the fault passes it unchanged), then the chunks' GET, flipped
        assert shard_index_nbytes(store.info.chunks_per_shard) < 100
        s3.proxy.add(Fault(flip_at=100, path=key, times=2))
    assert_same_sample(store.read_sample(i), reference.read_sample(i))
    # the first read, then a fresh one from the index on (when the index failed, the chunks were never asked for)
    assert gets(s3, key) == (["flip", "", ""] if flipped == "index" else ["flip", "flip", "", ""])
    assert store.io_stats.retries == 1
    for j in range(N):
        assert_same_sample(store.read_sample(j), reference.read_sample(j))


def test_the_cache_keeps_only_sound_downloads(local, remote, s3, bucket, tmp_path):
    """A shard flipped on its way into the cache never enters it: it is downloaded again, checked, and then read."""
    reference = Store(local.path)
    cache = tmp_path / "cache"
    store = opened(remote, s3, cache)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    key = shard_key(store, i)
    s3.proxy.add(Fault(flip_at=100, path=key))  # inside the shard's first inner chunk
    assert_same_sample(store.read_sample(i), reference.read_sample(i))
    assert gets(s3, key) == ["flip", ""] and store.io_stats.retries == 1
    for j in range(N):
        assert_same_sample(store.read_sample(j), reference.read_sample(j))
    sound = bucket_bodies(s3, bucket)
    assert all(body in sound for body in cached_bodies(cache))
    assert cache_state(cache).partial == 0

    s3.proxy.reset()  # a later epoch reads the cache alone
    again = opened(remote, s3, cache)
    for j in range(N):
        assert_same_sample(again.read_sample(j), reference.read_sample(j))
    assert gets(s3, key) == [] and again.io_stats.retries == 0


def poison_cached_shard(local_store: Path, cache: Path, i: int) -> tuple[Path, bytes]:
    """Flip a byte inside sample i's first aux chunk in its cached copy: (the cached file, the sound bytes)."""
    shard, offset, _ = inner_chunk_span(local_store, i, "aux_hidden_states", 0)
    sound = shard.read_bytes()
    poisoned = next(path for path in (cache / "objects").iterdir() if path.read_bytes() == sound)
    data = bytearray(sound)
    data[offset + 50] ^= 0xFF
    poisoned.write_bytes(bytes(data))
    return poisoned, sound


def test_a_poisoned_cache_entry_is_replaced_once_and_later_epochs_read_it(local, remote, s3, bucket, tmp_path):
    """A cached copy that fails its check (written by an older h5feed, or rotted on disk) is replaced by a fresh,
    checked download; the epochs after it read the new copy without a request."""
    reference = Store(local.path)
    cache = tmp_path / "cache"
    store = opened(remote, s3, cache)
    for j in range(N):
        store.read_sample(j)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    key = shard_key(store, i)
    poisoned, sound = poison_cached_shard(local.path, cache, i)

    for epoch in range(2):
        store = opened(remote, s3, cache)
        for j in range(N):
            assert_same_sample(store.read_sample(j), reference.read_sample(j))
        assert (gets(s3, key), store.io_stats.retries) == (([""], 1) if epoch == 0 else ([], 0)), epoch
    assert poisoned.read_bytes() == sound  # replaced in place
    sound_bodies = bucket_bodies(s3, bucket)
    assert all(body in sound_bodies for body in cached_bodies(cache))
    assert cache_state(cache).partial == 0


def _read_in_race(store: Store, i: int, start, queue) -> None:
    start.wait()
    store.io_stats = IOStats()
    queue.put((hashlib.sha256(store.read_sample(i).aux_hidden_states.view(torch.uint8).numpy()).hexdigest(),
               store.io_stats.retries))


def test_processes_racing_on_a_poisoned_cache_entry_all_read_it_exact(local, remote, s3, bucket, tmp_path):
    """Three processes read the chunk of a poisoned cached copy at once: each replaces the copy at most once
    (under the shared lock: nobody waits for another's readers), and all of them read the sample exact."""
    reference = Store(local.path)
    cache = tmp_path / "cache"
    store = opened(remote, s3, cache)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    store.read_sample(i)
    poisoned, sound = poison_cached_shard(local.path, cache, i)
    s3.proxy.reset()
    ctx = mp.get_context("fork")
    start, queue = ctx.Barrier(3), ctx.Queue()
    processes = [ctx.Process(target=_read_in_race, args=(store, i, start, queue)) for _ in range(3)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(10)
        assert process.exitcode == 0
    want = hashlib.sha256(reference.read_sample(i).aux_hidden_states.view(torch.uint8).numpy()).hexdigest()
    assert [digest for digest, _ in results] == [want] * 3
    assert 1 <= len(gets(s3, shard_key(store, i))) <= sum(retries for _, retries in results) <= 3  # downloads, failures
    assert poisoned.read_bytes() == sound and cache_state(cache).partial == 0


def test_a_dataloader_over_a_faulty_network_reads_exact_and_counts_the_refetches(local, remote, s3, bucket, tmp_path,
                                                                                 assert_same_batch):
    """DataLoader workers filling the cache through flipped bodies: every item exact, none skipped, the refetches
    counted in the workers' counters, the cache sound.  Spawned workers read with obstore, which does not check
    a whole object's checksum itself (s3fs, which a worker forked from this process uses, does: its error is
    the I/O layer's to retry)."""
    cache = tmp_path / "cache"
    reference = HiddenStatesDataset(local.path)
    want = [reference[i] for i in range(N)]
    dataset = HiddenStatesDataset(h5feed.StoreOptions(remote, storage_options=s3.storage_options, cache_dir=cache),
                                  on_corrupt="skip")
    keys = {shard_key(dataset.store, i, name) for i in range(N) for name in ("aux_hidden_states", "last_hidden_states")}
    assert len(keys) >= 2
    for key in sorted(keys)[:2]:
        s3.proxy.add(Fault(flip_at=100, path=key))
    got = list(DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    assert len(got) == N
    for g, w in zip(got, want):
        assert_same_batch(g, w)
    snapshot = dataset.counters.snapshot()
    assert (snapshot.total("retries"), snapshot.total("corrupt")) == (2, 0)
    assert sorted(r.fault for r in s3.proxy.requests() if r.fault) == ["flip", "flip"]
    sound = bucket_bodies(s3, bucket)
    assert all(body in sound for body in cached_bodies(cache))


# =========================================================================== damage in the bucket is still damage


@pytest.mark.parametrize("cached", [False, True])
def test_damage_in_the_bucket_raises_after_one_refetch(local, remote, s3, bucket, tmp_path, cached):
    store = Store(local.path)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    path, offset, _ = inner_chunk_span(local.path, i, "aux_hidden_states", 0)
    key = path.relative_to(local.path).as_posix()
    data = bytearray(path.read_bytes())
    data[offset + 50] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=f"{PREFIX}/{key}", Body=bytes(data))
    cache = tmp_path / "cache" if cached else None
    remote_store = opened(remote, s3, cache)
    with pytest.raises(CorruptSampleError) as err:
        remote_store.read_sample(i)
    assert err.value.path == f"{remote}/{key}" and err.value.sample == i
    assert re.fullmatch(
        rf"{re.escape(remote)}/{re.escape(key)}: sample {i} \(converted from {re.escape(store.source_paths[i])}\): "
        r"inner chunk 0 fails its checksum \(crc32c 0x[0-9a-f]{8}, stored 0x[0-9a-f]{8}\), and again when read "
        rf"afresh; the store is damaged: run `h5feed verify {re.escape(remote)}`", str(err.value))
    # two reads of it, each its own: a whole download into the cache, or the shard's index and then its chunks
    assert gets(s3, key) == (["", ""] if cached else ["", "", "", ""])
    assert remote_store.io_stats.retries == 1
    if cached:
        assert data not in cached_bodies(cache) and cache_state(cache).partial == 0


def test_with_skip_a_flip_in_transit_is_delivered_and_damage_is_a_counted_skip(local, remote, s3, bucket, tmp_path,
                                                                              assert_same_batch):
    reference = HiddenStatesDataset(local.path)
    store = Store(local.path)
    damaged = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    transit = next(j for j in range(N) if shard_key(store, j) != shard_key(store, damaged))
    path, offset, _ = inner_chunk_span(local.path, damaged, "aux_hidden_states", 0)
    data = bytearray(path.read_bytes())
    data[offset + 50] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=f"{PREFIX}/{path.relative_to(local.path).as_posix()}", Body=bytes(data))
    for cache in (None, tmp_path / "cache"):
        s3.proxy.reset()
        dataset = HiddenStatesDataset(h5feed.StoreOptions(remote, storage_options=s3.storage_options, cache_dir=cache),
                                      on_corrupt="skip")
        s3.proxy.add(Fault(flip_at=3, path=shard_key(store, transit)))
        assert_same_batch(dataset[transit], reference[transit])  # the sound sample itself, not a stand-in
        assert dataset.counters.snapshot().total("corrupt") == 0
        assert_same_batch(dataset[damaged], reference[(damaged + 1) % N])  # the next sound sample stands in
        assert dataset.counters.snapshot().total("corrupt") == 1


def test_a_local_shard_that_fails_is_mapped_again_once_then_damage(local, tmp_path, flip_byte, caplog):
    store_path = tmp_path / "store"
    shutil.copytree(local.path, store_path)
    store = Store(store_path)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    shard = flip_byte(store_path, i, "aux_hidden_states", chunk=1, at=60)
    with pytest.raises(CorruptSampleError) as err:
        store.read_sample(i)
    assert re.fullmatch(
        rf"{re.escape(str(shard))}: sample {i} \(converted from {re.escape(store.source_paths[i])}\): inner chunk 1 "
        r"fails its checksum \(crc32c 0x[0-9a-f]{8}, stored 0x[0-9a-f]{8}\), and again when read afresh; the store "
        rf"is damaged: run `h5feed verify {re.escape(str(store_path))}`", str(err.value))
    warnings = [r.getMessage() for r in caplog.records if r.name == "h5feed.store.reader"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{shard}: inner chunk 1 fails its checksum")
    assert warnings[0].endswith("; reading it again")


# =========================================================================== a deadline per sample read


def test_a_stalled_read_stops_at_its_deadline_which_the_error_states(remote, s3):
    store = opened(remote, s3, read_deadline=0.5)
    s3.proxy.delay = 5.0  # every request stalls
    started = time.monotonic()
    with pytest.raises(ObjectUnavailable) as err:
        store.read_sample(0)
    elapsed = time.monotonic() - started
    assert str(err.value) == (
        f"{remote}/{shard_key(store, 0)}: sample 0 was not read within its deadline of 0.5 s: the bucket is slow or "
        "unreachable; check the network, or give the Store a longer read_deadline")
    assert 0.5 <= elapsed < 3.0  # not the 5 s of the stalled request
