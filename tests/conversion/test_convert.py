"""`h5feed convert`: exact round trips of every input format, the store's self-description,
and crash safety: a conversion killed at any moment resumes to the bytes of an uninterrupted one."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import bits

from h5feed import StoreSettings
from h5feed.conversion.converter import convert
from h5feed.errors import StoreError
from h5feed.store import ReadStats, Store
from h5feed.store.journal import JOURNAL_FILE, read_journal
from h5feed.store.layout import EMPTY, decode_shard_index
from h5feed.store.writer_state import PLAN_FILE
from h5feed.testing.synthetic import FileOptions, write_synthetic
from h5feed.verify import describe_store, verify_store

H = 32
K = 3
CHUNK = 16
CHUNKED = StoreSettings(chunk_tokens=CHUNK)  # the store settings of most conversions here
# one token, exactly one chunk, one token past a chunk, short, many chunks, three chunks
LENGTHS = [1, 16, 17, 5, 100, 33]
SHARD = 112  # by default a shard holds the longest sample (100 tokens), rounded up to whole chunks
STARTS = [0, 112, 224, 336, 448, 560]  # every sample starts on a shard boundary
ZSTD = {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}
LZ4 = {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "blocksize": 1 << 20}
LEGACY = "speculators-legacy-pt"


def legacy_source(root: Path, lengths: list[int] | tuple[int, int] = LENGTHS, **kwargs) -> list[Path]:
    num = len(lengths) if isinstance(lengths, list) else kwargs.pop("num_samples")
    hidden_size, seed = kwargs.pop("hidden_size", H), kwargs.pop("seed", 3)
    return write_synthetic(root, LEGACY, num, hidden_size, lengths=lengths, seed=seed, **kwargs)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "fmt, layout, norm, relpath_5",
    [
        pytest.param(LEGACY, FileOptions(), "pre", "data_5.pt", id="legacy-flat"),
        pytest.param(LEGACY, FileOptions(layout="rows", rows_per_folder=4), "pre", "rows_4-8/data_5.pt",
                     id="legacy-rows"),
        pytest.param("speculators-v0-pt", FileOptions(), "post", "data_5.pt", id="v0"),
        pytest.param("specforge-ckpt", FileOptions(layout="rows"), "post", "rows_0-2000/data_5.ckpt", id="specforge"),
        pytest.param("specforge-ckpt", FileOptions(layout="rows", compress=True), "post", "rows_0-2000/data_5.ckpt.gz",
                     id="specforge-gz"),
        pytest.param("speculators-safetensors", FileOptions(), "pre", "hidden_states/hs_5.safetensors",
                     id="safetensors"),
    ],
)
def test_every_format_round_trips_bit_exactly(tmp_path, assert_sample_matches_source, fmt, layout, norm, relpath_5):
    src, dst = tmp_path / "src", tmp_path / "store"
    files = write_synthetic(src, fmt, len(LENGTHS), H, lengths=LENGTHS, seed=3, files=layout)

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)

    assert (report.num_samples, report.num_tokens, report.converted_now, report.resumed, report.skipped) == (
        6, sum(LENGTHS), 6, 0, [])
    (worker, done), = report.workers.items()  # workers=0: this process did every sample
    assert worker == f"{socket.gethostname()}:{os.getpid()}"
    assert (done.samples, done.bytes_in, done.bytes_out) == (6, report.bytes_in, report.bytes_out)
    assert report.bytes_in == sum(f.stat().st_size for f in files) and 0 < report.bytes_out
    store = Store(dst)
    info = store.info
    assert (info.source_format, info.hidden_size, info.num_aux_layers, info.dtype, info.last_state_norm) == (
        fmt, H, K, "bfloat16", norm)
    assert (info.codec.to_json(), info.chunk_tokens, info.shard_tokens, info.status) == (ZSTD, CHUNK, SHARD, "complete")
    assert info.format_version == 2
    assert info.source_root == str(src.resolve())
    assert (info.num_samples, info.num_tokens, info.skipped) == (6, sum(LENGTHS), [])
    assert store.source_paths == [f.relative_to(src).as_posix() for f in files]
    assert store.source_paths[5] == relpath_5
    assert store.source_indices.tolist() == list(range(6))
    assert store.sample_lengths.tolist() == LENGTHS
    assert store.sample_starts.tolist() == STARTS
    assert store.has_loss_mask.tolist() == [True] * 6
    for i in range(6):
        assert_sample_matches_source(store, i, fmt, src)
    assert (dst / PLAN_FILE).exists() and not (dst / "h5feed-writer.lock").exists()  # the plan stays, the lock goes
    assert [r["i"] for r in map(json.loads, (dst / JOURNAL_FILE).read_text().splitlines())] == list(range(6))
    check = verify_store(dst, src, progress=False)
    assert (check.ok, check.samples_checked, check.compared_with_source) == (True, 6, True)


@pytest.mark.parametrize("fmt", [LEGACY, "speculators-safetensors"])
def test_missing_loss_mask_is_stored_as_ones_and_flagged(tmp_path, assert_sample_matches_source, fmt):
    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, fmt, 3, H, lengths=[1, 20, 7], files=FileOptions(loss_mask=False))
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    store = Store(dst)
    assert store.has_loss_mask.tolist() == [False] * 3
    for i in range(3):
        assert store.read_sample(i).loss_mask.tolist() == [1] * [1, 20, 7][i]
        assert_sample_matches_source(store, i, fmt, src)


@pytest.mark.parametrize("dtype, name", [(torch.float16, "float16"), (torch.float32, "float32")])
def test_other_float_dtypes_round_trip(tmp_path, assert_sample_matches_source, dtype, name):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src, dtype=dtype)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    store = Store(dst)
    assert store.info.dtype == name
    for i in range(len(LENGTHS)):
        assert_sample_matches_source(store, i, LEGACY, src)


@pytest.mark.parametrize("codec, config", [("zstd", ZSTD), ("lz4", LZ4), ("none", {"name": "none"})])
def test_every_codec_round_trips(tmp_path, assert_sample_matches_source, codec, config):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(codec=codec, chunk_tokens=CHUNK))
    store = Store(dst)
    assert store.info.codec.to_json() == config
    for i in range(len(LENGTHS)):
        assert_sample_matches_source(store, i, LEGACY, src)
    # each sample is one shard of 7 inner chunks; those holding its rows are written: 1 + 1 + 2 + 1 + 7 + 3
    shards = sorted(f for f in (dst / "aux_hidden_states" / "c").rglob("*") if f.is_file())
    assert len(shards) == 6
    present = [int((shard_index(f, SHARD // CHUNK)[:, 0] != EMPTY).sum()) for f in shards]
    assert present == [1, 1, 2, 1, 7, 3]
    if codec == "none":  # raw chunks, each with its crc32c, then the index (7 entries of 16 bytes) and its crc32c
        assert [f.stat().st_size for f in shards] == [n * (CHUNK * K * H * 2 + 4) + 7 * 16 + 4 for n in present]


def shard_index(path: Path, chunks_per_shard: int):
    data = path.read_bytes()
    return decode_shard_index(data[-(chunks_per_shard * 16 + 4):], chunks_per_shard, len(data))


def test_samples_longer_than_a_shard_span_several(tmp_path, assert_sample_matches_source):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=32))
    store = Store(dst)
    assert store.info.shard_tokens == 32
    assert store.sample_starts.tolist() == [0, 32, 64, 96, 128, 256]  # 100 tokens: 4 shards; 33: 2
    shards = [p for p in (dst / "aux_hidden_states" / "c").rglob("*") if p.is_file()]
    assert sorted(int(p.parent.name) for p in shards) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    for i in range(len(LENGTHS)):
        assert_sample_matches_source(store, i, LEGACY, src)
    assert torch.equal(store.read_sample(4, 70).input_ids, store.read_sample(4).input_ids[:70])
    with pytest.raises(ValueError, match="shard_tokens must be a multiple of chunk_tokens"):
        convert(src, tmp_path / "other", workers=0, progress=False,
                settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=40))


def test_read_sample_max_tokens_truncates_and_reads_only_the_chunks_it_needs(tmp_path, source_sample):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(codec="none", chunk_tokens=CHUNK))
    store = Store(dst)
    want = source_sample(LEGACY, src, "data_4.pt", 4)  # 100 tokens, 7 chunks
    row_bytes = K * H * 2 + H * 2 + 8 + 8
    for max_tokens in (1, 15, 16, 17, 50, 99, 100, 101, 10_000, None):
        stats = ReadStats()
        got = store.read_sample(4, max_tokens, stats=stats)
        t = 100 if max_tokens is None else min(max_tokens, 100)
        assert got.num_tokens == 100
        assert got.aux_hidden_states.shape == (t, K * H) and got.last_hidden_state.shape == (t, H)
        assert torch.equal(got.input_ids, want["input_ids"][:t])
        assert torch.equal(got.loss_mask, want["loss_mask"][:t])
        assert torch.equal(bits(got.aux_hidden_states), bits(want["aux"][:t]))
        assert torch.equal(bits(got.last_hidden_state), bits(want["last"][:t]))
        chunks = math.ceil(t / CHUNK)  # each with its crc32c; and each array's shard index (7 entries + crc32c)
        assert stats.bytes_read == chunks * CHUNK * row_bytes + 4 * (chunks * 4 + 7 * 16 + 4), max_tokens
        assert stats.bytes_delivered == t * row_bytes
    with pytest.raises(IndexError, match="sample 6 out of range for a store of 6 samples"):
        store.read_sample(6)


# --------------------------------------------------------------------------- reruns


def test_rerun_of_a_complete_store_is_a_no_op(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dst.rglob("*") if p.is_file()}

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)

    assert (report.num_samples, report.num_tokens, report.converted_now, report.resumed) == (6, sum(LENGTHS), 0, 6)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dst.rglob("*") if p.is_file()} == before


def test_rerun_with_other_options_is_refused(tmp_path, interrupted_convert, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    legacy_source(src)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    assert sorted(interrupted_convert(src, dst, after=2, settings=CHUNKED)) == [0, 1]
    journal = (dst / JOURNAL_FILE).read_bytes()

    with pytest.raises(StoreError) as err:
        convert(src, dst, workers=0, progress=False, settings=StoreSettings(codec="lz4", chunk_tokens=CHUNK))
    assert str(err.value) == (
        f"{dst}: was started with codec zstd, not codec lz4: repeat that command to resume, or pass --overwrite"
    )
    with pytest.raises(StoreError, match="was started with chunk tokens 16, not chunk tokens 32: repeat"):
        convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=32))
    assert (dst / JOURNAL_FILE).read_bytes() == journal

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (report.converted_now, report.resumed) == (4, 2)
    assert_same_tree(dst, ref)

    # a complete store is not silently kept when another one is asked for
    refused = (r"is complete but was converted with codec zstd, not codec lz4: run the command with the store's "
               r"settings to append to it, or choose another DST or pass --overwrite")
    with pytest.raises(StoreError, match=refused):
        convert(src, dst, workers=0, progress=False, settings=StoreSettings(codec="lz4", chunk_tokens=CHUNK))
    assert_same_tree(dst, ref)
    report = convert(src, dst, workers=0, overwrite=True, progress=False,
                     settings=StoreSettings(codec="lz4", chunk_tokens=CHUNK))
    assert (report.num_samples, report.converted_now) == (6, 6) and Store(dst).info.codec.to_json() == LZ4


def test_a_folder_that_is_not_a_store_is_left_alone(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="exists and is not an h5feed store; choose another DST or pass --overwrite"):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]


# --------------------------------------------------------------------------- interrupted in this process


def test_unfinished_store_is_refused_by_every_reader(tmp_path, interrupted_convert):
    src, dst = tmp_path / "src", tmp_path / "store"
    legacy_source(src)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    for read in (Store, verify_store, describe_store):
        with pytest.raises(StoreError) as err:
            read(dst)
        assert str(err.value) == (
            f"{dst}: conversion has not finished (status 'converting'); "
            "run the same `h5feed convert` command again to resume it"
        )


def test_killed_while_planning_starts_again(tmp_path, monkeypatch, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    legacy_source(src)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    module = sys.modules["h5feed.conversion.plan"]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "write_atomically", killed)  # arrays created, plan not yet written
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    monkeypatch.undo()
    assert (dst / "zarr.json").exists() and not (dst / PLAN_FILE).exists()
    with pytest.raises(StoreError, match="has not finished"):
        Store(dst)

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (report.converted_now, report.resumed) == (6, 0)
    assert_same_tree(dst, ref)


def test_killed_just_before_the_status_flip_resumes(tmp_path, monkeypatch, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    legacy_source(src)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["h5feed.conversion.samples"], "write_info", killed)  # index and journal written, status still "converting"
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    monkeypatch.undo()
    with pytest.raises(StoreError, match="has not finished"):
        Store(dst)

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (report.converted_now, report.resumed) == (0, 6)
    assert_same_tree(dst, ref)


def test_a_partial_write_left_by_a_kill_is_removed_on_resume(tmp_path, interrupted_convert, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    legacy_source(src)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    # chunk files are written as NAME.<id>.partial, then renamed; a SIGKILL in between leaves one behind
    (dst / "aux_hidden_states" / "c" / "5").mkdir(parents=True, exist_ok=True)
    (dst / "aux_hidden_states" / "c" / "5" / "0.0123456789abcdef0123456789abcdef.partial").write_bytes(b"half a chunk")
    (dst / "input_ids" / "c" / "5.fedcba9876543210fedcba9876543210.partial").write_bytes(b"half")

    convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert_same_tree(dst, ref)


def test_a_journal_line_cut_short_loses_no_sample(tmp_path, interrupted_convert, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    legacy_source(src)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    interrupted_convert(src, dst, after=2, settings=CHUNKED)
    with open(dst / JOURNAL_FILE, "a") as journal:  # killed (or out of disk) in the middle of a line
        journal.write('{"i": 2, "checksum": [1234')

    report = convert(src, dst, workers=0, progress=False, settings=CHUNKED)
    assert (report.num_samples, report.converted_now, report.resumed) == (6, 4, 2)
    assert_same_tree(dst, ref)


# --------------------------------------------------------------------------- SIGKILL of the real command


def _journaled(dst: Path) -> int:
    return len(read_journal(dst))


def _kill_group_when(proc: subprocess.Popen, ready, what: str, log: Path) -> None:
    """SIGKILL the command and its worker processes as soon as `ready()` holds."""
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, f"the conversion ended (status {proc.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_sigkill_at_several_moments_then_the_same_command_gives_the_same_bytes(tmp_path, assert_same_tree):
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    num = 30
    legacy_source(src, (150, 300), num_samples=num, seed=5)
    convert(src, ref, workers=0, progress=False, settings=CHUNKED)
    command = [sys.executable, "-m", "h5feed.cli", "-q", "convert", str(src), str(dst), "--workers", "2",
               "--chunk-tokens", str(CHUNK)]

    journaled = 0
    for run, more in enumerate((None, 8)):  # None: as soon as the plan is written
        log = tmp_path / f"run{run}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if more is None:
            _kill_group_when(proc, lambda: (dst / PLAN_FILE).exists(), "the plan was written", log)
        else:
            target = journaled + more
            ready = lambda target=target: _journaled(dst) >= target
            _kill_group_when(proc, ready, f"{target} samples were journaled", log)
        with pytest.raises(StoreError) as err:
            Store(dst)
        assert "has not finished" in str(err.value) and "resume" in str(err.value)
        assert _journaled(dst) >= journaled  # nothing converted before is lost
        journaled = _journaled(dst)
    assert 8 <= journaled < num

    done = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"({num - journaled} converted now, {journaled} from an earlier run, 0 skipped)" in done.stderr
    assert_same_tree(dst, ref)
    store, reference = Store(dst), Store(ref)
    assert len(store) == len(reference) == num
    for i in range(num):
        a, b = store.read_sample(i), reference.read_sample(i)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(bits(a.aux_hidden_states), bits(b.aux_hidden_states))
        assert torch.equal(bits(a.last_hidden_state), bits(b.last_hidden_state))


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
def test_chunks_are_the_bytes_zarr_itself_writes(tmp_path, codec):
    """The converter encodes shards itself (zarr's pipeline costs as much as the codec); the
    bytes must be zarr's own: rewrite every array through zarr and compare every shard file."""
    import zarr

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 3, 32, lengths=[5, 64, 70], seed=4)
    convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False,
            settings=StoreSettings(chunk_tokens=32, codec=codec))
    group = zarr.open_group(tmp_path / "dst", mode="r")
    for name in ("aux_hidden_states", "last_hidden_states", "input_ids", "loss_mask"):
        original = group[name]
        values = original[...]
        copy = zarr.create_array(tmp_path / "zarr" / name, shape=original.shape, shards=original.shards,
                                 chunks=original.chunks, dtype=original.dtype, compressors=original.compressors,
                                 fill_value=0)
        copy[...] = values
        ours = sorted(p.relative_to(tmp_path / "dst" / name) for p in (tmp_path / "dst" / name / "c").rglob("*"))
        for rel in ours:
            mine, theirs = tmp_path / "dst" / name / rel, tmp_path / "zarr" / name / rel
            if mine.is_file():
                assert mine.read_bytes() == theirs.read_bytes(), (name, rel)
