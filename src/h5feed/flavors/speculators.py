"""speculators' flavors: the items of its datasets and its collates.

- ``speculators-legacy``: speculators 0.4 `Eagle3SampleFileDataset` (cast, lengths, position_ids,
  transform, then the shift), batched by 0.4's `create_collate_fn(max_len)` (also 0.5/0.6's
  `create_collate_fn(..., preprocess=shift_batch)`): items packed into one [1, max_len, ...] row,
  `lengths` cut where max_len is reached.
- ``speculators``: speculators 0.5+ `BaseDataset` (no shift; the collate shifts), batched by 0.7+'s
  `CollateFn(max_len, ..., preprocess=shift_batch)`: the shift, the same packing with the hidden
  states cast to `dtype`, `document_ids` instead of `lengths`, and `error_records`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from h5feed.flavors.base import (
    Batch,
    BatchPlan,
    Flavor,
    Item,
    Placement,
    RowKey,
    TensorSpec,
    TrainerCollate,
    Transform,
    cast_to,
    host_to,
    register_flavors,
)
from h5feed.store import Allocator, RawSample, StoreInfo


def _speculators_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """speculators `BaseDataset.__getitem__`: standardized keys, cast, lengths, position_ids, transform."""
    t = len(raw.input_ids)
    item: Item = {
        "hidden_states": cast_to(raw.aux_hidden_states, dtype, allocate),
        "input_ids": raw.input_ids,
        "verifier_last_hidden_states": cast_to(raw.last_hidden_state, dtype, allocate),
        "loss_mask": raw.loss_mask,
        "lengths": torch.tensor([t], dtype=torch.long),
        "position_ids": torch.arange(t, dtype=torch.long),
    }
    return transform(item) if transform is not None else item


def _speculators_legacy_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """speculators 0.4: the 0.5 item, then `shift_batch` (keys in its order)."""
    item = _speculators_item(raw, info, dtype, transform, allocate)
    return {
        "input_ids": item["input_ids"][1:],
        "hidden_states": item["hidden_states"][:-1],
        "verifier_last_hidden_states": item["verifier_last_hidden_states"][1:],
        "loss_mask": item["loss_mask"][1:],
        "lengths": item["lengths"] - 1,
        "position_ids": item["position_ids"][1:],
    }


def pack_lengths(lengths: Sequence[int], max_len: int) -> list[int]:
    """speculators' cut of `lengths`: documents while they fit, the last one truncated, the rest dropped."""
    out: list[int] = []
    total = 0
    for length in lengths:
        if length + total >= max_len:
            out.append(max_len - total)
            break
        out.append(length)
        total += length
    return out


class SpeculatorsCollate(TrainerCollate):
    """speculators: items (shifted) packed one after another into a single [1, max_len] row."""

    row_keys = (
        RowKey("input_ids", "input_ids", shift=1),
        RowKey("hidden_states", "aux_hidden_states"),
        RowKey("verifier_last_hidden_states", "last_hidden_states", shift=1),
        RowKey("loss_mask", "loss_mask", shift=1),
        RowKey("position_ids", None, shift=1),
    )

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None,
                 legacy: bool) -> None:
        if max_len is None:
            raise ValueError(f"flavor {flavor.name!r} packs items into max_len tokens: max_len is required")
        super().__init__(flavor, max_len, hidden_states_dtype)
        self.legacy = legacy
        self.casts_hidden_states = not legacy
        order = ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask")
        self.keys = (*order, "lengths", "position_ids") if legacy else (*order, "position_ids", "document_ids")

    def item_rows(self, num_tokens: int) -> int:
        return self.flavor.tokens_to_read(num_tokens, self.max_len) - 1  # the shift drops one

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        assert self.max_len is not None
        placements, offset = [], 0
        for count in rows:
            placed = max(0, min(count, self.max_len - offset))
            placements.append(Placement(0, offset, placed))
            offset += placed
        return BatchPlan(1, self.max_len, placements, pack_lengths(rows, self.max_len))

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        assert self.max_len is not None
        return BatchPlan(1, self.max_len, [], [0] * batch_size)  # at most one document per item

    def _summary_spec(self, key: str, plan: BatchPlan) -> TensorSpec:
        if key == "lengths":
            return (len(plan.lengths),), torch.long
        return (1, plan.positions), torch.long  # document_ids

    def write_summary(self, batch: Batch, plan: BatchPlan) -> None:
        lengths = torch.tensor(plan.lengths, dtype=torch.long)
        if self.legacy:
            batch["lengths"].copy_(host_to(lengths, batch["lengths"]))
            return
        ids = torch.full((plan.positions,), -1, dtype=torch.long)
        ids[: int(lengths.sum())] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        batch["document_ids"][0].copy_(host_to(ids, batch["document_ids"]))
        batch["error_records"] = 0  # items that failed to load: h5feed raises instead

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        positions = batch["position_ids"][0]
        for place in plan.placements:
            positions[place.offset : place.offset + place.count] = torch.arange(1, place.count + 1,
                                                                                device=positions.device)

    def preprocess(self, item: Batch) -> Batch:
        if self.legacy:
            return item
        return {  # speculators.models.eagle3.data.shift_batch (views, lengths clamped at 0)
            "input_ids": item["input_ids"][1:],
            "hidden_states": item["hidden_states"][:-1],
            "verifier_last_hidden_states": item["verifier_last_hidden_states"][1:],
            "loss_mask": item["loss_mask"][1:],
            "lengths": torch.clamp(item["lengths"] - 1, min=0),
            "position_ids": item["position_ids"][1:],
        }

    def item_length(self, item: Batch) -> int:
        return int(item["lengths"][0])


register_flavors(
    Flavor("speculators-legacy", "pre", torch.float32, 1, _speculators_legacy_item,
           lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=True)),
    Flavor("speculators", "pre", torch.bfloat16, 1, _speculators_item,
           lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=False)),
)
