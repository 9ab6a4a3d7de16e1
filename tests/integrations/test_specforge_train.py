"""SpecForge 0.2's own offline training on an h5feed store: its runtime's refs, feature store and `specforge train`.

Against the installed SpecForge: the refs h5feed's reader lists are those SpecForge's reader lists for the files;
its loader (`FeatureDataLoader`, with each algorithm's normalizer and collator) yields from the store exactly the
batches it yields from the files; and ``python -m h5feed.specforge_train train`` trains as ``specforge train`` does
on the files, step for step the same losses (DFlash, Domino and DSpark on this CPU; EAGLE-3, whose objective is a
Triton kernel, on a GPU).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import specforge.launch
import torch
from conftest import CAPTURE_H, CAPTURE_LENGTHS, REPO, specforge_provider, write_capture
from specforge.data.preprocessing import process_token_dict_to_mappings
from specforge.runtime.data_plane import offline_reader
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from specforge.training.vocab_mapping import count_effective_feature_tokens

import h5feed
from h5feed.errors import CorruptSampleError, H5feedError, StoreError
from h5feed.integrations.specforge import StoreAccess, count_loss_tokens, install
from h5feed.integrations.specforge_train import NEEDS, prepared, unmet_requirement

H, LENGTHS = CAPTURE_H, CAPTURE_LENGTHS  # SpecForge's captures as conftest writes them
VOCAB = 1000
MAX_LEN = 12  # cuts most of LENGTHS (5..16)
ALGORITHMS = ("eagle3", "dflash", "domino", "dspark")
FILE_READER = offline_reader.OfflineManifestReader  # SpecForge's own, whatever a test installs
ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel", "domino": "DominoDraftModel",
                 "dspark": "DSparkDraftModel"}


@pytest.fixture
def installed(monkeypatch) -> Any:
    """`installed(access)` installs h5feed's reader and feature store; SpecForge's own are put back after the test."""
    monkeypatch.setattr(offline_reader, "OfflineManifestReader", offline_reader.OfflineManifestReader)
    monkeypatch.setattr(specforge.launch, "LocalFeatureStore", specforge.launch.LocalFeatureStore)
    return lambda access=StoreAccess(): install(access)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny verifier, each algorithm's draft config and SpecForge-written files, and their stores."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("specforge_run")
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=6,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=512, bos_token_id=1, eos_token_id=2))
    # sharded, as real verifiers are: SpecForge's EAGLE-3 reads the verifier's lm_head through the shards' index
    verifier.to(torch.bfloat16).save_pretrained(root / "verifier", max_shard_size="20KB")
    assert (root / "verifier" / "model.safetensors.index.json").is_file(), "the verifier was saved in one file"
    for algorithm in ALGORITHMS:
        write_capture(root / algorithm / "hs", algorithm)
        h5feed.convert(root / algorithm / "hs", root / algorithm / "hs.zarr", workers=0, progress=False,
                       settings=h5feed.StoreSettings(chunk_tokens=8))
        (root / algorithm / "draft.json").write_text(json.dumps(draft_config(algorithm)))
    return root


def draft_config(algorithm: str) -> dict:
    """A one-layer draft of the verifier's width: DFlash-family drafts read the files' five captured layers."""
    config = {"architectures": [ARCHITECTURES[algorithm]], "hidden_size": H, "intermediate_size": 2 * H,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": H // 4,
              "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "pad_token_id": 0, "tie_word_embeddings": False}
    if algorithm == "eagle3":
        return {**config, "model_type": "llama", "draft_vocab_size": VOCAB // 2}  # a vocabulary mapping is needed
    method = {"target_layer_ids": [0, 1, 2, 3, 4], "mask_token_id": 3}
    method.update({"emb_dim": 32, "gru_hidden_dim": 16} if algorithm == "domino" else {})
    return {**config, "model_type": "qwen3", "num_target_layers": 6, "block_size": 4, "layer_types": ["full_attention"],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "dflash_config": method}


def run_config(run: Path, algorithm: str, source: str, out: str, **training: Any) -> Path:
    """SpecForge's run file for `algorithm` on `source` (its files, "hs", or its store, "hs.zarr")."""
    config = {
        "model": {"target_model_path": str(run / "verifier"), "draft_model_config": str(run / algorithm / "draft.json"),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(run / algorithm / source), "max_length": MAX_LEN,
                 "cache_dir": str(run / algorithm / f"cache-{out}"), "dataloader_num_workers": 2},
        "training": {"strategy": algorithm, "max_steps": 3, "batch_size": 2, "attention_backend": "sdpa",
                     "num_anchors": 4, "log_interval": 1, "ttt_length": 2, **training},
        "output_dir": str(run / algorithm / out),
    }
    path = run / algorithm / f"{out}.json"
    path.write_text(json.dumps(config))
    return path


def command(*args: Any, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])})


def losses(result: subprocess.CompletedProcess[str]) -> list[float]:
    """The loss SpecForge's console logger prints at each step."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    found = [float(m) for m in re.findall(r"^step \d+: \{.*?'loss': ([0-9.e+-]+)", result.stdout, re.MULTILINE)]
    assert len(found) == 3, result.stdout[-3000:]
    return found


def file_refs(run: Path, algorithm: str) -> list[Any]:
    """The refs SpecForge's own reader lists for the files, with the arguments the algorithm's provider passes."""
    reader = specforge_provider(algorithm).build_reader(str(run / algorithm / "hs"), run_id="r", ttt_length=2,
                                                        max_len=MAX_LEN)
    assert type(reader) is FILE_READER
    return reader.read()


def store_refs(run: Path, algorithm: str) -> list[Any]:
    return specforge_provider(algorithm).build_reader(str(run / algorithm / "hs.zarr"), run_id="r", ttt_length=2,
                                                      max_len=MAX_LEN).read()


def batches(store: Any, refs: list[Any], algorithm: str, num_workers: int = 2) -> list[dict[str, torch.Tensor]]:
    """What SpecForge's loader hands its trainer: each ref through the store, the normalizer and the collator."""
    provider = specforge_provider(algorithm)
    loader = FeatureDataLoader(store, refs=refs, batch_size=3, collate_fn=provider.build_collator(),
                               per_sample_transform=provider.build_normalizer(MAX_LEN), drop_last=False,
                               strategy=algorithm, num_workers=num_workers)
    return [batch.tensors for batch in loader]


# --------------------------------------------------------------------------- the runtime's contracts


@pytest.mark.parametrize("validate", [False, True], ids=["lazy", "validated"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_refs_are_specforges_for_the_files(run, installed, monkeypatch, algorithm: str, validate: bool) -> None:
    """Same order (SpecForge's sorted paths: data_10 before data_2), ids, keys and metadata; validated
    (SPECFORGE_VALIDATE_OFFLINE_FEATURES=1, which reads every file) the same specs, from the store's index."""
    monkeypatch.setenv("SPECFORGE_VALIDATE_OFFLINE_FEATURES", "1" if validate else "0")
    want = file_refs(run, algorithm)
    installed()
    got = store_refs(run, algorithm)
    assert len(got) == len(want) == len(LENGTHS)
    for ours, theirs in zip(got, want):
        location, _, sample = ours.feature_store_uri.partition("#")
        assert location == f"h5feed+{run / algorithm / 'hs.zarr'}"
        assert theirs.feature_store_uri == f"file://{run / algorithm / 'hs' / h5feed.Store(run / algorithm / 'hs.zarr').source_paths[int(sample)]}"
        assert {**vars(ours), "feature_store_uri": None} == {**vars(theirs), "feature_store_uri": None}
    assert [ref.metadata["file_index"] for ref in got] == list(range(len(LENGTHS)))
    assert bool(got[0].feature_specs) == validate


def test_listing_the_refs_opens_no_sample(run, installed, monkeypatch) -> None:
    """The first step waits on no pass over the data: the index lists the samples."""
    installed()
    monkeypatch.setattr(h5feed.Store, "read_sample", lambda *a, **k: pytest.fail("a sample was read"))
    monkeypatch.setattr(h5feed.Store, "read_rows_into", lambda *a, **k: pytest.fail("a sample was read"))
    assert len(store_refs(run, "dflash")) == len(LENGTHS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_feature_store_returns_what_specforge_loads_from_each_file(run, installed, assert_same_batch,
                                                                        algorithm: str) -> None:
    """Same keys, dtypes, shapes and bits as `load_feature_file`, cut where every normalizer cuts (max_len)."""
    files = LocalFeatureStore("files")
    want = [files.get(ref)[0] for ref in file_refs(run, algorithm)]
    installed()
    store = specforge.launch.LocalFeatureStore("r")
    for ref, expected in zip(store_refs(run, algorithm), want, strict=True):
        got, handle = store.get(ref)
        store.release(handle)
        assert_same_batch(got, {k: v[:MAX_LEN] if v.dim() == 1 else v[:, :MAX_LEN] for k, v in expected.items()})
        whole = dict(ref.metadata, max_len=64)
        assert_same_batch(store.get(type(ref)(**{**vars(ref), "metadata": whole}))[0], expected)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_loaders_batches_from_the_store_are_those_from_the_files(run, installed, assert_same_batch,
                                                                     algorithm: str) -> None:
    want = batches(LocalFeatureStore("files"), file_refs(run, algorithm), algorithm)
    installed()
    got = batches(specforge.launch.LocalFeatureStore("r"), store_refs(run, algorithm), algorithm)
    assert len(got) == len(want) == 4
    for ours, theirs in zip(got, want):
        assert_same_batch(ours, theirs)


def test_a_store_without_the_algorithms_keys_is_refused_before_training(run, installed) -> None:
    installed()
    with pytest.raises(StoreError) as info:
        specforge_provider("eagle3").build_reader(str(run / "dflash" / "hs.zarr"), run_id="r", ttt_length=2,
                                                  max_len=MAX_LEN).read()
    assert info.value.problem == (
        "cannot serve SpecForge the feature key(s) 'hidden_state', 'aux_hidden_state' this algorithm reads: it holds "
        "'input_ids', 'loss_mask', 'hidden_states' (converted from specforge-dflash-ckpt). Convert the files this "
        "algorithm's capture wrote")


def test_a_pre_norm_store_is_refused_for_specforge_targets(tmp_path: Path, installed) -> None:
    """speculators' files hold the pre-norm last state; SpecForge's lm_head needs the post-norm one."""
    from h5feed.testing.synthetic import write_synthetic

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 3, H, 3, lengths=(6, 8), seed=1)
    h5feed.convert(tmp_path / "src", tmp_path / "hs.zarr", workers=0, progress=False)
    installed()
    with pytest.raises(StoreError, match=r"'target_last_hidden_states' this algorithm reads: its last hidden state is pre-norm, "
                       r"and SpecForge applies the verifier's lm_head to its target states directly \(post-norm\)"):
        specforge_provider("dspark").build_reader(str(tmp_path / "hs.zarr"), run_id="r", ttt_length=2,
                                                  max_len=8).read()


# --------------------------------------------------------------------------- damaged samples


def test_a_damaged_sample_is_an_error_naming_it(run, tmp_path: Path, installed, flip_byte) -> None:
    import shutil

    shutil.copytree(run / "dflash" / "hs.zarr", tmp_path / "hs.zarr")
    store = h5feed.Store(tmp_path / "hs.zarr")
    flip_byte(tmp_path / "hs.zarr", 4, "aux_hidden_states", at=20)
    installed()
    refs = specforge_provider("dflash").build_reader(str(tmp_path / "hs.zarr"), run_id="r", ttt_length=2,
                                                     max_len=MAX_LEN).read()
    with pytest.raises(CorruptSampleError) as info:
        batches(specforge.launch.LocalFeatureStore("r"), refs, "dflash")
    assert (info.value.sample, info.value.source_path) == (4, store.source_paths[4])
    assert f"sample 4 (converted from {store.source_paths[4]})" in str(info.value)


def test_a_damaged_sample_skipped_is_counted_and_the_next_stands_in(run, tmp_path: Path, installed, flip_byte,
                                                                    assert_same_batch, caplog) -> None:
    import shutil

    shutil.copytree(run / "dflash" / "hs.zarr", tmp_path / "hs.zarr")
    flip_byte(tmp_path / "hs.zarr", 4, "aux_hidden_states", at=20)
    installed(StoreAccess(on_corrupt="skip"))
    refs = specforge_provider("dflash").build_reader(str(tmp_path / "hs.zarr"), run_id="r", ttt_length=2,
                                                     max_len=MAX_LEN).read()
    store = specforge.launch.LocalFeatureStore("r")
    damaged = next(ref for ref in refs if ref.feature_store_uri.endswith("#4"))
    stand_in = next(ref for ref in refs if ref.feature_store_uri.endswith("#5"))
    assert_same_batch(store.get(damaged)[0], store.get(stand_in)[0])
    assert store.health()["h5feed_damaged_skipped"] == 1
    assert "skipping a damaged sample (on_corrupt='skip'; the next sound sample stands in)" in caplog.text


# --------------------------------------------------------------------------- the vocabulary mapping


def test_the_vocabulary_counts_and_mapping_are_specforges_from_the_files(run, monkeypatch) -> None:
    """EAGLE-3 with a smaller draft vocabulary: SpecForge would count every file's ids before the first step; the
    command makes the same mapping (ties broken alike: same order) from the store's ids and masks."""
    store = h5feed.Store(run / "eagle3" / "hs.zarr")
    want = count_effective_feature_tokens(str(run / "eagle3" / "hs"), max_length=MAX_LEN, target_vocab_size=VOCAB)
    got = count_loss_tokens(store, MAX_LEN, VOCAB)
    assert list(got.items()) == list(want.items())
    monkeypatch.setenv("SPECFORGE_DEVICE", "cuda")  # SpecForge's own switch: past the no-GPU check, nothing runs
    argv = prepared(["train", "--config", str(run_config(run, "eagle3", "hs.zarr", "mapping"))], StoreAccess())
    assert argv[:5] == ["train", "--config", str(run / "eagle3" / "mapping.json"), "--role", "auto"]
    assert argv[5].startswith(f"model.vocab_mapping_path={run / 'eagle3' / 'cache-mapping' / 'vocab_mapping'}/h5feed-")
    mapping = torch.load(argv[5].split("=", 1)[1], weights_only=True)
    d2t, t2d = process_token_dict_to_mappings(want, VOCAB // 2, VOCAB)
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)


def test_a_damaged_sample_in_the_vocabulary_counts_is_an_error_or_a_counted_skip(run, tmp_path: Path, flip_byte,
                                                                                  caplog) -> None:
    import shutil

    shutil.copytree(run / "eagle3" / "hs.zarr", tmp_path / "hs.zarr")
    flip_byte(tmp_path / "hs.zarr", 3, "input_ids", at=4)
    store = h5feed.Store(tmp_path / "hs.zarr")
    with pytest.raises(CorruptSampleError) as info:
        count_loss_tokens(store, MAX_LEN, VOCAB)
    assert (info.value.sample, info.value.source_path) == (3, store.source_paths[3])
    skipped = count_loss_tokens(store, MAX_LEN, VOCAB, on_corrupt="skip")
    sound = h5feed.Store(run / "eagle3" / "hs.zarr")
    t = min(int(sound.sample_lengths[3]), MAX_LEN)
    raw = sound.read_sample(3, t)
    missing = raw.input_ids[raw.loss_mask.bool()]
    assert sum(count_loss_tokens(sound, MAX_LEN, VOCAB).values()) - sum(skipped.values()) == len(missing)
    assert "skipping a damaged sample in the vocabulary counts (on_corrupt='skip')" in caplog.text


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("algorithm", ["dflash", "domino", "dspark"])
def test_train_on_the_store_is_train_on_the_files(run, algorithm: str) -> None:
    """Three steps on this CPU (SpecForge uses DDP when told not to shard): the same losses, step for step."""
    on_files = command("-m", "specforge.cli", "train", "--config",
                       run_config(run, algorithm, "hs", "files", fsdp_sharding="NO_SHARD"))
    on_store = command("-m", "h5feed.specforge_train", "train", "--config",
                       run_config(run, algorithm, "hs.zarr", "store", fsdp_sharding="NO_SHARD"))
    assert losses(on_store) == losses(on_files)
    assert (run / algorithm / "store" / "specforge-run-step3").is_dir()


@pytest.mark.gpu(nvcomp=False)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SpecForge's EAGLE-3 objective is a Triton kernel: CUDA")
def test_eagle3_train_on_the_store_is_train_on_the_files(run) -> None:
    """On a GPU: FSDP as SpecForge shards by default, the vocabulary mapping made from the store."""
    on_files = command("-m", "specforge.cli", "train", "--config", run_config(run, "eagle3", "hs", "files"))
    on_store = command("-m", "h5feed.specforge_train", "train", "--config", run_config(run, "eagle3", "hs.zarr", "store"))
    assert losses(on_store) == losses(on_files)
    (specforges,) = (run / "eagle3" / "cache-files" / "vocab_mapping").glob("*.pt")  # derived from every file
    (h5feeds,) = (run / "eagle3" / "cache-store" / "vocab_mapping").glob("h5feed-*.pt")  # from the store's ids
    theirs, ours = (torch.load(path, weights_only=True) for path in (specforges, h5feeds))
    assert torch.equal(ours["d2t"], theirs["d2t"]) and torch.equal(ours["t2d"], theirs["t2d"])


def test_a_damaged_store_stops_the_run_naming_the_sample(run, tmp_path: Path, flip_byte) -> None:
    import shutil

    shutil.copytree(run / "dflash" / "hs.zarr", tmp_path / "hs.zarr")
    flip_byte(tmp_path / "hs.zarr", 2, "aux_hidden_states", at=20)
    config = json.loads(run_config(run, "dflash", "hs.zarr", "damaged", fsdp_sharding="NO_SHARD").read_text())
    config["data"]["hidden_states_path"] = str(tmp_path / "hs.zarr")
    config["training"]["max_steps"] = 6  # the whole epoch: every sample is read
    (tmp_path / "run.json").write_text(json.dumps(config))
    result = command("-m", "h5feed.specforge_train", "train", "--config", tmp_path / "run.json")
    assert result.returncode != 0
    source = h5feed.Store(tmp_path / "hs.zarr").source_paths[2]
    assert f"CorruptSampleError: {tmp_path / 'hs.zarr'}" in result.stderr
    assert f"sample 2 (converted from {source})" in result.stderr


@pytest.mark.parametrize(("change", "problem"), [
    ({"deployment": {"mode": "disaggregated"}}, "is an h5feed store, which SpecForge reads in its colocated offline "
     "runtime (deployment.mode local_colocated); a disaggregated producer ingests feature files"),
    ({"deployment": {"trainer": {"nproc_per_node": 2}}}, "deployment.trainer asks for 2 processes, which SpecForge "
     "would start as `python -m specforge.cli`, without h5feed's store: start them with torchrun instead: torchrun "
     "--nproc_per_node 2 -m h5feed.specforge_train train --config"),
    ({"training": {"fsdp_sharding": "FULL_SHARD"}}, "training.fsdp_sharding FULL_SHARD: SpecForge wraps the draft in "
     "FSDP, which needs a GPU; on a CPU pass training.fsdp_sharding=NO_SHARD (SpecForge then uses DDP)"),
])
def test_what_would_fail_later_is_said_first(run, tmp_path: Path, monkeypatch, change: dict, problem: str) -> None:
    if "fsdp_sharding" in json.dumps(change):
        monkeypatch.setenv("SPECFORGE_DEVICE", "cpu")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = json.loads(run_config(run, "dflash", "hs.zarr", "refused").read_text())
    for section, values in change.items():
        if section == "deployment" and values.get("mode") == "disaggregated":
            values = {**values, "disaggregated": {"control_dir": str(tmp_path / "control"), "backend": "shared_dir",
                                                  "store_root": str(tmp_path / "features")}}
        config.setdefault(section, {}).update(values)
    (tmp_path / "run.json").write_text(json.dumps(config))
    with pytest.raises(H5feedError) as info:  # SpecForge's own validation takes the config: it is h5feed's refusal
        prepared(["train", "--config", str(tmp_path / "run.json")], StoreAccess())
    assert problem in str(info.value)


def test_eagle3_without_a_gpu_is_said_first(run, monkeypatch) -> None:
    monkeypatch.setenv("SPECFORGE_DEVICE", "cpu")
    with pytest.raises(H5feedError, match=r"^training.strategy eagle3: SpecForge 0.2's EAGLE-3 objective runs a Triton "
                       r"kernel \(specforge.core.loss\), which needs a CUDA GPU; this machine has none$"):
        prepared(["train", "--config", str(run_config(run, "eagle3", "hs.zarr", "nogpu"))], StoreAccess())


def test_a_run_on_files_and_other_commands_pass_through_unchanged(run) -> None:
    argv = ["train", "--config", str(run_config(run, "dflash", "hs", "plain")), "training.seed=3"]
    assert prepared(argv, StoreAccess()) == argv
    assert prepared(["export", "--to", "hf"], StoreAccess()) == ["export", "--to", "hf"]
    plan = command("-m", "h5feed.specforge_train", "train", "--plan", "--config",
                   run_config(run, "dflash", "hs.zarr", "plan", fsdp_sharding="NO_SHARD"))
    assert plan.returncode == 0, plan.stderr
    assert "worker" in plan.stdout


def test_install_refuses_a_specforge_that_is_not_0_2(installed, monkeypatch) -> None:
    monkeypatch.setattr(specforge.launch, "LocalFeatureStore", object)
    with pytest.raises(H5feedError, match=r"^specforge.launch.LocalFeatureStore is not SpecForge 0.2's own \(<class "
                       r"'object'>\): this SpecForge is not the release h5feed's integration was written for "
                       r"\(pip install specforge==0.2.0\)$"):
        installed()


def test_a_missing_package_is_named_with_what_to_install(monkeypatch) -> None:
    from importlib import util

    import h5feed.integrations.specforge_train as train

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name: None if name == "accelerate" else find_spec(name))
    assert unmet_requirement() == "accelerate is not installed"
    with pytest.raises(SystemExit) as stopped:
        train.main(["train", "--config", "run.yaml"])
    assert str(stopped.value) == f"python -m h5feed.specforge_train: accelerate is not installed; it needs {NEEDS}"
    assert "pip install --no-deps specforge==0.2.0" in NEEDS


def test_h5feeds_flags_are_taken_out_before_specforge_reads_the_rest() -> None:
    from h5feed.integrations.specforge_train import h5feed_options

    access, rest = h5feed_options(["train", "--h5feed-on-corrupt", "skip", "-c", "r.yaml", "--h5feed-cache-dir",
                                   "/tmp/c", "a.b=1"])
    assert access == StoreAccess(on_corrupt="skip", cache_dir="/tmp/c")
    assert rest == ["train", "-c", "r.yaml", "a.b=1"]
    with pytest.raises(ValueError, match="on_corrupt must be 'raise' or 'skip', not 'drop'"):
        StoreAccess(on_corrupt="drop")  # type: ignore[arg-type]
