"""h5feed.open_writer: samples appended by extraction code, equal byte for byte to what `h5feed convert` makes of
the same samples saved as files; crash-safe under kill -9; readers see only published, whole samples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CHECKOUT_ENV

import h5feed
from h5feed import (
    HiddenStatesDataset,
    SourceError,
    Store,
    StoreError,
    StoreSettings,
    WriteOptions,
    convert,
    open_writer,
)
from h5feed.store.journal import read_journal
from h5feed.testing.synthetic import write_synthetic

H, N, CHUNK, SHARD = 32, 12, 16, 64
LENGTHS = (10, 90)  # some samples span two shards


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("src")
    return root, write_synthetic(root, "speculators-legacy-pt", N, H, lengths=LENGTHS, seed=4)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("converted") / "store"
    convert(source[0], dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD))
    return dst


def samples_of(files: list[Path]) -> list[dict]:
    return [torch.load(f, weights_only=True) for f in files]


def array_files(store: Path) -> dict[str, bytes]:
    """Every object of the arrays (shards and their metadata aside): what holds the samples' bytes."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.glob("*/c/**/*")) if p.is_file()}


def write(dst: Path, samples: list[dict], **options) -> h5feed.WriterReport:
    with open_writer(dst, **options, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        for i, sample in enumerate(samples):
            assert writer.append(sample, name=f"data_{i}.pt") == i
    return writer.report


def test_appended_samples_are_the_bytes_convert_writes_from_the_same_samples_as_files(source, converted, tmp_path):
    dst = tmp_path / "written"
    report = write(dst, samples_of(source[1]))
    assert (report.samples, report.published) == (N, N) and report.bytes_out > 0
    assert array_files(dst) == array_files(converted)  # every shard, byte for byte
    written, reference = Store(dst), Store(converted)
    assert written.source_paths == reference.source_paths
    assert (written.sample_starts == reference.sample_starts).all() and (written.checksums == reference.checksums).all()
    items, want = HiddenStatesDataset(dst, max_len=128), HiddenStatesDataset(converted, max_len=128)
    for i in range(N):  # the trainer's items
        assert all(torch.equal(items[i][k], want[i][k]) for k in want[i])
    assert h5feed.verify_store(dst).ok


def test_a_sample_given_as_keywords_is_the_sample_given_as_a_dict(source, tmp_path):
    sample = samples_of(source[1][:1])[0]
    with open_writer(tmp_path / "kw", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        writer.append(**sample)
    with open_writer(tmp_path / "dict", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        writer.append(sample)
    assert array_files(tmp_path / "kw") == array_files(tmp_path / "dict")


def test_a_sample_that_does_not_fit_is_refused_naming_it_and_the_store_keeps_the_others(source, tmp_path):
    samples = samples_of(source[1][:3])
    dst = tmp_path / "store"
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        writer.append(samples[0], name="first")
        other = dict(samples[1], hidden_states=[h[:, :16] for h in samples[1]["hidden_states"]])
        with pytest.raises(SourceError, match=r"extraction-7: hidden size 16 differs from 32 of the store's samples"):
            writer.append(other, name="extraction-7")
        with pytest.raises(SourceError, match=r"missing key\(s\) 'input_ids'"):
            writer.append(hidden_states=samples[1]["hidden_states"])
        writer.append(samples[2], name="third")
    assert Store(dst).source_paths == ["first", "third"]


def test_settings_and_stores_that_cannot_be_written_are_refused(source, converted, tmp_path):
    with pytest.raises(ValueError, match="samples are given as the dict of one of speculators-legacy-pt"):
        open_writer(tmp_path / "a", format="speculators-safetensors")
    with pytest.raises(ValueError, match="must be a positive multiple of chunk_tokens"):
        open_writer(tmp_path / "b", settings=StoreSettings(chunk_tokens=16, shard_tokens=40))
    with pytest.raises(StoreError, match="was made by `h5feed convert`, not by open_writer"):
        open_writer(converted)
    write(tmp_path / "written", [])  # an empty writer makes nothing to refuse; one sample does:
    with open_writer(tmp_path / "written") as writer:
        writer.append(input_ids=torch.arange(3), hidden_states=[torch.zeros(3, 8, dtype=torch.bfloat16)] * 2)
    with pytest.raises(StoreError, match="was written by `h5feed.open_writer`, not converted: append to it with"):
        convert(source[0], tmp_path / "written", workers=0, progress=False)
    with open_writer(tmp_path / "c"), pytest.raises(StoreError, match=r"another `h5feed.open_writer` \(host .*, pid \d+, .*\) is writing this store"):
        open_writer(tmp_path / "c")  # one writer at a time
    with open_writer(tmp_path / "c"):  # the first let it go
        pass


def test_a_reader_sees_whole_published_samples_while_the_writer_appends(source, converted, tmp_path):
    dst, samples = tmp_path / "store", samples_of(source[1])
    reference = Store(converted)
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                     writing=WriteOptions(publish_every=4)) as writer:
        seen = []
        for i, sample in enumerate(samples):
            writer.append(sample, name=f"data_{i}.pt")
            if (dst / "zarr.json").exists():
                try:
                    store = Store(dst)
                except StoreError as err:  # nothing published yet: the writer is named, and how far it is
                    assert i < 3
                    assert "it is being written now by `h5feed.open_writer` (host " in str(err)
                    assert f"): {i + 1} samples written so far; wait for it to finish" in str(err)
                    continue
                seen.append(len(store))
                for j in range(len(store)):
                    assert torch.equal(store.read_sample(j).aux_hidden_states, reference.read_sample(j).aux_hidden_states)
    assert seen == [4] * 4 + [8] * 4 + [12]  # published every 4 samples, each time whole
    assert len(Store(dst)) == N


KILLED_WRITER = """
import sys, time, torch, h5feed
from pathlib import Path
files = sorted(Path(sys.argv[2]).glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
with h5feed.open_writer(sys.argv[1], settings=h5feed.StoreSettings(chunk_tokens=16, shard_tokens=64), writing=h5feed.WriteOptions(publish_every=5)) as w:
    for i, f in enumerate(files):
        w.append(torch.load(f, weights_only=True), name=f.name)
        time.sleep(0.05)
time.sleep(60)
"""


@pytest.mark.parametrize("journaled", [2, 7])
def test_kill_9_loses_only_unjournaled_samples_and_the_next_writer_resumes(source, converted, tmp_path, journaled,
                                                                          caplog):
    dst, (src, files) = tmp_path / "store", source
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(dst), str(src)], env=CHECKOUT_ENV)
    try:
        deadline = time.monotonic() + 120
        while len(read_journal(dst)) < journaled:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.005)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    kept = len(read_journal(dst))
    assert journaled <= kept < N

    caplog.set_level("INFO", logger="h5feed")
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as resumed:  # publishes what was journaled
        assert len(Store(dst)) == kept
        assert f"resuming: {kept} samples kept, the last one 'data_{kept - 1}.pt'" in caplog.text
        for i, sample in enumerate(samples_of(files[kept:]), kept):
            resumed.append(sample, name=f"data_{i}.pt")
    assert array_files(dst) == array_files(converted)  # as if never killed
    assert Store(dst).source_paths == Store(converted).source_paths and h5feed.verify_store(dst).ok


# =========================================================================== readers that follow the writer

SLOW_WRITER = """
import sys, time, torch, h5feed
from pathlib import Path
files = sorted(Path(sys.argv[2]).glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
with h5feed.open_writer(sys.argv[1], settings=h5feed.StoreSettings(chunk_tokens=16, shard_tokens=64), writing=h5feed.WriteOptions(publish_every=1)) as w:
    for i, f in enumerate(files):
        w.append(torch.load(f, weights_only=True), name=f.name)
        time.sleep(float(sys.argv[3]))
    time.sleep(float(sys.argv[4]))  # holds the store, publishing nothing more
"""


def start_writer(dst: Path, src: Path, pause: float, hold: float = 0.0) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(dst), str(src), str(pause), str(hold)],
                              env=CHECKOUT_ENV)
    deadline = time.monotonic() + 120
    while True:  # the trainer starts on the first published sample
        try:
            Store(dst)
            return writer
        except (StoreError, FileNotFoundError):
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.02)


def stream_items(loader) -> list[dict]:
    return [{k: v.clone() for k, v in item.items()} for item in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_follower_reads_every_sample_once_in_publication_order_while_the_writer_appends(
        source, converted, tmp_path, workers):
    dst = tmp_path / "store"
    writer = start_writer(dst, source[0], pause=0.15)
    try:
        stream = h5feed.HiddenStatesStream(dst, max_len=128,
                                           schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(poll_s=0.02)))
        got = stream_items(h5feed.StreamLoader(stream, batch_size=None, num_workers=workers))
    finally:
        assert writer.wait(120) == 0
    want = stream_items(h5feed.HiddenStatesStream(converted, max_len=128, schedule=h5feed.ScheduleOptions(shuffle=False)))
    assert len(got) == len(want) == N
    for g, w in zip(got, want):
        assert all(torch.equal(g[k], w[k]) for k in w)
    snapshot = stream.counters.snapshot()
    assert snapshot.total("samples") == N and snapshot.total("writer_wait_seconds") > 0.5  # it outran the writer


def test_a_follower_stops_at_its_bounds(source, tmp_path):
    dst = tmp_path / "store"
    writer = start_writer(dst, source[0], pause=0.02, hold=30)
    try:
        bounded = h5feed.HiddenStatesStream(dst, max_len=128,
                                            schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(samples=5)))
        assert len(stream_items(bounded)) == 5
        waited = time.monotonic()
        idle = h5feed.HiddenStatesStream(dst, max_len=128,
                                         schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(idle_timeout=1.0, poll_s=0.05)))
        assert len(stream_items(idle)) == N  # all published, then a second without a new one
        assert time.monotonic() - waited >= 1.0
        with pytest.raises(TypeError, match="follows its writer has no length"):
            len(idle)
        with pytest.raises(ValueError, match="pass shuffle=False"):
            h5feed.HiddenStatesStream(dst, schedule=h5feed.ScheduleOptions(follow=h5feed.Follow()))
    finally:
        writer.kill()
        writer.wait()


def test_the_monitor_says_the_trainer_waits_for_the_writer_not_for_the_disk(source, tmp_path, caplog):
    dst = tmp_path / "store"
    writer = start_writer(dst, source[0], pause=0.5)
    caplog.set_level("INFO", logger="h5feed")
    try:
        stream = h5feed.HiddenStatesStream(dst, max_len=128,
                                           schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow(poll_s=0.02)))
        loader = h5feed.StreamLoader(stream, batch_size=None, num_workers=1)
        monitored = h5feed.monitor(loader, every=0.5, stall_after=0.25, log_dir=tmp_path / "log", name="follow")
        assert len([item for item in monitored]) == N
    finally:
        assert writer.wait(120) == 0
    records = [json.loads(line) for line in (tmp_path / "log" / "h5feed-monitor-follow.jsonl").read_text().splitlines()]
    verdicts = {r["verdict"] for r in records if r["kind"] == "stall"}
    # the loader waits for samples to exist: not stuck, not idle (a slow read on a loaded machine may still be
    # a bottleneck now and then)
    assert "writer" in verdicts and verdicts <= {"writer", "bottleneck"}
    assert "WAITS FOR THE WRITER to publish more" in caplog.text and "extraction is slower than training" in caplog.text
    end = records[-1]
    assert end["kind"] == "end" and end["loader"]["writer_wait_s"] > 1.0
    assert "workers waited " in caplog.text and " s for the writer to publish samples" in caplog.text


# =========================================================================== write_behind


@pytest.mark.parametrize("depth", [1, 3])
def test_samples_written_behind_are_the_bytes_written_at_once(source, converted, tmp_path, depth):
    """With write_behind, append returns before the sample is compressed; the store is the same, byte for byte,
    and the caller may overwrite its tensors as soon as append returns (they were copied)."""
    dst = tmp_path / "behind"
    with open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                     writing=WriteOptions(write_behind=depth)) as writer:
        for i, sample in enumerate(samples_of(source[1])):
            assert writer.append(sample, name=f"data_{i}.pt") == i
            for tensor in (sample["input_ids"], *sample["hidden_states"]):
                tensor.zero_()  # a buffer reused by the caller's next sample
    assert (writer.report.samples, writer.report.published) == (N, N)
    assert array_files(dst) == array_files(converted)
    assert [r.name for _, r in sorted(read_journal(dst).items())] == [f"data_{i}.pt" for i in range(N)]


def test_a_failure_while_writing_behind_is_raised_and_the_samples_before_it_are_kept(source, tmp_path, monkeypatch):
    """A write that fails behind append (here a full disk at the 5th sample) is raised by the next call; the
    samples before it are journaled and published at close, and no later sample is written."""
    from h5feed.conversion import writer as writer_module

    real, calls = writer_module.write_sample, []

    def disk_fills_up(dst, info, sample, start, durable):
        calls.append(start)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(dst, info, sample, start, durable)

    monkeypatch.setattr(writer_module, "write_sample", disk_fills_up)
    samples = samples_of(source[1])
    dst = tmp_path / "full"
    w = open_writer(dst, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                    writing=WriteOptions(write_behind=2))
    with pytest.raises(OSError, match="No space left on device"):
        for i, sample in enumerate(samples):
            w.append(sample, name=f"data_{i}.pt")
        w.publish()
    with pytest.raises(OSError, match="No space left on device"):  # the writer stays broken: said again
        w.append(samples[0])
    with pytest.raises(OSError, match="No space left on device"):  # and at close, which publishes the rest
        w.close()
    assert len(calls) == 5  # nothing written after the failure, also what was queued behind it
    assert [r.name for _, r in sorted(read_journal(dst).items())] == [f"data_{i}.pt" for i in range(4)]
    store = Store(dst)
    assert len(store) == 4
    for i in range(4):
        assert torch.equal(store.read_sample(i).input_ids, samples[i]["input_ids"])


def test_write_behind_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="write_behind must be >= 0, not -1"):
        open_writer(tmp_path / "s", writing=WriteOptions(write_behind=-1))


def test_a_folder_a_writer_appended_nothing_to_takes_a_conversion(source, converted, tmp_path):
    """open_writer that appended nothing leaves only its lock files: `h5feed convert` takes the folder as empty."""
    dst = tmp_path / "store"
    with open_writer(dst, writer="rank0"):
        pass
    assert dst.is_dir() and any(dst.iterdir())  # its bookkeeping
    convert(source[0], dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD))
    assert array_files(dst) == array_files(converted)


def test_an_error_in_the_with_block_is_the_one_raised_when_writing_behind_failed_too(source, tmp_path, monkeypatch,
                                                                                      caplog):
    from h5feed.conversion import writer as writer_module

    def full(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "write_sample", full)
    with pytest.raises(KeyError, match="the extraction's own error"), \
            open_writer(tmp_path / "s", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD),
                        writing=WriteOptions(write_behind=2)) as w:
        w.append(samples_of(source[1][:1])[0])
        time.sleep(0.2)  # the write behind fails meanwhile
        raise KeyError("the extraction's own error")
    assert "writing behind failed as well" in caplog.text and "No space left on device" in caplog.text


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("loss_mask", 2, "'loss_mask' holds 2 at token 3 (1 such values): a loss mask holds 0 (no loss on the token) or 1"),
    ("input_ids", -100, "'input_ids' holds -100 at token 3 (1 negative ids): token ids are >= 0;"),
])
def test_a_loss_mask_value_other_than_0_or_1_and_a_negative_id_are_refused_by_a_writer_as_by_convert(
        source, tmp_path, key, value, problem):
    sample = samples_of(source[1][:1])[0]
    sample[key] = sample[key].clone()
    sample[key][3] = value
    (tmp_path / "src").mkdir()
    torch.save(sample, tmp_path / "src" / "data_0.pt")
    with pytest.raises(SourceError) as converting:
        convert(tmp_path / "src", tmp_path / "converted", workers=0, progress=False)
    with open_writer(tmp_path / "written", settings=StoreSettings(chunk_tokens=CHUNK, shard_tokens=SHARD)) as writer:
        with pytest.raises(SourceError) as appending:
            writer.append(sample, name="data_0.pt")
    assert converting.value.path == str(tmp_path / "src" / "data_0.pt")
    assert appending.value.path == str(tmp_path / "written" / "data_0.pt")
    assert converting.value.problem == appending.value.problem
    assert converting.value.problem.startswith(problem)
