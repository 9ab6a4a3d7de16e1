"""`h5feed repair`: damaged samples re-encoded in place from their source files, bit for bit, crash-safe."""

from __future__ import annotations

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

import h5feed
from conftest import _tree, bits
from h5feed.errors import StoreError
from h5feed.store import Store
from h5feed.store.writer_state import LOCK_FILE
from h5feed.synthetic import write_synthetic

CHUNK = 16
REPO = Path(__file__).resolve().parents[1]


def converted(tmp_path: Path, num: int = 6, hidden: int = 32, lengths=(20, 60)) -> tuple[Path, Path, Path]:
    """A source folder, its store, and a second, fresh conversion of it to compare the repaired one with."""
    src, dst, ref = tmp_path / "src", tmp_path / "store", tmp_path / "ref"
    write_synthetic(src, "speculators-legacy-pt", num, hidden, lengths=lengths, seed=3)
    for store in (dst, ref):
        h5feed.convert(src, store, workers=0, chunk_tokens=CHUNK, progress=False)
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
    before = _tree(dst)

    r = cli("repair", dst)
    assert r.status == 1
    assert "UNRECOVERABLE sample 2" in r.output and source.name in r.output
    assert ("is gone" if change == "gone" else "changed since it was converted") in r.output
    assert _tree(dst) == before  # nothing written
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
    with h5feed.open_writer(dst, chunk_tokens=CHUNK, shard_tokens=64) as writer:
        writer.append({"input_ids": torch.arange(20), "hidden_states": [torch.randn(20, 8, dtype=torch.bfloat16)
                                                                         for _ in range(4)]})
    r = cli("repair", dst)
    assert r.status == 1 and "open_writer" in r.output and "no source files" in r.output


def test_help_shows_an_example(cli):
    with pytest.raises(SystemExit):
        cli("repair", "--help")
    from h5feed.cli.main import EXAMPLES

    assert "h5feed repair /data/hs.zarr" in EXAMPLES["repair"]


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
