"""Failures of a real S3 API, injected by the test proxy: transient ones are retried and counted,
permanent ones raise at once naming the object, a cut or short body is never returned as data, a stalled
request fails in the time the retry policy states, and an upload changed on the way is never stored."""

from __future__ import annotations

import hashlib
import re
import time

import numpy as np
import pytest
from s3_server import S3, Fault, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

import h5feed
from h5feed.io import AccessDenied, IOStats, ObjectNotFound, ObjectUnavailable, RetryPolicy, S3Store, TransferMismatch

FAST = RetryPolicy(attempts=4, base=0.001, cap=0.01)
STALLED = RetryPolicy(attempts=4, base=0.001, cap=0.01, timeout=1.0)
READERS = ("obstore", "s3fs")
DATA = np.random.default_rng(0).bytes(3_000_000)
RANGES = [(0, 1_000_000), (1_000_000, 3_000_000)]


def opened(s3: S3, bucket: str, reader: str, retry: RetryPolicy = FAST) -> S3Store:
    s3.client.put_object(Bucket=bucket, Key="shard", Body=DATA)
    store = S3Store(f"s3://{bucket}", s3.storage_options, concurrency=4, retry=retry, use_obstore=reader == "obstore")
    store.stats = IOStats()
    assert store.reader == reader
    return store


def retries(store: S3Store) -> int:
    return store.stats.retries  # type: ignore[attr-defined]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (503, "ServiceUnavailable")])
def test_server_errors_are_retried_and_counted(s3: S3, bucket: str, reader: str, status: int, code: str) -> None:
    store = opened(s3, bucket, reader)
    s3.proxy.add(Fault(status=status, code=code, path="/shard", times=2))
    assert [bytes(b) for b in store.get_ranges("shard", RANGES)] == [DATA[a:b] for a, b in RANGES]
    assert retries(store) == 2
    assert [r.fault for r in s3.proxy.requests("GET", "/shard")].count("status") == 2


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("cut_at", [100, 500_000])  # in the response head, mid-body
def test_dropped_connections_are_retried(s3: S3, bucket: str, reader: str, cut_at: int) -> None:
    """Every drop is one counted retry, except that aiohttp (under s3fs) silently re-sends a request
    once itself when the server hangs up before the first byte of a response: of three such drops
    h5feed sees one."""
    store = opened(s3, bucket, reader)
    s3.proxy.add(Fault(drop_after=cut_at, path="/shard", times=3))
    assert bytes(store.get_ranges("shard", [(0, 2_000_000)])[0]) == DATA[:2_000_000]
    assert retries(store) == (1 if (reader, cut_at) == ("s3fs", 100) else 3)
    assert [r.fault for r in s3.proxy.requests("GET", "/shard")] == ["drop"] * 3 + [""]
    s3.proxy.add(Fault(drop_after=500_000, path="/shard", times=1))
    assert store.get("shard") == DATA


@pytest.mark.parametrize("reader", READERS)
def test_a_cut_body_is_never_returned(s3: S3, bucket: str, reader: str) -> None:
    """With no retry left, a response cut mid-body is an error, not short data."""
    store = opened(s3, bucket, reader, retry=RetryPolicy(attempts=1))
    s3.proxy.add(Fault(drop_after=500_000, path="/shard", times=None))
    with pytest.raises(ObjectUnavailable) as err:
        store.get_ranges("shard", [(0, 2_000_000)])
    assert str(err.value).startswith(f"s3://{bucket}/shard: still failing after 1 attempts (")
    with pytest.raises(ObjectUnavailable):
        store.get("shard")


@pytest.mark.parametrize("reader", READERS)
def test_retries_are_bounded(s3: S3, bucket: str, reader: str) -> None:
    store = opened(s3, bucket, reader)
    s3.proxy.add(Fault(status=503, code="SlowDown", path="/shard", times=None))
    with pytest.raises(ObjectUnavailable) as err:
        store.get_ranges("shard", [(0, 10)])
    assert str(err.value).startswith(f"s3://{bucket}/shard: still failing after 4 attempts (")
    assert "retry later or lower the concurrency" in str(err.value)
    assert retries(store) == 3 and len(s3.proxy.requests("GET", "/shard")) == 4


@pytest.mark.parametrize("reader", READERS)
def test_access_denied_is_not_retried(s3: S3, bucket: str, reader: str) -> None:
    store = opened(s3, bucket, reader)
    s3.proxy.add(Fault(status=403, code="AccessDenied", path="/shard", times=None))
    with pytest.raises(AccessDenied) as err:
        store.get_ranges("shard", [(0, 10)])
    assert str(err.value).startswith(f"s3://{bucket}/shard: access denied; check the credentials")
    assert retries(store) == 0 and len(s3.proxy.requests("GET", "/shard")) == 1


@pytest.mark.parametrize("reader", READERS)
def test_missing_objects_and_buckets_are_not_retried(s3: S3, bucket: str, reader: str) -> None:
    store = opened(s3, bucket, reader)
    with pytest.raises(ObjectNotFound, match=f"^s3://{bucket}/nothing: no such object or bucket; check the URL"):
        store.get_ranges("nothing", [(0, 10)])
    elsewhere = S3Store("s3://no-such-bucket-h5feed/hs.zarr", s3.storage_options, retry=FAST,
                        use_obstore=reader == "obstore")
    with pytest.raises(ObjectNotFound, match="^s3://no-such-bucket-h5feed/hs.zarr/zarr.json: no such object"):
        elsewhere.get("zarr.json")
    assert retries(store) == 0


def test_writes_are_retried(s3: S3, bucket: str) -> None:
    store = opened(s3, bucket, "s3fs")
    s3.proxy.add(Fault(status=503, code="SlowDown", method="PUT", path="/new", times=2))
    store.put_atomic("new", DATA)
    assert s3.client.get_object(Bucket=bucket, Key="new")["Body"].read() == DATA
    assert retries(store) == 2


def test_an_unreachable_endpoint_says_so() -> None:
    store = S3Store("s3://bucket/hs.zarr", {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"},
                    retry=RetryPolicy(attempts=2, base=0.001))
    with pytest.raises(ObjectUnavailable, match=r"^s3://bucket/hs.zarr/x: still failing after 2 attempts"):
        store.get_ranges("x", [(0, 1)])


# =========================================================================== short bodies, deadlines, uploads


@pytest.mark.parametrize("reader", READERS)
def test_a_short_body_is_fetched_again_not_called_damage(s3: S3, bucket: str, reader: str) -> None:
    """A range answered with fewer bytes than asked (said consistently in its headers) is a fresh request;
    only an object that is short every time is reported as not the size expected."""
    store = opened(s3, bucket, reader)
    s3.proxy.add(Fault(short_body=1000, path="/shard", times=2))
    assert [bytes(b) for b in store.get_ranges("shard", RANGES)] == [DATA[a:b] for a, b in RANGES]
    assert retries(store) == 2
    assert [r.fault for r in s3.proxy.requests("GET", "/shard")].count("short") == 2

    s3.proxy.add(Fault(short_body=1000, path="/shard", times=None))
    with pytest.raises(TransferMismatch) as err:
        store.get_ranges("shard", [(0, 2_000_000)])
    assert str(err.value) == (f"s3://{bucket}/shard: asked for bytes [0, 2000000) but got 1000: the object is not the "
                              "size expected, so the store is damaged or another store's object is in its place; "
                              "run `h5feed verify`")
    assert len(s3.proxy.requests("GET", "/shard")) == 2 + 2 + FAST.attempts


@pytest.mark.parametrize("reader", READERS)
def test_a_stalled_read_fails_in_the_stated_time(s3: S3, bucket: str, reader: str) -> None:
    store = opened(s3, bucket, reader, retry=STALLED)
    s3.proxy.add(Fault(stall=20, path="/shard", times=None))
    for read in (lambda: store.get_ranges("shard", RANGES), lambda: store.get("shard")):
        started = time.monotonic()
        with pytest.raises(ObjectUnavailable) as err:
            read()
        # one deadline for the read, not one per attempt (4 attempts: >= 4 s) nor the stall (20 s); the slack is a
        # loaded 2-core box's scheduling
        assert time.monotonic() - started < STALLED.timeout + 2.5
        assert str(err.value) == (f"s3://{bucket}/shard: no answer in 1 s; check the endpoint and the network, or "
                                  "raise H5FEED_REQUEST_TIMEOUT (seconds) for a slow link")


def test_a_stalled_upload_fails_in_the_stated_time(s3: S3, bucket: str) -> None:
    store = opened(s3, bucket, "s3fs", retry=STALLED)
    s3.proxy.add(Fault(stall=20, method="PUT", path="/new", times=None))
    for write in (lambda: store.put_atomic("new", DATA), lambda: store.put_if("new", DATA, None)):
        started = time.monotonic()
        with pytest.raises(ObjectUnavailable, match=f"^s3://{bucket}/new: no answer in 1 s; check the endpoint"):
            write()
        assert time.monotonic() - started < STALLED.timeout + 2.5  # one deadline, not one per attempt (>= 4 s)


def test_the_request_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H5FEED_REQUEST_TIMEOUT", "2.5")
    assert RetryPolicy().timeout == 2.5
    monkeypatch.setenv("H5FEED_REQUEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="^H5FEED_REQUEST_TIMEOUT='soon': expected the seconds a request may wait"):
        RetryPolicy()


def test_an_upload_changed_on_the_way_is_sent_again(s3: S3, bucket: str) -> None:
    """A PUT body changed on the way is refused by a server that checks its Content-MD5, or (moto, which does
    not) stored under an ETag that is not the MD5 of the bytes sent: either way it is sent again, a conditional
    PUT replacing exactly its own garbled object, and a body garbled every time is an error naming the object."""
    store = opened(s3, bucket, "s3fs")
    s3.proxy.add(Fault(flip_request_byte=1234, method="PUT", path="/new", times=2))
    store.put_atomic("new", DATA)
    assert s3.client.get_object(Bucket=bucket, Key="new")["Body"].read() == DATA
    assert retries(store) == 2
    s3.proxy.add(Fault(flip_request_byte=5, method="PUT", path="/lock", times=1))
    etag = store.put_if("lock", b'{"holder": "me"}', None)
    assert etag == s3.client.head_object(Bucket=bucket, Key="lock")["ETag"]
    assert [r.fault for r in s3.proxy.requests("PUT")] == ["flip", "flip", "", "flip", ""]

    s3.proxy.add(Fault(flip_request_byte=1234, method="PUT", path="/other", times=None))
    with pytest.raises(TransferMismatch) as err:
        store.put_atomic("other", DATA)
    assert re.fullmatch(f"s3://{bucket}/other: the server stored other bytes than the 3000000 sent "
                        f'\\(its ETag "[0-9a-f]{{32}}", their MD5 {hashlib.md5(DATA).hexdigest()}\\); check the '
                        "endpoint and the network between", str(err.value))
    assert len(s3.proxy.requests("PUT", "/other")) == FAST.attempts


def test_a_store_converted_through_garbled_uploads_holds_the_bytes_of_a_clean_run(s3: S3, bucket: str, tmp_path):
    """Shards, index and metadata PUT bodies changed on the way: the bucket's store is object for object the
    local conversion's, and every garbled upload was sent again."""
    import h5feed
    from h5feed.testing.synthetic import write_synthetic

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 4, 32, lengths=(10, 40), seed=3)
    kwargs = {"workers": 0, "progress": False, "settings": h5feed.StoreSettings(chunk_tokens=16)}
    h5feed.convert(tmp_path / "src", tmp_path / "clean", **kwargs)
    for part in ("/aux_hidden_states/c/", "/index/", "/zarr.json"):
        s3.proxy.add(Fault(flip_request_byte=5, method="PUT", path=f"/store{part}", times=2))
    report = h5feed.convert(tmp_path / "src", f"s3://{bucket}/store", **kwargs,
                            bucket=h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging"))
    assert report.num_samples == 4
    assert [r.fault for r in s3.proxy.requests("PUT")].count("flip") == 6
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=bucket, Prefix="store/")["Contents"]]
    published = {k[len("store/"):]: s3.client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
    clean = {p.relative_to(tmp_path / "clean").as_posix(): p.read_bytes()
             for p in (tmp_path / "clean").rglob("*") if p.is_file()}
    assert {k: v for k, v in published.items() if k in clean} == clean


def test_elsewhere_an_upload_is_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend without checksums (fsspec's memory filesystem, whose first write is garbled here): the object
    is read back, and written again when it differs."""
    from fsspec.implementations.memory import MemoryFileSystem

    from h5feed.io import FsspecStore

    writes: list[bytes] = []
    write = MemoryFileSystem.pipe_file

    def garbled_once(self, path, value, *args, **kwargs):
        writes.append(value)
        return write(self, path, value[::-1] if len(writes) == 1 else value, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", garbled_once)
    store = FsspecStore("memory://h5feed-read-back/hs.zarr", retry=FAST)
    store.stats = IOStats()
    store.put_atomic("shard", DATA[:1000])
    assert store.get("shard") == DATA[:1000] and writes == [DATA[:1000]] * 2 and retries(store) == 1
    assert store.list() == {"shard": 1000}  # no temporary file left


def test_a_sample_whose_chunk_came_short_is_read_again_not_skipped(s3: S3, bucket: str, synthetic_store) -> None:
    """Through the Store, with on_corrupt="skip": a short body is a fresh request, and the sample delivered
    is the bucket's own (not another in its place, not an error)."""
    import torch

    from h5feed import HiddenStatesDataset

    local = synthetic_store("short-bodies", "speculators-legacy-pt", 3, 32, [20, 30, 40], codec="none", seed=4)
    for path in sorted(local.path.rglob("*")):
        if path.is_file():
            s3.client.put_object(Bucket=bucket, Key=f"hs.zarr/{path.relative_to(local.path).as_posix()}",
                                 Body=path.read_bytes())
    dataset = HiddenStatesDataset(h5feed.StoreOptions(f"s3://{bucket}/hs.zarr", storage_options=s3.storage_options),
                                  on_corrupt="skip")
    s3.proxy.reset()
    s3.proxy.add(Fault(short_body=100, path="/aux_hidden_states/c/", times=2))
    want = HiddenStatesDataset(local.path)
    for i in range(3):
        got = dataset[i]
        assert all(torch.equal(got[k], want[i][k]) for k in got if isinstance(got[k], torch.Tensor))
    assert [r.fault for r in s3.proxy.requests("GET")].count("short") == 2
