"""What a writer says when it cannot go on: a writer waiting for a shared step names who holds it, a publication
that failed leaves its sample kept and says so (a caller that follows the message publishes it once), and a full
disk is said as `h5feed convert` says it."""

from __future__ import annotations

import errno
import threading

import pytest
from conftest import WRITER_CHUNK, WRITER_SHARD, check_sample, make_sample, name_of

import h5feed.conversion.lock
import h5feed.conversion.writer
from h5feed import StoreError, StoreSettings, WriteOptions, open_writer
from h5feed.conversion.lock import held_briefly
from h5feed.errors import DiskFullError
from h5feed.store import Store
from h5feed.store.writer_state import PUBLISH_LOCK, ROWS_LOCK, WRITER_API, WRITERS_DIR


def writer_of(path, **options):
    return open_writer(path, **options, settings=StoreSettings(chunk_tokens=WRITER_CHUNK, shard_tokens=WRITER_SHARD))


def test_a_writer_waiting_for_a_step_says_who_holds_it_and_for_how_long(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(h5feed.conversion.lock, "WAIT_LOG_S", 0.2)
    store = tmp_path / "hs.zarr"
    with writer_of(store, writer="b") as waiting:
        held, release = threading.Event(), threading.Event()

        def stuck_in_its_step() -> None:  # a writer whose rows step does not end (a stalled disk, a stopped VM)
            with held_briefly(store / WRITERS_DIR / ROWS_LOCK, {"by": WRITER_API, "writer": "a"}):
                held.set()
                release.wait(60)

        holder = threading.Thread(target=stuck_in_its_step)
        holder.start()
        held.wait(60)
        threading.Timer(1.0, release.set).start()
        caplog.set_level("WARNING", logger="h5feed")
        waiting.append(make_sample(0, 0), name=name_of(0, 0))  # its rows step waits for writer 'a'
        holder.join(60)
    assert f"for {ROWS_LOCK}, held by writer 'a', host" in caplog.text
    assert len(Store(store)) == 1


def test_a_failed_publication_keeps_its_sample_says_so_and_publishes_it_once_later(tmp_path, monkeypatch):
    store = tmp_path / "hs.zarr"
    with writer_of(store, writer="a", writing=WriteOptions(publish_every=1)) as writer:
        writer.append(make_sample(0, 0), name=name_of(0, 0))
        commit, failures = writer.site.commit, [1]

        def stalls_once(step, body):
            if step == PUBLISH_LOCK and failures:
                failures.pop()
                raise StoreError(writer.location, "the bucket did not answer within 30 s")
            return commit(step, body)

        monkeypatch.setattr(writer.site, "commit", stalls_once)
        with pytest.raises(StoreError, match=r"'w0-1' is appended and kept \(do not append it again\), but publishing "
                                             r"it failed: .*did not answer.*; publish\(\) or close\(\) tries again"):
            writer.append(make_sample(0, 1), name=name_of(0, 1))
        assert len(Store(store)) == 1  # not published yet
        assert writer.report.samples == 2 and writer.report.published == 1
    published = Store(store)
    assert [check_sample(published, j) for j in range(len(published))] == [name_of(0, 0), name_of(0, 1)]


def test_a_full_disk_is_said_as_the_converter_says_it_and_the_sample_can_be_appended_again(tmp_path, monkeypatch):
    store = tmp_path / "hs.zarr"
    write_sample, full = h5feed.conversion.writer.write_sample, [1]

    def disk_full_once(*args, **kwargs):
        if full:
            full.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_sample(*args, **kwargs)

    with writer_of(store, writer="a") as writer:
        writer.append(make_sample(0, 0), name=name_of(0, 0))
        monkeypatch.setattr(h5feed.conversion.writer, "write_sample", disk_full_once)
        with pytest.raises(DiskFullError, match=rf"{store}: disk full while writing 'w0-1' \(No space left on "
                                                r"device\): free space, then append it again \(the samples appended "
                                                r"before it are kept\)"):
            writer.append(make_sample(0, 1), name=name_of(0, 1))
        writer.append(make_sample(0, 1), name=name_of(0, 1))
    published = Store(store)
    assert [check_sample(published, j) for j in range(len(published))] == [name_of(0, 0), name_of(0, 1)]
