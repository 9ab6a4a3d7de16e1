"""No wrong sample is ever delivered silently, and no second writer, crash or damaged index can spoil a store."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, same_item

import h5feed
from h5feed import HiddenStatesDataset, HiddenStatesStream, SkipPolicy, Store, StoreSettings, StreamLoader, convert
from h5feed.errors import CorruptSampleError, SourceError, StoreError
from h5feed.store.journal import JOURNAL_FILE
from h5feed.store.writer_state import LOCK_FILE
from h5feed.testing.synthetic import write_synthetic
from h5feed.verify import verify_store

H = 32
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here
LENGTHS = [20, 35, 40, 8, 33, 17]
LEGACY = "speculators-legacy-pt"


def make_store(tmp_path: Path, name: str = "store", **kwargs) -> tuple[Path, Path]:
    src = tmp_path / "src"
    if not src.exists():
        write_synthetic(src, LEGACY, len(LENGTHS), H, lengths=LENGTHS, seed=2)
    dst = tmp_path / name
    convert(src, dst, workers=0, progress=False, **kwargs, settings=CHUNKED)
    return src, dst


# --------------------------------------------------------------------------- silent wrong data


@pytest.fixture
def damaged(tmp_path, flip_byte):
    """A store whose sample 2 has one flipped byte in its second chunk of aux hidden states, and a sound copy."""
    _src, dst = make_store(tmp_path)
    _, sound = make_store(tmp_path, "sound")
    shard = flip_byte(dst, 2, "aux_hidden_states", chunk=1, at=300)
    return dst, sound, shard


def test_a_flipped_byte_raises_in_every_reader(damaged):
    dst, _, shard = damaged
    problem = (f"{shard}: sample 2 (converted from data_2.pt): inner chunk 1 fails its checksum (crc32c ")

    with pytest.raises(CorruptSampleError) as err:
        HiddenStatesDataset(dst)[2]
    assert str(err.value).startswith(problem)
    assert "run `h5feed verify" in str(err.value)
    with pytest.raises(Exception, match="sample 2 \\(converted from data_2.pt\\): inner chunk 1 fails its checksum"):
        list(torch.utils.data.DataLoader(HiddenStatesDataset(dst), num_workers=2, collate_fn=list))
    with pytest.raises(CorruptSampleError, match="inner chunk 1 fails its checksum"):
        list(HiddenStatesStream(dst, schedule=h5feed.ScheduleOptions(shuffle=False), reading=h5feed.ReadOptions(threads=2)))
    with pytest.raises(Exception, match="sample 2 \\(converted from data_2.pt\\): inner chunk 1 fails its checksum"):
        list(StreamLoader(HiddenStatesStream(dst, schedule=h5feed.ScheduleOptions(shuffle=False)), num_workers=2, collate_fn=list))
    # a truncated read that stops before the damaged chunk is sound, and is served
    assert HiddenStatesDataset(dst, max_len=CHUNK - 1)[2]["input_ids"].shape == (CHUNK - 1,)


def test_on_corrupt_skip_skips_counts_and_never_serves_the_damage(damaged):
    dst, sound, _ = damaged
    reference = HiddenStatesDataset(sound)

    dataset = HiddenStatesDataset(dst, on_corrupt="skip")
    assert same_item(dataset[2], reference[3])  # the next sound sample stands in
    assert same_item(dataset[1], reference[1])
    assert dataset.counters.snapshot().total("corrupt") == 1

    for workers in (0, 2):
        stream = HiddenStatesStream(dst, on_corrupt="skip",
                                    schedule=h5feed.ScheduleOptions(shuffle=False, equal_per_rank=False))
        items = [b[0] for b in StreamLoader(stream, num_workers=workers, collate_fn=list)]
        wanted = [reference[i] for i in (0, 1, 3, 4, 5)]
        items.sort(key=lambda item: item["input_ids"].tolist())  # workers deliver in turn: a gap shifts the order
        wanted.sort(key=lambda item: item["input_ids"].tolist())
        assert len(items) == 5 and all(same_item(a, b) for a, b in zip(items, wanted)), workers
        assert stream.counters.snapshot().total("corrupt") == 1
    with pytest.raises(ValueError, match="on_corrupt must be 'raise' or 'skip', not 'ignore'"):
        HiddenStatesDataset(dst, on_corrupt="ignore")


def test_verify_names_the_damaged_sample(damaged):
    dst, _, shard = damaged
    report = verify_store(dst, progress=False)
    assert [(m.sample, m.source_path) for m in report.mismatches] == [(2, "data_2.pt")]
    assert str(shard) in report.mismatches[0].problem


def _rewrite_index(dst: Path, column: str, change) -> None:
    import zarr

    array = zarr.open_group(dst, mode="r+")["index"][column]
    values = array[...]
    change(values)
    array[...] = values


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda v: v.__setitem__(1, v[0]), "sample 1 (start 0, 35 tokens) overlaps sample 0"),
        (lambda v: v.__setitem__(2, v[1]), "sample 2 (start 48, 40 tokens) overlaps sample 1"),
        (lambda v: v.__setitem__(3, v[3] + 1), "sample 3 (start 145, 8 tokens) does not start on a multiple of 48 rows"),
        (lambda v: v.__setitem__(5, v[5] * 10), "sample 5 (start 2400, 17 tokens) ends past the arrays' 288 rows"),
    ],
    ids=["points-at-sample-0", "points-at-sample-1", "misaligned", "past-the-end"],
)
def test_a_damaged_index_is_refused_at_open_and_rebuilt_by_a_rerun(tmp_path, assert_same_tree, change, problem):
    src, dst = make_store(tmp_path)
    _, ref = make_store(tmp_path, "ref")
    _rewrite_index(dst, "sample_start", change)

    with pytest.raises(StoreError) as err:
        Store(dst)
    assert str(err.value) == (f"{dst}: the sample index is damaged: {problem}; run the `h5feed convert` command "
                              "that made the store again to rebuild the index")
    with pytest.raises(StoreError, match="the sample index is damaged"):
        HiddenStatesDataset(dst)

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)  # the same command again
    assert (report.num_samples, report.converted_now, report.resumed) == (6, 0, 6)
    assert_same_tree(dst, ref)


def test_swapped_starts_that_overlap_nothing_are_refused_by_the_index_digest_and_rebuilt(tmp_path, assert_same_tree):
    # writers appending together publish rows out of disk order: the order alone no longer tells, the digest does
    src, dst = make_store(tmp_path)
    _, ref = make_store(tmp_path, "ref")
    _rewrite_index(dst, "sample_start", lambda v: v.__setitem__(slice(1, 3), v[[2, 1]]))
    with pytest.raises(StoreError, match="the sample index fails the checksum recorded at conversion"):
        Store(dst)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)  # the same command again
    assert_same_tree(dst, ref)


def test_a_damaged_index_chunk_fails_its_checksum(tmp_path):
    _, dst = make_store(tmp_path)
    chunk = dst / "index" / "sample_length" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="the sample index is missing or damaged .*checksum"):
        Store(dst)


def test_a_complete_store_without_plan_and_journal_says_what_to_run(tmp_path):
    src, dst = make_store(tmp_path)
    _rewrite_index(dst, "sample_start", lambda v: v.__setitem__(1, v[0]))
    (dst / JOURNAL_FILE).unlink()
    with pytest.raises(StoreError, match="is complete but damaged .* no plan and journal to rebuild its index from: "
                                         "pass --overwrite to convert again"):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)


# --------------------------------------------------------------------------- two writers


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "h5feed.cli", "-q", *map(str, args)]


def _journal_lines(dst: Path) -> int:
    try:
        return (dst / JOURNAL_FILE).read_text().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("when", ["locked", "planned", "converting", "half-done"])
def test_a_second_converter_is_refused_and_the_store_stays_intact(tmp_path, assert_same_tree, when):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, LEGACY, 24, 128, lengths=(200, 400), seed=1)
    convert(src, ref, workers=0, progress=False, settings=StoreSettings(chunk_tokens=64))
    ready = {"locked": lambda: (dst / LOCK_FILE).exists(), "planned": lambda: (dst / "h5feed-plan.json").exists(),
             "converting": lambda: _journal_lines(dst) >= 1, "half-done": lambda: _journal_lines(dst) >= 12}[when]
    first = subprocess.Popen(_cli("convert", src, dst, "--workers", 1, "--chunk-tokens", 64), cwd=REPO / "src",
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert first.poll() is None, f"the first converter finished before the point {when!r}: {first.stdout.read()}"
        with pytest.raises(StoreError) as err:
            convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=64))
        assert f"another `h5feed convert` (host {os.uname().nodename}, pid {first.pid}, started at " in str(err.value)
        assert str(err.value).endswith("is writing this store; wait for it to finish, or stop it and run this "
                                       "command again")
    finally:
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    assert_same_tree(dst, ref)


# --------------------------------------------------------------------------- edge cases


def test_a_resume_that_skips_every_remaining_sample_keeps_the_converted_ones(tmp_path, interrupted_convert):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = write_synthetic(src, LEGACY, 5, H, lengths=[20, 30, 5, 7, 9], seed=1)
    assert sorted(interrupted_convert(src, dst, after=2, settings=CHUNKED)) == [0, 1]
    for f in files[2:]:
        f.write_bytes(b"junk")

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED,
                     skips=SkipPolicy(skip_bad=True))

    assert (report.num_samples, report.converted_now, report.resumed) == (2, 0, 2)
    assert [s.path for s in report.skipped] == ["data_2.pt", "data_3.pt", "data_4.pt"]
    assert Store(dst).source_paths == ["data_0.pt", "data_1.pt"]


def test_a_run_that_converts_nothing_ends_with_a_clear_error(tmp_path, interrupted_convert):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = write_synthetic(src, LEGACY, 3, H, lengths=[20, 30, 5], seed=1)
    assert interrupted_convert(src, dst, after=0, settings=CHUNKED) == {}  # planned, nothing converted yet
    for f in files:
        f.write_bytes(b"junk")
    with pytest.raises(SourceError) as err:
        convert(src, dst, workers=0, progress=False, settings=CHUNKED,
                skips=SkipPolicy(skip_bad=True))
    assert str(err.value).startswith(f"{src.resolve()}: no sample could be converted: all 3 were skipped (first: "
                                     "data_0.pt: not a readable torch.save file (truncated or corrupt)")


# --------------------------------------------------------------------------- leftovers


def _sems() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.")}


def _names(recorded: list) -> set[str]:
    return {name for name, _ in recorded}


def test_workers_die_with_a_killed_converter_and_the_next_run_cleans_up(tmp_path, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, LEGACY, 24, 128, lengths=(200, 400), seed=1)
    convert(src, ref, workers=0, progress=False, settings=StoreSettings(chunk_tokens=64))
    main = subprocess.Popen(_cli("convert", src, dst, "--workers", 2, "--chunk-tokens", 64), cwd=REPO / "src",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while _journal_lines(dst) < 1 and main.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    children = psutil.Process(main.pid).children(recursive=True)
    recorded = json.loads((dst / LOCK_FILE).read_text())["semaphores"]
    assert len(children) >= 3 and recorded  # two workers and the resource tracker; the pool's semaphores

    main.send_signal(signal.SIGKILL)  # the main process only, as an OOM killer would
    main.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []  # no orphaned workers (and the resource tracker follows them)

    report = convert(src, dst, workers=2, progress=False, settings=StoreSettings(chunk_tokens=64))
    assert report.resumed >= 1 and report.num_samples == 24
    assert_same_tree(dst, ref)
    assert not _names(recorded) & _sems()


def test_semaphores_left_by_a_killed_process_group_are_removed_by_the_next_run(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, LEGACY, 24, 128, lengths=(200, 400), seed=1)
    group = subprocess.Popen(_cli("convert", src, dst, "--workers", 2, "--chunk-tokens", 64), cwd=REPO / "src",
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while _journal_lines(dst) < 1 and group.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    recorded = json.loads((dst / LOCK_FILE).read_text())["semaphores"]
    os.killpg(group.pid, signal.SIGKILL)  # everything at once: nobody is left to clean up
    group.wait()
    time.sleep(0.5)
    left = _names(recorded) & _sems()
    assert left, "a SIGKILLed process group leaves its pool's semaphores"

    convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=64))
    assert not left & _sems()


def test_clean_runs_leave_nothing_in_dev_shm(tmp_path):
    from h5feed.conversion.pool import _mapped_shm_inodes

    before = set(os.listdir("/dev/shm"))
    _, dst = make_store(tmp_path)
    convert(tmp_path / "src", tmp_path / "pooled", workers=2, progress=False,
            settings=CHUNKED)
    for context in ("fork", "spawn", "forkserver"):
        stream = HiddenStatesStream(dst, schedule=h5feed.ScheduleOptions(shuffle=False))
        assert len(list(StreamLoader(stream, num_workers=2, collate_fn=list, multiprocessing_context=context))) == 6
    gc.collect()  # the pool's and loaders' queues are finalized: they unlink their semaphores
    others = set()  # what other processes on this machine map now is theirs, not ours
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) != os.getpid():
            others |= _mapped_shm_inodes(pid)
    new = {n for n in set(os.listdir("/dev/shm")) - before if os.stat(f"/dev/shm/{n}").st_ino not in others}
    assert new == set()


# --------------------------------------------------------------------------- verify and zarr


@pytest.mark.parametrize("array, message", [
    ("last_hidden_states", "MISMATCH last_hidden_states: zarr-python cannot open the array: "),
    ("index/source_path", "the sample index is missing or damaged"),  # the reader itself needs the index
])
def test_verify_fails_a_store_whose_array_metadata_is_damaged(tmp_path, cli, array, message):
    _, dst = make_store(tmp_path)
    meta = dst / array / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:50])

    r = cli("verify", dst)

    assert r.status == 1 and message in r.output


def test_the_monitor_reports_skipped_damage(damaged, tmp_path, caplog):
    import logging

    import h5feed

    dst, _, _ = damaged
    stream = HiddenStatesStream(dst, on_corrupt="skip", schedule=h5feed.ScheduleOptions(shuffle=False))
    loader = StreamLoader(stream, num_workers=2, collate_fn=list)
    caplog.set_level(logging.INFO, logger="h5feed")
    for _ in h5feed.monitor(loader, every=0.05, log_dir=tmp_path, name="damaged"):
        time.sleep(0.05)
    records = [json.loads(line) for line in (tmp_path / "h5feed-monitor-damaged.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "end" and records[-1]["loader"]["corrupt"] == 1
    assert any("1 DAMAGED sample(s) skipped (on_corrupt='skip'; run `h5feed verify`)" in m for m in caplog.messages)


def test_copied_frames_are_checked_and_decode_to_the_sample(tmp_path, flip_byte):
    import numpy as np
    from numcodecs import blosc

    _, dst = make_store(tmp_path)
    store = Store(dst)
    out = np.zeros(1 << 20, dtype=np.uint8)
    placed = store.copy_frames_into(1, "aux_hidden_states", 35, out)  # 35 tokens: chunks 0, 1, 2
    assert [chunk for chunk, _, _ in placed] == [0, 1, 2]
    assert [offset for _, offset, _ in placed] == [0, placed[0][2], placed[0][2] + placed[1][2]]
    decoded = np.concatenate([np.frombuffer(blosc.decompress(out[o : o + n].tobytes()), np.uint16) for _, o, n in placed])
    want = store.read_sample(1).aux_hidden_states.view(torch.uint16).numpy().reshape(-1)
    assert np.array_equal(decoded[: want.size], want)
    with pytest.raises(ValueError, match="out holds 100 bytes"):
        store.copy_frames_into(1, "aux_hidden_states", 35, np.zeros(100, dtype=np.uint8))

    flip_byte(dst, 1, "aux_hidden_states", chunk=2, at=40)
    with pytest.raises(CorruptSampleError, match="sample 1 .*inner chunk 2 fails its checksum"):
        Store(dst).copy_frames_into(1, "aux_hidden_states", 35, out)
