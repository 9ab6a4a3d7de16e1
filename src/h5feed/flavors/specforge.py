"""SpecForge's flavors: the items of its `OfflineEagle3Dataset` and its `DataCollatorWithPadding`.

- ``specforge``: `OfflineEagle3Dataset.process_data` (window of max_len tokens, last loss-mask
  position zeroed, no shift).
- ``specforge-shifted``: the same for SpecForge builds before 2026-01-22, whose dataset shifted
  `input_ids` and `target` left by one with a zero fill.

Both batch with `DataCollatorWithPadding` (sp_degree 1): every item in its own row, zero-padded to
the longest.
"""

from __future__ import annotations

import torch

from h5feed.flavors.base import (
    Batch,
    BatchPlan,
    Flavor,
    Item,
    PaddedRowsCollate,
    RowKey,
    Transform,
    cast_to,
    register_flavors,
)
from h5feed.store import Allocator, RawSample, StoreInfo


def _specforge_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """SpecForge `process_data`: batch dim, last loss-mask position of the window zeroed (in place, like SpecForge)."""
    loss_mask = raw.loss_mask[None, :]
    loss_mask[0, -1] = 0
    item: Item = {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": cast_to(raw.last_hidden_state, dtype, allocate)[None],
        "hidden_state": cast_to(raw.aux_hidden_states, dtype, allocate)[None],
        "input_ids": raw.input_ids[None, :],
    }
    return transform(item) if transform is not None else item


def _shift_left(tensor: torch.Tensor, allocate: Allocator) -> torch.Tensor:
    """SpecForge's `padding(t, left=False)`: drop the first position of dim 1, append zeros.

    Built in memory from `allocate`, as `_cast` is, so a worker hands it over without a copy."""
    out = allocate(tuple(tensor.shape), tensor.dtype)
    out[:, :-1] = tensor[:, 1:]
    out[:, -1:] = 0
    return out


def _specforge_shifted_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    item = _specforge_item(raw, info, dtype, None, allocate)
    item["target"] = _shift_left(item["target"], allocate)
    item["input_ids"] = _shift_left(item["input_ids"], allocate)
    return transform(item) if transform is not None else item


class SpecForgeCollate(PaddedRowsCollate):
    """SpecForge `DataCollatorWithPadding` (sp_degree 1): each item in its own row, zero-padded to the longest."""

    keys = ("input_ids", "attention_mask", "loss_mask", "hidden_state", "target")

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None,
                 shifted: bool) -> None:
        super().__init__(flavor, max_len, hidden_states_dtype)
        shift = int(shifted)  # before 2026-01-22 the dataset shifted input_ids and target left by one
        self.row_keys = (
            RowKey("input_ids", "input_ids", shift=shift),
            RowKey("attention_mask", None),
            RowKey("loss_mask", "loss_mask"),
            RowKey("hidden_state", "aux_hidden_states"),
            RowKey("target", "last_hidden_states", shift=shift),
        )

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        super().derive_rows(batch, plan)
        for place in plan.placements:
            if place.count:
                batch["loss_mask"][place.row, place.count - 1] = 0  # process_data masks the window's last position


register_flavors(
    Flavor("specforge", "post", None, 0, _specforge_item, lambda f, m, d: SpecForgeCollate(f, m, d, shifted=False)),
    Flavor("specforge-shifted", "post", None, 0, _specforge_shifted_item,
           lambda f, m, d: SpecForgeCollate(f, m, d, shifted=True)),
)
