"""SpecForge 0.2's offline items and batches, for each algorithm, equal those h5feed's flavors make from a store.

The reference is the installed SpecForge: each algorithm's registered offline provider (its normalizer, run on
what `load_feature_file` returns for each file, and its collator), never a restatement of it.  EAGLE-3 is the
``specforge`` flavor; DFlash and Domino share ``specforge-dflash``; DSpark is ``specforge-dspark``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CAPTURE_H, CAPTURE_K, specforge_provider, write_capture
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import save_file
from specforge.runtime.data_plane.feature_store import load_feature_file

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, StoreError, trainer_collate

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

H, K = CAPTURE_H, CAPTURE_K  # SpecForge's captures as conftest writes them
FLAVOR = {"eagle3": "specforge", "dflash": "specforge-dflash", "domino": "specforge-dflash",
          "dspark": "specforge-dspark"}
BATCH = 3


def specforge_items(store: h5feed.Store, src: Path, algorithm: str, max_len: int) -> list[dict]:
    """What SpecForge's loader hands its collate for each stored sample: its normalizer on the file's tensors."""
    normalize = specforge_provider(algorithm).build_normalizer(max_len)
    return [normalize({k: v.clone() for k, v in load_feature_file(str(src / p)).items()}) for p in store.source_paths]


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Any:
    """`captured(algorithm)` -> (source folder, store) of SpecForge-written files of that algorithm (made once)."""
    made: dict[str, tuple[Path, h5feed.Store]] = {}

    def make(algorithm: str) -> tuple[Path, h5feed.Store]:
        if algorithm not in made:
            root = tmp_path_factory.mktemp(algorithm)
            write_capture(root / "src", algorithm)
            h5feed.convert(root / "src", root / "store", workers=0, progress=False,
                           settings=h5feed.StoreSettings(chunk_tokens=8))
            made[algorithm] = root / "src", h5feed.Store(root / "store")
        return made[algorithm]

    return make


@pytest.mark.parametrize("max_len", [8, 64])  # cutting most samples; cutting none
@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "domino", "dspark"])
def test_items_and_batches_equal_specforges(captured, assert_same_batch, algorithm: str, max_len: int) -> None:
    src, store = captured(algorithm)
    want = specforge_items(store, src, algorithm, max_len)
    dataset = HiddenStatesDataset(store, FLAVOR[algorithm], max_len)
    for i, expected in enumerate(want):
        assert_same_batch(dataset[i], expected)
    collate = specforge_provider(algorithm).build_collator()
    ours = trainer_collate(FLAVOR[algorithm], max_len)
    groups = [range(j, min(j + BATCH, len(want))) for j in range(0, len(want), BATCH)]
    for group in groups:
        assert_same_batch(ours([dataset[i] for i in group]), collate([want[i] for i in group]))
    loader = BatchLoader(store, flavor=FLAVOR[algorithm], max_len=max_len, batch_size=BATCH, drop_last=False,
                         schedule=h5feed.ScheduleOptions(shuffle=False), decode=h5feed.ThreadsOptions(threads=2))
    batches = [{k: v.clone() for k, v in batch.items()} for batch in loader]
    assert len(batches) == len(groups)
    for got, group in zip(batches, groups):
        assert_same_batch(got, collate([want[i] for i in group]))


def test_a_sample_specforge_refuses_is_refused(tmp_path: Path) -> None:
    """No two supervised tokens in a row: SpecForge's DFlash-family normalizer raises in the middle of training, and
    so do the item, the collate over items and the batch decoded from the store."""
    write_capture(tmp_path / "src", "dflash", lengths=(6, 9, 7))
    path = tmp_path / "src" / "rows_0-2000" / "data_1.ckpt"
    for name, mask in (("data_0.ckpt", [1, 0, 1, 1, 0, 0]), ("data_1.ckpt", [1, 0, 1, 0, 1, 0, 0, 1, 0])):
        d = torch.load(path.with_name(name), weights_only=True)
        d["loss_mask"] = torch.tensor(mask)
        torch.save(d, path.with_name(name))
    normalize = specforge_provider("dflash").build_normalizer(64)
    with pytest.raises(ValueError, match="offline DFlash-family samples require two consecutive supervised tokens"):
        normalize(load_feature_file(str(path)))
    h5feed.convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False)
    dataset = HiddenStatesDataset(tmp_path / "store", "specforge-dflash", 64)
    dataset[0]
    with pytest.raises(ValueError) as info:
        dataset[1]
    assert str(info.value) == (
        "a sample of 9 tokens: SpecForge's DFlash-family training refuses it: offline DFlash-family samples require "
        "two consecutive supervised tokens (its loss mask has no two 1s in a row within the tokens read)")
    loader = BatchLoader(tmp_path / "store", flavor="specforge-dflash", max_len=64, batch_size=1,
                         schedule=h5feed.ScheduleOptions(shuffle=False), decode=h5feed.ThreadsOptions(threads=1))
    with pytest.raises(ValueError, match=r"^the sample in batch row 0: SpecForge's DFlash-family training refuses it"):
        list(loader)
    # cut to 2 tokens the sample has no pair left: SpecForge refuses it there, as the flavor does
    with pytest.raises(ValueError, match="require two consecutive supervised tokens"):
        specforge_provider("dflash").build_normalizer(2)(load_feature_file(str(path.with_name("data_0.ckpt"))))
    with pytest.raises(ValueError, match="require two consecutive supervised tokens"):
        HiddenStatesDataset(tmp_path / "store", "specforge-dflash", 2)[0]


def test_a_dflash_store_serves_only_the_dflash_flavor(captured) -> None:
    _, store = captured("dflash")
    for flavor in ("specforge", "specforge-dspark", "angelslim"):
        with pytest.raises(StoreError) as info:
            HiddenStatesDataset(store, flavor, None if flavor == "angelslim" else 16)
        assert info.value.problem == (
            f"flavor {flavor!r} needs the verifier's last hidden state, which this store (converted from "
            "specforge-dflash-ckpt) does not hold: its samples have the captured layers only, as SpecForge's DFlash "
            "and Domino files do: serve it with flavor 'specforge-dflash'")


def test_a_loader_given_no_flavor_on_a_dflash_store_names_the_flavors_that_serve_it(captured) -> None:
    _, store = captured("dflash")
    with pytest.raises(ValueError, match=r"\): pass flavor=, the trainer whose batches to make: specforge-dflash$"):
        h5feed.BatchLoader(store.path, max_len=16)


def test_an_eagle3_or_dspark_store_serves_the_dflash_flavor_its_captured_layers(captured, assert_same_batch) -> None:
    """An EAGLE-3 store's aux layers are the `hidden_states` a DFlash draft reads (its last state left unread)."""
    for algorithm, aux_key in (("eagle3", "aux_hidden_state"), ("dspark", "hidden_states")):
        src, store = captured(algorithm)
        dataset = HiddenStatesDataset(store, "specforge-dflash", 10)
        for i, relpath in enumerate(store.source_paths):
            d = load_feature_file(str(src / relpath))
            want = specforge_provider("dflash").build_normalizer(10)(
                {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"], "hidden_states": d[aux_key]})
            assert_same_batch(dataset[i], want)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_an_fp8_stores_items_are_fp8transfers_dequantization(tmp_path: Path, assert_same_batch, algorithm: str) -> None:
    """An FP8 store (`--precision fp8`): the items' hidden states are what hs-connectors' FP8Transfer returns for
    the same states quantized by its fp8 backend; ids and masks as SpecForge reads them."""
    write_capture(tmp_path / "src", algorithm)
    h5feed.convert(tmp_path / "src", tmp_path / "fp8", workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=8, precision="fp8"))
    exact_dir = tmp_path / "exact"
    h5feed.convert(tmp_path / "src", exact_dir, workers=0, progress=False,
                   settings=h5feed.StoreSettings(chunk_tokens=8))
    exact = h5feed.Store(exact_dir)
    (tmp_path / "files").mkdir()
    for i in range(len(exact)):
        raw = exact.read_sample(i)
        layers = raw.aux_hidden_states.view(raw.num_tokens, K, H)
        if raw.last_hidden_state is not None:
            layers = torch.cat([layers, raw.last_hidden_state[:, None]], dim=1)
        fp8, scales = quantize_tensor_to_fp8(layers)
        save_file({"hidden_states": fp8, SCALES_KEY: scales, "token_ids": raw.input_ids},
                  str(tmp_path / "files" / f"hs_{i}.safetensors"))
    transfer = FP8Transfer(tmp_path / "files")
    dataset = HiddenStatesDataset(tmp_path / "fp8", FLAVOR[algorithm], 12)
    normalize = specforge_provider(algorithm).build_normalizer(12)
    for i, relpath in enumerate(exact.source_paths):
        restored = transfer.get_cached(i)["hidden_states"]
        d = load_feature_file(str(tmp_path / "src" / relpath))
        d["hidden_states"] = restored[:, :K].reshape(1, -1, K * H)
        if algorithm == "dspark":
            d["target_last_hidden_states"] = restored[None, :, K]
        assert_same_batch(dataset[i], normalize(d))
