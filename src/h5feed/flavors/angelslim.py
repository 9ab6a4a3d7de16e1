"""Tencent AngelSlim's flavor: the items of its `OfflineEagle3Dataset` and its `DataCollatorWithPadding`.

- ``angelslim``: the stored dict as the file held it (batch dim kept, its key order, None-valued keys
  kept), plus `attention_mask`; batched by `DataCollatorWithPadding` (its LLM offline path): [1, T]
  items concatenated into [B, N], zero-padded to the longest; `inputs_embeds` and `position_ids`
  are not batched.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence

import torch

from h5feed.flavors.base import (
    Batch,
    Flavor,
    Item,
    PaddedRowsCollate,
    RowKey,
    TrainerCollate,
    Transform,
    cast_to,
    register_flavors,
)
from h5feed.formats import position_ids_from_rows
from h5feed.store import Allocator, RawSample, StoreInfo, shared_allocator


def _angelslim_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """AngelSlim `OfflineEagle3Dataset._load_ckpt`: the stored dict as the file held it ([1, T, ...], its key
    order, None-valued keys kept), plus `attention_mask` ones [1, T]."""
    layout = json.loads(info.source_info.get("layout", "{}"))
    assert raw.last_hidden_state is not None  # check_store refused stores without one
    tensors: Item = {
        "input_ids": raw.input_ids[None],
        "loss_mask": raw.loss_mask[None],
        "hidden_states": cast_to(raw.aux_hidden_states, dtype, allocate)[None],
        "target_hiddens": cast_to(raw.last_hidden_state, dtype, allocate)[None],
    }
    if "inputs_embeds" in raw.extras:
        tensors["inputs_embeds"] = cast_to(raw.extras["inputs_embeds"], dtype, allocate)[None]
    if "position_ids" in raw.extras:
        tensors["position_ids"] = position_ids_from_rows(raw.extras["position_ids"], layout["position_ids"])
    none = set(layout.get("none", ()))
    item = {key: None if key in none else tensors[key] for key in layout.get("keys", _ANGELSLIM_KEYS)}
    item["attention_mask"] = torch.ones_like(item["input_ids"])
    return transform(item) if transform is not None else item


_ANGELSLIM_KEYS = ("input_ids", "loss_mask", "hidden_states", "target_hiddens")  # its HF backend's files


class AngelSlimCollate(PaddedRowsCollate):
    """AngelSlim `DataCollatorWithPadding` (its LLM offline path): each [1, T] item in its own row, zero-padded
    to the longest; `hidden_states` / `target_hiddens` are None unless every item has them; `inputs_embeds` and
    `position_ids` are not batched."""

    order = ("input_ids", "attention_mask", "loss_mask", "hidden_states", "target_hiddens")  # the trainer's keys
    hidden = (RowKey("hidden_states", "aux_hidden_states"), RowKey("target_hiddens", "last_hidden_states"))

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None) -> None:
        if max_len is not None:
            raise ValueError(f"flavor {flavor.name!r}: AngelSlim's collate pads to the longest item and its "
                             "dataset yields whole samples: max_len does not apply (pass None)")
        super().__init__(flavor, max_len, hidden_states_dtype)
        self._batch_hidden(tuple(rk.key for rk in self.hidden))

    def _batch_hidden(self, present: tuple[str, ...]) -> None:
        """Lay out the hidden-state keys that every item has (the others are None)."""
        self.row_keys = (RowKey("input_ids", "input_ids"), RowKey("attention_mask", None),
                         RowKey("loss_mask", "loss_mask"), *(rk for rk in self.hidden if rk.key in present))
        self.keys = tuple(rk.key for rk in self.row_keys)

    def _take_from_store(self, info: StoreInfo) -> None:
        layout = json.loads(info.source_info.get("layout", "{}"))  # the files' keys, as the flavor's items keep them
        keys, none = layout.get("keys", self.order), set(layout.get("none", ()))
        self._batch_hidden(tuple(k for k in keys if k not in none))

    def finish(self, batch: Batch) -> Batch:
        return {key: batch.get(key) for key in self.order}

    def __call__(self, items: Sequence[Batch], allocate: Allocator = shared_allocator) -> Batch:
        present = tuple(rk.key for rk in self.hidden if all(item.get(rk.key) is not None for item in items))
        if present == self.keys[3:]:
            return super().__call__(items, allocate)
        bound = copy.copy(self)
        bound._batch_hidden(present)
        return TrainerCollate.__call__(bound, items, allocate)


register_flavors(
    Flavor("angelslim", "post", None, 0, _angelslim_item, AngelSlimCollate, truncates=False,
           extras=lambda info: tuple(n for n in ("inputs_embeds", "position_ids") if n in info.extra_arrays)),
)
