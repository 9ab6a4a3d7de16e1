"""The mistakes users make, each answered with a message that says what to do, as early as it can be."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from conftest import REPO

import h5feed
from h5feed import BatchLoader, HiddenStatesStream, StreamLoader
from h5feed.errors import (
    CorruptSampleError,
    DiskFullError,
    NotAStoreError,
    SourceError,
    StoreError,
    WorkerDiedError,
)
from h5feed.io import ObjectNotFound

H = 8
LENGTHS = [5, 17, 3, 9]


@pytest.fixture(scope="module")
def pre_norm_store(synthetic_store):
    return synthetic_store("ue_legacy", "speculators-legacy-pt", len(LENGTHS), H, LENGTHS, seed=3)


@pytest.fixture(scope="module")
def post_norm_store(synthetic_store):
    return synthetic_store("ue_specforge", "specforge-ckpt", len(LENGTHS), H, LENGTHS, seed=4)


def test_a_mistyped_flavor_is_refused_with_the_nearest_name(pre_norm_store):
    with pytest.raises(ValueError, match=r"unknown flavor 'specforg': did you mean 'specforge'\? \(one of: "
                                         r"speculators-legacy, speculators, specforge, "):
        BatchLoader(pre_norm_store.path, flavor="specforg", max_len=64)
    with pytest.raises(ValueError, match="unknown flavor 'xyz': [(]one of"):  # nothing close: no guess
        HiddenStatesStream(pre_norm_store.path, "xyz", 64)


def test_a_mistyped_format_on_the_command_line_names_the_nearest(cli, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli("convert", tmp_path, tmp_path / "out", "--format", "vllm-safetensor")
    assert exit_.value.code == 2
    assert ("argument --format: unknown format 'vllm-safetensor': did you mean 'vllm-safetensors'?"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", [
    lambda path: BatchLoader(path, flavor="speculators-legacy", max_len=64, num_workers=1000),
    lambda path: StreamLoader(HiddenStatesStream(path, "speculators-legacy", 64), num_workers=1000),
], ids=["BatchLoader", "StreamLoader"])
def test_too_many_workers_are_refused_when_the_loader_is_made(pre_norm_store, make):
    with pytest.raises(ValueError, match=r"num_workers=1000: an h5feed loader runs at most 64 DataLoader workers"):
        make(pre_norm_store.path)


def test_without_a_flavor_the_default_serves_a_pre_norm_store(pre_norm_store, assert_same_batch):
    args = {"max_len": 64, "hidden_states_dtype": torch.bfloat16, "decode": h5feed.ThreadsOptions(threads=1)}
    loader = BatchLoader(pre_norm_store.path, **args)
    assert loader.dataset.flavor.name == "speculators-legacy"
    got, want = list(loader), list(BatchLoader(pre_norm_store.path, flavor="speculators-legacy", **args))
    assert len(got) == len(LENGTHS)
    for a, b in zip(got, want):
        assert_same_batch(a, b)


def test_without_a_flavor_a_post_norm_store_names_the_flavors_that_fit(post_norm_store):
    with pytest.raises(ValueError) as refused:
        BatchLoader(post_norm_store.path, max_len=64)
    message = str(refused.value)
    assert message.startswith(f"{post_norm_store.path}: no flavor given, and the default (speculators-legacy")
    fits = message.split("the trainer whose batches to make: ")[1].split(", ")
    assert fits == ["specforge", "specforge-shifted", "specforge-dflash", "specforge-dspark", "modelopt",
                    "modelopt-answer-only", "modelopt-0.45", "angelslim"]
    for name in fits:  # each one named does open the store
        HiddenStatesStream(post_norm_store.path, name, None if name == "angelslim" else 64)


def test_the_wrong_norm_refusal_names_the_flavors_that_fit(post_norm_store):
    with pytest.raises(StoreError, match=r"final-norm weight\. Flavors that fit this store: specforge, "
                                         r"specforge-shifted, specforge-dflash, specforge-dspark, modelopt, "
                                         r"modelopt-answer-only, modelopt-0.45, angelslim$"):
        HiddenStatesStream(post_norm_store.path, "speculators", 64)


def test_verify_against_a_wrong_folder_is_one_error_naming_the_right_one(cli, pre_norm_store, tmp_path):
    missing = cli("verify", pre_norm_store.path, "--against", tmp_path / "nowhere")
    assert missing.status != 0
    assert f"{tmp_path / 'nowhere'}: is not a folder: pass the folder the store was converted from" in missing.output
    assert str(pre_norm_store.src) in missing.output and "MISMATCH" not in missing.output

    (tmp_path / "other").mkdir()
    wrong = cli("verify", pre_norm_store.path, "--against", tmp_path / "other")
    assert wrong.status != 0
    assert wrong.output.count("holds none of the store's first source files") == 1
    assert "MISMATCH" not in wrong.output

    right = cli("verify", pre_norm_store.path, "--against", pre_norm_store.src)
    assert right.status == 0, right.output


def test_a_dataloader_with_too_many_workers_says_how_many_it_may_have(pre_norm_store):
    counters = HiddenStatesStream(pre_norm_store.path, "speculators-legacy", 64).counters
    with pytest.raises(ValueError, match=r"DataLoader worker 64: an h5feed loader runs at most 64 DataLoader workers; "
                                         r"pass num_workers <= 64"):
        counters.worker(64)


def test_source_error_is_what_verify_raises_for_the_api(pre_norm_store, tmp_path):
    with pytest.raises(SourceError, match="is not a folder"):
        h5feed.verify_store(pre_norm_store.path, tmp_path / "nowhere", progress=False)


def test_a_resumed_conversion_says_so_and_how_much_was_done(tmp_path, cli, interrupted_convert):
    from h5feed.testing.synthetic import write_synthetic

    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, "speculators-legacy-pt", 5, H, lengths=(4, 20), seed=9)
    assert sorted(interrupted_convert(src, dst, after=2)) == [0, 1]
    resumed = cli("convert", src, dst, "--workers", "0")
    assert resumed.status == 0, resumed.output
    assert (f"{dst}: resuming an unfinished conversion: 2 of 5 samples were done by an earlier run; 3 to go"
            in resumed.output)
    again = cli("convert", src, dst, "--workers", "0")  # complete: nothing is resumed
    assert again.status == 0 and "resuming" not in again.output


def test_inspect_and_verify_of_a_store_being_converted_name_the_writer_and_its_progress(tmp_path, cli,
                                                                                         interrupted_convert):
    import subprocess
    import sys

    from h5feed.testing.synthetic import write_synthetic

    src, dst = tmp_path / "src", tmp_path / "store"
    write_synthetic(src, "speculators-legacy-pt", 5, H, lengths=(4, 20), seed=9)
    assert sorted(interrupted_convert(src, dst, after=2)) == [0, 1]
    holder = subprocess.Popen(  # another process that writes the store: what a running convert holds
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from h5feed.conversion.lock import "
         "WriterLock; lock = WriterLock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)",
         str(dst)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for command in ("inspect", "verify"):
            r = cli(command, dst)
            assert r.status == 1
            assert f"{dst}: it is being written now by `h5feed convert` (host " in r.output
            assert f", pid {holder.pid}, started at " in r.output
            assert "): 2 of 5 samples done; wait for it to finish" in r.output
        with pytest.raises(StoreError) as opened:  # and so does a trainer opening it in Python
            h5feed.Store(dst)
        message = str(opened.value)
        assert "conversion has not finished (status 'converting'); it is being written now by `h5feed convert`" in message
        assert f", pid {holder.pid}, " in message and "2 of 5 samples done; wait for it to finish" in message
    finally:
        holder.kill()
        holder.wait()
    after = cli("inspect", dst)  # the writer is gone: the store is unfinished, to be resumed
    assert after.status == 1 and "run the same `h5feed convert` command again to resume it" in after.output


def test_a_script_that_converts_unguarded_is_told_to_guard_the_call(tmp_path):
    """A script calling h5feed.convert(..., workers=2) at its top level: every spawned worker runs the script
    again as it starts.  The re-run call says to guard it, not that "another h5feed convert" holds the store;
    the same call under `if __name__ == "__main__":` converts."""
    import subprocess
    import sys

    from h5feed.testing.synthetic import write_synthetic

    src = tmp_path / "src"
    write_synthetic(src, "speculators-legacy-pt", 2, H, lengths=(4, 8), seed=5)
    call = f"h5feed.convert({str(src)!r}, {str(tmp_path / 'store')!r}, workers=2, progress=False)"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def run(body: str) -> subprocess.CompletedProcess[str]:
        script = tmp_path / "convert_it.py"
        script.write_text(f"import h5feed\n{body}\nprint('converted')\n")
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, check=False)

    unguarded = run(call)
    assert unguarded.returncode != 0 and "converted" not in unguarded.stdout
    assert (f"{tmp_path / 'convert_it.py'}: calls h5feed.convert at its top level, which every worker process of "
            'the conversion runs again as it starts; put the call under `if __name__ == "__main__":`'
            in unguarded.stderr), unguarded.stderr
    assert "is writing this store" not in unguarded.stderr
    guarded = run(f"if __name__ == '__main__':\n    {call}")
    assert guarded.returncode == 0 and "converted" in guarded.stdout, guarded.stderr


def test_a_loader_pointed_at_the_sample_files_says_to_convert_them(tmp_path):
    """The folder the samples were written to, given where their store was meant: the error names what the
    folder holds and the command that makes a store of it."""
    from h5feed.testing.synthetic import write_synthetic

    src = tmp_path / "hidden_states"
    write_synthetic(src, "speculators-v0-pt", 2, H, lengths=(4, 8), seed=6)
    said = (f"{src}: a folder of speculators-v0-pt sample files (data_{{i}}.pt), not an h5feed store: convert them "
            f"into one with `h5feed convert {src} DST`")
    for open_it in (lambda: BatchLoader(src, max_len=64), lambda: HiddenStatesStream(src, "speculators", 64),
                    lambda: HiddenStatesStream(src, "speculators", 64,
                                               schedule=h5feed.ScheduleOptions(shuffle=False, follow=h5feed.Follow()))):
        with pytest.raises(NotAStoreError) as err:
            open_it()
        assert said in str(err.value)
    with pytest.raises(NotAStoreError) as err:  # the store itself knows no input format: it says how to make one
        h5feed.Store(src)
    assert str(err.value) == f"{src}: not an h5feed store (no zarr.json); create one with `h5feed convert SRC DST`"
    with pytest.raises(StoreError, match="missing: does not exist: check the path, or create the store with "):
        BatchLoader(tmp_path / "missing", max_len=64)


@pytest.mark.parametrize("error", [
    SourceError("src/data_0.pt", "is truncated"),
    StoreError("store", "is damaged"),
    CorruptSampleError("store/aux_hidden_states/c/0/0", "fails its checksum", 3, "data_3.pt"),
    DiskFullError("store", "the disk is full"),
    WorkerDiedError("store", "DataLoader worker 1 (pid 42) was killed", worker=1, pid=42, sample=7),
    ObjectNotFound("s3://bucket/store/zarr.json", "no such object or bucket"),
], ids=lambda error: type(error).__name__)
def test_every_error_about_one_path_is_a_path_error_that_crosses_processes_whole(error):
    """One base to catch them by (`h5feed.PathError`), the path and the problem apart, and the same error after a
    pickle (a DataLoader worker's error reaches the trainer so)."""
    assert isinstance(error, h5feed.PathError)
    assert str(error).startswith(f"{error.path}: ") and str(error).endswith(error.problem)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and vars(copy) == vars(error)
