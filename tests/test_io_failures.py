"""Failures of a real S3 API, injected by the test proxy: transient ones are retried and counted,
permanent ones raise at once naming the object, and a cut body is never returned as data."""

from __future__ import annotations

import numpy as np
import pytest
from s3_server import S3, Fault, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed.io import AccessDenied, IOStats, ObjectNotFound, ObjectUnavailable, RetryPolicy, S3Store

FAST = RetryPolicy(attempts=4, base=0.001, cap=0.01)
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
