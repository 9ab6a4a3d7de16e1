"""`h5feed repair`: damaged samples re-encoded in place from their source files, bit for bit, crash-safe."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, bits, file_tree

import h5feed
from h5feed.errors import StoreError
from h5feed.store import Store
from h5feed.store.layout import read_info, write_info
from h5feed.store.writer_state import LOCK_FILE, PLAN_FILE
from h5feed.testing.synthetic import write_synthetic

CHUNK = 16


def converted(tmp_path: Path, num: int = 6, hidden: int = 32, lengths=(20, 60)) -> tuple[Path, Path, Path]:
    """A source folder, its store, and a second, fresh conversion of it to compare the repaired one with."""
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, "speculators-legacy-pt", num, hidden, lengths=lengths, seed=3)
    for store in (dst, ref):
        h5feed.convert(src, store, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=CHUNK))
    return src, dst, ref


def assert_same_samples(a: Path, b: Path) -> None:
    store, reference = Store(a), Store(b)
    assert len(store) == len(reference)
    for i in range(len(store)):
        x, y = store.read_sample(i), reference.read_sample(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(bits(x.aux_hidden_states), bits(y.aux_hidden_states))
        assert torch.equal(bits(x.last_hidden_state), bits(y.last_hidden_state))


def test_a_flipped_byte_is_named_by_verify_then_repaired_bit_for_bit(tmp_path, cli, flip_byte, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    flip_byte(dst, 3, "aux_hidden_states", chunk=1, at=20)

    r = cli("verify", dst)
    assert r.status == 1 and f"run `h5feed repair {dst}`" in r.output
    r = cli("convert", src, dst, "--chunk-tokens", CHUNK)  # reads no sample (a terabyte): says what finds damage
    assert r.status == 0 and f"`h5feed verify {dst}` checks every chunk, and `h5feed repair {dst}`" in r.output

    report = h5feed.repair(dst, progress=False)
    assert report.ok and report.repaired == [3] and report.unrecoverable == []
    assert h5feed.verify_store(dst, progress=False).ok
    assert_same_tree(dst, ref)  # every file, the repaired shard too, as a fresh conversion writes it
    assert_same_samples(dst, ref)

    r = cli("repair", dst)  # a sound store: nothing to do
    assert r.status == 0 and "nothing to repair" in r.output
    assert_same_tree(dst, ref)


def test_damage_in_several_arrays_and_samples_is_repaired_from_the_cli(tmp_path, cli, flip_byte, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    flip_byte(dst, 0, "last_hidden_states", chunk=0, at=10)
    flip_byte(dst, 4, "aux_hidden_states", chunk=0, at=30)
    moved = tmp_path / "moved"
    shutil.move(src, moved)  # --from: the sources are elsewhere now

    r = cli("repair", dst)
    assert r.status == 1 and "--from" in r.output  # the recorded source folder is gone: said, nothing written
    r = cli("repair", dst, "--from", moved)
    assert r.status == 0, r.output
    assert "repaired 2 sample(s)" in r.output
    shutil.move(moved, src)
    assert_same_tree(dst, ref)


@pytest.mark.parametrize("change", ["rewritten", "touched", "gone"])
def test_a_source_changed_since_conversion_is_unrecoverable_and_left_alone(tmp_path, cli, flip_byte, change):
    src, dst, _ = converted(tmp_path)
    flip_byte(dst, 2, "aux_hidden_states", chunk=0, at=20)
    source = src / Store(dst).source_paths[2]
    if change == "rewritten":
        write_synthetic(tmp_path / "other", "speculators-legacy-pt", 6, 32, lengths=(20, 60), seed=9)
        shutil.copy(tmp_path / "other" / source.name, source)
    elif change == "touched":
        os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    else:
        source.unlink()
    before = file_tree(dst)

    r = cli("repair", dst)
    assert r.status == 1
    assert "UNRECOVERABLE sample 2" in r.output and source.name in r.output
    assert ("is gone" if change == "gone" else "changed since it was converted") in r.output
    assert file_tree(dst) == before  # nothing written
    report = h5feed.repair(dst, progress=False)
    assert not report.ok and report.repaired == [] and [u.sample for u in report.unrecoverable] == [2]


def test_damaged_array_metadata_is_a_short_error_then_rebuilt(tmp_path, cli, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    meta = dst / "aux_hidden_states" / "zarr.json"
    meta.write_text(meta.read_text()[:40])  # cut short

    with pytest.raises(StoreError) as err:
        Store(dst)
    message = str(err.value)
    assert "aux_hidden_states/zarr.json" in message and f"h5feed repair {dst}" in message and len(message) < 400
    r = cli("verify", dst)
    assert r.status == 1 and f"h5feed repair {dst}" in r.output and len(r.output) < 1000
    r = cli("convert", src, dst, "--chunk-tokens", CHUNK)
    assert r.status == 1 and f"h5feed repair {dst}" in r.output

    r = cli("repair", dst)
    assert r.status == 0, r.output
    assert "rebuilt aux_hidden_states/zarr.json" in r.output
    assert_same_tree(dst, ref)


def test_a_store_written_by_open_writer_cannot_be_repaired_from_sources(tmp_path, cli):
    dst = tmp_path / "written"
    with h5feed.open_writer(dst, settings=h5feed.StoreSettings(chunk_tokens=CHUNK, shard_tokens=64)) as writer:
        writer.append({"input_ids": torch.arange(20), "hidden_states": [torch.randn(20, 8, dtype=torch.bfloat16)
                                                                         for _ in range(4)]})
    r = cli("repair", dst)
    assert r.status == 1 and "open_writer" in r.output and "no source files" in r.output


def test_help_shows_an_example(cli):
    with pytest.raises(SystemExit):
        cli("repair", "--help")
    from h5feed.cli.main import EXAMPLES

    assert "h5feed repair /data/hs.zarr" in EXAMPLES["repair"]


@pytest.mark.slow
def test_sigkill_during_a_repair_then_a_second_repair_finishes_it(tmp_path, assert_same_tree):
    """A repair killed at a random moment leaves each shard as it was or repaired: the next one finishes the job."""
    src, damaged, ref = converted(tmp_path, num=40, hidden=256, lengths=(100, 200))
    from conftest import inner_chunk_span

    for i in range(40):  # every sample damaged: the repair has work enough to be killed in the middle of
        path, offset, _ = inner_chunk_span(damaged, i, "aux_hidden_states", 0)
        data = bytearray(path.read_bytes())
        data[offset + 20] ^= 0xFF
        path.write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    rng = random.Random(7)
    for trial in range(3):
        dst = tmp_path / f"trial{trial}"
        shutil.copytree(damaged, dst)
        command = [sys.executable, "-m", "h5feed.cli", "-q", "repair", str(dst)]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while not (dst / LOCK_FILE).exists() and proc.poll() is None:  # the repair has started
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(rng.uniform(0.1, 2.0))  # the imports done: verifying, or re-encoding (about 2 s here)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        assert h5feed.verify_store(dst, progress=False).ok
        assert_same_tree(dst, ref)


# --- dropping what cannot be repaired -----------------------------------------------------------------------------


def damage_and_lose_source(src: Path, dst: Path, sample: int, flip_byte, change: str = "gone") -> str:
    """Damage a sample of `dst` and take its source away (or change it): the sample cannot be repaired."""
    flip_byte(dst, sample, "aux_hidden_states", chunk=0, at=20)
    relpath = Store(dst).source_paths[sample]
    if change == "gone":
        (src / relpath).unlink()
    else:  # another sample's content under its name
        shutil.copy(src / Store(dst).source_paths[(sample + 1) % len(Store(dst))], src / relpath)
    return relpath


def assert_samples_are(store_path: Path, ref: Path, kept: list[int]) -> None:
    """The store holds exactly the reference's samples `kept`, in that order, bit for bit."""
    store, reference = Store(store_path), Store(ref)
    assert store.source_paths == [reference.source_paths[i] for i in kept]
    for got, want in enumerate(kept):
        x, y = store.read_sample(got), reference.read_sample(want)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(bits(x.aux_hidden_states), bits(y.aux_hidden_states))
        assert torch.equal(bits(x.last_hidden_state), bits(y.last_hidden_state))


@pytest.mark.parametrize("change", ["gone", "rewritten"])
def test_drop_unrecoverable_drops_the_sample_records_why_and_convert_leaves_it(tmp_path, cli, flip_byte, change):
    src, dst, ref = converted(tmp_path)
    flip_byte(dst, 4, "last_hidden_states", chunk=0, at=10)  # repairable: repaired, not dropped
    relpath = damage_and_lose_source(src, dst, 2, flip_byte, change)

    r = cli("repair", dst, "--drop-unrecoverable")
    assert r.status == 0, r.output
    why = ("is gone: the sample cannot be converted again" if change == "gone"
           else "changed since it was converted (size ")
    assert f"DROPPED sample 2 ({relpath}): dropped by `h5feed repair --drop-unrecoverable`: its stored rows fail " \
           f"their checks, and repair could not convert it again ({why}" in r.output
    assert "repaired 1 sample(s)" in r.output and "dropped 1 from the index" in r.output
    assert "all 5 samples check out now" in r.output

    assert cli("verify", dst).status == 0
    assert_samples_are(dst, ref, [0, 1, 3, 4, 5])  # the sound ones untouched, the repaired one as converted
    [skip] = Store(dst).info.skipped
    assert skip.path == relpath and skip.problem.startswith("dropped by `h5feed repair --drop-unrecoverable`: ")
    inspected = cli("inspect", dst)
    assert f"  skipped {relpath}: dropped by `h5feed repair --drop-unrecoverable`" in inspected.stdout
    assert "samples            5" in inspected.stdout
    with h5feed.BatchLoader(dst, flavor="speculators-legacy", max_len=64,
                            schedule=h5feed.ScheduleOptions(shuffle=False),
                            decode=h5feed.ThreadsOptions(threads=1)) as loader:
        assert sum(len(batch["lengths"]) for batch in loader) == 5
    assert len(h5feed.HiddenStatesDataset(dst)) == 5

    before = file_tree(dst)
    r = cli("convert", src, dst, "--chunk-tokens", CHUNK)  # left skipped, neither re-added nor tripped over
    assert r.status == 0, r.output
    assert "nothing to do; 1 file(s) were skipped: once repaired, --retry-skipped converts them" in r.output
    assert file_tree(dst) == before
    assert cli("repair", dst).status == 0 and file_tree(dst) == before  # nothing to repair: the drop stays

    r = cli("convert", src, dst, "--chunk-tokens", CHUNK, "--retry-skipped", "--skip-bad")  # asked for: tried again
    assert r.status == 0, r.output
    store = Store(dst)
    if change == "gone":  # still no file: still skipped, now saying so
        assert len(store) == 5 and [s.path for s in store.info.skipped] == [relpath]
        assert "--retry-skipped found no file to try again" in store.info.skipped[0].problem
    else:  # the file as it is now, appended after the others
        assert len(store) == 6 and store.info.skipped == [] and store.source_paths[-1] == relpath
    assert h5feed.verify_store(dst, src, progress=False).ok


def test_the_python_api_drops_as_the_cli_does_and_reports_it(tmp_path, flip_byte):
    src, dst, ref = converted(tmp_path)
    relpath = damage_and_lose_source(src, dst, 5, flip_byte)
    kept = h5feed.repair(dst, progress=False)  # without the flag: reported, left as it was
    assert not kept.ok and [m.sample for m in kept.unrecoverable] == [5] and kept.dropped == []
    assert len(Store(dst)) == 6

    report = h5feed.repair(dst, progress=False, drop_unrecoverable=True)
    assert report.ok and report.unrecoverable == [] and report.repaired == []
    assert [(m.sample, m.source_path) for m in report.dropped] == [(5, relpath)]
    assert report.dropped[0].problem == Store(dst).info.skipped[0].problem
    assert_samples_are(dst, ref, [0, 1, 2, 3, 4])


@pytest.mark.slow
def test_sigkill_during_a_drop_then_a_second_run_finishes_it(tmp_path, assert_same_tree):
    """kill -9 at random moments of `repair --drop-unrecoverable`, and once just as it publishes the index without
    the dropped samples: the next run leaves the store as an uninterrupted one does, every sound sample kept."""
    src, damaged, ref = converted(tmp_path, num=40, hidden=256, lengths=(100, 200))
    from conftest import inner_chunk_span

    for i in range(40):
        path, offset, _ = inner_chunk_span(damaged, i, "aux_hidden_states", 0)
        data = bytearray(path.read_bytes())
        data[offset + 20] ^= 0xFF
        path.write_bytes(bytes(data))
    lost = [3, 17, 30, 39]
    for i in lost:
        (src / Store(damaged).source_paths[i]).unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(damaged, uninterrupted)
    command = [sys.executable, "-m", "h5feed.cli", "-q", "repair", "--drop-unrecoverable"]
    done = subprocess.run([*command, str(uninterrupted)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_samples_are(uninterrupted, ref, [i for i in range(40) if i not in lost])
    journal = damaged / "h5feed-journal.jsonl"
    rng = random.Random(11)
    for trial in range(4):
        dst = tmp_path / f"trial{trial}"
        shutil.copytree(damaged, dst)
        proc = subprocess.Popen([*command, str(dst)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        if trial == 0:  # just as the journal with the drops is renamed in: the index is being published
            first = (dst / journal.name).stat().st_ino
            while (dst / journal.name).stat().st_ino == first:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.0005)
        else:
            while not (dst / LOCK_FILE).exists() and proc.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            time.sleep(rng.uniform(0.1, 3.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        done = subprocess.run([*command, str(dst)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert h5feed.verify_store(dst, progress=False).ok
        assert_same_tree(dst, uninterrupted)


# --- the store's attributes and its index, written again from the plan and journal ------------------------------


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_a_row(dst: Path) -> None:
    import zarr

    column = zarr.open_array(dst / "index" / "source_index", mode="r+")
    column[1] = 7  # zarr's own checksums are sound: the index digest recorded at conversion is not


INDEX_DAMAGE = {
    "flipped byte in a column's chunk": lambda dst: _flip(dst / "index" / "source_path" / "c" / "0", 5),
    "truncated column chunk": lambda dst: (dst / "index" / "sample_start" / "c" / "0").write_bytes(b"\x00" * 3),
    "deleted column metadata": lambda dst: (dst / "index" / "checksum" / "zarr.json").unlink(),
    "deleted index group": lambda dst: (dst / "index" / "zarr.json").unlink(),
    "deleted index": lambda dst: shutil.rmtree(dst / "index"),
    "rewritten row": _rewrite_a_row,
}


@pytest.mark.parametrize("damage", list(INDEX_DAMAGE))
def test_a_damaged_index_is_published_again_from_the_journal(tmp_path, cli, damage, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    INDEX_DAMAGE[damage](dst)
    with pytest.raises(StoreError, match="index"):
        Store(dst)

    r = cli("repair", dst)
    assert r.status == 0, r.output
    assert "rebuilt index" in r.output and "all 6 samples check out now" in r.output
    assert_same_tree(dst, ref)  # byte for byte what the conversion wrote
    assert h5feed.verify_store(dst, src, progress=False).ok


def _edit_attributes(dst: Path) -> None:
    meta = json.loads((dst / "zarr.json").read_text())
    meta["attributes"]["h5feed"]["hidden_size"] = 64  # still a valid store's figure: only the plan tells
    (dst / "zarr.json").write_text(json.dumps(meta))


ROOT_DAMAGE = {
    "flipped byte": lambda dst: _flip(dst / "zarr.json", 40),
    "truncated": lambda dst: (dst / "zarr.json").write_bytes((dst / "zarr.json").read_bytes()[:100]),
    "deleted": lambda dst: (dst / "zarr.json").unlink(),
    "a figure edited": _edit_attributes,
    "its publication edited": lambda dst: write_info(dst, dataclasses.replace(read_info(dst), num_samples=4),
                                                     durable=False),
}


@pytest.mark.parametrize("damage", list(ROOT_DAMAGE))
def test_damaged_store_attributes_are_written_again_from_the_plan(tmp_path, cli, damage, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    ROOT_DAMAGE[damage](dst)
    if damage in ("flipped byte", "truncated", "deleted"):
        r = cli("verify", dst)
        assert r.status == 1 and f"{dst}: its zarr.json (the store's attributes) is " in r.output
        assert f"run `h5feed repair {dst}` to write it again from the conversion's plan" in r.output
    try:
        still_opens = len(Store(dst)) == 6 and Store(dst).info == Store(ref).info
    except StoreError:
        still_opens = False
    assert not still_opens

    r = cli("repair", dst)
    assert r.status == 0, r.output
    assert ("rebuilt index" if damage == "its publication edited" else "rebuilt zarr.json") in r.output
    assert_same_tree(dst, ref)
    assert h5feed.verify_store(dst, src, progress=False).ok
    assert cli("convert", src, dst, "--chunk-tokens", CHUNK).status == 0  # the converter takes it as its own
    assert_same_tree(dst, ref)


def test_the_attributes_and_the_index_damaged_together_are_both_rebuilt(tmp_path, cli, flip_byte, assert_same_tree):
    src, dst, ref = converted(tmp_path)
    flip_byte(dst, 1, "aux_hidden_states", chunk=0, at=20)
    (dst / "zarr.json").unlink()
    shutil.rmtree(dst / "index")
    (dst / "input_ids" / "zarr.json").unlink()
    r = cli("repair", dst)
    assert r.status == 0, r.output
    assert all(f"rebuilt {what}" in r.output for what in ("zarr.json", "input_ids/zarr.json", "index"))
    assert "repaired 1 sample(s)" in r.output
    assert_same_tree(dst, ref)


def test_attributes_that_the_plan_has_no_copy_of_are_refused_saying_so(tmp_path, cli):
    src, dst, _ = converted(tmp_path)
    plan = json.loads((dst / PLAN_FILE).read_text())
    del plan["store"]  # as plans were written before they kept one
    (dst / PLAN_FILE).write_text(json.dumps(plan))
    (dst / "zarr.json").unlink()
    r = cli("repair", dst)
    assert r.status == 1
    assert f"{dst}: zarr.json (the store's attributes) is missing, and its plan (h5feed-plan.json) was written by " \
           "an h5feed that kept no copy of them, so repair cannot write them again: convert the store again" in r.output
    assert not (dst / "zarr.json").exists()
    (dst / PLAN_FILE).write_text("{")  # the plan damaged too: nothing to rebuild from
    r = cli("repair", dst)
    assert r.status == 1 and f"{dst}: has no readable plan (h5feed-plan.json: JSONDecodeError)" in r.output


def test_an_unfinished_append_is_left_to_convert(tmp_path, cli):
    """The journal of an append killed midway holds samples the index does not publish yet: repair leaves the
    index to the `h5feed convert` that finishes the append, and says so where the index is damaged."""
    src, dst, _ = converted(tmp_path)
    plan = json.loads((dst / PLAN_FILE).read_text())
    extra = dict(plan["samples"][-1], relpath="late.pt", start=plan["total_rows"])
    plan["samples"].append(extra)  # planned by an append, never converted
    plan["total_rows"] += 64
    plan["append_from"] = 6
    (dst / PLAN_FILE).write_text(json.dumps(plan))
    assert cli("repair", dst).status == 0  # the index opens: nothing to do
    shutil.rmtree(dst / "index")
    r = cli("repair", dst)
    assert r.status == 1
    assert "its journal lacks 1 of the plan's samples (an append that did not finish, or a damaged journal): run " \
           "the same `h5feed convert SRC DST` again, which finishes an append and rebuilds the index" in r.output
