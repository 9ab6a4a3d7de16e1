"""Training straight from a bucket: a store uploaded to a real S3 API (moto's server, behind the fault proxy)
read by every h5feed reader, equal to the same store read locally, under every worker start method.

Requests are counted twice, independently: by the proxy (what reached the server) and by the loader's
own counters (what h5feed says it did), and the two must agree.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from pathlib import Path

import pytest
import torch
from conftest import inner_chunk_span
from s3_server import S3, Fault, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)
from torch.utils.data import DataLoader

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, HiddenStatesStream, Store, StreamLoader
from h5feed.errors import CorruptSampleError
from h5feed.io import AccessDenied, IOStats, ObjectNotFound, cache_state, open_url
from h5feed.store.format import CHECKSUMMED, TOKEN_ARRAYS
from h5feed.store.layout import object_key, shard_index_nbytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 6
WORKERS = 2
OBJECTS_PER_SAMPLE = len(CHECKSUMMED)  # one shard per array
# input_ids and loss_mask: the shard in one request; each hidden-state shard: its index, then the chunks
# wanted in ranges of whole chunks up to 16 MiB (here: one range)
REQUESTS_PER_SAMPLE = 2 + 2 * 2


@pytest.fixture(scope="module")
def local(synthetic_store):
    """6 samples of 22..47 tokens in 16-token inner chunks: shards of 3 chunks, so max_len reads part of some."""
    return synthetic_store("remote", "speculators-legacy-pt", N, 32, (20, 70), chunk_tokens=16, seed=5)


def upload(store: Path, s3: S3, bucket: str, prefix: str = "hs.zarr") -> str:
    """Put every file of a local store into the bucket (through h5feed's own atomic PUTs); the store's URL."""
    url = f"s3://{bucket}/{prefix}"
    objects = open_url(url, s3.storage_options)
    for path in sorted(store.rglob("*")):
        if path.is_file():
            objects.put_atomic(path.relative_to(store).as_posix(), path.read_bytes())
    s3.proxy.reset()
    return url


@pytest.fixture
def remote(local, s3: S3, bucket: str) -> str:
    return upload(local.path, s3, bucket)


def data_requests(s3: S3, method: str | None = "GET") -> list:
    """Requests for the arrays' objects (not the metadata, index or listings)."""
    return [r for r in s3.proxy.requests(method) if any(f"/{name}/c/" in r.path for name in CHECKSUMMED)]


def items(loader) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in item.items()} for item in loader]


def assert_same_items(got, want, assert_same_batch) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_batch(g, w)


def assert_counted(loader_dataset, s3: S3, workers: int) -> None:
    """The workers' counters hold every data request the server saw (the trainer's process made none),
    plus one listing of each hidden-state array per worker (the objects' sizes)."""
    snapshot = loader_dataset.counters.snapshot()
    assert len(snapshot.workers) == workers
    assert sum(w.requests for w in snapshot.workers) == len(data_requests(s3)) + 2 * workers
    assert all(w.network_bytes > 0 for w in snapshot.workers)


# =========================================================================== the same items, every start method


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataset_and_stream_in_workers_equal_the_local_store(local, remote, s3, method, assert_same_batch):
    options = s3.storage_options
    reference = HiddenStatesDataset(local.path, max_len=20)
    want = items(reference[i] for i in range(N))
    dataset = HiddenStatesDataset(h5feed.StoreOptions(remote, storage_options=options), max_len=20)
    got = items(DataLoader(dataset, batch_size=None, num_workers=WORKERS, multiprocessing_context=method))
    assert_same_items(got, want, assert_same_batch)
    assert_counted(dataset, s3, WORKERS)
    # speculators-legacy reads max_len + 1 = 21 tokens: all the chunks of some samples, part of the others'
    assert {-(-min(n, 21) // 16) < -(-n // 16) for n in local.lengths} == {True, False}
    assert len(data_requests(s3)) == N * REQUESTS_PER_SAMPLE

    s3.proxy.reset()
    want = items(HiddenStatesStream(local.path, schedule=h5feed.ScheduleOptions(seed=1)))
    stream = HiddenStatesStream(h5feed.StoreOptions(remote, storage_options=options),
                                schedule=h5feed.ScheduleOptions(seed=1), reading=h5feed.ReadOptions(prefetch=3))
    got = items(StreamLoader(stream, batch_size=None, num_workers=WORKERS, multiprocessing_context=method))
    assert_same_items(got, want, assert_same_batch)
    assert_counted(stream, s3, WORKERS)
    assert len(data_requests(s3)) == N * REQUESTS_PER_SAMPLE


def test_batch_loader_batches_equal_the_local_store(local, remote, s3, assert_same_batch):
    for kwargs in ({"decode": h5feed.ThreadsOptions(threads=2)}, {"num_workers": 2}):
        got = items(BatchLoader(h5feed.StoreOptions(remote, storage_options=s3.storage_options), flavor="speculators",
                                max_len=30, batch_size=2, schedule=h5feed.ScheduleOptions(seed=4), **kwargs))
        want = items(BatchLoader(local.path, flavor="speculators", max_len=30, batch_size=2,
                                 schedule=h5feed.ScheduleOptions(seed=4), **kwargs))
        assert_same_items(got, want, assert_same_batch)


def test_partial_reads_fetch_only_the_chunks_wanted(local, remote, s3):
    """A max_len read of a long sample fetches each hidden-state shard's index, then only the chunks wanted."""
    store, local_store = Store(remote, storage_options=s3.storage_options), Store(local.path)
    i = max(range(N), key=lambda j: int(local_store.sample_lengths[j]))  # 47 tokens: 3 chunks of 16
    store.io_stats = stats = IOStats()
    s3.proxy.reset()
    got, want = store.read_sample(i, 17), local_store.read_sample(i, 17)  # chunks 0 and 1
    assert torch.equal(got.aux_hidden_states.view(torch.int16), want.aux_hidden_states.view(torch.int16))
    assert torch.equal(got.last_hidden_state.view(torch.int16), want.last_hidden_state.view(torch.int16))
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)
    assert len(data_requests(s3)) == REQUESTS_PER_SAMPLE
    wanted = 0
    for name in CHECKSUMMED:
        path, offset, length = inner_chunk_span(local.path, i, name, 1)
        index = shard_index_nbytes(local_store.info.chunks_per_shard)
        wanted += path.stat().st_size if name in TOKEN_ARRAYS else index + offset + length  # chunk 0 starts at 0
    assert stats.bytes == wanted < local_store.stored_nbytes()


def test_samples_ahead_are_fetched_concurrently(remote, s3):
    """`will_need` fetches a sample's objects at once, and several samples ahead before any read; the reads
    then take what was fetched."""
    store = Store(remote, storage_options=s3.storage_options)
    gate = s3.proxy.gate(OBJECTS_PER_SAMPLE, path="/c/")  # opens only once a sample's 4 objects are asked at once
    ahead = 4
    for i in range(ahead):
        store.will_need(i)
    deadline = time.monotonic() + 60
    while len(data_requests(s3)) < ahead * REQUESTS_PER_SAMPLE and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gate.filled and len(data_requests(s3)) == ahead * REQUESTS_PER_SAMPLE
    for i in range(ahead):
        store.read_sample(i, read_ahead=False)
    assert len(data_requests(s3)) == ahead * REQUESTS_PER_SAMPLE


def test_the_store_pickles_as_its_location_and_options(remote, s3):
    store = Store(remote, storage_options=s3.storage_options, cache_dir="/tmp/unused-h5feed-cache")
    assert store.__getstate__() == {"location": remote, "checked": True, "storage_options": s3.storage_options,
                                    "cache_dir": "/tmp/unused-h5feed-cache", "cache_limit": None,
                                    "num_samples": len(store), "read_deadline": 300.0}  # the snapshot an append keeps
    assert len(pickle.dumps(store)) < 1000
    assert pickle.loads(pickle.dumps(store)).sample_lengths.tolist() == store.sample_lengths.tolist()


def test_split_samples_takes_a_url(local, remote, s3):
    assert h5feed.split_samples(h5feed.StoreOptions(remote, storage_options=s3.storage_options), 0.5, seed=3) == \
        h5feed.split_samples(local.path, 0.5, seed=3)


# =========================================================================== the node cache


def test_the_second_epoch_reads_the_cache_and_makes_no_request(local, remote, s3, tmp_path, assert_same_batch):
    cache = tmp_path / "cache"
    want = items(HiddenStatesStream(local.path, schedule=h5feed.ScheduleOptions(seed=2)))
    stream = HiddenStatesStream(h5feed.StoreOptions(remote, storage_options=s3.storage_options, cache_dir=cache),
                                schedule=h5feed.ScheduleOptions(seed=2))
    loader = StreamLoader(stream, batch_size=None, num_workers=WORKERS)
    assert_same_items(items(loader), want, assert_same_batch)
    first = stream.counters.snapshot()
    assert first.total("cache_misses") == N * OBJECTS_PER_SAMPLE and first.total("cache_hits") == 0
    assert len(data_requests(s3, "HEAD")) == N * OBJECTS_PER_SAMPLE  # each object downloaded once
    assert cache_state(cache).objects == N * OBJECTS_PER_SAMPLE

    s3.proxy.reset()
    assert_same_items(items(loader), want, assert_same_batch)  # the same epoch again: new workers, same order
    assert s3.proxy.requests() == []  # forked workers: not even metadata
    second = stream.counters.snapshot()
    assert second.total("cache_hits") == N * OBJECTS_PER_SAMPLE and second.total("requests") == first.total("requests")

    described = h5feed.describe_store(remote, storage_options=s3.storage_options, cache_dir=cache)
    assert described["cache"].startswith(f"cache {cache}: {N * OBJECTS_PER_SAMPLE} objects")
    assert "50% hits (24 hits, 24 misses" in described["cache"]


# =========================================================================== failures


@pytest.mark.parametrize("cached", [False, True])
def test_a_flipped_byte_in_the_bucket_raises_naming_the_object(local, s3, bucket, tmp_path, cached):
    url = upload(local.path, s3, bucket)
    store = Store(local.path)
    i = max(range(N), key=lambda j: int(store.sample_lengths[j]))
    path, offset, _ = inner_chunk_span(local.path, i, "aux_hidden_states", 0)
    key = f"hs.zarr/{path.relative_to(local.path).as_posix()}"
    data = bytearray(path.read_bytes())
    data[offset + 50] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    remote = Store(url, storage_options=s3.storage_options, cache_dir=tmp_path / "c" if cached else None)
    for max_tokens in (None, 17):  # the whole shard, and a span of it
        with pytest.raises(CorruptSampleError) as err:
            remote.read_sample(i, max_tokens)
        assert err.value.path == f"s3://{bucket}/{key}"
        assert err.value.sample == i and "inner chunk 0 fails its checksum" in str(err.value)
    for j in set(range(N)) - {i}:
        remote.read_sample(j)  # the others are sound


def test_transient_failures_are_retried_and_counted_for_the_monitor(local, remote, s3, caplog, assert_same_batch):
    """503s, and connections cut.  Spawned workers read with obstore, which counts every cut; a worker forked
    from this process (which used obstore in earlier tests) reads with s3fs, where aiohttp re-sends a request
    cut in its response head once itself, uncounted (tests/io/test_io_failures.py)."""
    s3.proxy.add(Fault(status=503, code="SlowDown", path="/last_hidden_states/c/", times=3))
    s3.proxy.add(Fault(drop_after=100, path="/aux_hidden_states/c/", times=2))
    stream = HiddenStatesStream(h5feed.StoreOptions(remote, storage_options=s3.storage_options),
                                schedule=h5feed.ScheduleOptions(seed=0))
    loader = StreamLoader(stream, batch_size=None, num_workers=WORKERS, multiprocessing_context="spawn")
    caplog.set_level(logging.INFO, logger="h5feed.monitor")
    got = [{k: v.clone() for k, v in item.items()} for item in h5feed.monitor(loader, every=60)]
    assert_same_items(got, items(HiddenStatesStream(local.path, schedule=h5feed.ScheduleOptions(seed=0))),
                      assert_same_batch)
    assert stream.counters.snapshot().total("retries") == 5
    assert sorted(r.fault for r in s3.proxy.requests() if r.fault) == ["drop", "drop", "status", "status", "status"]
    end = next(m for m in caplog.messages if "finished" in m)
    assert "| network " in end and ", 5 retries" in end


def test_a_deleted_object_stops_with_an_error_naming_it(remote, s3, bucket):
    store = Store(remote, storage_options=s3.storage_options)
    store.read_sample(0)  # the objects' sizes are listed now
    key = f"hs.zarr/{object_key(store.info, 'aux_hidden_states', int(store.sample_starts[1]) // store.info.shard_tokens)}"
    s3.client.delete_object(Bucket=bucket, Key=key)
    for reader in (store, Store(remote, storage_options=s3.storage_options)):  # a GET's 404, a HEAD's 404
        with pytest.raises(ObjectNotFound) as err:
            reader.read_sample(1)
        assert str(err.value).startswith(f"s3://{bucket}/{key}: no such object or bucket; check the URL")


def test_access_denied_stops_with_an_error_naming_the_object(remote, s3, bucket):
    stream = HiddenStatesStream(h5feed.StoreOptions(remote, storage_options=s3.storage_options),
                                schedule=h5feed.ScheduleOptions(shuffle=False))
    s3.proxy.add(Fault(status=403, code="AccessDenied", path="/loss_mask/", times=None))
    with pytest.raises(AccessDenied, match=f"^s3://{bucket}/hs.zarr/loss_mask/c/0: access denied"):
        next(iter(stream))


# =========================================================================== the command line


def test_verify_and_inspect_take_a_url_and_storage_options(local, remote, s3, bucket, cli, tmp_path):
    options = ["--storage-option", f"endpoint_url={s3.proxy.url}", "--storage-option", "key=testing",
               "--storage-option", "secret=testing", "--storage-option", "client_kwargs.region_name=us-east-1"]
    result = cli("verify", remote, *options)
    assert result.status == 0 and f"{remote}: {N} samples OK (checksums)" in result.output

    result = cli("inspect", remote, "--json", *options, "--cache-dir", tmp_path / "c")
    summary, want = json.loads(result.stdout), h5feed.describe_store(local.path)
    assert {k: v for k, v in summary.items() if k not in ("store", "cache")} == \
        {k: v for k, v in want.items() if k != "store"}
    assert summary["store"] == remote and summary["cache"].startswith(f"cache {tmp_path / 'c'}: 0 objects")

    key = f"hs.zarr/{object_key(Store(local.path).info, 'loss_mask', 0)}"
    s3.client.delete_object(Bucket=bucket, Key=key)
    result = cli("verify", remote, *options)
    assert result.status == 1 and f"s3://{bucket}/{key}: no such object" in result.output

    result = cli("inspect", remote, "--storage-option", "endpoint_url")
    assert result.status == 1 and "--storage-option 'endpoint_url': expected KEY=VALUE" in result.output


def test_bench_reads_a_url(local, remote, s3, cli):
    options = ["--storage-option", f"endpoint_url={s3.proxy.url}", "--storage-option", "key=testing",
               "--storage-option", "secret=testing"]
    result = cli("bench", remote, *options, "--loaders", "pt-baseline,StreamLoader", "--workers", "1",
                 "--no-cold", "--json")
    assert result.status == 0, result.output
    report = json.loads(result.stdout)
    assert report["store"] == remote and report["store_bytes"] == Store(local.path).stored_nbytes()
    assert [(p["loader"], p["samples"]) for p in report["passes"]] == [("pt-baseline", N), ("StreamLoader", N)]
    assert report["checks"] == {"pt-baseline": "reference", "StreamLoader": "equal"}  # same batches from the bucket
