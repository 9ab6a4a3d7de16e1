"""The trainers' own collates, restated on one batch layout that the decode-into-batch path shares.

`trainer_collate(flavor, max_len)` returns a collate whose batches equal, tensor for
tensor, those of the collate the flavor's trainer runs (notes/trainer_semantics.md):

- ``speculators-legacy``: speculators 0.4 `create_collate_fn(max_len)` (also 0.5/0.6's
  `create_collate_fn(..., preprocess=shift_batch)`): items packed into one
  [1, max_len, ...] row, `lengths` cut where max_len is reached.
- ``speculators``: speculators 0.7+ `CollateFn(max_len, ..., preprocess=shift_batch)`:
  the shift, the same packing with the hidden states cast to `dtype`, `document_ids`
  instead of `lengths`, and `error_records`.
- ``specforge`` / ``specforge-shifted``: SpecForge `DataCollatorWithPadding`: every
  item in its own row, zero-padded to the longest.

Each collate is described as a layout (`plan`: where each sample's rows go, `specs`:
the batch tensors) so that `h5feed.loading` can decode stored rows straight into
their place in the batch, and `__call__` copies each item's rows once into a batch
allocated once (no cat, no pad), in shared memory inside a DataLoader worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h5feed.flavors import Flavor, FlavorName, get_flavor
from h5feed.loading.placement import place_items
from h5feed.store import Allocator, shared_allocator

Batch = dict[str, Any]
TensorSpec = tuple[tuple[int, ...], torch.dtype]  # shape, dtype


@dataclass(frozen=True)
class RowKey:
    """A batch key with one entry per token position: [B, N] or [B, N, width]."""

    key: str
    array: str | None  # the store array it is decoded from; None: h5feed computes it
    shift: int = 0  # stored row of the sample that lands on the item's first row


@dataclass(frozen=True)
class Placement:
    """Where one item's rows go: batch row `row`, positions [offset, offset + count)."""

    row: int
    offset: int
    count: int


@dataclass
class BatchPlan:
    """Where every item of one batch goes, and the batch's [B, N] extent."""

    batch_rows: int  # B
    positions: int  # N
    placements: list[Placement]
    lengths: list[int] = field(default_factory=list)  # speculators: the documents' lengths as the trainer cuts them


class TrainerCollate:
    """A trainer's collate: `collate(items)` builds its batch; `plan`/`specs` describe the batch for direct decoding.

    `hidden_states_dtype` is the dtype of the hidden-state keys in batches built
    from the store.  The trainers' collates keep the items' dtype (0.4's cat,
    SpecForge's padding) except speculators 0.7+'s `CollateFn`, which casts to its
    `dtype`: that collate casts to `hidden_states_dtype` in `__call__` too.
    """

    row_keys: tuple[RowKey, ...]
    keys: tuple[str, ...]  # tensor keys of the batch, in the trainer's order
    casts_hidden_states = False  # `__call__` casts the hidden-state keys to hidden_states_dtype

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None) -> None:
        self.flavor = flavor
        self.max_len = max_len
        self.hidden_states_dtype = hidden_states_dtype

    def __repr__(self) -> str:
        return f"trainer_collate({self.flavor.name!r}, max_len={self.max_len})"

    # --- the layout --------------------------------------------------------------------------
    def item_rows(self, num_tokens: int) -> int:
        """Rows an item of a stored sample of `num_tokens` tokens has once the collate sees it."""
        raise NotImplementedError

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        """Where items of `rows` rows each go in the batch."""
        raise NotImplementedError

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        """A plan as large in every key as any batch of `batch_size` items of at most `longest` rows."""
        raise NotImplementedError

    def specs(self, plan: BatchPlan, trailing: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Shape and dtype of every tensor key for `plan`; `trailing` gives each row key's
        per-position shape and dtype (() for token keys, (width,) for hidden states)."""
        out: dict[str, TensorSpec] = {}
        for key in self.keys:
            if key in trailing:
                shape, dtype = trailing[key]
                out[key] = ((plan.batch_rows, plan.positions, *shape), dtype)
            else:
                out[key] = self._summary_spec(key, plan)
        return out

    def _summary_spec(self, key: str, plan: BatchPlan) -> TensorSpec:
        raise NotImplementedError(key)

    def write_summary(self, batch: Batch, plan: BatchPlan) -> None:
        """Write the keys that describe the whole batch (lengths, document_ids) and non-tensor values."""

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        """Write what the trainer's dataset computes rather than reads (position_ids, attention_mask, ...)."""
        raise NotImplementedError

    # --- the trainer's collate on items ------------------------------------------------------
    def preprocess(self, item: Batch) -> Batch:
        """What the trainer's collate does to each item first (speculators 0.7+: the shift)."""
        return item

    def item_length(self, item: Batch) -> int:
        raise NotImplementedError

    def item_rows_of(self, item: Batch, key: str) -> torch.Tensor:
        """The item's rows of a row key, [rows, ...]."""
        return item[key]

    def __call__(self, items: Sequence[Batch], allocate: Allocator = shared_allocator) -> Batch:
        """The trainer's batch of `items`: each item's rows are copied once into a batch allocated once
        (shared memory inside a DataLoader worker: the hand-off to the trainer moves no bytes)."""
        if not items:
            raise ValueError("cannot collate an empty batch")
        items = [self.preprocess(item) for item in items]
        plan = self.plan([self.item_length(item) for item in items])
        first = items[0]
        trailing: dict[str, TensorSpec] = {}
        for row_key in self.row_keys:
            rows = self.item_rows_of(first, row_key.key)
            dtype = self.hidden_states_dtype if self.casts_hidden_states and rows.dim() > 1 else rows.dtype
            trailing[row_key.key] = (tuple(rows.shape[1:]), dtype)
        batch = {key: allocate(*spec) for key, spec in self.specs(plan, trailing).items()}

        def copy_rows(n: int, rows: dict[RowKey, torch.Tensor]) -> None:
            for row_key, dest in rows.items():
                dest[...] = self.item_rows_of(items[n], row_key.key)[: dest.shape[0]]

        place_items(self.row_keys, plan, batch, copy_rows)
        self.write_summary(batch, plan)
        return batch


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
            batch["lengths"].copy_(lengths)
            return
        ids = batch["document_ids"][0]
        ids.fill_(-1)
        ids[: int(lengths.sum())] = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        batch["error_records"] = 0  # items that failed to load: h5feed raises instead

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        positions = batch["position_ids"][0]
        for place in plan.placements:
            positions[place.offset : place.offset + place.count] = torch.arange(1, place.count + 1)

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


class SpecForgeCollate(TrainerCollate):
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

    def item_rows(self, num_tokens: int) -> int:
        return self.flavor.tokens_to_read(num_tokens, self.max_len)

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        return BatchPlan(len(rows), max(rows), [Placement(b, 0, count) for b, count in enumerate(rows)])

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        return BatchPlan(batch_size, longest, [])

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        for place in plan.placements:
            batch["attention_mask"][place.row, : place.count] = 1
            if place.count:
                batch["loss_mask"][place.row, place.count - 1] = 0  # process_data masks the window's last position

    def item_length(self, item: Batch) -> int:
        return int(item["input_ids"].shape[1])

    def item_rows_of(self, item: Batch, key: str) -> torch.Tensor:
        return item[key][0]  # items carry a leading batch dim of 1


_COLLATES: dict[str, Callable[[Flavor, int | None, torch.dtype | None], TrainerCollate]] = {
    "speculators-legacy": lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=True),
    "speculators": lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=False),
    "specforge": lambda f, m, d: SpecForgeCollate(f, m, d, shifted=False),
    "specforge-shifted": lambda f, m, d: SpecForgeCollate(f, m, d, shifted=True),
}


def trainer_collate(
    flavor: FlavorName | str, max_len: int | None, *, hidden_states_dtype: torch.dtype | None = None
) -> TrainerCollate:
    """The collate of the flavor's trainer, for `DataLoader(collate_fn=...)` over h5feed's items.

    Args:
        flavor: ``speculators-legacy`` (0.4 `create_collate_fn(max_len)`), ``speculators``
            (0.7+ `CollateFn(max_len, ..., preprocess=shift_batch)`), ``specforge`` or
            ``specforge-shifted`` (`DataCollatorWithPadding`).
        max_len: the trainer's max_len / total_seq_len (speculators packs into it; SpecForge's
            items are already cut to it).
        hidden_states_dtype: speculators 0.7+: `CollateFn`'s `dtype` (default bfloat16).  Others
            keep their items' dtype; for them this is the dtype `BatchLoader` decodes into.
    """
    f = get_flavor(flavor)
    if f.name not in _COLLATES:  # Model-Optimizer, AngelSlim, NeMo Automodel: plain collates, no batch layout yet
        raise ValueError(f"flavor {f.name!r}: its trainer's collate is h5feed.pipeline_collate({f.name!r}, max_len); "
                         "BatchLoader's decoding straight into the batch does not serve it yet")
    dtype = hidden_states_dtype or f.default_hidden_states_dtype
    return _COLLATES[f.name](f, max_len, dtype)
