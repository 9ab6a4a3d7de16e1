"""The trainers' own collates, restated on one batch layout that the decode-into-batch path shares.

`trainer_collate(flavor, max_len)` returns, for every flavor, a collate whose batches equal,
tensor for tensor, those of the collate the flavor's trainer runs (notes/trainer_semantics.md):

- ``speculators-legacy``: speculators 0.4 `create_collate_fn(max_len)` (also 0.5/0.6's
  `create_collate_fn(..., preprocess=shift_batch)`): items packed into one
  [1, max_len, ...] row, `lengths` cut where max_len is reached.
- ``speculators``: speculators 0.7+ `CollateFn(max_len, ..., preprocess=shift_batch)`:
  the shift, the same packing with the hidden states cast to `dtype`, `document_ids`
  instead of `lengths`, and `error_records`.
- ``specforge`` / ``specforge-shifted``: SpecForge `DataCollatorWithPadding`: every
  item in its own row, zero-padded to the longest.
- ``modelopt*``: Model-Optimizer `EagleOfflineDataCollator(train_len)`: every key zero-padded or
  cut to `train_len` and stacked; the hidden states under `base_model_outputs`, with
  `base_hidden_prenorm` (0.46+), which must be the same for the whole batch.
- ``angelslim``: AngelSlim `DataCollatorWithPadding`: [1, T] items concatenated into [B, N],
  zero-padded to the longest; `inputs_embeds` and `position_ids` are not batched (its LLM path).
- ``nemo-eagle3``: NeMo Automodel `_collate_cached`: the cache's fixed-length items stacked.

Each collate is described as a layout (`plan`: where each sample's rows go, `specs`:
the batch tensors, `derive_rows`: what is computed rather than read, `finish`: the
trainer's structure) so that `h5feed.loading` can decode stored rows straight into
their place in the batch, and `__call__` copies each item's rows once into a batch
allocated once (no cat, no pad), in shared memory inside a DataLoader worker.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h5feed.flavors import IGNORE_TOKEN_ID, TARGET_PROBS_ARRAYS, Flavor, FlavorName, get_flavor
from h5feed.placement import place_items
from h5feed.store import HIDDEN_ARRAYS, Allocator, StoreInfo, shared_allocator

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
    # speculators: the documents' lengths as the trainer cuts them; Model-Optimizer: each item's rows before the cut
    lengths: list[int] = field(default_factory=list)


class TrainerCollate:
    """A trainer's collate: `collate(items)` builds its batch; `plan`/`specs` describe the batch for direct decoding.

    `hidden_states_dtype` is the dtype of the hidden-state keys in batches built
    from the store.  The trainers' collates keep the items' dtype except
    speculators 0.7+'s `CollateFn`, which casts to its `dtype`: that collate casts to
    `hidden_states_dtype` in `__call__` too.

    The decode-into-batch path uses the collate bound to the store it reads
    (`for_store`): some layouts depend on what the store holds (NeMo's seq_length and
    target distribution, Model-Optimizer's norm flag, AngelSlim's keys).
    """

    row_keys: tuple[RowKey, ...]
    keys: tuple[str, ...]  # tensor keys of the batch as laid out in memory (`finish` gives the trainer's structure)
    casts_hidden_states = False  # `__call__` casts the hidden-state keys to hidden_states_dtype
    info: StoreInfo | None = None  # the store the decode-into-batch path reads (`for_store`)

    def __init__(self, flavor: Flavor, max_len: int | None, hidden_states_dtype: torch.dtype | None) -> None:
        self.flavor = flavor
        self.max_len = max_len
        self.hidden_states_dtype = hidden_states_dtype

    def __repr__(self) -> str:
        return f"trainer_collate({self.flavor.name!r}, max_len={self.max_len})"

    # --- the layout --------------------------------------------------------------------------
    def for_store(self, info: StoreInfo) -> TrainerCollate:
        """This collate as it lays out batches decoded from a store described by `info` (a copy)."""
        bound = copy.copy(self)
        bound.info = info
        bound._take_from_store(info)
        return bound

    def _take_from_store(self, info: StoreInfo) -> None:
        """What the layout takes from its store, set on the bound copy."""

    def trailing(self) -> dict[str, TensorSpec]:
        """Each row key's per-position shape and dtype in batches from the bound store: (width,) and
        `hidden_states_dtype` for hidden states, the stored shape and dtype for other arrays, () int64 for the
        keys h5feed computes."""
        assert self.info is not None, "bind the collate to its store first (for_store)"
        out: dict[str, TensorSpec] = {}
        for rk in self.row_keys:
            if rk.array is None:
                out[rk.key] = ((), torch.long)
            elif rk.array in HIDDEN_ARRAYS:
                out[rk.key] = ((self.info.width(rk.array),), self.hidden_states_dtype or self.info.torch_dtype)
            else:
                shape = (self.info.width(rk.array),) if self.info.is_matrix(rk.array) else ()
                out[rk.key] = (shape, self.info.logical_dtype(rk.array))
        return out

    def item_rows(self, num_tokens: int) -> int:
        """Rows an item of a stored sample of `num_tokens` tokens has once the collate sees it."""
        return self.flavor.tokens_to_read(num_tokens, self.max_len)

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
        """Write what the trainer's dataset computes rather than reads (position_ids, attention_mask, ...).

        Positions past an item's decoded rows that it writes must be written in every batch (the ring's
        dirty marks only cover decoded rows)."""
        raise NotImplementedError

    def finish(self, batch: Batch) -> Batch:
        """The trainer's batch from the laid-out one: its structure and key order (the loaders call it last)."""
        return batch

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
        return self.finish(batch)


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


def padded_plan(rows: Sequence[int]) -> BatchPlan:
    """Every item in its own row from position 0, the batch as long as the longest."""
    return BatchPlan(len(rows), max(rows), [Placement(b, 0, count) for b, count in enumerate(rows)])


def host_to(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A small CPU tensor on `like`'s device; to a GPU through page-locked memory, without waiting.

    Why: a plain CPU-to-GPU copy waits for everything queued on the stream, which on the GPU
    decode path is the decode itself: the batch's few computed values must not wait for it."""
    if like.device.type == "cpu":
        return values
    return values.pin_memory().to(like.device, non_blocking=True)


def ones_where_items(tensor: torch.Tensor, plan: BatchPlan) -> None:
    """An attention mask: ones over each item's positions (pads are zeroed with the other row keys')."""
    for place in plan.placements:
        tensor[place.row, place.offset : place.offset + place.count] = 1


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


class PaddedRowsCollate(TrainerCollate):
    """What SpecForge's and AngelSlim's `DataCollatorWithPadding` share: each [1, T] item in its own row from
    position 0, zero-padded to the longest, with an attention mask of ones over the items' positions."""

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        return padded_plan(rows)

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        return BatchPlan(batch_size, longest, [])

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        ones_where_items(batch["attention_mask"], plan)

    def item_length(self, item: Batch) -> int:
        return int(item["input_ids"].shape[1])

    def item_rows_of(self, item: Batch, key: str) -> torch.Tensor:
        return item[key][0]  # items carry a leading batch dim of 1


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


NEMO_CACHE_KEYS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs")


class NemoCollate(TrainerCollate):
    """NeMo Automodel `_collate_cached`: the cache's items, each its seq_length S long, stacked (`torch.stack`
    of each key, in the reader's order).

    Decoded from the store, each sample's T stored rows go in place and the rest of its item is rebuilt as the
    flavor's items rebuild it: the ids' padding (the pad id, then the shift's 0), attention_mask ones over T,
    zeros past T in the other keys; a top-k store's values and indices are decoded beside the batch and
    scattered back to the draft vocabulary's width."""

    keys: tuple[str, ...] = NEMO_CACHE_KEYS
    row_keys = (
        RowKey("input_ids", "input_ids"),
        RowKey("attention_mask", None),
        RowKey("loss_mask", "loss_mask"),
        RowKey("aux_hidden_states", "aux_hidden_states"),
        RowKey("position_mask", "position_mask"),
        RowKey("target_probs", "target_probs"),
    )
    seq_length: int | None = None  # S, from the store (for_store); items: their own length
    top_k = False  # the store holds target_probs_values and target_probs_indices, not target_probs

    def _take_from_store(self, info: StoreInfo) -> None:
        self.seq_length = int(info.source_info["seq_length"])
        if "target_probs" not in info.extra_arrays:
            top_k = TARGET_PROBS_ARRAYS[1]
            self.top_k = True
            self.row_keys = (*self.row_keys[:-1], RowKey("target_probs", None), *(RowKey(a, a) for a in top_k))
            self.keys = (*NEMO_CACHE_KEYS, *top_k)

    def trailing(self) -> dict[str, TensorSpec]:
        assert self.info is not None
        out = super().trailing()
        out["position_mask"] = ((1,), out["position_mask"][1])  # the cache's [S, 1]
        if self.top_k:
            values = TARGET_PROBS_ARRAYS[1][0]
            out["target_probs"] = ((int(self.info.source_info["draft_vocab_size"]),), out[values][1])
        return out

    def plan(self, rows: Sequence[int]) -> BatchPlan:
        return BatchPlan(len(rows), self.seq_length or max(rows), [Placement(b, 0, n) for b, n in enumerate(rows)])

    def largest_plan(self, batch_size: int, longest: int) -> BatchPlan:
        return BatchPlan(batch_size, self.seq_length or longest, [])

    def derive_rows(self, batch: Batch, plan: BatchPlan) -> None:
        """Every position past T is written here or zeroed as a pad, in every batch."""
        ones_where_items(batch["attention_mask"], plan)
        ids, s = batch["input_ids"], plan.positions
        for place in plan.placements:
            if 0 < place.count < s:
                ids[place.row, place.count :] = ids[place.row, place.count - 1]  # the pad id, shifted left
                ids[place.row, s - 1] = 0  # the shift's zero fill
        if self.top_k:
            probs, values, indices = batch["target_probs"], batch["target_probs_values"], batch["target_probs_indices"]
            for place in plan.placements:
                t = place.count
                probs[place.row, :t].zero_()
                probs[place.row, :t].scatter_(-1, indices[place.row, :t].to(torch.long), values[place.row, :t])

    def finish(self, batch: Batch) -> Batch:
        return {key: batch[key] for key in NEMO_CACHE_KEYS}

    def item_length(self, item: Batch) -> int:
        return int(item["input_ids"].shape[0])


_COLLATES: dict[str, Callable[[Flavor, int | None, torch.dtype | None], TrainerCollate]] = {
    "speculators-legacy": lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=True),
    "speculators": lambda f, m, d: SpeculatorsCollate(f, m, d, legacy=False),
    "specforge": lambda f, m, d: SpecForgeCollate(f, m, d, shifted=False),
    "specforge-shifted": lambda f, m, d: SpecForgeCollate(f, m, d, shifted=True),
    "modelopt": lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=False, prenorm_flag=True),
    "modelopt-answer-only": lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=True, prenorm_flag=True),
    "modelopt-0.45": lambda f, m, d: ModelOptCollate(f, m, d, answer_only_loss=False, prenorm_flag=False),
    "angelslim": AngelSlimCollate,
    "nemo-eagle3": NemoCollate,
}


def trainer_collate(
    flavor: FlavorName | str, max_len: int | None = None, *, hidden_states_dtype: torch.dtype | None = None
) -> TrainerCollate:
    """The collate of the flavor's trainer, for `DataLoader(collate_fn=...)` over h5feed's items: one entry
    point for every flavor, the same layout BatchLoader decodes into.

    Args:
        flavor: ``speculators-legacy`` (0.4 `create_collate_fn(max_len)`), ``speculators``
            (0.7+ `CollateFn(max_len, ..., preprocess=shift_batch)`), ``specforge`` or
            ``specforge-shifted`` (`DataCollatorWithPadding`), ``modelopt``, ``modelopt-answer-only``,
            ``modelopt-0.45`` (`EagleOfflineDataCollator(training_seq_len)`), ``angelslim``
            (`DataCollatorWithPadding`), ``nemo-eagle3`` (`_collate_cached`).
        max_len: the trainer's max_len / total_seq_len / training_seq_len (speculators packs into it,
            Model-Optimizer pads or cuts to it; SpecForge's items are already cut to it); None for
            AngelSlim and NeMo, whose collates take the items' lengths.
        hidden_states_dtype: speculators 0.7+: `CollateFn`'s `dtype` (default bfloat16).  Others
            keep their items' dtype; for them this is the dtype `BatchLoader` decodes into.
    """
    f = get_flavor(flavor)
    dtype = hidden_states_dtype or f.default_hidden_states_dtype
    return _COLLATES[f.name](f, max_len, dtype)
