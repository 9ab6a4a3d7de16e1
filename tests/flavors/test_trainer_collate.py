"""trainer_collate(flavor, max_len) builds, tensor for tensor, the batches of the trainers' own collates.

The expected batches come from re-implementations of the released collates, written
here from their code (speculators 0.4.0 `train/data.py::create_collate_fn`, 0.9.0
`train/data.py::CollateFn` with `models/eagle3/data.py::shift_batch`, SpecForge 0.2.0
`data/utils.py::DataCollatorWithPadding`), applied to h5feed's items.
"""

from __future__ import annotations

import pytest
import torch
from conftest import speculators_04_collate, speculators_shift_batch

from h5feed import trainer_collate
from h5feed.loading.datasets import HiddenStatesDataset
from h5feed.loading.placement import zero_pads

H = 32
K = 3
LENGTHS = [1, 5, 16, 17, 33, 64, 100, 3, 48, 31, 2]


@pytest.fixture(scope="module")
def legacy_store(synthetic_store):
    return synthetic_store("co_legacy", "speculators-legacy-pt", len(LENGTHS), H, LENGTHS, chunk_tokens=16, seed=5)


@pytest.fixture(scope="module")
def specforge_store(synthetic_store):
    return synthetic_store("co_specforge", "specforge-ckpt", len(LENGTHS), H, LENGTHS, chunk_tokens=16, seed=6)


# --------------------------------------------------------------------------- the released collates, restated


def speculators_09_collate(max_len, dtype=torch.bfloat16):
    """speculators 0.9 `CollateFn(max_len, hidden_size, dtype=dtype, preprocess=shift_batch)` on items that all load."""

    def collate_fn(batch):
        batch = [speculators_shift_batch(item, clamp=True) for item in batch]
        collated = {}
        for key in batch[0]:
            if key == "lengths":
                collated[key] = torch.cat([b[key] for b in batch], dim=0)
                continue
            first = batch[0][key]
            out = torch.zeros((max_len, *first.shape[1:]), dtype=dtype if "hidden_states" in key else first.dtype)
            offset = 0
            for b in batch:
                tensor = b[key]
                num_rows = min(tensor.shape[0], max_len - offset)
                out[offset : offset + num_rows] = tensor[:num_rows]
                offset += num_rows
                if offset == max_len:
                    break
            collated[key] = out.unsqueeze(0)
        lengths = collated.pop("lengths")
        new_lengths, cum_length = [], 0
        for length in lengths:
            if length + cum_length >= max_len:
                new_lengths.append(max_len - cum_length)
                break
            new_lengths.append(length)
            cum_length += length
        lengths = torch.tensor(new_lengths, dtype=torch.long)
        document_ids = torch.repeat_interleave(torch.arange(lengths.shape[0], dtype=torch.long), lengths)
        document_ids = torch.cat([document_ids, -1 * torch.ones(max_len - document_ids.shape[0], dtype=torch.long)])
        collated["document_ids"] = document_ids.unsqueeze(0)
        collated["error_records"] = 0
        return collated

    return collate_fn


def specforge_collate(features):
    """SpecForge 0.2.0 `DataCollatorWithPadding()(features)` without distributed (sp_degree 1), no position_ids."""

    def paddingtensor(intensors, n):
        b, m, s = intensors.shape
        return torch.cat((intensors, torch.zeros(b, n - m, s, dtype=intensors.dtype)), dim=1)

    def paddingtensor2d(intensors, n):
        b, m = intensors.shape
        return torch.cat((intensors, torch.zeros(b, n - m, dtype=intensors.dtype)), dim=1)

    max_length = max(item["input_ids"].shape[1] for item in features)
    batch = {
        "input_ids": torch.cat([paddingtensor2d(item["input_ids"], max_length) for item in features]),
        "attention_mask": torch.cat([paddingtensor2d(item["attention_mask"], max_length) for item in features]),
        "loss_mask": torch.cat([paddingtensor2d(item["loss_mask"], max_length) for item in features]),
        "hidden_state": None,
        "target": None,
    }
    if all("hidden_state" in item for item in features):
        batch["hidden_state"] = torch.cat([paddingtensor(item["hidden_state"], max_length) for item in features])
        batch["target"] = torch.cat([paddingtensor(item["target"], max_length) for item in features])
    return batch


# --------------------------------------------------------------------------- batches

# batches of store indices: single items, packs that fit, packs cut at max_len, items wholly past max_len
BATCHES = [[0], [6], [3], [1, 2], [0, 7, 10], [4, 5, 6], [6, 8, 9, 1], [2, 3, 0, 1, 10, 7]]


def batches_of(dataset):
    for indices in BATCHES:
        yield indices, [dataset[i] for i in indices]


@pytest.mark.parametrize("max_len", [16, 40, 120])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculators_legacy_equals_04_collate(legacy_store, assert_same_batch, max_len, dtype):
    dataset = HiddenStatesDataset(legacy_store.path, "speculators-legacy", max_len=max_len, hidden_states_dtype=dtype)
    collate, want_collate = trainer_collate("speculators-legacy", max_len), speculators_04_collate(max_len)
    for indices, items in batches_of(dataset):
        got = collate(items)
        assert_same_batch(got, want_collate(items))
        assert got["hidden_states"].dtype == dtype, indices


@pytest.mark.parametrize("max_len", [16, 40, 120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculators_equals_09_collate(legacy_store, assert_same_batch, max_len, dtype):
    dataset = HiddenStatesDataset(legacy_store.path, "speculators", max_len=max_len)
    collate = trainer_collate("speculators", max_len, hidden_states_dtype=dtype)
    want_collate = speculators_09_collate(max_len, dtype)
    for _, items in batches_of(dataset):
        assert_same_batch(collate(items), want_collate(items))


def test_items_read_whole_give_the_same_batches(legacy_store, assert_same_batch):
    """Items read in full (max_len=None in the dataset) pack to the same batch as items read only as far as used."""
    whole = HiddenStatesDataset(legacy_store.path, "speculators-legacy")
    cut = HiddenStatesDataset(legacy_store.path, "speculators-legacy", max_len=40)
    collate = trainer_collate("speculators-legacy", 40)
    for indices in BATCHES:
        assert_same_batch(collate([cut[i] for i in indices]), collate([whole[i] for i in indices]))


@pytest.mark.parametrize("flavor", ["specforge", "specforge-shifted"])
@pytest.mark.parametrize("max_len", [16, 40, 1000])
def test_specforge_equals_data_collator_with_padding(specforge_store, assert_same_batch, flavor, max_len):
    dataset = HiddenStatesDataset(specforge_store.path, flavor, max_len=max_len)
    collate = trainer_collate(flavor, max_len)
    for _, items in batches_of(dataset):
        assert_same_batch(collate(items), specforge_collate(items))


def test_noisy_items_are_copied_as_they_are(legacy_store, assert_same_batch):
    """A transform's values (speculators' noise) reach the batch unchanged: the collate copies items, it reads nothing."""

    def noise(item):
        item["hidden_states"] = item["hidden_states"] + torch.rand_like(item["hidden_states"])
        return item

    dataset = HiddenStatesDataset(legacy_store.path, "speculators-legacy", max_len=40, transform=noise)
    for _, items in batches_of(dataset):
        assert_same_batch(trainer_collate("speculators-legacy", 40)(items), speculators_04_collate(40)(items))


def test_packing_details(legacy_store):
    """Spelled out for one batch: rows 0..4 from sample 1 (5 tokens: 4 rows), then 36 rows cut from sample 6."""
    dataset = HiddenStatesDataset(legacy_store.path, "speculators", max_len=40)
    batch = trainer_collate("speculators", 40)([dataset[1], dataset[6], dataset[0]])
    assert batch["document_ids"].tolist() == [[0] * 4 + [1] * 36]
    assert batch["position_ids"].tolist() == [list(range(1, 5)) + list(range(1, 37))]
    assert batch["error_records"] == 0
    assert "lengths" not in batch
    shifted = HiddenStatesDataset(legacy_store.path, "speculators-legacy", max_len=40)
    legacy = trainer_collate("speculators-legacy", 40)([shifted[i] for i in (1, 0, 0)])
    assert legacy["lengths"].tolist() == [4, 0, 0]
    assert legacy["position_ids"].tolist() == [list(range(1, 5)) + [0] * 36]
    assert legacy["hidden_states"][0, 4:].count_nonzero() == 0


def test_zero_pads_touches_only_dirty_pad_positions():
    buffer = torch.full((2, 5, 3), 7.0)
    # fresh memory: every pad position is zeroed; afterwards only the data positions can be non-zero
    assert zero_pads(buffer, [2, 4]) == 9
    assert buffer[0, 2:].count_nonzero() == 0 and buffer[1, 4:].count_nonzero() == 0
    assert buffer[0, :2].eq(7).all() and buffer[1, :4].eq(7).all()
    # a reused buffer known clean past position 3 of the flat view: positions 3..9 are left alone
    buffer = torch.full((2, 5), 7)
    assert zero_pads(buffer, [1, 0], dirty_rows=3) == 1
    assert buffer.flatten().tolist() == [7, 0, 0, 7, 7, 7, 7, 7, 7, 7]
    # dirty positions beyond this batch's view stay dirty for the next one
    assert zero_pads(torch.ones(1, 4), [2], dirty_rows=10) == 10


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_len is required"):
        trainer_collate("speculators", None)
    with pytest.raises(ValueError, match="unknown flavor 'eagle'"):
        trainer_collate("eagle", 16)
    with pytest.raises(ValueError, match="empty batch"):
        trainer_collate("specforge", 16)([])
