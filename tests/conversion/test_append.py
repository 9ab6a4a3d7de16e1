"""Appending: `h5feed convert SRC DST` on a complete store takes SRC's new files.

Existing samples keep their indices and their shard files, readers that opened
the store before keep their view (and one that opens it in the middle of an
append sees the samples before it), a kill at any moment of an append loses
nothing, and a converted file that changed since is refused, never silently
converted again."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, same_item

from h5feed import HiddenStatesDataset, SkipPolicy, StoreSettings
from h5feed.conversion.converter import convert
from h5feed.errors import SourceError, StoreError
from h5feed.store import Store
from h5feed.store.journal import read_journal
from h5feed.store.writer_state import PLAN_FILE
from h5feed.testing.synthetic import FileOptions, write_synthetic
from h5feed.verify import verify_store

H = 32
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here
LEGACY = "speculators-legacy-pt"
# rows_0-4 (the first conversion, longest 40: shards of 48 rows), then rows_4-8, whose 100- and
# 64-token samples are longer than a shard and span 3 and 2
LENGTHS = [5, 40, 17, 33, 100, 1, 64, 20]
FIRST, SECOND = "rows_0-4", "rows_4-8"


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def staged(tmp_path) -> Path:
    """Eight sample files written once, in two rows_* folders, to be moved into SRC as they 'arrive'."""
    staging = tmp_path / "staging"
    write_synthetic(staging, LEGACY, len(LENGTHS), H, lengths=LENGTHS, seed=7,
                    files=FileOptions(layout="rows", rows_per_folder=4))
    return staging


def arrive(staged: Path, src: Path, folder: str) -> None:
    """A new rows_* folder shows up in SRC (copied with its files' mtimes)."""
    shutil.copytree(staged / folder, src / folder, copy_function=shutil.copy2)


def test_new_files_are_appended_after_the_old_samples_which_stay_untouched(tmp_path, staged):
    src, dst = tmp_path / "src", tmp_path / "store"
    arrive(staged, src, FIRST)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    before = Store(dst)
    assert before.sample_starts.tolist() == [0, 48, 96, 144] and before.info.shard_tokens == 48
    shards_before = {k: v for k, v in tree(dst).items() if "/c/" in k and not k.startswith("index/")}

    arrive(staged, src, SECOND)
    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)

    assert (report.num_samples, report.num_tokens, report.converted_now, report.resumed) == (8, sum(LENGTHS), 4, 4)
    store = Store(dst)
    assert store.info.status == "complete" and store.info.num_samples == 8 and store.info.format_version == 2
    # old samples keep their index; new ones follow the last row, a long one spanning several shards
    assert store.sample_starts.tolist() == [0, 48, 96, 144, 192, 336, 384, 480]
    assert store.sample_lengths.tolist() == LENGTHS
    assert store.source_paths == [f"{FIRST}/data_{i}.pt" for i in range(4)] + [f"{SECOND}/data_{i}.pt" for i in range(4, 8)]
    assert store.total_rows == 528
    after = tree(dst)
    assert {k: after[k] for k in shards_before} == shards_before  # same bytes, never rewritten (same mtime)
    check = verify_store(dst, src, progress=False)
    assert (check.ok, check.samples_checked, check.compared_with_source) == (True, 8, True)

    # the same files converted in one go make the same store; only the plan records that it grew
    fresh_src, fresh = tmp_path / "fresh-src", tmp_path / "fresh"
    arrive(staged, fresh_src, FIRST)
    arrive(staged, fresh_src, SECOND)
    convert(fresh_src, fresh, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=48))
    a, b = tree(dst), tree(fresh)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k][0] != b[k][0]] == [PLAN_FILE, "zarr.json"]  # the plan, and source_root
    plan, fresh_plan = (json.loads((p / PLAN_FILE).read_text()) for p in (dst, fresh))
    assert plan["samples"] == fresh_plan["samples"] and plan["total_rows"] == fresh_plan["total_rows"] == 528
    assert plan["append_from"] == 4

    # nothing new: a no-op that touches no file
    again = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (again.num_samples, again.converted_now, again.resumed) == (8, 0, 8)
    assert tree(dst) == after


def test_readers_open_across_an_append_keep_their_samples_and_new_readers_see_all(tmp_path, staged):
    src, dst = tmp_path / "src", tmp_path / "store"
    arrive(staged, src, FIRST)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    old = HiddenStatesDataset(dst)
    old_items = [old[i] for i in range(4)]
    pickled = pickle.dumps(old.store)  # what a DataLoader worker started later receives

    arrive(staged, src, SECOND)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)

    assert len(old) == 4 and all(same_item(old[i], old_items[i]) for i in range(4))
    assert len(pickle.loads(pickled)) == 4  # re-opened after the append: the same snapshot
    new = HiddenStatesDataset(dst)
    assert len(new) == 8 and all(same_item(new[i], old_items[i]) for i in range(4))
    with pytest.raises(StoreError, match="holds 8 samples, not the 9 asked for"):
        Store(dst, num_samples=9)


def _raise_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["planned", "converting", "index written", "before the flip"])
def test_an_append_killed_at_any_step_is_invisible_to_readers_and_a_rerun_completes_it(
    tmp_path, staged, monkeypatch, assert_same_tree, where
):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    arrive(staged, src, FIRST)
    for store in (dst, ref):
        convert(src, store, workers=0, progress=False, settings=CHUNKED)
    old_items = [HiddenStatesDataset(dst)[i] for i in range(4)]
    arrive(staged, src, SECOND)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)  # an uninterrupted append
    module = sys.modules["h5feed.conversion.converter"]
    if where == "planned":  # the plan holds the new samples; the arrays are not resized yet
        monkeypatch.setattr(module, "grow_arrays", _raise_interrupt)
    elif where == "converting":  # two of the four new samples converted
        module = sys.modules["h5feed.conversion.tasks"]
        original, calls = module.convert_one, []

        def convert_one(*args):
            calls.append(args)
            if len(calls) > 2:
                raise KeyboardInterrupt
            return original(*args)

        monkeypatch.setattr(module, "convert_one", convert_one)
    elif where == "index written":  # every index column written with eight rows, then killed
        samples = sys.modules["h5feed.conversion.samples"]
        original_publish = samples.publish_index

        def publish(*args):
            original_publish(*args)
            raise KeyboardInterrupt

        monkeypatch.setattr(samples, "publish_index", publish)
    else:  # index and journal written: the status and sample count not flipped yet
        monkeypatch.setattr(sys.modules["h5feed.conversion.samples"], "write_info", _raise_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    monkeypatch.undo()

    reader = HiddenStatesDataset(dst)  # opened in the middle of the append: the samples before it
    assert reader.store.info.status == "complete"
    assert len(reader) == 4 and all(same_item(reader[i], old_items[i]) for i in range(4))
    if where == "index written":
        import zarr

        assert zarr.open_group(dst, mode="r")["index"]["sample_start"].shape == (8,)  # longer than published

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)  # the same command again
    assert report.num_samples == 8
    assert_same_tree(dst, ref)


def test_an_append_killed_by_sigkill_then_rerun_equals_an_uninterrupted_one(tmp_path, assert_same_tree):
    staging, src, dst, ref = (tmp_path / n for n in ("staging", "src", "store", "ref"))
    write_synthetic(staging, LEGACY, 24, 128, lengths=(200, 400), seed=2,
                    files=FileOptions(layout="rows", rows_per_folder=8))
    shutil.copytree(staging / "rows_0-8", src / "rows_0-8")
    for store in (dst, ref):
        convert(src, store, workers=0, progress=False, settings=CHUNKED)
    for folder in ("rows_8-16", "rows_16-24"):
        shutil.copytree(staging / folder, src / folder)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)  # uninterrupted
    command = [sys.executable, "-m", "h5feed.cli", "-q", "convert", str(src), str(dst), "--workers", "0",
               "--chunk-tokens", str(CHUNK)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(read_journal(dst)) < 8 + 4:  # four of the sixteen new samples journaled
        assert proc.poll() is None, "the append ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(Store(dst)) == 8  # killed mid-append: readers still get the samples before it
    assert 12 <= len(read_journal(dst)) < 24

    done = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(Store(dst)) == 24
    assert_same_tree(dst, ref)


def test_a_converted_file_that_changed_is_refused_or_recorded_as_skipped(tmp_path, staged):
    src, dst = tmp_path / "src", tmp_path / "store"
    arrive(staged, src, FIRST)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    old_items = [HiddenStatesDataset(dst)[i] for i in range(4)]
    arrive(staged, src, SECOND)
    changed = src / FIRST / "data_1.pt"
    shutil.copyfile(staged / FIRST / "data_2.pt", changed)  # another sample's content under its name
    before = tree(dst)

    with pytest.raises(SourceError) as err:
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    problem = err.value.problem
    assert err.value.path == str(changed)
    assert problem.startswith(f"changed since it was converted (size {(staged / FIRST / 'data_1.pt').stat().st_size} "
                              f"-> {changed.stat().st_size} bytes, modified ")
    assert problem.endswith("; convert into another DST to take the new content, or pass --skip-bad to record it "
                            "as skipped and keep the samples converted before")
    assert tree(dst) == before  # nothing appended, nothing rewritten

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED,
                     skips=SkipPolicy(skip_bad=True))
    assert (report.num_samples, report.converted_now) == (8, 4)
    assert [s.path for s in report.skipped] == [f"{FIRST}/data_1.pt"]
    assert report.skipped[0].problem.endswith("; the store keeps the samples converted before")
    store = Store(dst)
    assert store.info.skipped == report.skipped
    reader = HiddenStatesDataset(dst)
    assert all(same_item(reader[i], old_items[i]) for i in range(4))  # sample 1 is what it was
    again = convert(src, dst, workers=0, progress=False, settings=CHUNKED,
                    skips=SkipPolicy(skip_bad=True))  # recorded once
    assert again.converted_now == 0 and Store(dst).info.skipped == report.skipped


def test_appending_from_another_folder_is_refused(tmp_path, staged):
    src, dst, other = tmp_path / "src", tmp_path / "store", tmp_path / "other"
    arrive(staged, src, FIRST)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    arrive(staged, other, SECOND)
    with pytest.raises(StoreError) as err:
        convert(other, dst, workers=0, progress=False, settings=CHUNKED)
    assert str(err.value) == (f"{dst}: was converted from {src.resolve()}, not {other.resolve()}: run the command with "
                              "that SRC (new files there are appended), or convert into another DST")
    assert len(Store(dst)) == 4


def test_files_arriving_while_an_append_is_unfinished_join_it(tmp_path, monkeypatch, assert_same_tree):
    staging, src, dst, ref = (tmp_path / n for n in ("staging", "src", "store", "ref"))
    write_synthetic(staging, LEGACY, 12, H, lengths=(5, 40), seed=3,
                    files=FileOptions(layout="rows", rows_per_folder=4))
    shutil.copytree(staging / "rows_0-4", src / "rows_0-4")
    for store in (dst, ref):
        convert(src, store, workers=0, progress=False, settings=CHUNKED)
    shutil.copytree(staging / "rows_4-8", src / "rows_4-8")
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    module = sys.modules["h5feed.conversion.converter"]
    monkeypatch.setattr(module, "grow_arrays", _raise_interrupt)  # planned, then killed
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    monkeypatch.undo()
    shutil.copytree(staging / "rows_8-12", src / "rows_8-12")  # more files arrive before the rerun
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)

    assert (report.num_samples, report.converted_now, report.resumed) == (12, 8, 4)
    a, b = tree(dst), tree(ref)
    assert sorted(a) == sorted(b) and [k for k in a if a[k][0] != b[k][0]] == [PLAN_FILE]
    assert json.loads((dst / PLAN_FILE).read_text())["append_from"] == 4  # the samples a finished run published
    assert json.loads((ref / PLAN_FILE).read_text())["append_from"] == 8


def test_a_store_whose_journal_is_gone_is_not_appended_to(tmp_path, staged):
    src, dst = tmp_path / "src", tmp_path / "store"
    arrive(staged, src, FIRST)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    (dst / "h5feed-journal.jsonl").unlink()
    arrive(staged, src, SECOND)
    with pytest.raises(StoreError, match=r"cannot append: its journal \(h5feed-journal.jsonl\) lacks samples converted "
                                         "before, and an append rewrites the index from it"):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert len(Store(dst)) == 4
