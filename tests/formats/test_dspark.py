"""SpecForge's DSpark files: EAGLE-3's `data_{i}.ckpt` with other keys, converted into the same store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import h5feed
from h5feed import HiddenStatesDataset
from h5feed.errors import SourceError
from h5feed.formats import FORMATS, detect_format

H, K = 16, 5


def dspark_dict(t: int, seed: int, batched_ids: bool = False) -> dict:
    """What DSpark's offline generator `torch.save`s: K target layers concatenated and the post-norm last state."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (t,), generator=g)
    return {
        "input_ids": ids[None] if batched_ids else ids,
        "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.int64),
        "hidden_states": torch.randn(1, t, K * H, generator=g).to(torch.bfloat16),
        "target_last_hidden_states": torch.randn(1, t, H, generator=g).to(torch.bfloat16),
    }


def write_dspark(root: Path, lengths=(7, 10, 12)) -> list[dict]:
    samples = [dspark_dict(t, seed=i, batched_ids=i == 1) for i, t in enumerate(lengths)]
    for i, d in enumerate(samples):
        path = root / "rows_0-2000" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(d, path)
    return samples


def test_dspark_files_convert_bit_exact(tmp_path: Path) -> None:
    samples = write_dspark(tmp_path / "src")
    assert detect_format(tmp_path / "src") is FORMATS["specforge-ckpt"]
    h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    store = h5feed.Store(tmp_path / "dst")
    assert (store.info.source_format, store.info.last_state_norm) == ("specforge-ckpt", "post")
    assert (store.info.hidden_size, store.info.num_aux_layers, store.info.dtype) == (H, K, "bfloat16")
    for i, d in enumerate(samples):
        raw = store.read_sample(i)
        assert torch.equal(raw.input_ids, d["input_ids"].reshape(-1))
        assert torch.equal(raw.loss_mask, d["loss_mask"])
        assert torch.equal(raw.aux_hidden_states, d["hidden_states"][0])
        assert torch.equal(raw.last_hidden_state, d["target_last_hidden_states"][0])
    dataset = HiddenStatesDataset(tmp_path / "dst", flavor="specforge")  # SpecForge's item: aux, then target
    for i, d in enumerate(samples):
        item = dataset[i]
        assert torch.equal(item["hidden_state"], d["hidden_states"])
        assert torch.equal(item["target"], d["target_last_hidden_states"])
        assert torch.equal(item["input_ids"], d["input_ids"].reshape(1, -1))


def test_a_folder_of_eagle3_and_dspark_files_converts(tmp_path: Path) -> None:
    """Both key sets hold the same arrays (aux concat, post-norm last state), so one store holds both."""
    samples = write_dspark(tmp_path / "src", lengths=(7, 9))
    eagle3 = {"input_ids": torch.arange(8), "loss_mask": torch.ones(8, dtype=torch.int64),
              "aux_hidden_state": torch.randn(1, 8, K * H).to(torch.bfloat16),
              "hidden_state": torch.randn(1, 8, H).to(torch.bfloat16)}
    torch.save(eagle3, tmp_path / "src" / "rows_0-2000" / "data_2.ckpt")
    h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    store = h5feed.Store(tmp_path / "dst")
    assert torch.equal(store.read_sample(1).aux_hidden_states, samples[1]["hidden_states"][0])
    assert torch.equal(store.read_sample(2).aux_hidden_states, eagle3["aux_hidden_state"][0])
    assert torch.equal(store.read_sample(2).last_hidden_state, eagle3["hidden_state"][0])


def test_a_file_of_neither_key_set_is_refused_naming_both(tmp_path: Path) -> None:
    write_dspark(tmp_path / "src", lengths=(7,))
    bad = tmp_path / "src" / "rows_0-2000" / "data_1.ckpt"
    torch.save({"input_ids": torch.arange(7), "hidden_states": torch.zeros(1, 7, K * H)}, bad)
    f = FORMATS["specforge-ckpt"]
    with pytest.raises(SourceError) as info:
        f.probe(f.discover(tmp_path / "src")[1])
    assert Path(info.value.path) == bad
    assert info.value.problem == (
        "keys ('input_ids', 'hidden_states') are neither SpecForge EAGLE-3's ('aux_hidden_state' + 'hidden_state') "
        "nor SpecForge DSpark's ('hidden_states' + 'target_last_hidden_states'): if another pipeline wrote it, "
        "name that pipeline's format with --format (SpecForge DFlash's and Domino's files, 'hidden_states' alone, "
        "are specforge-dflash-ckpt and convert into a store of their own)")
    with pytest.raises(SourceError, match="data_1.ckpt"):
        h5feed.convert(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)


def test_a_dspark_last_state_whose_width_does_not_divide_the_aux_is_refused(tmp_path: Path) -> None:
    d = dspark_dict(7, seed=0)
    d["target_last_hidden_states"] = d["target_last_hidden_states"][..., :12]
    torch.save(d, tmp_path / "data_0.ckpt")
    f = FORMATS["specforge-ckpt"]
    with pytest.raises(SourceError, match="'hidden_states' width 80 is not a positive multiple of the hidden size "
                       "12 of 'target_last_hidden_states'"):
        f.load(f.discover(tmp_path)[0])
