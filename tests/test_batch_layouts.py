"""Model-Optimizer, AngelSlim and NeMo Automodel on the decode-into-batch path: the stores, the trainers' collates
(restated in test_trainers.py from the released code) and the references that test_decode_backends.py holds every
backend's batches to, key by key and bit for bit; a reused slot's pads; one collate entry point for every flavor."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainers import angelslim_collate, assert_same, modelopt_collate, nemo_collate

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, HiddenStatesStream, StreamLoader, trainer_collate
from h5feed.testing.synthetic import PipelineOptions, write_synthetic

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

H, K = 32, 3
LENGTHS = [6, 30, 11, 25, 9, 17, 3, 28]  # below and past every train_len used here
CHUNK = 8

# store name: (format, variant, --last-state-norm)
STORES = {
    "modelopt-hf": ("modelopt-pt", "hf", "post"),
    "modelopt-vllm": ("modelopt-pt", "vllm", "pre"),  # base_hidden_prenorm True
    "angelslim-hf": ("angelslim-ckpt", "hf", None),
    "angelslim-vllm": ("angelslim-ckpt", "vllm", "post"),  # inputs_embeds, position_ids: not batched
    "nemo-full": ("nemo-eagle3-cache", "full", None),
    "nemo-topk": ("nemo-eagle3-cache", "topk", None),  # values and indices scattered back
}
# (store, flavor, max_len): every flavor without a batch layout until now
CASES = [
    ("modelopt-hf", "modelopt", 12),
    ("modelopt-hf", "modelopt", 40),
    ("modelopt-hf", "modelopt-answer-only", 12),
    ("modelopt-hf", "modelopt-0.45", 28),
    ("modelopt-vllm", "modelopt", 25),
    ("angelslim-hf", "angelslim", None),
    ("angelslim-vllm", "angelslim", None),
    ("nemo-full", "nemo-eagle3", None),
    ("nemo-topk", "nemo-eagle3", None),
]
IDS = [f"{flavor}-{store}-{max_len}" for store, flavor, max_len in CASES]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`store(name)` -> the path of the store converted from synthetic files of that pipeline (made once)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            fmt, variant, norm = STORES[name]
            root = tmp_path_factory.mktemp(name)
            write_synthetic(root / "src", fmt, len(LENGTHS), H, K, lengths=LENGTHS, seed=11,
                            pipeline=PipelineOptions(variant=variant))
            h5feed.convert(root / "src", root / "store", workers=0, progress=False,
                           settings=h5feed.StoreSettings(chunk_tokens=CHUNK, last_state_norm=norm))
            made[name] = root / "store"
        return made[name]

    return make


def restated_collate(flavor: str, max_len: int | None) -> Any:
    """The trainer's released collate, as test_trainers.py restates it."""
    if flavor.startswith("modelopt"):
        return lambda items: modelopt_collate(items, max_len)
    return angelslim_collate if flavor == "angelslim" else nemo_collate


def reference(path: Path, flavor: str, max_len: int | None, batch_size: int, epoch: int = 0,
              **schedule: Any) -> list[Any]:
    """What the trainer gets from a DataLoader over the flavor's items with its own collate."""
    stream = HiddenStatesStream(path, flavor, max_len, schedule=h5feed.ScheduleOptions(**schedule))
    stream.set_epoch(epoch)
    return list(StreamLoader(stream, batch_size=batch_size, collate_fn=restated_collate(flavor, max_len)))


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
def test_a_short_batch_after_a_long_one_in_the_same_slot(store: Any, name: str, flavor: str,
                                                         max_len: int | None) -> None:
    """One reader thread fills the ring's three slots in turn (batch j in slot j % 3), so that later batches
    reuse slots whose earlier rows were longer: their pads must be zeroes (or the trainer's pad values), not
    what the earlier batch left there (Model-Optimizer's -100 one row past the decoded labels)."""
    path = store(name)
    for batch_size, order in ((1, [2, 4, 0, 6, 1, 7, 3, 5]),  # slot 0: 11 tokens, then 3; slot 1: 9, then 30
                              (2, [1, 7, 3, 5, 2, 4, 0, 6])):  # slot 0: 30 and 28 tokens, then 11 and 9
        loader = BatchLoader(path, flavor=flavor, max_len=max_len, batch_size=batch_size,
                             schedule=h5feed.ScheduleOptions(samples=order, shuffle=False),
                             decode=h5feed.ThreadsOptions(threads=1, prefetch=1))
        assert loader.backend.slots_per_worker == 3
        assert_same(one_pass(loader), reference(path, flavor, max_len, batch_size, samples=order, shuffle=False))


@pytest.mark.parametrize(("name", "flavor", "max_len"), CASES, ids=IDS)
def test_the_collate_over_items_is_the_trainers(store: Any, name: str, flavor: str, max_len: int | None) -> None:
    """`trainer_collate` is the one entry point: over the items of a DataLoader it is the trainer's collate."""
    dataset = HiddenStatesDataset(store(name), flavor, max_len)
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


def test_model_optimizer_refuses_a_batch_of_mixed_norms(store: Any) -> None:
    post = HiddenStatesDataset(store("modelopt-hf"), "modelopt", 12)[0]
    pre = HiddenStatesDataset(store("modelopt-vllm"), "modelopt", 12)[0]
    assert (post["base_hidden_prenorm"], pre["base_hidden_prenorm"]) == (False, True)
    with pytest.raises(ValueError, match=r"base_hidden_prenorm is not constant across the batch"):
        trainer_collate("modelopt", 12)([post, pre])


