"""open_writer's samples keyed by their source index (`append(..., source_index=ROW)`, `unique_source_index=True`):
what the tap of streamed hidden states writes with, one writer per DataLoader worker, each possibly receiving a row
another worker has kept already.  The index holds at most one sample per row, the first published, under kill -9
too; a writer of the other kind is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS

from h5feed import Store, StoreError, StoreSettings, WriteOptions, open_writer
from h5feed.store.journal import journal_records
from h5feed.store.writer_state import WriterFiles

H, CHUNK, SHARD = 32, 16, 32
# this checkout's h5feed, and this module and conftest for the writers that import them
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(TESTS), str(Path(__file__).resolve().parent)])}


def sample(row: int, tokens: int = 12, salt: int = 0) -> dict:
    """A speculators-legacy-pt sample whose values say which row (and which copy of it, `salt`) it is."""
    g = torch.Generator().manual_seed(1000 * row + salt)
    layers = [torch.randn(tokens, H, generator=g).to(torch.bfloat16) for _ in range(4)]
    return {"input_ids": torch.arange(tokens) + row, "hidden_states": layers, "loss_mask": torch.ones(tokens, dtype=torch.int64)}


def keyed(store: Path, writer: str | None = None, **options):
    return open_writer(store, writer=writer, unique_source_index=True, **options,
                       settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD))


def stored_rows(store: Path) -> dict[int, torch.Tensor]:
    """{source index: its sample's aux hidden states} of the published index."""
    opened = Store(store)
    assert len(set(opened.source_indices.tolist())) == len(opened)
    return {int(row): opened.read_sample(i).aux_hidden_states for i, row in enumerate(opened.source_indices)}


def aux_of(s: dict) -> torch.Tensor:
    return torch.cat(s["hidden_states"][:-1], dim=1)


def test_each_sample_is_stored_under_the_source_index_it_is_given(tmp_path):
    rows = [7, 3, 11]
    with keyed(tmp_path / "hs.zarr") as writer:
        for row in rows:
            writer.append(sample(row), name=f"hs_{row}", source_index=row)
    store = Store(tmp_path / "hs.zarr")
    assert store.source_indices.tolist() == rows and store.source_paths == [f"hs_{r}" for r in rows]
    assert store.info.source_info == {"unique_source_index": True}
    for row, aux in stored_rows(tmp_path / "hs.zarr").items():
        assert torch.equal(aux, aux_of(sample(row)))


def test_without_the_option_a_given_source_index_is_stored_and_the_default_stays_the_samples_number(tmp_path):
    with open_writer(tmp_path / "hs.zarr", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        writer.append(sample(0))
        writer.append(sample(1), source_index=40)
        writer.append(sample(2))
    store = Store(tmp_path / "hs.zarr")
    assert store.source_indices.tolist() == [0, 40, 2] and store.info.source_info == {}


def test_a_row_another_writer_published_first_is_left_out_of_the_index(tmp_path, caplog):
    """Two writers at once: b appends rows 2, 3 and 4 after a published 1, 2 and 3; the index keeps a's 2 and 3."""
    dst = tmp_path / "hs.zarr"
    caplog.set_level("INFO", logger="h5feed")
    with keyed(dst, "a", writing=WriteOptions(publish_every=100)) as a, keyed(dst, "b", writing=WriteOptions(publish_every=100)) as b:
        for row in (1, 2, 3):
            a.append(sample(row, salt=1), source_index=row)
        for row in (2, 3, 4):
            b.append(sample(row, salt=2), source_index=row)
        a.publish()
        b.publish()
        b.publish()  # again: still left out, counted once
        assert (a.report.published, a.report.left_out) == (3, 0)
        assert (b.report.samples, b.report.published, b.report.left_out) == (3, 1, 2)
    got = stored_rows(dst)
    assert sorted(got) == [1, 2, 3, 4]
    for row, salt in ((1, 1), (2, 1), (3, 1), (4, 2)):
        assert torch.equal(got[row], aux_of(sample(row, salt=salt))), row
    assert caplog.text.count("2 of writer 'b''s samples left out of the index: their source index was published by "
                             "another writer first (unique_source_index)") == 1


def test_a_row_one_writer_appends_twice_is_stored_once_the_first(tmp_path):
    with keyed(tmp_path / "hs.zarr", writing=WriteOptions(publish_every=100)) as writer:
        writer.append(sample(5, salt=1), source_index=5)
        writer.append(sample(5, salt=2), source_index=5)
        writer.append(sample(6), source_index=6)
    assert writer.report.left_out == 1
    got = stored_rows(tmp_path / "hs.zarr")
    assert sorted(got) == [5, 6] and torch.equal(got[5], aux_of(sample(5, salt=1)))


KILLED = """
import os, signal, sys
from test_keyed_writer import WriteOptions, keyed, sample
with keyed(sys.argv[1], sys.argv[2], writing=WriteOptions(publish_every=100)) as w:
    for row in (9, 4, 6):
        w.append(sample(row), source_index=row)
    os.kill(os.getpid(), signal.SIGKILL)  # journaled, never published
"""


def test_a_killed_writer_resumed_publishes_its_journaled_rows_under_their_source_index(tmp_path):
    dst = tmp_path / "hs.zarr"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(dst), "w0"], check=False, timeout=120, env=ENV)
    assert killed.returncode == -signal.SIGKILL
    records = journal_records(WriterFiles(dst, "w0").journal)
    assert [r.source_index for r in records if r.i is not None] == [9, 4, 6]
    with keyed(dst, "w1") as other:  # another writer published row 4 meanwhile
        other.append(sample(4, salt=7), source_index=4)
    with keyed(dst, "w0") as resumed:  # publishes what w0 journaled
        assert (resumed.report.published, resumed.report.left_out) == (2, 1)
    store = Store(dst)
    assert store.source_indices.tolist() == [4, 9, 6]
    got = stored_rows(dst)
    assert torch.equal(got[4], aux_of(sample(4, salt=7))) and torch.equal(got[9], aux_of(sample(9)))


def test_a_keyed_writer_needs_each_samples_source_index(tmp_path):
    with keyed(tmp_path / "hs.zarr") as writer:
        with pytest.raises(ValueError) as err:
            writer.append(sample(0))
        assert str(err.value) == ("this writer keeps one sample per source index (unique_source_index=True): give "
                                  "each sample's append(..., source_index=ROW)")
        for bad in (-1, 2.0, True, "3"):
            with pytest.raises(ValueError, match=r"source_index must be an int >= 0, not "):
                writer.append(sample(0), source_index=bad)
        writer.append(sample(0), source_index=0)
    assert len(Store(tmp_path / "hs.zarr")) == 1


@pytest.mark.parametrize("first_keyed", [True, False])
def test_writers_of_the_other_kind_are_refused(tmp_path, first_keyed):
    dst = tmp_path / "hs.zarr"
    with open_writer(dst, unique_source_index=first_keyed,
                     settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        writer.append(sample(0), source_index=0)
    with pytest.raises(StoreError) as err:
        open_writer(dst, writer="other", unique_source_index=not first_keyed,
                    settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD))
    assert str(err.value) == (f"{dst}: was written with unique_source_index={first_keyed}, not "
                              f"unique_source_index={not first_keyed}: open every writer of a store with its settings, "
                              "or write into another store")


def test_concurrent_keyed_writers_in_processes_store_each_row_once(tmp_path):
    """Four processes append the same 8 rows each, in another order, publishing every 2: one sample per row."""
    code = """
import sys
from test_keyed_writer import WriteOptions, keyed, sample
w = int(sys.argv[2])
with keyed(sys.argv[1], f"w{w}", writing=WriteOptions(publish_every=2)) as writer:
    for row in [(r * (2 * w + 1)) % 8 for r in range(8)]:
        writer.append(sample(row, salt=w), source_index=row)
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "hs.zarr"), str(w)], env=ENV)
             for w in range(4)]
    deadline = time.monotonic() + 180
    for p in procs:
        assert p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    got = stored_rows(tmp_path / "hs.zarr")
    assert sorted(got) == list(range(8))
    for row, aux in got.items():  # each row is one writer's copy of it, whole
        assert any(torch.equal(aux, aux_of(sample(row, salt=w))) for w in range(4)), row
