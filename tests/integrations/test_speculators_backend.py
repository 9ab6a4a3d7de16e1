"""speculators 0.9's own `train` command on an h5feed store: the released speculators and hs-connectors, unchanged.

The `h5feed` hidden-states backend must hand speculators' `ArrowDataset` exactly what its `file` backend reads
from the original ``hidden_states/hs_{i}.safetensors`` files, through its sampler, collate and spawned workers,
and `python -m h5feed.speculators_train` must run speculators' `train` with it.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hs_connectors import FileTransfer, HiddenStatesBackend
from s3_server import CREDENTIALS, REGION, S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)
from speculators.train.data import ArrowDataset

import h5feed
from h5feed.errors import CorruptSampleError, H5feedError, StoreError
from h5feed.integrations.speculators import H5feedBackend, StoreTransfer
from h5feed.integrations.speculators_train import NEEDS
from h5feed.io import cache_state, open_url
from h5feed.store import CHECKSUMMED, Store
from h5feed.testing.synthetic import VOCAB_SIZE, write_synthetic

H, K = 32, 3
NUM_SAMPLES = 10
LENGTHS = (5, 40)
SEQ_LEN = 96  # speculators' total_seq_len: several samples packed in one batch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """speculators' data folder (Arrow dataset + hidden_states/hs_{i}.safetensors), its store, and a tiny verifier."""
    root = tmp_path_factory.mktemp("speculators_run")
    write_synthetic(root / "data", "speculators-safetensors", NUM_SAMPLES, H, num_aux_layers=K, lengths=LENGTHS, seed=5)
    h5feed.convert(root / "data", root / "hs.zarr", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16))
    return root


@pytest.fixture(scope="module")
def verifier(run):
    """A tiny Llama checkpoint (config + weights) for speculators to read the draft's shapes and embeddings from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(run / "verifier")
    return run / "verifier"


def h5feed_transfer(store: Path) -> StoreTransfer:
    """The transfer speculators' `train` builds for `--hidden-states-backend h5feed --h5feed-store STORE`."""
    args = argparse.Namespace(h5feed_store=str(store), h5feed_cache_dir=None, h5feed_on_corrupt="raise")
    return HiddenStatesBackend.registry["h5feed"].from_train_args(args, Store(store).info.source_root)


# --------------------------------------------------------------------------- the backend returns the file's sample


def test_the_backend_is_registered_as_hs_connectors_expects():
    assert HiddenStatesBackend.registry["h5feed"] is H5feedBackend
    assert {"file", "fp8", "mooncake", "h5feed"} <= set(HiddenStatesBackend.registry)


def test_get_cached_returns_what_the_file_backend_reads(run, assert_same_batch):
    files, store = FileTransfer(run / "data" / "hidden_states"), h5feed_transfer(run / "hs.zarr")
    for i in range(NUM_SAMPLES):
        want = files.get_cached(i)
        assert want["hidden_states"].shape[1:] == (K + 1, H) and want["hidden_states"].dtype == torch.bfloat16
        assert_same_batch(store.get_cached(i), want)


@pytest.mark.parametrize("split", ["train", "val"])
def test_arrow_dataset_items_equal_the_file_backends(run, split, assert_same_batch):
    def dataset(transfer):
        return ArrowDataset(SEQ_LEN, run / "data", transfer=transfer, on_missing="raise", train_ratio=0.7, split=split)

    on_files, on_store = dataset(FileTransfer(run / "data" / "hidden_states")), dataset(h5feed_transfer(run / "hs.zarr"))
    assert len(on_store) == len(on_files) == (7 if split == "train" else 3)
    for i in range(len(on_files)):
        assert_same_batch(on_store[i], on_files[i])


def test_train_loaders_yield_the_file_backends_batches(run, verifier, assert_same_batch):
    """What `train` does before its Trainer (which needs an accelerator): resolve the arguments, build the backend's
    transfer, then speculators' own loaders (packing sampler, collate with the EAGLE-3 shift; the store's through a
    spawned worker, as `train` runs them, the files' in-process: the sampler fixes the batches either way)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders

    def batches(workers: int, *backend_args: str) -> list[list[dict]]:
        cfg = TrainConfig.resolve(["--verifier-name-or-path", str(verifier), "--data-path", str(run / "data"),
                                   "--total-seq-len", str(SEQ_LEN), "--num-workers", str(workers),
                                   "--prefetch-factor", "2", "--train-data-ratio", "0.7", *backend_args])
        args = argparse.Namespace(**cfg.flatten())
        transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
        loaders = create_train_val_loaders(
            data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16,
            transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing="raise",
            verifier_name_or_path=args.verifier_name_or_path, request_timeout=None, max_retries=0,
            generation_validation_retries=0, max_consecutive_generation_failures=1, hidden_size=H,
            num_target_layers=K, num_workers=args.num_workers, prefetch_factor=args.prefetch_factor,
            preprocess=shift_batch, train_data_ratio=args.train_data_ratio, seed=args.seed)
        return [list(loader) for loader in loaders]

    on_files = batches(0, "--hidden-states-backend", "file")
    on_store = batches(1, "--hidden-states-backend", "h5feed", "--h5feed-store", str(run / "hs.zarr"))
    assert [len(b) for b in on_store] == [len(b) for b in on_files] and all(on_files)
    for got_split, want_split in zip(on_store, on_files):
        for got, want in zip(got_split, want_split):
            assert want["error_records"] == 0
            assert_same_batch(got, want)


def test_a_store_in_a_bucket_through_the_node_cache(run, s3: S3, bucket, tmp_path, monkeypatch, assert_same_batch):
    """--h5feed-store s3://... --h5feed-cache-dir DIR, the endpoint and credentials from the environment: the file
    backend's samples; a second run (a new transfer, as a new `train` builds) reads the cache and asks the bucket
    for no array's chunk (only the small index, read at every open)."""
    url = f"s3://{bucket}/hs.zarr"
    objects = open_url(url, s3.storage_options)
    for path in sorted((run / "hs.zarr").rglob("*")):
        if path.is_file():
            objects.put_atomic(path.relative_to(run / "hs.zarr").as_posix(), path.read_bytes())
    for name, value in {"AWS_ENDPOINT_URL_S3": s3.proxy.url, "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
                        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"], "AWS_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(h5feed_store=url, h5feed_cache_dir=str(tmp_path / "cache"), h5feed_on_corrupt="raise")
    files = FileTransfer(run / "data" / "hidden_states")
    for run_number in (1, 2):
        s3.proxy.reset()
        transfer = H5feedBackend.from_train_args(args, str(run / "data"))
        for i in range(NUM_SAMPLES):
            assert_same_batch(transfer.get_cached(i), files.get_cached(i))
        chunk_gets = [r for r in s3.proxy.requests("GET") if any(f"/{a}/c/" in r.path for a in CHECKSUMMED)]
        assert (len(chunk_gets) > 0) == (run_number == 1), run_number
    assert cache_state(tmp_path / "cache").objects > 0


# --------------------------------------------------------------------------- refusals


def test_a_file_index_the_store_lacks_is_refused(run, tmp_path, assert_same_batch):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data)
    (data / "hidden_states" / "hs_8.safetensors").unlink()
    h5feed.convert(data, tmp_path / "hs.zarr", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16))
    transfer = h5feed_transfer(tmp_path / "hs.zarr")
    assert transfer.store.source_paths[8] == "hidden_states/hs_9.safetensors"
    assert_same_batch(transfer.get_cached(9), FileTransfer(data / "hidden_states").get_cached(9))
    with pytest.raises(StoreError) as err:
        ArrowDataset(SEQ_LEN, data, transfer=transfer, on_missing="raise")[8]
    assert str(err.value) == (
        f"{tmp_path / 'hs.zarr'}: holds no sample converted from hidden_states/hs_8.safetensors, which speculators' "
        "dataset asks for (row 8 of its Arrow dataset): convert that file into the store (`h5feed convert` on the "
        "same folder appends what is missing), or train on an Arrow dataset whose rows the store holds")


def test_a_store_of_another_pipeline_is_refused(tmp_path):
    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 2, H, lengths=(4, 8))
    h5feed.convert(tmp_path / "src", tmp_path / "hs.zarr", workers=0, progress=False)
    with pytest.raises(StoreError) as err:
        h5feed_transfer(tmp_path / "hs.zarr")
    assert str(err.value) == (
        f"{tmp_path / 'hs.zarr'}: was converted from speculators-legacy-pt files, not from speculators' "
        "hidden_states/hs_{i}.safetensors (speculators-safetensors): the h5feed backend pairs row i of "
        "speculators' Arrow dataset with the sample converted from hs_{i}.safetensors")


def test_a_store_with_two_files_of_one_index_is_refused(run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(run / "data", data)
    shutil.copy(data / "hidden_states" / "hs_3.safetensors", data / "hidden_states" / "hs_03.safetensors")
    h5feed.convert(data, tmp_path / "hs.zarr", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=16))
    with pytest.raises(StoreError) as err:
        h5feed_transfer(tmp_path / "hs.zarr")
    assert str(err.value) == (
        f"{tmp_path / 'hs.zarr'}: holds 2 samples of file index 3 (hidden_states/hs_03.safetensors, "
        "hidden_states/hs_3.safetensors): speculators' dataset has one row per index; keep one file of each index "
        "in hidden_states/ and convert again")


def test_a_store_converted_from_another_folder_is_named(run, caplog):
    args = argparse.Namespace(h5feed_store=str(run / "hs.zarr"), h5feed_cache_dir=None, h5feed_on_corrupt="raise")
    with caplog.at_level("WARNING", logger="h5feed.integrations.speculators"):
        H5feedBackend.from_train_args(args, str(run / "data"))
        assert caplog.messages == []
        H5feedBackend.from_train_args(args, "/elsewhere/data")
    assert caplog.messages == [(
        f"{run / 'hs.zarr'} was converted from {run / 'data'}, and speculators trains on the Arrow dataset in "
        "/elsewhere/data: if these are not the same data, every sample's token ids will differ from its row's and "
        "speculators will skip it")]


def test_the_store_flag_is_required():
    with pytest.raises(H5feedError, match=r"--hidden-states-backend h5feed needs --h5feed-store PATH_OR_URL, the "
                       r"store converted from /runs/data/hidden_states \(`h5feed convert /runs/data STORE`\)"):
        H5feedBackend.from_train_args(argparse.Namespace(h5feed_store=None, h5feed_cache_dir=None), "/runs/data")


def test_a_damaged_sample_is_an_error_never_a_sample(run, tmp_path, flip_byte):
    shutil.copytree(run / "hs.zarr", tmp_path / "hs.zarr")
    shard = flip_byte(tmp_path / "hs.zarr", sample=4)
    dataset = ArrowDataset(SEQ_LEN, run / "data", transfer=h5feed_transfer(tmp_path / "hs.zarr"), on_missing="raise")
    with pytest.raises(CorruptSampleError) as err:
        dataset[4]
    assert (err.value.sample, err.value.source_path, Path(err.value.path)) == (
        4, "hidden_states/hs_4.safetensors", shard)
    assert torch.equal(dataset[5]["input_ids"], FileTransfer(run / "data" / "hidden_states").get_cached(5)["token_ids"])


def test_a_damaged_sample_skipped_is_counted_in_speculators_batch(run, tmp_path, flip_byte, caplog,
                                                                  assert_same_batch):
    """--h5feed-on-corrupt skip: speculators' collate leaves the sample out and counts it; its batch keeps the others."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.recovery import SampleUnavailable

    shutil.copytree(run / "hs.zarr", tmp_path / "hs.zarr")
    flip_byte(tmp_path / "hs.zarr", sample=4)
    args = argparse.Namespace(h5feed_store=str(tmp_path / "hs.zarr"), h5feed_cache_dir=None, h5feed_on_corrupt="skip")
    skipping = ArrowDataset(SEQ_LEN, run / "data", transfer=H5feedBackend.from_train_args(args, str(run / "data")),
                            on_missing="raise")
    on_files = ArrowDataset(SEQ_LEN, run / "data", on_missing="raise")
    collate = CollateFn(SEQ_LEN, H, num_target_layers=K, preprocess=shift_batch)
    with caplog.at_level("ERROR", logger="h5feed.integrations.speculators"):
        item = skipping[4]
    assert isinstance(item, SampleUnavailable) and "sample 4 (converted from hidden_states/hs_4.safetensors)" in item.reason
    assert caplog.messages == [f"skipping a damaged sample (on_corrupt='skip'): {item.reason}"]
    got, want = collate([skipping[3], item, skipping[5]]), collate([on_files[3], on_files[5]])
    assert (got.pop("error_records"), want.pop("error_records")) == (1, 0)
    assert_same_batch(got, want)


def test_a_pickled_transfer_is_its_store(run, assert_same_batch):
    """Spawned DataLoader workers get the store's location and options, and rebuild the file-index map."""
    transfer = h5feed_transfer(run / "hs.zarr")
    pickled = pickle.dumps(transfer)
    assert len(pickled) < 1000
    assert_same_batch(pickle.loads(pickled).get_cached(3), transfer.get_cached(3))


# --------------------------------------------------------------------------- the command


def train_command(run: Path, verifier: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h5feed.speculators_train", "--verifier-name-or-path", str(verifier),
         "--data-path", str(run / "data"), "--speculator-type", "eagle3", "--num-layers", "1",
         "--draft-attn-impl", "sdpa", "--mask-token-id", "0", "--total-seq-len", str(SEQ_LEN),
         "--num-workers", "0", "--epochs", "1", "--max-steps", "3", "--save-path", str(run / "ckpt"),
         "--log-dir", str(run / "logs"), "--hidden-states-backend", "h5feed", "--h5feed-store", str(run / "hs.zarr"),
         *extra],
        check=False, capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_the_command_takes_the_backends_flags(run, verifier):
    r = train_command(run, verifier, "--dump-config")
    assert r.returncode == 0, r.stderr
    assert "hidden_states_backend: h5feed" in r.stdout
    assert f"h5feed_store: {run / 'hs.zarr'}" in r.stdout


@pytest.mark.skipif(torch.accelerator.is_available(), reason="shows what the command says without an accelerator")
def test_without_an_accelerator_the_command_says_so_before_anything_runs(run, verifier):
    """Not after loading the verifier, the draft model and the data, where speculators' Trainer would stop."""
    r = train_command(run, verifier)
    assert r.returncode == 1
    assert r.stderr.strip() == ("python -m h5feed.speculators_train: torch sees no GPU (speculators' Trainer places "
                                f"the model on one); it needs {NEEDS}")
    assert not (run / "ckpt").exists()


def test_a_missing_package_is_named_with_what_to_install(monkeypatch):
    from importlib import util

    import h5feed.integrations.speculators_train as command

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name: None if name == "transformers" else find_spec(name))
    assert command.unmet_requirement(["--dump-config"]) == "transformers is not installed"
    with pytest.raises(SystemExit) as stopped:
        command.main(["--dump-config"])
    assert str(stopped.value) == f"python -m h5feed.speculators_train: transformers is not installed; it needs {NEEDS}"
    assert "pip install 'speculators>=0.9,<0.10'" in NEEDS and "a GPU" in NEEDS


@pytest.mark.gpu(nvcomp=False)
@pytest.mark.skipif(not torch.accelerator.is_available(), reason="speculators' Trainer needs an accelerator")
def test_train_runs_a_few_steps_on_the_store(run, verifier):
    """3 steps (the first compiles the draft's forward: torch.compile on CUDA), then speculators' validation."""
    r = train_command(run, verifier)
    assert r.returncode == 0, r.stderr
    assert "Training epoch 1/1 completed" in r.stdout + r.stderr
    assert "Validation epoch 1/1 completed" in r.stdout + r.stderr
    assert "hidden_states_backend: h5feed" in (run / "ckpt" / "run.yaml").read_text()


def test_registering_after_speculators_parser_was_set_up_warns():
    code = ("import warnings, speculators.train.config.resolution\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import h5feed.integrations.speculators\n"
            "print([str(w.message) for w in caught])")
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert r.returncode == 0, r.stderr
    assert ("speculators' train parser was set up before h5feed's backend was registered, so it lacks "
            "--h5feed-store: import h5feed.integrations.speculators before speculators.train, or run "
            "`python -m h5feed.speculators_train`") in r.stdout
