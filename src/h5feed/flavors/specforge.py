"""SpecForge's flavors: the items its offline datasets (0.2: its strategies' normalizers) make, and their collates.

- ``specforge``: EAGLE-3, `OfflineEagle3Dataset.process_data` (0.2: eagle3's `normalize_offline_sample`): window
  of max_len tokens, last loss-mask position zeroed, no shift.
- ``specforge-shifted``: the same for SpecForge builds before 2026-01-22, whose dataset shifted
  `input_ids` and `target` left by one with a zero fill.
- ``specforge-dflash``: 0.2's DFlash and Domino (`dflash_family_data.normalize_offline_sample`): ``input_ids``,
  ``loss_mask`` (as stored) and ``hidden_states`` (the captured layers), each [1, t, ...], t = min(T, max_len);
  a sample whose loss mask has no two supervised tokens in a row is refused, as SpecForge refuses it.
- ``specforge-dspark``: 0.2's DSpark (`normalize_dspark_offline_sample`): the same and
  ``target_last_hidden_states`` [1, t, H], the post-norm last state.

The EAGLE-3 flavors batch with `DataCollatorWithPadding` (sp_degree 1): every item in its own row, zero-padded to
the longest, with an attention mask.  The DFlash family batches with `pad_and_concatenate_features`: the same rows
and zeros, and no attention mask.
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


def refuse_unsupervised(loss_mask: torch.Tensor, where: str) -> None:
    """SpecForge's DFlash-family normalizer refuses a sample without two supervised tokens in a row (its block
    objective has nothing to learn from it), raising in the middle of training: so do these flavors, at the
    sample (`where` names it)."""
    supervised = loss_mask != 0
    if not bool((supervised[..., :-1] & supervised[..., 1:]).any()):
        raise ValueError(f"{where}: SpecForge's DFlash-family training refuses it: offline DFlash-family samples "
                         "require two consecutive supervised tokens (its loss mask has no two 1s in a row within the "
                         "tokens read)")


def _dflash_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """DFlash-family `normalize_offline_sample`: [1, t] ids and mask (the mask kept as it is), [1, t, K*H] states."""
    refuse_unsupervised(raw.loss_mask, f"a sample of {raw.num_tokens} tokens")
    item: Item = {
        "input_ids": raw.input_ids[None, :],
        "loss_mask": raw.loss_mask[None, :],
        "hidden_states": cast_to(raw.aux_hidden_states, dtype, allocate)[None],
    }
    return transform(item) if transform is not None else item


def _dspark_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """`normalize_dspark_offline_sample`: the DFlash-family item and the post-norm last state, [1, t, H]."""
    item = _dflash_item(raw, info, dtype, None, allocate)
    item["target_last_hidden_states"] = cast_to(raw.last_hidden_state, dtype, allocate)[None]
    return transform(item) if transform is not None else item


class DFlashFamilyCollate(PaddedRowsCollate):
    """SpecForge 0.2's DFlash-family collate (`pad_and_concatenate_features`): each [1, t, ...] item in its own row,
    zero-padded along dim 1 to the longest `input_ids`, concatenated along dim 0; no attention mask.  Batches
    decoded straight from a store are checked as SpecForge's normalizer checks each sample."""

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None,
                 with_last_state: bool) -> None:
        super().__init__(flavor, max_len, hidden_states_dtype)
        last = (RowKey("target_last_hidden_states", "last_hidden_states"),) if with_last_state else ()
        self.row_keys = (RowKey("input_ids", "input_ids"), RowKey("loss_mask", "loss_mask"),
                         RowKey("hidden_states", "aux_hidden_states"), *last)
        self.keys = tuple(rk.key for rk in self.row_keys)

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        for place in plan.placements:  # nothing is derived; each decoded sample is checked
            refuse_unsupervised(batch["loss_mask"][place.row, : place.count], f"the sample in batch row {place.row}")


register_flavors(
    Flavor("specforge", "post", None, 0, _specforge_item, lambda f, m, d: SpecForgeCollate(f, m, d, shifted=False)),
    Flavor("specforge-shifted", "post", None, 0, _specforge_shifted_item,
           lambda f, m, d: SpecForgeCollate(f, m, d, shifted=True)),
    Flavor("specforge-dflash", None, None, 0, _dflash_item,
           lambda f, m, d: DFlashFamilyCollate(f, m, d, with_last_state=False), needs_last_state=False),
    Flavor("specforge-dspark", "post", None, 0, _dspark_item,
           lambda f, m, d: DFlashFamilyCollate(f, m, d, with_last_state=True)),
)
