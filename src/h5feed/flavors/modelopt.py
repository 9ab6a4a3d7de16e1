"""NVIDIA Model-Optimizer's flavors: the items of its `OfflineSupervisedDataset` and its
`EagleOfflineDataCollator(train_len)`.

- ``modelopt``: 0.46+ with answer_only_loss=False (a loss mask of ones), with `labels` and
  `base_hidden_prenorm`; ``modelopt-answer-only``: the stored loss mask; ``modelopt-0.45``:
  releases before that flag (post-norm only).

The collate pads or cuts every key to `train_len` and stacks them; the hidden states go under
`base_model_outputs`, with `base_hidden_prenorm` (0.46+), which must be the same for the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from h5feed.flavors.base import (
    Batch,
    BatchPlan,
    Build,
    Flavor,
    Item,
    Placement,
    RowKey,
    TrainerCollate,
    Transform,
    cast_to,
    ones_where_items,
    register_flavors,
)
from h5feed.store import Allocator, RawSample, StoreInfo, shared_allocator

IGNORE_TOKEN_ID = -100  # transformers' LabelSmoother.ignore_index, which Model-Optimizer's labels use


def _modelopt_item(answer_only_loss: bool, prenorm_key: bool) -> Build:
    """Model-Optimizer `OfflineSupervisedDataset.__getitem__`: labels = ids shifted left with -100 at the end;
    loss mask of ones unless answer_only_loss; 0.46+ adds `base_hidden_prenorm` (the consumer re-applies the
    final norm when it is True), here from the norm the store recorded."""

    def build(raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None,
              allocate: Allocator) -> Item:
        ids = raw.input_ids
        labels = torch.full_like(ids, IGNORE_TOKEN_ID)
        labels[:-1] = ids[1:]
        assert raw.last_hidden_state is not None  # check_store refused stores without one
        item: Item = {
            "input_ids": ids,
            "base_model_hidden_states": cast_to(raw.last_hidden_state, dtype, allocate),
            "aux_hidden_states": cast_to(raw.aux_hidden_states, dtype, allocate),
            "attention_mask": torch.ones_like(ids),
            "loss_mask": raw.loss_mask if answer_only_loss else torch.ones_like(ids),
            "labels": labels,
        }
        if prenorm_key:
            item["base_hidden_prenorm"] = info.last_state_norm == "pre"
        return transform(item) if transform is not None else item

    return build


class ModelOptCollate(TrainerCollate):
    """Model-Optimizer `EagleOfflineDataCollator(train_len)` (0.44 to 0.46): each item zero-padded or cut to
    `train_len` (max_len) and stacked, the hidden states under `base_model_outputs`, with 0.46's
    `base_hidden_prenorm`, which must be the same for the whole batch.

    Decoded from the store, `labels` are the stored ids one row on, and the item's last label (-100: no next
    token) is written where it falls inside train_len; attention_mask (and the loss mask of ones, unless
    answer_only_loss) are ones over the item."""

    keys = ("input_ids", "attention_mask", "loss_mask", "labels", "base_model_hidden_states", "aux_hidden_states")
    outputs = ("base_model_hidden_states", "aux_hidden_states")  # the keys under base_model_outputs

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None,
                 answer_only_loss: bool, prenorm_flag: bool) -> None:
        if max_len is None:
            raise ValueError(f"flavor {flavor.name!r}: Model-Optimizer's collate pads or cuts to training_seq_len: "
                             "max_len is required")
        super().__init__(flavor, max_len, hidden_states_dtype)
        self.answer_only_loss = answer_only_loss  # the stored loss mask; else ones
        self.prenorm_flag = prenorm_flag  # 0.46+: the batch says base_hidden_prenorm
        self.prenorm: bool | None = None  # its value: from the items, or from the store's norm (for_store)
        self.row_keys = (
            RowKey("input_ids", "input_ids"),
            RowKey("attention_mask", None),
            RowKey("loss_mask", "loss_mask" if answer_only_loss else None),
            RowKey("labels", "input_ids", shift=1),  # labels[j] = input_ids[j + 1]
            RowKey("base_model_hidden_states", "last_hidden_states"),
            RowKey("aux_hidden_states", "aux_hidden_states"),
        )

    def _take_from_store(self, info: StoreInfo) -> None:
        if self.prenorm_flag:
            self.prenorm = info.last_state_norm == "pre"  # as the flavor's items say

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        assert self.max_len is not None
        return BatchPlan(len(rows), self.max_len, [Placement(b, 0, min(count, self.max_len))
                                                   for b, count in enumerate(rows)], list(rows))

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        assert self.max_len is not None
        return BatchPlan(batch_size, self.max_len, [])

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        assert self.max_len is not None
        ones_where_items(batch["attention_mask"], plan)
        if not self.answer_only_loss:
            ones_where_items(batch["loss_mask"], plan)
        labels = batch["labels"]
        for place, rows in zip(plan.placements, plan.lengths):
            if 0 < rows <= self.max_len:  # the item's last label is in the batch: -100, then pads
                labels[place.row, rows - 1] = IGNORE_TOKEN_ID
                labels[place.row, rows:] = 0  # in every batch: the ring's dirty marks end before the -100

    def write_summary(self, batch: Batch, plan: BatchPlan) -> None:
        if self.prenorm is not None:
            batch["base_hidden_prenorm"] = self.prenorm

    def finish(self, batch: Batch) -> Batch:
        outputs = {key: batch.pop(key) for key in self.outputs}
        if "base_hidden_prenorm" in batch:
            outputs["base_hidden_prenorm"] = batch.pop("base_hidden_prenorm")
        batch["base_model_outputs"] = outputs
        return batch

    def item_length(self, item: Batch) -> int:
        return int(item["input_ids"].shape[0])

    def __call__(self, items: Sequence[Batch], allocate: Allocator = shared_allocator) -> Batch:
        if not items or "base_hidden_prenorm" not in items[0]:
            return super().__call__(items, allocate)
        flags = {bool(item["base_hidden_prenorm"]) for item in items}
        if len(flags) > 1:
            raise ValueError(f"base_hidden_prenorm is not constant across the batch (got {flags}); "
                             "do not mix pre-norm and post-norm dumps")
        bound = copy.copy(self)
        bound.prenorm = flags.pop()
        return TrainerCollate.__call__(bound, items, allocate)


register_flavors(
    Flavor("modelopt", None, None, 1, _modelopt_item(False, True),
           lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=False, prenorm_flag=True), reads_loss_mask=False),
    Flavor("modelopt-answer-only", None, None, 1, _modelopt_item(True, True),
           lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=True, prenorm_flag=True)),
    Flavor("modelopt-0.45", "post", None, 1, _modelopt_item(False, False),
           lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=False, prenorm_flag=False), reads_loss_mask=False),
)
