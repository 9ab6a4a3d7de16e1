"""SpecForge 0.2's offline files for each of its algorithms, as its own runtime reads them, converted bit for bit.

EAGLE-3 (`aux_hidden_state` + `hidden_state`) and DSpark (`hidden_states` + `target_last_hidden_states`) files
have a last state; DFlash's and Domino's (`hidden_states` alone) do not, and take H from the source's
config.json.  Every file is checked against what SpecForge's `load_feature_file` returns for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CAPTURE_H, CAPTURE_K, CAPTURE_LENGTHS, EAGLE3_LAYERS, dflash_dict, dspark_dict, write_capture
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files

import h5feed
from h5feed.errors import SourceError
from h5feed.formats import FORMATS, detect_format

H, K, LENGTHS = CAPTURE_H, CAPTURE_K, CAPTURE_LENGTHS  # SpecForge's captures as conftest writes them


def convert(src: Path, dst: Path) -> h5feed.Store:
    h5feed.convert(src, dst, workers=0, progress=False, settings=h5feed.StoreSettings(chunk_tokens=8))
    return h5feed.Store(dst)


def assert_store_holds_what_specforge_reads(store: h5feed.Store, src: Path, aux_key: str, last_key: str | None) -> None:
    """Every sample is its file as SpecForge's `load_feature_file` returns it, bit for bit."""
    assert sorted(str(src / p) for p in store.source_paths) == list_feature_files(str(src))
    for i, relpath in enumerate(store.source_paths):
        raw, d = store.read_sample(i), load_feature_file(str(src / relpath))
        assert torch.equal(raw.input_ids, d["input_ids"]) and torch.equal(raw.loss_mask, d["loss_mask"])
        assert raw.aux_hidden_states.dtype == d[aux_key].dtype == torch.bfloat16
        assert torch.equal(raw.aux_hidden_states.view(torch.int16), d[aux_key][0].view(torch.int16))
        if last_key is None:
            assert raw.last_hidden_state is None
        else:
            assert torch.equal(raw.last_hidden_state.view(torch.int16), d[last_key][0].view(torch.int16))


@pytest.mark.parametrize("compress", [False, True], ids=["ckpt", "ckpt.gz"])
@pytest.mark.parametrize("algorithm", ["dflash", "domino"])
def test_dflash_family_files_convert_bit_exact_with_h_from_the_verifiers_config(tmp_path: Path, algorithm: str,
                                                                               compress: bool) -> None:
    write_capture(tmp_path / "src", algorithm, compress=compress)
    assert detect_format(tmp_path / "src") is FORMATS["specforge-dflash-ckpt"]
    store = convert(tmp_path / "src", tmp_path / "dst")
    info = store.info
    assert (info.source_format, info.hidden_size, info.num_aux_layers, info.dtype) == (
        "specforge-dflash-ckpt", H, K, "bfloat16")
    assert (info.has_last_state, info.last_state_norm, len(store)) == (False, None, len(LENGTHS))
    assert (tmp_path / "dst" / info.companions["config.json"].copy).read_bytes() == (
        tmp_path / "src" / "config.json").read_bytes()
    assert_store_holds_what_specforge_reads(store, tmp_path / "src", "hidden_states", None)


def test_the_draft_config_gives_k_and_any_number_of_layers_converts(tmp_path: Path) -> None:
    """The DFlash draft's config.json: its target_layer_ids give K (here 2, and 7 in another source)."""
    for k in (2, 7):
        src = tmp_path / f"src{k}"
        for i, t in enumerate((5, 9)):
            d = dflash_dict(t, seed=i)
            d["hidden_states"] = torch.randn(1, t, k * H).to(torch.bfloat16)
            (src / "rows_0-2000").mkdir(parents=True, exist_ok=True)
            torch.save(d, src / "rows_0-2000" / f"data_{i}.ckpt")
        (src / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"],
                                                     "dflash_config": {"target_layer_ids": list(range(1, k + 1))}}))
        store = convert(src, tmp_path / f"dst{k}")
        assert (store.info.hidden_size, store.info.num_aux_layers) == (H, k)
        assert_store_holds_what_specforge_reads(store, src, "hidden_states", None)


def test_a_vlm_verifiers_text_config_gives_h(tmp_path: Path) -> None:
    write_capture(tmp_path / "src", "dflash", lengths=(6, 7), config={"text_config": {"hidden_size": H}})
    assert convert(tmp_path / "src", tmp_path / "dst").info.num_aux_layers == K


def test_without_a_config_the_error_says_what_to_put_where(tmp_path: Path) -> None:
    write_capture(tmp_path / "src", "dflash", lengths=(6, 7))
    (tmp_path / "src" / "config.json").unlink()
    with pytest.raises(SourceError) as info:
        h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert Path(info.value.path) == tmp_path / "src" / "config.json"
    assert info.value.problem == (
        "missing: SpecForge DFlash-family files hold the captured target layers concatenated ('hidden_states' "
        "[1, T, K*H]) and no last state, so nothing in them tells the hidden size H: copy (or link) the verifier's "
        "config.json (its hidden_size), or the DFlash draft's config.json (its dflash_config.target_layer_ids give "
        f"K), into {tmp_path / 'src'}")


@pytest.mark.parametrize(("config", "problem"), [
    ({"model_type": "qwen3"}, "says neither hidden_size (the verifier's config.json has it) nor "
     "dflash_config.target_layer_ids (the DFlash draft's has them): one of them tells the hidden size of the files' "
     "'hidden_states' [1, T, K*H]"),
    ({"hidden_size": "16"}, "hidden_size '16' is not a positive integer"),
    ({"dflash_config": {"target_layer_ids": []}}, "dflash_config.target_layer_ids [] is not a list of layer numbers"),
    ([16], "is not a JSON object: expected the verifier's or the DFlash draft's config.json"),
])
def test_a_config_that_does_not_tell_h_is_refused(tmp_path: Path, config, problem: str) -> None:
    write_capture(tmp_path / "src", "dflash", lengths=(6,), config=config)
    with pytest.raises(SourceError) as info:
        h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert (Path(info.value.path), info.value.problem) == (tmp_path / "src" / "config.json", problem)


def test_a_width_the_config_contradicts_is_refused_naming_the_file(tmp_path: Path) -> None:
    write_capture(tmp_path / "src", "dflash", lengths=(6, 7), config={"hidden_size": H,
                                                                     "dflash_config": {"target_layer_ids": [1, 2, 3]}})
    f = FORMATS["specforge-dflash-ckpt"]
    with pytest.raises(SourceError) as info:
        f.probe(f.discover(tmp_path / "src")[0])
    assert info.value.path.endswith("rows_0-2000/data_0.ckpt")
    assert info.value.problem == (
        f"'hidden_states' is {K * H} wide, but {tmp_path / 'src' / 'config.json'} says hidden_size {H} and 3 "
        "target_layer_ids: the file holds K captured layers of H values each, K*H wide; convert it with the config "
        "of the verifier and draft that captured it")


def test_a_file_with_a_last_state_among_dflash_files_is_refused_saying_whose_it_is(tmp_path: Path) -> None:
    write_capture(tmp_path / "src", "dflash", lengths=(6, 7))
    torch.save(dspark_dict(8, seed=3), tmp_path / "src" / "rows_0-2000" / "data_2.ckpt")
    with pytest.raises(SourceError) as info:
        h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert info.value.path.endswith("data_2.ckpt")
    assert info.value.problem == (
        "is a SpecForge DSpark file (it holds a last hidden state), not a DFlash-family one: files with and without "
        "a last state convert into separate stores (convert this one's folder with --format specforge-ckpt)")


def test_a_dflash_file_among_eagle3_files_points_to_its_format(tmp_path: Path) -> None:
    write_capture(tmp_path / "src", "eagle3", lengths=(6, 7))
    torch.save(dflash_dict(8, seed=3), tmp_path / "src" / "rows_0-2000" / "data_2.ckpt")
    with pytest.raises(SourceError, match=r"data_2\.ckpt: keys \('input_ids', 'loss_mask', 'hidden_states'\) are "
                       r"neither .* \(SpecForge DFlash's and Domino's files, 'hidden_states' alone, are "
                       r"specforge-dflash-ckpt and convert into a store of their own\)"):
        h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)


def test_an_unknown_key_or_shape_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_capture(src, "dflash", lengths=(6,))
    f = FORMATS["specforge-dflash-ckpt"]
    path = src / "rows_0-2000" / "data_0.ckpt"
    cases = [
        ({**dflash_dict(6, 0), "position_ids": torch.arange(6)},
         "has key(s) 'position_ids' that SpecForge's DFlash-family files do not have ('input_ids', 'loss_mask', "
         "'hidden_states'); h5feed keeps every key the trainer reads and will not drop others in silence"),
        ({**dflash_dict(6, 0), "hidden_states": torch.zeros(2, 6, K * H)},
         "'hidden_states' must be [1, T, K*H] (or [T, K*H]), got shape [2, 6, 80]"),
        ({**dflash_dict(6, 0), "hidden_states": torch.zeros(1, 5, K * H)},
         "'hidden_states' has 5 tokens but 'input_ids' has 6"),
        ({"input_ids": torch.arange(6), "hidden_states": torch.zeros(1, 6, K * H)},
         "missing key(s) 'loss_mask' for format specforge-dflash-ckpt (found keys: 'input_ids', 'hidden_states')"),
    ]
    for d, problem in cases:
        torch.save(d, path)
        with pytest.raises(SourceError) as info:
            f.load(f.discover(src)[0])
        assert (Path(info.value.path), info.value.problem) == (path, problem)


def test_unbatched_dflash_states_convert_too(tmp_path: Path) -> None:
    """SpecForge's DFlash-family reader takes [T, K*H] as well as [1, T, K*H]."""
    src = tmp_path / "src"
    write_capture(src, "dflash", lengths=(6,))
    d = dflash_dict(6, 0)
    d["hidden_states"] = d["hidden_states"][0].clone()
    torch.save(d, src / "rows_0-2000" / "data_0.ckpt")
    assert torch.equal(convert(src, tmp_path / "dst").read_sample(0).aux_hidden_states, d["hidden_states"])


@pytest.mark.parametrize(("algorithm", "aux_key", "last_key"), [("eagle3", "aux_hidden_state", "hidden_state"),
                                                                 ("dspark", "hidden_states", "target_last_hidden_states")])
def test_eagle3_and_dspark_files_convert_as_specforge_reads_them(tmp_path: Path, algorithm: str, aux_key: str,
                                                                 last_key: str) -> None:
    write_capture(tmp_path / "src", algorithm, compress=True)
    store = convert(tmp_path / "src", tmp_path / "dst")
    assert (store.info.source_format, store.info.last_state_norm, store.info.num_aux_layers) == (
        "specforge-ckpt", "post", EAGLE3_LAYERS if algorithm == "eagle3" else K)
    assert_store_holds_what_specforge_reads(store, tmp_path / "src", aux_key, last_key)
