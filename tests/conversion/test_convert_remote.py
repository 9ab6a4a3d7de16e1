"""`h5feed convert` to and from a bucket: a real S3 API (moto's server behind the fault proxy).

Sources are read from the bucket, the store is published to it; the bucket store holds, object
for object, what a local conversion of the same sources holds; a converter killed with SIGKILL
resumes to the objects of an uninterrupted run; one writer at a time; clear errors.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, bits, bucket_objects
from s3_server import S3, Fault, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

import h5feed
from h5feed.conversion.lock import BucketLock
from h5feed.conversion.publish import UPLOADS_FILE, is_shard
from h5feed.errors import SourceError, StoreError
from h5feed.io import AccessDenied, open_url
from h5feed.store.writer_state import LOCK_FILE
from h5feed.testing.synthetic import FileOptions, write_synthetic

N = 8
CHUNK = 16


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """8 speculators-legacy samples of 10..60 tokens, H=32, in the seeds' rows_*/data_*.pt layout."""
    root = tmp_path_factory.mktemp("remote-src") / "src"
    write_synthetic(root, "speculators-legacy-pt", N, 32, lengths=(10, 60), seed=7,
                    files=FileOptions(layout="rows", rows_per_folder=3))
    return root


def upload_tree(folder: Path, s3: S3, url: str) -> None:
    objects = open_url(url, s3.storage_options)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            objects.put_atomic(path.relative_to(folder).as_posix(), path.read_bytes())


@pytest.fixture
def src_url(source: Path, s3: S3, bucket: str) -> str:
    url = f"s3://{bucket}/src"
    upload_tree(source, s3, url)
    s3.proxy.reset()
    return url


def local_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_samples(a: h5feed.Store, b: h5feed.Store) -> None:
    assert len(a) == len(b)
    for i in range(len(b)):
        x, y = a.read_sample(i), b.read_sample(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(bits(x.aux_hidden_states), bits(y.aux_hidden_states))
        assert torch.equal(bits(x.last_hidden_state), bits(y.last_hidden_state))


def cli_options(s3: S3) -> list[str]:
    options = s3.storage_options
    return ["--storage-option", f"endpoint_url={options['endpoint_url']}", "--storage-option", "key=testing",
            "--storage-option", "secret=testing", "--storage-option", "client_kwargs.region_name=us-east-1"]


# =========================================================================== bucket to folder, bucket to bucket


def test_a_bucket_of_pt_files_converts_to_a_folder_and_to_a_bucket_holding_the_same_objects(
        source, src_url, s3, bucket, tmp_path, cli):
    options = s3.storage_options
    local = tmp_path / "local"
    report = h5feed.convert(src_url, local, workers=0, progress=False,
                            settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                            bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "fetch"))
    assert (report.num_samples, report.converted_now) == (N, N)
    store = h5feed.Store(local)
    assert store.info.source_root == src_url
    assert store.source_paths[:2] == ["rows_0-3/data_0.pt", "rows_0-3/data_1.pt"]
    h5feed.convert(source, tmp_path / "from-folder", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK))
    assert_same_samples(store, h5feed.Store(tmp_path / "from-folder"))  # the bucket's files are the folder's
    assert not list((tmp_path / "fetch").iterdir())  # the fetched source files are gone

    dst, staging = f"s3://{bucket}/store", tmp_path / "staging"
    s3.proxy.reset()
    report = h5feed.convert(src_url, dst, workers=1, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                            bucket=h5feed.BucketOptions(storage_options=options, staging_dir=staging))
    assert (report.store, report.num_samples, report.converted_now) == (dst, N, N)
    published = bucket_objects(s3, bucket, "store")
    assert published == local_files(local)  # object for object, byte for byte: the folder's store
    puts = sorted(r.path.split("/store/", 1)[1] for r in s3.proxy.requests("PUT") if "/store/" in r.path)
    # each object once; the root's zarr.json twice: "converting" first, "complete" last
    assert puts == sorted([*published, LOCK_FILE, "zarr.json"])
    assert [k for k in local_files(staging / "store") if is_shard(k)] == []  # shards left the staging folder

    result = cli("verify", dst, *cli_options(s3))
    assert result.status == 0 and f"{dst}: {N} samples OK (checksums)" in result.output
    assert_same_samples(h5feed.Store(dst, storage_options=options), store)

    s3.proxy.reset()  # the same command again: nothing to do, nothing sent
    report = h5feed.convert(src_url, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                            bucket=h5feed.BucketOptions(storage_options=options, staging_dir=staging))
    assert (report.converted_now, report.resumed) == (0, N)
    assert [r.path for r in s3.proxy.requests("PUT") if LOCK_FILE not in r.path] == []


def test_a_new_staging_folder_is_rebuilt_from_the_bucket_and_appends(source, src_url, s3, bucket, tmp_path):
    """Another machine (an empty staging folder) appends a new source file to a complete bucket store."""
    options = s3.storage_options
    dst = f"s3://{bucket}/store"
    h5feed.convert(src_url, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                   bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "first"))
    extra = tmp_path / "extra"
    write_synthetic(extra, "speculators-legacy-pt", N + 1, 32, lengths=(10, 60), seed=7,
                    files=FileOptions(layout="rows", rows_per_folder=3))
    new = extra / "rows_6-9" / "data_8.pt"
    s3.client.put_object(Bucket=bucket, Key="src/rows_6-9/data_8.pt", Body=new.read_bytes())
    s3.proxy.reset()
    report = h5feed.convert(src_url, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                            bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "second"))
    assert (report.num_samples, report.converted_now, report.resumed) == (N + 1, 1, N)
    assert not any(is_shard(r.path.split("/store/", 1)[1]) for r in s3.proxy.requests("GET") if "/store/" in r.path)
    whole = tmp_path / "whole"
    h5feed.convert(src_url, whole, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                   bucket=h5feed.BucketOptions(storage_options=options))
    appended = h5feed.Store(dst, storage_options=options)
    assert appended.source_paths[-1] == "rows_6-9/data_8.pt"
    assert_same_samples(appended, h5feed.Store(whole))
    assert h5feed.verify_store(dst, storage_options=options, progress=False).ok

    time.sleep(1.0)  # S3's modification times are whole seconds
    s3.client.put_object(Bucket=bucket, Key="src/rows_0-3/data_1.pt", Body=(source / "rows_0-3/data_1.pt").read_bytes())
    with pytest.raises(SourceError, match=f"^{src_url}/rows_0-3/data_1.pt: changed since it was converted "
                                          r"\(size (\d+) -> \1 bytes, modified "):
        h5feed.convert(src_url, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                       bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "second"))


# =========================================================================== SIGKILL, one writer, not readable early


def test_a_killed_converter_resumes_to_the_objects_of_an_uninterrupted_run(src_url, s3, bucket, tmp_path):
    options = s3.storage_options
    h5feed.convert(src_url, f"s3://{bucket}/whole", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                   bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "whole-staging"))
    dst = f"s3://{bucket}/killed"
    command = [sys.executable, "-m", "h5feed.cli", "-q", "convert", src_url, dst, "--workers", "0", "--chunk-tokens",
               str(CHUNK), "--staging-dir", str(tmp_path / "staging"), *cli_options(s3)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    log = tmp_path / "run.log"
    s3.proxy.delay = 0.08  # every request slowed down: the run is still going when it is killed
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_for(what: str, ready) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, f"the conversion ended before {what}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def keys() -> list[str]:
        found = s3.client.list_objects_v2(Bucket=bucket, Prefix="killed/").get("Contents", [])
        return [o["Key"].removeprefix("killed/") for o in found]

    wait_for("the lock was taken", lambda: LOCK_FILE in keys())
    with pytest.raises(StoreError) as err:  # a second converter, while the first runs
        h5feed.convert(src_url, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                       bucket=h5feed.BucketOptions(storage_options=options, staging_dir=tmp_path / "second"))
    assert err.value.path == dst
    assert f"another `h5feed convert` (host {socket.gethostname()}, pid {proc.pid}, started at " in err.value.problem
    wait_for("4 shards were published", lambda: sum(is_shard(k) for k in keys()) >= 4)
    with pytest.raises(StoreError, match="conversion has not finished"):
        h5feed.Store(dst, storage_options=options)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(StoreError, match="conversion has not finished"):
        h5feed.Store(dst, storage_options=options)
    assert LOCK_FILE in keys()  # left by the killed converter
    killed_at = len(keys())

    s3.proxy.reset()
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"taking over the lock {LOCK_FILE} of host {socket.gethostname()}, pid {proc.pid}" in done.stderr
    assert "that process no longer runs" in done.stderr
    assert bucket_objects(s3, bucket, "killed") == bucket_objects(s3, bucket, "whole")  # same keys, same bytes
    sent = {r.path.split("/killed/", 1)[1] for r in s3.proxy.requests("PUT") if "/killed/" in r.path}
    assert len(sent - {LOCK_FILE}) < len(bucket_objects(s3, bucket, "whole")) and killed_at > 5  # what was there stayed
    assert (tmp_path / "staging" / UPLOADS_FILE).exists()


def test_a_stale_lock_is_taken_over_and_a_live_one_refused(src_url, s3, bucket, tmp_path, monkeypatch, caplog):
    dst = f"s3://{bucket}/store"
    holder = {"host": "trainer-7", "pid": 4242, "started_at": "2026-11-30T08:00:00+00:00", "token": "x"}
    s3.client.put_object(Bucket=bucket, Key=f"store/{LOCK_FILE}", Body=json.dumps(holder).encode())
    kwargs = {"workers": 0, "progress": False, "settings": h5feed.StoreSettings(chunk_tokens=CHUNK),
              "bucket": h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging")}
    with pytest.raises(StoreError, match=r"another `h5feed convert` \(host trainer-7, pid 4242, started at "
                                         r"2026-11-30T08:00:00\+00:00, last heartbeat 20"):
        h5feed.convert(src_url, dst, **kwargs)
    monkeypatch.setattr("h5feed.conversion.lock.STALE_AFTER_S", 0.0)
    time.sleep(1.1)  # the bucket's clock (Last-Modified, Date) counts whole seconds: an age of 0 s is not stale
    with caplog.at_level(logging.WARNING, logger="h5feed.conversion.lock"):
        assert h5feed.convert(src_url, dst, **kwargs).num_samples == N
    assert any(f"taking over the lock {LOCK_FILE} of host trainer-7, pid 4242" in m and "s old" in m
               for m in caplog.messages)
    assert LOCK_FILE not in bucket_objects(s3, bucket, "store")  # released at the end


def test_a_holder_whose_lock_was_taken_over_learns_it_from_its_heartbeat(s3, bucket, monkeypatch):
    monkeypatch.setattr("h5feed.conversion.lock.HEARTBEAT_S", 0.05)
    objects = open_url(f"s3://{bucket}/store", s3.storage_options)
    with BucketLock.acquire(objects) as lock:
        lock.check()
        s3.client.put_object(Bucket=bucket, Key=f"store/{LOCK_FILE}", Body=b'{"host": "other"}')
        deadline = time.monotonic() + 30
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(StoreError, match="another `h5feed convert` took over this store's lock"):
            lock.check()
    assert s3.client.get_object(Bucket=bucket, Key=f"store/{LOCK_FILE}")["Body"].read() == b'{"host": "other"}'


# =========================================================================== errors


def test_a_missing_bucket_or_prefix_and_a_foreign_folder_are_clear_errors(src_url, s3, bucket, tmp_path):
    kwargs = {"workers": 0, "progress": False,
              "bucket": h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "s")}
    with pytest.raises(StoreError) as err:
        h5feed.convert(src_url, "s3://no-such-bucket-h5feed/store", **kwargs)
    assert err.value.path == "s3://no-such-bucket-h5feed/store"
    assert err.value.problem.startswith("the bucket does not exist: create it first")
    with pytest.raises(SourceError, match=f"^s3://{bucket}/nothing: holds no objects"):
        h5feed.convert(f"s3://{bucket}/nothing", tmp_path / "out", **kwargs)
    s3.client.put_object(Bucket=bucket, Key="notes/readme.txt", Body=b"hello")
    with pytest.raises(StoreError, match=f"^s3://{bucket}/notes: exists and is not an h5feed store \\(1 objects"):
        h5feed.convert(src_url, f"s3://{bucket}/notes", **kwargs)
    assert bucket_objects(s3, bucket, "notes") == {"readme.txt": b"hello"}  # untouched, and no lock left


def test_denied_uploads_stop_naming_the_object_and_transient_faults_are_retried(src_url, s3, bucket, tmp_path):
    kwargs = {"workers": 0, "progress": False, "settings": h5feed.StoreSettings(chunk_tokens=CHUNK),
              "bucket": h5feed.BucketOptions(storage_options=s3.storage_options, staging_dir=tmp_path / "staging")}
    dst = f"s3://{bucket}/store"
    s3.proxy.add(Fault(status=403, code="AccessDenied", method="PUT", path="/store/last_hidden_states/c/", times=None))
    with pytest.raises(AccessDenied, match=f"^{dst}/last_hidden_states/c/\\d+/0: access denied; check the credentials"):
        h5feed.convert(src_url, dst, **kwargs)
    with pytest.raises(StoreError, match="conversion has not finished"):
        h5feed.Store(dst, storage_options=s3.storage_options)

    s3.proxy.reset()
    s3.proxy.add(Fault(status=503, code="SlowDown", method="PUT", path="/store/", times=3))
    s3.proxy.add(Fault(drop_after=100, path="/src/rows_", times=2))  # source GETs cut mid-body
    assert h5feed.convert(src_url, dst, **kwargs).num_samples == N
    assert sorted(r.fault for r in s3.proxy.requests() if r.fault) == ["drop", "drop", "status", "status", "status"]
    whole = tmp_path / "whole"
    h5feed.convert(src_url, whole, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK),
                   bucket=h5feed.BucketOptions(storage_options=s3.storage_options))
    assert bucket_objects(s3, bucket, "store") == local_files(whole)
