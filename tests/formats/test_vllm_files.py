"""vLLM's own hidden-state files (`ExampleHiddenStatesConnector`): `{req_id}.safetensors` written with
`safetensors.torch.save_file`, keys `hidden_states` [T, K, H] and `token_ids` [T] int64, no metadata, each
under a `{req_id}.safetensors.lock` its writer holds with `flock(LOCK_EX)` until the file is complete.

They convert and verify bit for bit, with speculators' Arrow dataset beside them (its loss masks, paired by
token ids) or without (no loss mask, and the store says so); the last state is taken only where the user
states it.  A lock held by a real second process is waited for, a lock never released ends in an error
naming the file within the stated time, and with --skip-bad a recorded skip that a rerun appends."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import bits
from safetensors.torch import save_file

from h5feed import HiddenStatesDataset, SkipPolicy, StoreSettings
from h5feed.conversion import convert
from h5feed.errors import SourceError, StoreError
from h5feed.formats import FORMATS, detect_format
from h5feed.store import SkippedFile, Store
from h5feed.testing.synthetic import column_scales, make_sample, write_synthetic
from h5feed.verify import describe_store, verify_store

H, K = 32, 4  # K layers in each file: 3 aux, then the final one (its id is num_hidden_layers)
LENGTHS = {"cmpl-3a": 9, "cmpl-b7": 17, "cmpl-0c": 5, "cmpl-e2": 12}
CHUNK = 8


def request(src: Path, req_id: str, t: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What vLLM writes for one request: its `_write_tensors` calls `save_file({"hidden_states", "token_ids"})`
    after `wait_for_save` created the lock and held it with LOCK_EX; closing the lock's fd releases it."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"hidden_states": torch.randn(t, K, H, generator=g).to(dtype),
               "token_ids": torch.randint(0, 32000, (t,), generator=g)}
    lock = os.open(src / f"{req_id}.safetensors.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        save_file(tensors, str(src / f"{req_id}.safetensors"))
    finally:
        os.close(lock)
    return tensors


def write_requests(src: Path) -> dict[str, dict[str, torch.Tensor]]:
    src.mkdir(parents=True, exist_ok=True)
    return {req_id: request(src, req_id, t, seed) for seed, (req_id, t) in enumerate(LENGTHS.items())}


def write_arrow(src: Path, rows: list[dict[str, list[int]]]) -> None:
    """speculators' prepared dataset (`datasets.save_to_disk`): input_ids, loss_mask, seq_len per row."""
    import datasets

    datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
                                "seq_len": [len(r["input_ids"]) for r in rows]}).save_to_disk(str(src))


def assert_sample_is_file(store: Store, i: int, tensors: dict[str, torch.Tensor]) -> None:
    """Sample i holds the file's layers bit for bit: the first K-1 as the aux concat, the K-th as the last state."""
    hs = tensors["hidden_states"]
    got = store.read_sample(i)
    assert torch.equal(bits(got.aux_hidden_states), bits(hs[:, :K - 1].reshape(len(hs), (K - 1) * H)))
    assert torch.equal(bits(got.last_hidden_state), bits(hs[:, K - 1]))
    assert torch.equal(got.input_ids, tensors["token_ids"])


class Writer:
    """A second process that holds a file's lock with LOCK_EX, as vLLM's writer thread does, and writes the file
    (first a part of it, as while `save_file` runs) before it releases the lock after `hold_s` (never if None)."""

    SCRIPT = """
import fcntl, os, sys, time
lock, target, staged, hold = sys.argv[1:5]
fd = os.open(lock, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
data = open(staged, "rb").read()
if sys.argv[5] == "partial":
    open(target, "wb").write(data[: len(data) // 3])
print("held", flush=True)
if hold == "never":
    time.sleep(3600)
time.sleep(float(hold))
with open(target, "wb") as f:
    f.write(data)
os.close(fd)
"""

    def __init__(self, src: Path, req_id: str, t: int, seed: int, hold_s: float | None, partial: bool) -> None:
        staged = src.parent / f"{req_id}.staged"
        g = torch.Generator().manual_seed(seed)
        self.tensors = {"hidden_states": torch.randn(t, K, H, generator=g).to(torch.bfloat16),
                        "token_ids": torch.randint(0, 32000, (t,), generator=g)}
        save_file(self.tensors, str(staged))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, str(src / f"{req_id}.safetensors.lock"), str(src / f"{req_id}.safetensors"),
             str(staged), "never" if hold_s is None else str(hold_s), "partial" if partial else "absent"],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def wait(self) -> None:
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


# --------------------------------------------------------------------------- converting


def test_vllm_files_convert_and_verify_bit_for_bit(tmp_path: Path, cli) -> None:
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    files = write_requests(src)
    assert detect_format(src) is FORMATS["vllm-safetensors"]
    result = cli("convert", src, dst, "--last-state-norm", "pre", "--workers", "0", "--chunk-tokens", CHUNK)
    assert result.status == 0, result.output
    store = Store(dst)
    info = store.info
    assert (info.source_format, info.hidden_size, info.num_aux_layers, info.last_state_norm) == (
        "vllm-safetensors", H, K - 1, "pre")
    assert store.source_paths == sorted(f"{r}.safetensors" for r in LENGTHS)  # request ids carry no order: by name
    for i, relpath in enumerate(store.source_paths):
        assert_sample_is_file(store, i, files[relpath.removesuffix(".safetensors")])
    assert store.has_loss_mask.tolist() == [False] * len(LENGTHS)  # no Arrow dataset: no loss mask, and said so
    report = verify_store(dst, against=src, progress=False)
    assert (report.ok, report.samples_checked) == (True, len(LENGTHS))
    assert describe_store(dst)["source_format"] == "vllm-safetensors"
    with pytest.raises(StoreError, match=r"4 sample\(s\) had no loss_mask in their source files \(cmpl-0c\.safetensors, "
                       r"cmpl-3a\.safetensors, cmpl-b7\.safetensors\.\.\.\).* pass missing_loss_mask='ones'"):
        HiddenStatesDataset(dst, flavor="speculators")
    item = HiddenStatesDataset(dst, flavor="speculators", missing_loss_mask="ones")[0]
    first = files[store.source_paths[0].removesuffix(".safetensors")]
    t = len(first["token_ids"])  # speculators' item: the aux layers concatenated, and the final one
    assert torch.equal(bits(item["hidden_states"]), bits(first["hidden_states"][:, :K - 1].reshape(t, (K - 1) * H)))
    assert torch.equal(bits(item["verifier_last_hidden_states"]), bits(first["hidden_states"][:, K - 1]))
    assert torch.equal(item["loss_mask"], torch.ones(t, dtype=torch.int64))


def test_the_last_state_is_never_guessed(tmp_path: Path) -> None:
    src = tmp_path / "vllm"
    write_requests(src)
    with pytest.raises(SourceError, match=r"does not say whether its last hidden state .* num_hidden_layers is in "
                       r"that list.* --last-state-norm pre\|post"):
        convert(src, tmp_path / "a.zarr", workers=0, progress=False)
    with pytest.raises(SourceError, match=r"--last-state-norm post was given, but vllm-safetensors files cannot hold "
                       r"the post-norm last hidden state"):
        convert(src, tmp_path / "b.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="post"))
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def test_the_arrow_dataset_beside_gives_each_file_its_rows_loss_mask(tmp_path: Path) -> None:
    src, dst = tmp_path / "prepared", tmp_path / "hs.zarr"
    src.mkdir()
    masks = {req_id: [int(j % 3 != 0) for j in range(t)] for req_id, t in LENGTHS.items()}
    g = torch.Generator().manual_seed(99)
    other = torch.randint(0, 32000, (7,), generator=g).tolist()  # a prompt vLLM was not sent
    files = write_requests(src)
    rows = [{"input_ids": files[r]["token_ids"].tolist(), "loss_mask": masks[r]} for r in reversed(LENGTHS)]
    write_arrow(src, [rows[0], {"input_ids": other, "loss_mask": [1] * 7}, *rows[1:]])  # in another order
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, last_state_norm="pre"))
    store = Store(dst)
    assert store.has_loss_mask.tolist() == [True] * len(LENGTHS)
    for i, relpath in enumerate(store.source_paths):
        req_id = relpath.removesuffix(".safetensors")
        assert_sample_is_file(store, i, files[req_id])
        assert store.read_sample(i).loss_mask.tolist() == masks[req_id]
    assert verify_store(dst, against=src, progress=False).ok


def test_a_file_of_no_row_or_of_rows_that_disagree_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "prepared"
    src.mkdir()
    files = write_requests(src)
    rows = [{"input_ids": files[r]["token_ids"].tolist(), "loss_mask": [1] * t} for r, t in LENGTHS.items()]
    write_arrow(src, rows[1:])  # cmpl-3a's prompt is not in the dataset
    with pytest.raises(SourceError, match=r"cmpl-3a\.safetensors: its token_ids are the input_ids of no row of the "
                       r"Arrow dataset at .* \(3 rows\)"):
        convert(src, tmp_path / "a.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))
    twice = {"input_ids": rows[0]["input_ids"], "loss_mask": [0] * LENGTHS["cmpl-3a"]}
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (src / name).unlink()
    write_arrow(src, [*rows, twice])  # the same prompt twice, with another loss mask
    with pytest.raises(SourceError, match=r"cmpl-3a\.safetensors: its token_ids are the input_ids of rows 0 and 4 of "
                       r"the Arrow dataset, whose loss masks differ"):
        convert(src, tmp_path / "b.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))


def test_files_written_without_a_lock_and_keys_vllm_does_not_write(tmp_path: Path) -> None:
    src = tmp_path / "vllm"
    files = write_requests(src)
    for lock in src.glob("*.lock"):  # use_synchronization_lock off, or removed by a reader once loaded
        lock.unlink()
    convert(src, tmp_path / "a.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))
    store = Store(tmp_path / "a.zarr")
    for i, relpath in enumerate(store.source_paths):
        assert_sample_is_file(store, i, files[relpath.removesuffix(".safetensors")])
    save_file({**files["cmpl-3a"], "hidden_states_scales": torch.ones(9, 1, 1)}, str(src / "cmpl-3a.safetensors"))
    with pytest.raises(SourceError, match=r"cmpl-3a\.safetensors: 'hidden_states_scales' beside 'hidden_states' of "
                       r"dtype torch\.bfloat16: scales belong to float8_e4m3fn hidden states"):  # FP8 files take them
        convert(src, tmp_path / "b.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))
    save_file({**files["cmpl-3a"], "extra": torch.ones(9)}, str(src / "cmpl-3a.safetensors"))
    with pytest.raises(SourceError, match=r"cmpl-3a\.safetensors: has key\(s\) 'extra' that format "
                       "vllm-safetensors does not have"):
        convert(src, tmp_path / "c.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))


def test_a_file_of_fewer_positions_than_tokens_names_prefix_caching(tmp_path: Path, cli) -> None:
    """With prefix caching (or chunked prefill) vLLM computes, and its connector writes, only the positions after
    the cached prefix, beside the whole prompt's token ids: refused, naming the cause and the fix, not a generic
    shape error; with --skip-bad a recorded skip with that reason, the other files converted."""
    src = tmp_path / "vllm"
    files = write_requests(src)
    cached = files["cmpl-b7"]  # 17 tokens, the first 12 served from the prefix cache: 5 positions written
    save_file({"hidden_states": cached["hidden_states"][12:].contiguous(), "token_ids": cached["token_ids"]},
              str(src / "cmpl-b7.safetensors"))
    problem = (r"'hidden_states' holds 5 positions but 'token_ids' has 17 tokens \(12 missing\): vLLM wrote only the "
               r"positions it computed, most likely because prefix caching or chunked prefill was on during extraction"
               r".*enable_prefix_caching=False and chunked prefill off")
    with pytest.raises(SourceError, match=problem) as raised:
        convert(src, tmp_path / "a.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))
    assert raised.value.path == str(src / "cmpl-b7.safetensors")
    result = cli("convert", src, tmp_path / "b.zarr", "--last-state-norm", "pre", "--workers", "0")
    assert result.status != 0 and "cmpl-b7.safetensors" in result.output
    assert "holds 5 positions but 'token_ids' has 17 tokens" in result.output
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()
    result = cli("convert", src, tmp_path / "c.zarr", "--last-state-norm", "pre", "--workers", "0", "--skip-bad")
    assert result.status == 0, result.output
    store = Store(tmp_path / "c.zarr")
    [skipped] = store.info.skipped
    assert skipped.path == "cmpl-b7.safetensors" and "prefix caching or chunked prefill" in skipped.problem
    assert sorted(store.source_paths) == sorted(f"{r}.safetensors" for r in LENGTHS if r != "cmpl-b7")
    for i, relpath in enumerate(store.source_paths):
        assert_sample_is_file(store, i, files[relpath.removesuffix(".safetensors")])


# --------------------------------------------------------------------------- files still being written


@pytest.mark.parametrize("partial", [True, False], ids=["half-written", "not-created-yet"])
def test_a_held_lock_is_waited_for(tmp_path: Path, partial: bool) -> None:
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    files = write_requests(src)
    writer = Writer(src, "cmpl-ff", 21, seed=7, hold_s=1.5, partial=partial)
    try:
        started = time.monotonic()
        convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, last_state_norm="pre"),
                skips=SkipPolicy(lock_timeout=60))
        assert time.monotonic() - started >= 1.0  # it waited for the writer
        writer.wait()
    finally:
        writer.kill()
    store = Store(dst)
    assert store.source_paths == sorted(f"{r}.safetensors" for r in [*LENGTHS, "cmpl-ff"])
    for i, relpath in enumerate(store.source_paths):
        req_id = relpath.removesuffix(".safetensors")
        assert_sample_is_file(store, i, writer.tensors if req_id == "cmpl-ff" else files[req_id])
    assert store.info.skipped == []
    assert verify_store(dst, against=src, progress=False).ok


@pytest.mark.parametrize("partial", [True, False], ids=["half-written", "not-created-yet"])
def test_a_lock_never_released_ends_in_a_clear_error_in_the_time_stated(tmp_path: Path, cli, partial: bool) -> None:
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    write_requests(src)
    writer = Writer(src, "cmpl-ff", 21, seed=7, hold_s=None, partial=partial)
    try:
        started = time.monotonic()
        result = cli("convert", src, dst, "--last-state-norm", "pre", "--workers", "0", "--lock-timeout", "1.5")
        elapsed = time.monotonic() - started
    finally:
        writer.kill()
    assert result.status == 1
    assert f"{src / 'cmpl-ff.safetensors'}: is still being written: its lock cmpl-ff.safetensors.lock was held for " \
           "the 1.5 s waited (vLLM holds it until the file is complete); run the command again when vLLM is done " \
           "(give --lock-timeout more seconds to wait longer), or pass --skip-bad to convert the finished files now " \
           "and append this one on a rerun" in result.output
    assert 1.5 <= elapsed < 1.5 + 5  # the wait, then the error: no conversion was started
    assert not dst.exists()


def test_with_skip_bad_it_is_a_recorded_skip_that_a_rerun_appends(tmp_path: Path, cli) -> None:
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    files = write_requests(src)
    writer = Writer(src, "cmpl-ff", 21, seed=7, hold_s=None, partial=True)
    try:
        result = cli("convert", src, dst, "--last-state-norm", "pre", "--workers", "0", "--chunk-tokens", CHUNK,
                     "--skip-bad", "--lock-timeout", "0.5")
        assert result.status == 0, result.output
        store = Store(dst)
        assert store.source_paths == sorted(f"{r}.safetensors" for r in LENGTHS)
        assert [s.path for s in store.info.skipped] == ["cmpl-ff.safetensors"]
        assert store.info.skipped[0].problem.startswith("is still being written: its lock cmpl-ff.safetensors.lock")
        inspected = cli("inspect", dst)
        assert "skipped cmpl-ff.safetensors: is still being written" in inspected.output
        # nothing finished since: a rerun has nothing to do, and says the file is still skipped
        again = cli("convert", src, dst, "--last-state-norm", "pre", "--workers", "0", "--chunk-tokens", CHUNK,
                    "--skip-bad", "--lock-timeout", "0.5")
        assert again.status == 0 and "skipped cmpl-ff.safetensors: is still being written" in again.output
        assert Store(dst).source_paths == store.source_paths
    finally:
        writer.kill()
    late = Writer(src, "cmpl-ff", 21, seed=7, hold_s=0, partial=False)  # vLLM writes it whole and lets go
    late.wait()
    rerun = cli("convert", src, dst, "--last-state-norm", "pre", "--workers", "0", "--chunk-tokens", CHUNK,
                "--skip-bad", "--lock-timeout", "0.5")
    assert rerun.status == 0, rerun.output
    assert "appending 1 new sample file(s) after its 4 samples" in rerun.output
    store = Store(dst)
    assert store.source_paths == [*sorted(f"{r}.safetensors" for r in LENGTHS), "cmpl-ff.safetensors"]
    assert store.info.skipped == []
    for i, relpath in enumerate(store.source_paths[:-1]):
        assert_sample_is_file(store, i, files[relpath.removesuffix(".safetensors")])
    assert_sample_is_file(store, len(LENGTHS), late.tensors)
    assert verify_store(dst, against=src, progress=False).ok


def test_a_lock_alone_is_a_request_never_written(tmp_path: Path) -> None:
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    write_requests(src)
    os.close(os.open(src / "cmpl-dd.safetensors.lock", os.O_CREAT | os.O_WRONLY, 0o644))  # aborted: lock, no file
    problem = ("is a lock with no cmpl-dd.safetensors beside it: vLLM never wrote that request's hidden states (it "
               "was aborted, or its write failed: see vLLM's log); delete the lock once you know why")
    with pytest.raises(SourceError) as raised:
        convert(src, dst, workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"))
    assert (raised.value.path, raised.value.problem) == (str(src / "cmpl-dd.safetensors.lock"), problem)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"),
            skips=SkipPolicy(skip_bad=True))
    assert Store(dst).info.skipped == [SkippedFile("cmpl-dd.safetensors.lock", problem)]
    assert len(Store(dst)) == len(LENGTHS)


def test_synthetic_vllm_files_convert_with_their_arrow_loss_masks(tmp_path: Path) -> None:
    """`h5feed.testing.synthetic` writes vLLM's layout too (for benches): the Arrow dataset beside gives the masks."""
    src, dst = tmp_path / "vllm", tmp_path / "hs.zarr"
    lengths = [7, 19, 3, 11]
    write_synthetic(src, "vllm-safetensors", len(lengths), H, K - 1, lengths=lengths, seed=5)
    convert(src, dst, workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK, last_state_norm="pre"))
    store = Store(dst)
    scales = column_scales(H, K, 5)
    assert store.source_paths == [f"req-{i:06d}.safetensors" for i in range(len(lengths))]
    for i, t in enumerate(lengths):
        ids, mask, layers = make_sample(i, t, scales, seed=5)
        assert_sample_is_file(store, i, {"hidden_states": torch.stack(layers, dim=1), "token_ids": ids})
        assert mask is not None and torch.equal(store.read_sample(i).loss_mask, mask)


def test_a_lock_taken_again_after_discovery_is_an_error_not_a_read(tmp_path: Path) -> None:
    """A new vLLM run into the same folder reuses request ids: a file found finished may be rewritten under its lock
    while the conversion runs.  Reading it then would read a half-written file: it is refused, naming it."""
    src = tmp_path / "vllm"
    write_requests(src)
    fmt = FORMATS["vllm-safetensors"]
    source = next(s for s in fmt.scan(src).files if s.relpath == "cmpl-3a.safetensors")
    writer = Writer(src, "cmpl-3a", 9, seed=0, hold_s=None, partial=False)
    try:
        for read in (fmt.probe, fmt.load):
            with pytest.raises(SourceError) as raised:
                read(source)
            assert (raised.value.path, raised.value.problem) == (str(src / "cmpl-3a.safetensors"), (
                "is being written again (its lock cmpl-3a.safetensors.lock is held since it was found finished): "
                "convert once vLLM is done with this folder"))
    finally:
        writer.kill()
    assert torch.equal(fmt.load(source).input_ids, write_requests(tmp_path / "again")["cmpl-3a"]["token_ids"])


def test_a_lock_that_is_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    src = tmp_path / "vllm"
    write_requests(src)
    (src / "cmpl-b7.safetensors.lock").unlink()
    os.mkfifo(src / "cmpl-b7.safetensors.lock")  # opening it would wait for a writer that never comes
    with pytest.raises(SourceError) as raised:
        convert(src, tmp_path / "hs.zarr", workers=0, progress=False, settings=StoreSettings(last_state_norm="pre"),
                skips=SkipPolicy(lock_timeout=60))
    assert (raised.value.path, raised.value.problem) == (
        str(src / "cmpl-b7.safetensors.lock"), "is a named pipe (FIFO), not a regular file: refused without opening it")
