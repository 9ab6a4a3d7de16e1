"""HiddenStatesDataset yields, tensor for tensor, what each trainer's own Dataset yields from the source files.

The expected items are built here from the source files by re-implementations of
the trainers' code as notes/trainer_semantics.md quotes it (speculators 0.4
`Eagle3SampleFileDataset`, 0.5/0.9 `BaseDataset`, SpecForge `process_data`), never
through h5feed.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import speculators_04_collate, speculators_shift_batch

from h5feed import Store, StoreError
from h5feed.loading.datasets import HiddenStatesDataset, HiddenStatesStream, split_samples
from h5feed.testing.baseline import list_files
from h5feed.testing.synthetic import FileOptions

H = 32
K = 3
# 1-token samples, chunk-sized ones (16) and samples spanning many chunks
LEGACY_LENGTHS = [1, 5, 16, 17, 33, 64, 100, 250, 3, 1, 48, 300, 31]
SAFETENSORS_LENGTHS = [7, 1, 40, 120, 16, 2, 77]
SPECFORGE_LENGTHS = [30, 1, 65, 2, 130, 17]


@pytest.fixture(scope="module")
def legacy(synthetic_store):
    return synthetic_store("ds_legacy", "speculators-legacy-pt", len(LEGACY_LENGTHS), H, LEGACY_LENGTHS,
                           chunk_tokens=16, files=FileOptions(layout="rows", rows_per_folder=5))


@pytest.fixture(scope="module")
def safetensors_src(synthetic_store):
    return synthetic_store("ds_safetensors", "speculators-safetensors", len(SAFETENSORS_LENGTHS), H,
                           SAFETENSORS_LENGTHS, chunk_tokens=32, seed=1)


@pytest.fixture(scope="module", params=["ckpt", "ckpt.gz"])
def specforge(request, synthetic_store):
    gz = request.param == "ckpt.gz"
    return synthetic_store(f"ds_specforge_{'gz' if gz else 'plain'}", "specforge-ckpt", len(SPECFORGE_LENGTHS), H,
                           SPECFORGE_LENGTHS, chunk_tokens=64, seed=2,
                           files=FileOptions(layout="rows", rows_per_folder=4, compress=gz))


# --------------------------------------------------------------------------- exact comparison

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.dtype.is_floating_point:  # compare bits: exact, NaN-safe, -0 != +0
        got, want = got.view(_BITS[got.element_size()]), want.view(_BITS[want.element_size()])
    assert torch.equal(got, want), what


def assert_same_item(got: dict, want: dict) -> None:
    assert list(got) == list(want), "key set or key order differs"
    for key, value in want.items():
        assert_same_tensor(got[key], value, key)


# --------------------------------------------------------------------------- speculators 0.4 (train/data.py)


def standardize_data_v1(data):
    return {
        "hidden_states": torch.cat(data["hidden_states"][:-1], dim=-1),
        "input_ids": data["input_ids"],
        "verifier_last_hidden_states": data["hidden_states"][-1],
        "loss_mask": data["loss_mask"],
    }


def base_dataset_getitem(data, hidden_states_dtype, transform):
    """speculators 0.5 `BaseDataset.__getitem__` after `_get_raw_data` (0.9 = no cast, no transform)."""
    data = {k: v.to(hidden_states_dtype) if "hidden_states" in k else v for k, v in data.items()}
    seq_len = data["input_ids"].shape[0]
    data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
    data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
    if transform:
        data = transform(data)
    return data


def eagle3_sample_file_getitem(path, hidden_states_dtype=torch.float, transform=None, max_tokens=None):
    """speculators 0.4 `Eagle3SampleFileDataset.__getitem__`; `max_tokens` cuts the file's sample first."""
    data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if max_tokens is not None:
        data = {"input_ids": data["input_ids"][:max_tokens], "loss_mask": data["loss_mask"][:max_tokens],
                "hidden_states": [h[:max_tokens] for h in data["hidden_states"]]}
    data = standardize_data_v1(data)
    return speculators_shift_batch(base_dataset_getitem(data, hidden_states_dtype, transform))


def collate_fn_09(batch, max_len, dtype=torch.bfloat16):
    """speculators 0.9 `CollateFn(max_len, hidden_size, dtype=bf16, preprocess=shift_batch)`."""
    batch = [speculators_shift_batch(b, clamp=True) for b in batch]
    out = {}
    for key in batch[0]:
        if key == "lengths":
            continue
        first = batch[0][key]
        buf = torch.zeros((max_len, *first.shape[1:]), dtype=dtype if "hidden_states" in key else first.dtype)
        offset = 0
        for b in batch:
            rows = min(b[key].shape[0], max_len - offset)
            if rows <= 0:
                break
            buf[offset : offset + rows] = b[key][:rows]
            offset += rows
        out[key] = buf.unsqueeze(0)
    new_lengths, cum = [], 0
    for length in torch.cat([b["lengths"] for b in batch]):
        if length + cum >= max_len:
            new_lengths.append(max_len - cum)
            break
        new_lengths.append(int(length))
        cum += int(length)
    lengths = torch.tensor(new_lengths, dtype=torch.long)
    out["lengths"] = lengths
    docs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    out["document_ids"] = F.pad(docs, [0, max_len - len(docs)], value=-1).unsqueeze(0)
    out["error_records"] = 0
    return out


def split_files(datapath, ratio=0.9, seed=0):
    random.seed(seed)
    file_list = list_files(datapath)
    random.shuffle(file_list)
    n_train = int(len(file_list) * ratio)
    return file_list[:n_train], file_list[n_train:]


# --------------------------------------------------------------------------- speculators 0.5/0.9 ArrowDataset


def arrow_rows(root: Path) -> dict:
    import pyarrow as pa

    state = json.loads((root / "state.json").read_text())
    tables = [pa.ipc.open_stream(pa.OSFile(str(root / f["filename"]))).read_all() for f in state["_data_files"]]
    return pa.concat_tables(tables).to_pydict()


def arrow_dataset_raw(root: Path, index: int, max_tokens=None) -> dict:
    """speculators 0.9 `ArrowDataset._get_raw_data` (row index <-> hs_{index}.safetensors)."""
    from safetensors.torch import load_file

    row = {k: torch.tensor(v[index]) for k, v in arrow_rows(root).items() if k != "seq_len"}  # format "torch"
    loaded = load_file(str(root / "hidden_states" / f"hs_{index}.safetensors"))
    assert torch.equal(loaded["token_ids"], row["input_ids"])
    data = {
        "hidden_states": loaded["hidden_states"][:, :-1].flatten(1),
        "input_ids": loaded["token_ids"],
        "verifier_last_hidden_states": loaded["hidden_states"][:, -1],
        "loss_mask": row["loss_mask"],
    }
    return data if max_tokens is None else {k: v[:max_tokens] for k, v in data.items()}


def sample_file_raw(path: Path, max_tokens=None) -> dict:
    """speculators 0.5 `SampleFileDataset._get_raw_data`: the 0.4 reader without the shift."""
    data = standardize_data_v1(torch.load(path, mmap=True, weights_only=True, map_location="cpu"))
    return data if max_tokens is None else {k: v[:max_tokens] for k, v in data.items()}


# --------------------------------------------------------------------------- SpecForge 0.2 (data/preprocessing.py)


def specforge_open_file(path: Path) -> dict:
    if str(path).endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=False)
    return torch.load(path, weights_only=False, mmap=True)


def process_data(data, max_len):
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]
    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :]
    loss_mask[0, -1] = 0
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": target,
        "hidden_state": hidden_state,
        "input_ids": input_ids,
    }


def padding(tensor, left=False):
    """SpecForge's `padding(t, left=False)` (the only way process_data called it)."""
    assert not left
    return torch.cat((tensor[:, 1:], torch.zeros_like(tensor[:, -1:])), dim=1)


def process_data_pre448(data, max_len):
    """SpecForge before PR #448 (2026-01-22): `target` and `input_ids` shifted left after the cut."""
    item = process_data(data, max_len)
    item["target"] = padding(item["target"], left=False)
    item["input_ids"] = padding(item["input_ids"], left=False)
    return item


# --------------------------------------------------------------------------- transforms


def add_one(data):
    """Deterministic stand-in for speculators' noise: replaces `hidden_states` (TransformTensors style)."""
    data["hidden_states"] = data["hidden_states"] + 1
    return data


def add_position(data):
    """Row-dependent, so applying it after the shift (positions 1..T-1 on rows 0..T-2) would show."""
    hs = data["hidden_states"]
    data["hidden_states"] = hs + data["position_ids"][:, None].to(hs.dtype)
    return data


TRANSFORMS = {"none": None, "add_one": add_one, "add_position": add_position}
DTYPES = {"default": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


# =========================================================================== items


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_speculators_legacy_items_equal_speculators_04(legacy, dtype, transform):
    ds = HiddenStatesDataset(legacy.path, "speculators-legacy", transform=TRANSFORMS[transform],
                             hidden_states_dtype=DTYPES[dtype])
    assert len(ds) == len(legacy.files)
    want_dtype = DTYPES[dtype] or torch.float  # speculators 0.4's default
    for i, path in enumerate(legacy.files):
        want = eagle3_sample_file_getitem(path, want_dtype, TRANSFORMS[transform])
        assert_same_item(ds[i], want)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_speculators_items_from_safetensors_and_arrow(safetensors_src, dtype, transform):
    ds = HiddenStatesDataset(safetensors_src.path, "speculators", transform=TRANSFORMS[transform],
                             hidden_states_dtype=DTYPES[dtype])
    want_dtype = DTYPES[dtype] or torch.bfloat16  # 0.9's default (stored bf16: no cast)
    for i in range(len(safetensors_src.files)):
        want = base_dataset_getitem(arrow_dataset_raw(safetensors_src.src, i), want_dtype, TRANSFORMS[transform])
        assert_same_item(ds[i], want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculators_items_from_pt(legacy, dtype):
    ds = HiddenStatesDataset(legacy.path, "speculators", transform=add_position, hidden_states_dtype=DTYPES[dtype])
    for i, path in enumerate(legacy.files):
        assert_same_item(ds[i], base_dataset_getitem(sample_file_raw(path), DTYPES[dtype], add_position))


@pytest.mark.parametrize("max_len", [None, 1, 16, 64])
@pytest.mark.parametrize("flavor", ["specforge", "specforge-shifted"])
def test_specforge_items_equal_process_data(specforge, flavor, max_len):
    process = process_data if flavor == "specforge" else process_data_pre448
    ds = HiddenStatesDataset(specforge.path, flavor, max_len=max_len)
    for i, path in enumerate(specforge.files):
        want = process(specforge_open_file(path), max_len if max_len is not None else 10**9)
        assert_same_item(ds[i], want)


def test_one_token_samples(legacy, specforge):
    one = LEGACY_LENGTHS.index(1)
    item = HiddenStatesDataset(legacy.path, "speculators-legacy")[one]
    assert item["lengths"].tolist() == [0]
    assert item["hidden_states"].shape == (0, K * H) and item["verifier_last_hidden_states"].shape == (0, H)
    assert item["input_ids"].shape == item["loss_mask"].shape == item["position_ids"].shape == (0,)
    item = HiddenStatesDataset(legacy.path, "speculators")[one]
    assert item["lengths"].tolist() == [1] and item["position_ids"].tolist() == [0]
    assert item["hidden_states"].shape == (1, K * H)
    one = SPECFORGE_LENGTHS.index(1)
    item = HiddenStatesDataset(specforge.path, "specforge")[one]
    assert item["loss_mask"].tolist() == [[0]] and item["attention_mask"].tolist() == [[1]]
    item = HiddenStatesDataset(specforge.path, "specforge-shifted")[one]
    assert item["input_ids"].tolist() == [[0]] and not item["target"].any()
    # a batch of only 1-token samples still collates the way speculators 0.4 does
    ds = HiddenStatesDataset(legacy.path, "speculators-legacy", max_len=8)
    ones = [ds[i] for i, t in enumerate(LEGACY_LENGTHS) if t == 1]
    batch = speculators_04_collate(8)(ones)
    assert batch["lengths"].tolist() == [0, 0] and batch["hidden_states"].shape == (1, 8, K * H)


# =========================================================================== max_len


def _groups(n: int) -> list[list[int]]:
    """Batches that put each item at offset 0, behind others, and the longest ones first and last."""
    by_length = sorted(range(n), key=lambda i: LEGACY_LENGTHS[i])
    return [[i] for i in range(n)] + [list(range(n)), by_length, by_length[::-1], [by_length[-1], by_length[0]],
                                      [by_length[0], by_length[-2], by_length[-1]]]


@pytest.mark.parametrize("transform", ["none", "add_position"])
@pytest.mark.parametrize("max_len", [1, 16, 40, 299, 500])
def test_speculators_legacy_max_len_gives_the_same_batches(legacy, max_len, transform):
    kw = {"transform": TRANSFORMS[transform], "hidden_states_dtype": torch.bfloat16}
    full = HiddenStatesDataset(legacy.path, "speculators-legacy", **kw)
    cut = HiddenStatesDataset(legacy.path, "speculators-legacy", max_len=max_len, **kw)
    n = len(full)
    full_items, cut_items = [full[i] for i in range(n)], [cut[i] for i in range(n)]
    for i, (t, item) in enumerate(zip(LEGACY_LENGTHS, cut_items)):
        assert item["lengths"].tolist() == [min(t - 1, max_len)]
        assert item["input_ids"].shape[0] == min(t, max_len + 1) - 1
        # the item is the trainer's item of the sample cut to max_len + 1 tokens
        assert_same_item(item, eagle3_sample_file_getitem(legacy.files[i], torch.bfloat16, TRANSFORMS[transform],
                                                          max_tokens=max_len + 1))
    collate = speculators_04_collate(max_len)
    for group in _groups(n):
        got = collate([cut_items[i] for i in group])
        want = collate([full_items[i] for i in group])
        assert list(got) == list(want)
        for key in want:
            assert_same_tensor(got[key], want[key], f"{key} of batch {group}")
    assert cut.approx_lengths == full.approx_lengths == LEGACY_LENGTHS


@pytest.mark.parametrize("max_len", [1, 16, 40, 500])
def test_speculators_max_len_gives_the_same_batches(safetensors_src, max_len):
    full = HiddenStatesDataset(safetensors_src.path, "speculators")
    cut = HiddenStatesDataset(safetensors_src.path, "speculators", max_len=max_len)
    n = len(full)
    full_items, cut_items = [full[i] for i in range(n)], [cut[i] for i in range(n)]
    for i, (t, item) in enumerate(zip(SAFETENSORS_LENGTHS, cut_items)):
        assert item["lengths"].tolist() == [min(t, max_len + 1)]
        want = base_dataset_getitem(arrow_dataset_raw(safetensors_src.src, i, max_len + 1), torch.bfloat16, None)
        assert_same_item(item, want)
    collates = [speculators_04_collate(max_len, preprocess=speculators_shift_batch),
                lambda b: collate_fn_09(b, max_len)]
    groups = [[i] for i in range(n)] + [list(range(n)), list(range(n))[::-1], [3, 2], [1, 3, 6]]
    for collate in collates:
        for group in groups:
            got = collate([cut_items[i] for i in group])
            want = collate([full_items[i] for i in group])
            assert list(got) == list(want)
            for key in want:
                if key == "error_records":
                    assert got[key] == want[key]
                else:
                    assert_same_tensor(got[key], want[key], f"{key} of batch {group}")
    assert cut.approx_lengths == full.approx_lengths == SAFETENSORS_LENGTHS


def test_approx_lengths_are_exact(legacy, safetensors_src, specforge):
    json_lengths = json.loads((legacy.src / "sample_lengths.json").read_text())
    for flavor in ("speculators-legacy", "speculators"):
        ds = HiddenStatesDataset(legacy.path, flavor, max_len=20)
        # speculators 0.4's own json path: key = stem suffix, value = T
        assert ds.approx_lengths == [json_lengths[Path(f).stem.split("_")[-1]] for f in legacy.files]
        assert ds.approx_lengths == [len(torch.load(f, weights_only=True)["input_ids"]) for f in legacy.files]
    # 0.9: list(seq_len) of the Arrow dataset
    assert HiddenStatesDataset(safetensors_src.path, "speculators").approx_lengths == \
        arrow_rows(safetensors_src.src)["seq_len"]
    assert HiddenStatesDataset(specforge.path, "specforge").approx_lengths == SPECFORGE_LENGTHS
    picked = HiddenStatesDataset(legacy.path, samples=[7, 0, 11]).approx_lengths
    assert picked == [LEGACY_LENGTHS[7], LEGACY_LENGTHS[0], LEGACY_LENGTHS[11]]


# =========================================================================== pre- vs post-norm


def test_pre_norm_flavor_refuses_post_norm_store_and_back(legacy, specforge):
    for flavor in ("speculators-legacy", "speculators"):
        with pytest.raises(StoreError, match="post-norm"):
            HiddenStatesDataset(specforge.path, flavor)
        with pytest.raises(StoreError, match="post-norm"):
            HiddenStatesStream(specforge.path, flavor)
    for flavor in ("specforge", "specforge-shifted"):
        with pytest.raises(StoreError, match="pre-norm"):
            HiddenStatesDataset(legacy.path, flavor)
        with pytest.raises(StoreError, match="pre-norm"):
            HiddenStatesStream(legacy.path, flavor)


# =========================================================================== selection


def test_select_by_source_file_list(legacy):
    full = HiddenStatesDataset(legacy.path, hidden_states_dtype=torch.bfloat16)
    picks = [9, 2, 12, 5]
    rel = [f.relative_to(legacy.src).as_posix() for f in (legacy.files[i] for i in picks)]
    assert all("/" in r for r in rel)  # rows_*/ sub-folders
    absolute = [str(legacy.files[i]) for i in picks]
    bare = [legacy.files[i].name for i in picks]
    for samples in (rel, absolute, [Path(p) for p in absolute], bare, [rel[0], absolute[1], bare[2], 5]):
        ds = HiddenStatesDataset(legacy.path, hidden_states_dtype=torch.bfloat16, samples=samples)
        assert len(ds) == len(picks)
        assert ds.indices == picks
        assert ds.approx_lengths == [LEGACY_LENGTHS[i] for i in picks]
        for j, i in enumerate(picks):
            assert_same_item(ds[j], full[i])
            assert_same_item(ds[j], eagle3_sample_file_getitem(legacy.files[i], torch.bfloat16))
    # the file lists speculators 0.4's split_files hands to Eagle3SampleFileDataset(file_list=...)
    train_files, val_files = split_files(legacy.src, ratio=0.7, seed=0)
    for files in (train_files, val_files):
        ds = HiddenStatesDataset(legacy.path, "speculators-legacy", samples=files)
        assert ds.indices == [legacy.files.index(f) for f in files]
        for j, f in enumerate(files):
            assert_same_item(ds[j], eagle3_sample_file_getitem(f))
    with pytest.raises(StoreError, match="no sample"):
        HiddenStatesDataset(legacy.path, samples=["data_999.pt"])
    with pytest.raises(IndexError):
        HiddenStatesDataset(legacy.path, samples=[len(legacy.files)])


def test_split_samples(legacy):
    store = Store(legacy.path)
    n = len(store)
    for ratio in (0.0, 0.3, 0.9, 1.0):
        train, val = split_samples(legacy.path, ratio, seed=3)
        assert len(train) == int(n * ratio)
        assert not set(train) & set(val)
        assert sorted(train + val) == list(range(n))
        assert (train, val) == split_samples(store, ratio, seed=3)  # deterministic, path or Store
    assert split_samples(store, 0.5, seed=0) != split_samples(store, 0.5, seed=1)
    train, val = split_samples(store, 0.7, seed=5)
    ds_train = HiddenStatesDataset(store, samples=train)
    ds_val = HiddenStatesDataset(store, samples=val)
    assert len(ds_train) + len(ds_val) == n
    assert ds_train.approx_lengths == [LEGACY_LENGTHS[i] for i in train]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            split_samples(store, bad)
