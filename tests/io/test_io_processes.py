"""Stores in child processes after the parent made requests: fork, spawn and forkserver.

s3fs refuses ("not fork-safe") and obstore hangs in a forked child once the parent made a request
with them.  Stores make their clients lazily in each process; obstore's runtime cannot be made
again in a forked child, so such a child reads with s3fs (spawn and forkserver children with obstore).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Any

import numpy as np
import pytest
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

from h5feed.io import IOStats, ObjectStore, S3Store

METHODS = ("fork", "spawn", "forkserver")
DATA = np.random.default_rng(1).bytes(2_000_000)
DIGEST = hashlib.sha256(DATA).hexdigest()


def _read(store: ObjectStore, queue: Any) -> None:
    """In the child: read the object as four concurrent ranges; report the reader, a digest and the child's counts."""
    store.stats = IOStats()
    parts = store.get_ranges("shard", [(i * 500_000, (i + 1) * 500_000) for i in range(4)])
    queue.put((getattr(store, "reader", ""), hashlib.sha256(b"".join(parts)).hexdigest(),
               store.stats.requests))  # type: ignore[attr-defined]


def read_in_child(store: ObjectStore, method: str) -> tuple[str, str, int]:
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_read, args=(store, queue))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail(f"a {method} child hung reading {store.url}")
    assert child.exitcode == 0, f"a {method} child failed"
    return queue.get(timeout=5)


@pytest.mark.parametrize("method", METHODS)
def test_s3fs_store_in_children_after_the_parent_read(s3: S3, bucket: str, method: str) -> None:
    s3.client.put_object(Bucket=bucket, Key="shard", Body=DATA)
    store = S3Store(f"s3://{bucket}", s3.storage_options, use_obstore=False)
    assert hashlib.sha256(store.get("shard")).hexdigest() == DIGEST  # the parent's client and loop exist now
    assert read_in_child(store, method) == ("s3fs", DIGEST, 4)
    assert hashlib.sha256(store.get("shard")).hexdigest() == DIGEST  # and still work


def _parent(storage_options: dict[str, Any], bucket: str, queue: Any) -> None:
    """A fresh process (spawned), so that whether it has used obstore is known."""
    fast, slow = (S3Store(f"s3://{bucket}", storage_options, use_obstore=flag) for flag in (True, False))
    results = {}
    slow.get_ranges("shard", [(0, 10)])  # requests through s3fs, and metadata reads (whole objects) of either
    fast.get("shard")                    # store, leave obstore usable in a forked child
    results["fork, parent read with s3fs"] = read_in_child(fast, "fork")
    fast.get_ranges("shard", [(0, 10)])  # through obstore: its runtime would hang in a forked child
    for method in METHODS:
        results[f"{method}, parent read with obstore"] = read_in_child(fast, method)
    results["parent after its children"] = (fast.reader, hashlib.sha256(fast.get_large("shard")).hexdigest(), 0)
    queue.put(results)


def test_obstore_store_in_children_after_the_parent_read(s3: S3, bucket: str) -> None:
    s3.client.put_object(Bucket=bucket, Key="shard", Body=DATA)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    parent = ctx.Process(target=_parent, args=(s3.storage_options, bucket, queue))
    parent.start()
    results = queue.get(timeout=240)
    parent.join(30)
    assert results == {
        "fork, parent read with s3fs": ("obstore", DIGEST, 4),
        "fork, parent read with obstore": ("s3fs", DIGEST, 4),
        "spawn, parent read with obstore": ("obstore", DIGEST, 4),
        "forkserver, parent read with obstore": ("obstore", DIGEST, 4),
        "parent after its children": ("obstore", DIGEST, 0),
    }
