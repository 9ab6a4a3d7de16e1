"""Conversion on Dask distributed: the per-sample work as tasks on a cluster of worker
processes (a real `distributed.LocalCluster` on loopback), with the driver's plan, journal and
finalize unchanged: the same bytes as the local pool, a killed worker's sample redone elsewhere,
a run killed as a whole resumed."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")
from conftest import REPO

from h5feed import RunOptions, StoreSettings
from h5feed.conversion.converter import convert
from h5feed.errors import H5feedError, StoreError
from h5feed.store import Store
from h5feed.store.journal import read_journal
from h5feed.testing.synthetic import FileOptions, write_synthetic

H = 64
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here
LEGACY = "speculators-legacy-pt"


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes of one thread each, as `h5feed convert --dask --workers 2` starts them."""
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as c:
        with distributed.Client(c) as client:
            client.run(importlib.import_module, "h5feed.conversion.converter")  # torch's import, once, outside the tests
        yield c


@pytest.fixture
def source(tmp_path) -> Path:
    src = tmp_path / "src"
    write_synthetic(src, LEGACY, 12, H, lengths=(20, 120), seed=4, files=FileOptions(layout="rows", rows_per_folder=6))
    return src


class KillOnce(distributed.WorkerPlugin):
    """SIGKILLs the worker process that starts the first conversion task, while it holds the task;
    once in the cluster's life (a marker file, created exclusively, names the task)."""

    name = "h5feed-test-kill-once"

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish == "executing" and str(key).startswith("_convert_task"):
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.write(fd, f"{key} {os.getpid()}".encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)


def test_conversion_on_a_cluster_equals_the_local_pool_byte_for_byte(tmp_path, source, cluster, assert_same_tree):
    dst, ref = tmp_path / "store", tmp_path / "ref"
    convert(source, ref, workers=2, progress=False, settings=CHUNKED)

    report = convert(source, dst, progress=False, run=RunOptions(scheduler=cluster.scheduler_address),
                     settings=CHUNKED)

    assert (report.num_samples, report.converted_now, report.resumed, report.skipped) == (12, 12, 0, [])
    assert_same_tree(dst, ref)  # shards, index, plan, journal, attributes: every file
    workers = set(cluster.scheduler_info["workers"])
    assert set(report.workers) <= workers and sum(w.samples for w in report.workers.values()) == 12
    assert sum(w.bytes_in for w in report.workers.values()) == report.bytes_in == sum(
        p.stat().st_size for p in source.rglob("*.pt"))
    assert sum(w.bytes_out for w in report.workers.values()) == report.bytes_out > 0


def test_a_worker_killed_while_it_converts_has_its_sample_redone_elsewhere(tmp_path, source, cluster, assert_same_tree):
    dst, ref = tmp_path / "store", tmp_path / "ref"
    convert(source, ref, workers=0, progress=False, settings=CHUNKED)
    marker = tmp_path / "killed"
    with distributed.Client(cluster) as client:
        client.register_plugin(KillOnce(marker))
        try:
            report = convert(source, dst, progress=False, run=RunOptions(scheduler=cluster.scheduler_address),
                             settings=CHUNKED)
        finally:
            client.unregister_worker_plugin(KillOnce.name)
        key, pid = marker.read_text().split()
        assert key.startswith("_convert_task-")
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)  # that worker process is gone; the nanny started another
        client.wait_for_workers(2)

    assert (report.num_samples, report.converted_now, report.skipped) == (12, 12, [])
    assert_same_tree(dst, ref)


def test_a_run_killed_as_a_whole_resumes_on_the_cluster(tmp_path, source, cluster, assert_same_tree):
    dst, ref = tmp_path / "store", tmp_path / "ref"
    convert(source, ref, workers=0, progress=False, settings=CHUNKED)
    command = [sys.executable, "-m", "h5feed.cli", "convert", str(source), str(dst), "--scheduler",
               cluster.scheduler_address, "--chunk-tokens", str(CHUNK)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(read_journal(dst)) < 3:
        assert proc.poll() is None, "the conversion ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    with pytest.raises(StoreError, match="has not finished"):
        Store(dst)
    journaled = len(read_journal(dst))

    done = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr
    assert f"({12 - journaled} converted now, {journaled} from an earlier run, 0 skipped)" in done.stderr
    assert f"Dask: 2 worker thread(s) at {cluster.scheduler_address}" in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("  worker tcp://127.0.0.1:")]
    assert 1 <= len(lines) <= 2 and all(" MB/s in, " in line for line in lines)
    assert_same_tree(dst, ref)


def test_dask_flag_starts_a_local_cluster(tmp_path, cli, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, LEGACY, 4, H, lengths=(20, 60), seed=1)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)

    r = cli("convert", src, dst, "--dask", "--workers", 1, "--chunk-tokens", CHUNK)

    assert r.status == 0, r.output
    assert "Dask: 1 worker thread(s) at tcp://127.0.0.1:" in r.output and "; dashboard http" in r.output
    assert "(4 converted now, 0 from an earlier run, 0 skipped)" in r.output
    assert_same_tree(dst, ref)


def test_without_dask_the_error_says_what_to_install(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, LEGACY, 2, H, lengths=[5, 9])
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` raises ImportError
    with pytest.raises(H5feedError) as err:
        convert(src, dst, progress=False, run=RunOptions(scheduler="local"))
    assert str(err.value) == ("converting on Dask needs Dask distributed, which is not installed: "
                              "pip install 'h5feed[dask]'")
    assert not dst.exists()


def test_workers_are_the_clusters_own(tmp_path):
    with pytest.raises(ValueError, match="the cluster at tcp://127.0.0.1:8786 has the workers it has"):
        convert(tmp_path, tmp_path / "store", workers=4, run=RunOptions(scheduler="tcp://127.0.0.1:8786"))
    with pytest.raises(ValueError, match="workers=0 converts in this process; with a scheduler, give 1 or more"):
        convert(tmp_path, tmp_path / "store", workers=0, run=RunOptions(scheduler="local"))


def test_the_cli_refuses_workers_with_a_scheduler_without_a_traceback(tmp_path, capsys):
    from h5feed.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(tmp_path), str(tmp_path / "store"), "--scheduler", "tcp://127.0.0.1:8786",
              "--workers", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("error: --workers sets the size of the local pool or of --dask; the cluster at "
                        "tcp://127.0.0.1:8786 has the workers it has\n")
    assert "Traceback" not in err and not (tmp_path / "store").exists()
