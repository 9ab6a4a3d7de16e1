"""Model-Optimizer, AngelSlim and NeMo Automodel on the decode-into-batch path: the trainers' released collates
(restated in conftest, beside the stores and the references every decode backend's batches are held to, key by key
and bit for bit) against h5feed's; a reused slot's pads; one collate entry point for every flavor."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import PIPELINE_CASE_IDS, PIPELINE_CASES, assert_same, pipeline_reference, restated_collate

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, trainer_collate

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def cloned(value: Any) -> Any:
    """A batch copied out of its slot (so the slot goes back at once)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: cloned(v) for key, v in value.items()}
    return value


def one_pass(loader: Any, epoch: int = 0) -> list[Any]:
    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no batch may leave the slot ring
        return [cloned(batch) for batch in loader]


@pytest.mark.parametrize(("name", "flavor", "max_len"), [
    ("modelopt-hf", "modelopt", 12),  # labels' -100 and pads after a row that filled train_len
    ("angelslim-vllm", "angelslim", None),
    ("nemo-topk", "nemo-eagle3", None),  # the pad ids, the scattered distributions
])
def test_a_short_batch_after_a_long_one_in_the_same_slot(pipeline_store: Any, name: str, flavor: str,
                                                         max_len: int | None) -> None:
    """One reader thread fills the ring's three slots in turn (batch j in slot j % 3), so that later batches
    reuse slots whose earlier rows were longer: their pads must be zeroes (or the trainer's pad values), not
    what the earlier batch left there (Model-Optimizer's -100 one row past the decoded labels)."""
    path = pipeline_store(name)
    for batch_size, order in ((1, [2, 4, 0, 6, 1, 7, 3, 5]),  # slot 0: 11 tokens, then 3; slot 1: 9, then 30
                              (2, [1, 7, 3, 5, 2, 4, 0, 6])):  # slot 0: 30 and 28 tokens, then 11 and 9
        loader = BatchLoader(path, flavor=flavor, max_len=max_len, batch_size=batch_size,
                             schedule=h5feed.ScheduleOptions(samples=order, shuffle=False),
                             decode=h5feed.ThreadsOptions(threads=1, prefetch=1))
        assert loader.backend.slots_per_worker == 3
        want = pipeline_reference(path, flavor, max_len, batch_size, samples=order, shuffle=False)
        assert_same(one_pass(loader), want)


@pytest.mark.parametrize(("name", "flavor", "max_len"), PIPELINE_CASES, ids=PIPELINE_CASE_IDS)
def test_the_collate_over_items_is_the_trainers(pipeline_store: Any, name: str, flavor: str,
                                               max_len: int | None) -> None:
    """`trainer_collate` is the one entry point: over the items of a DataLoader it is the trainer's collate."""
    dataset = HiddenStatesDataset(pipeline_store(name), flavor, max_len)
    items = [dataset[i] for i in range(len(dataset))]
    collate = trainer_collate(flavor, max_len)
    for batch in (items[:3], items[3:], items[5:6]):
        assert_same(collate(batch), restated_collate(flavor, max_len)(batch))


def test_the_collates_say_what_they_need() -> None:
    with pytest.raises(ValueError, match=r"^flavor 'modelopt': Model-Optimizer's collate pads or cuts to "
                                         r"training_seq_len: max_len is required$"):
        trainer_collate("modelopt")
    with pytest.raises(ValueError, match=r"^flavor 'angelslim': AngelSlim's collate pads to the longest item and "
                                         r"its dataset yields whole samples: max_len does not apply \(pass None\)$"):
        trainer_collate("angelslim", 2048)


def test_model_optimizer_refuses_a_batch_of_mixed_norms(pipeline_store: Any) -> None:
    post = HiddenStatesDataset(pipeline_store("modelopt-hf"), "modelopt", 12)[0]
    pre = HiddenStatesDataset(pipeline_store("modelopt-vllm"), "modelopt", 12)[0]
    assert (post["base_hidden_prenorm"], pre["base_hidden_prenorm"]) == (False, True)
    with pytest.raises(ValueError, match=r"base_hidden_prenorm is not constant across the batch"):
        trainer_collate("modelopt", 12)([post, pre])


