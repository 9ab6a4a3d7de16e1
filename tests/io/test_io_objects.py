"""The ObjectStore interface, the same on every backend: a local folder, and S3 (moto on loopback,
through the test proxy) read with obstore and with s3fs; plus https:// read-only."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed.io import (
    PART_BYTES,
    FsspecStore,
    IOStats,
    LocalStore,
    ObjectError,
    ObjectNotFound,
    ObjectStore,
    RetryPolicy,
    S3Store,
    is_remote,
    open_url,
    parse_storage_options,
)

BACKENDS = ("local", "s3-obstore", "s3-s3fs")
FAST = RetryPolicy(attempts=3, base=0.001, cap=0.01)  # a short range is fetched again before it is an error


def payload(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(nbytes)


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """An empty store rooted at a prefix (or folder) of its own, counting into a fresh IOStats."""
    if request.param == "local":
        yield open_url(tmp_path / "root")
        return
    s3: S3 = request.getfixturevalue("s3")
    name = request.getfixturevalue("bucket")
    opened = S3Store(f"s3://{name}/stores/hs.zarr", s3.storage_options, concurrency=8, retry=FAST,
                     use_obstore=request.param == "s3-obstore")
    opened.stats = IOStats()
    yield opened


def test_open_url_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_url(tmp_path), LocalStore)
    assert open_url(f"file://{tmp_path}/a%20b").local_path("k") == tmp_path / "a b" / "k"
    assert type(open_url("s3://bucket/prefix")) is S3Store
    assert type(open_url("gs://bucket/prefix")) is FsspecStore
    assert open_url("https://example.org/hs.zarr").read_only
    assert [is_remote(u) for u in (tmp_path, f"file://{tmp_path}", "s3://b/p", "simplecache::s3://b/p")] == [
        False, False, True, True]


def test_storage_options_from_the_command_line() -> None:
    got = parse_storage_options(["key=abc", "anon=false", "client_kwargs.region_name=eu-west-1",
                                 "config_kwargs.max_pool_connections=64", 'token="123"'])
    assert got == {"key": "abc", "anon": False, "client_kwargs": {"region_name": "eu-west-1"},
                   "config_kwargs": {"max_pool_connections": 64}, "token": "123"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_storage_options(["region"])


def test_put_get_size_list_delete(store: ObjectStore) -> None:
    objects = {"zarr.json": b"{}", "rows_0/data_0.pt": payload(1000, 1), "rows_0/data_1.pt": payload(10, 2),
               "rows_1/data_2.pt": payload(3000, 3), "rows_1/deeper/x": b""}
    for key, data in objects.items():
        store.put_atomic(key, data)
    assert store.list() == {key: len(data) for key, data in sorted(objects.items())}
    assert store.list("rows_1") == {"rows_1/data_2.pt": 3000, "rows_1/deeper/x": 0}
    assert store.list("rows_9") == {}
    for key, data in objects.items():
        assert store.get(key) == data and store.size(key) == len(data) and store.exists(key)
    store.put_atomic("rows_0/data_0.pt", b"replaced")
    assert store.get("rows_0/data_0.pt") == b"replaced"
    store.delete("rows_0/data_1.pt")
    store.delete("rows_0/data_1.pt")  # not there any more: no error
    assert not store.exists("rows_0/data_1.pt") and not store.exists("rows_0")  # a folder is not an object
    assert sorted(store.list()) == ["rows_0/data_0.pt", "rows_1/data_2.pt", "rows_1/deeper/x", "zarr.json"]


def test_get_ranges_returns_exact_bytes(store: ObjectStore) -> None:
    data = payload(3 * PART_BYTES // 2 + 7)
    store.put_atomic("shard", data)
    ranges = [(0, 1), (5, 5), (100, 300_000), (PART_BYTES, len(data)), (0, len(data)), (len(data) - 1, len(data))]
    got = store.get_ranges("shard", ranges)
    assert [bytes(g) for g in got] == [data[a:b] for a, b in ranges]
    assert store.get_large("shard") == data
    if is_remote(store.url):  # one request per non-empty range, every byte counted
        before = store.stats.snapshot()  # type: ignore[attr-defined]
        store.get_ranges("shard", ranges)
        after = store.stats.snapshot()  # type: ignore[attr-defined]
        assert after["requests"] - before["requests"] == 5
        assert after["bytes"] - before["bytes"] == sum(b - a for a, b in ranges)


def test_missing_objects_and_short_ranges_name_the_object(store: ObjectStore) -> None:
    store.put_atomic("small", b"0123456789")
    url = store.key_url("nothing")
    for call in (lambda: store.get("nothing"), lambda: store.get_ranges("nothing", [(0, 4)]),
                 lambda: store.size("nothing")):
        with pytest.raises(ObjectNotFound) as err:
            call()
        assert str(err.value).startswith(f"{url}: no such")
    with pytest.raises(ObjectError, match=r"small: asked for bytes \[5, 20\) but got 5: the object is not the size"):
        store.get_ranges("small", [(5, 20)])


def test_stores_pickle_as_their_configuration(store: ObjectStore) -> None:
    store.put_atomic("a", b"abc")
    store.get("a")  # the client exists now; it does not travel
    copy = pickle.loads(pickle.dumps(store))
    assert copy.url == store.url and copy.get("a") == b"abc"
    assert not any(name.startswith("_client") for name in pickle.loads(pickle.dumps(store)).__dict__)


def test_local_put_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_atomic("a/b/c", b"x" * 100)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "c"]
    assert store.local_path("a/b/c").read_bytes() == b"x" * 100


def test_get_ranges_are_concurrent(s3: S3, bucket: str) -> None:
    """Eight ranges are held by the proxy until all eight are in flight at once (a sequential client never fills it)."""
    s3.client.put_object(Bucket=bucket, Key="shard", Body=payload(8000))
    for use_obstore in (True, False):
        store = S3Store(f"s3://{bucket}", s3.storage_options, concurrency=8, use_obstore=use_obstore)
        gate = s3.proxy.gate(8, path="/shard")
        got = store.get_ranges("shard", [(i * 1000, (i + 1) * 1000) for i in range(8)])
        assert b"".join(got) == payload(8000) and gate.filled, store.reader


def test_connection_pool_is_sized_to_the_concurrency(s3: S3, bucket: str) -> None:
    """botocore's default pool of 10 would hold 30 requests to 10 at a time, and the gate would never fill."""
    s3.client.put_object(Bucket=bucket, Key="shard", Body=payload(30_000))
    store = S3Store(f"s3://{bucket}", s3.storage_options, concurrency=30, use_obstore=False)
    gate = s3.proxy.gate(30, path="/shard")
    got = store.get_ranges("shard", [(i * 1000, (i + 1) * 1000) for i in range(30)])
    assert b"".join(got) == payload(30_000) and gate.filled


def test_https_is_read_only(s3: S3, bucket: str) -> None:
    data = payload(5000)
    s3.client.put_object(Bucket=bucket, Key="public/hs.zarr/shard", Body=data, ACL="public-read")
    store = open_url(f"{s3.proxy.url}/{bucket}/public/hs.zarr")
    assert isinstance(store, FsspecStore) and store.read_only
    assert store.size("shard") == 5000 and store.get("shard") == data
    assert [bytes(b) for b in store.get_ranges("shard", [(10, 20), (4000, 5000)])] == [data[10:20], data[4000:]]
    with pytest.raises(ObjectError, match="hs.zarr/x: this location is read-only"):
        store.put_atomic("x", b"1")


def test_chained_urls(s3: S3, bucket: str) -> None:
    """A store inside a zip inside a bucket: a synchronous fsspec filesystem, read from a thread pool."""
    files = {"hs.zarr/zarr.json": b"{}", "hs.zarr/shard/0": payload(100_000)}
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    s3.client.put_object(Bucket=bucket, Key="stores.zip", Body=archive.getvalue())
    store = open_url(f"zip://hs.zarr::s3://{bucket}/stores.zip", {"s3": s3.storage_options})
    assert type(store) is FsspecStore and store.list() == {"shard/0": 100_000, "zarr.json": 2}
    ranges = [(0, 10), (50_000, 100_000)]
    assert [bytes(b) for b in store.get_ranges("shard/0", ranges)] == [files["hs.zarr/shard/0"][a:b] for a, b in ranges]
    assert store.get("zarr.json") == b"{}"
