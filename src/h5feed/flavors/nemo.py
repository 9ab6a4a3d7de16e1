"""NVIDIA NeMo Automodel's flavor: the items of its `CachedEagle3Dataset` and its `_collate_cached`.

- ``nemo-eagle3``: every sample padded to the cache's seq_length, ids pre-shifted, the full
  draft-vocab target distribution; the collate stacks the cache's fixed-length items.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from h5feed.flavors.base import (
    TARGET_PROBS_ARRAYS,
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
    ones_where_items,
    register_flavors,
)
from h5feed.store import Allocator, RawSample, StoreInfo


def _nemo_extras(info: StoreInfo) -> tuple[str, ...]:
    return ("position_mask", *next(n for n in TARGET_PROBS_ARRAYS if set(n) <= set(info.extra_arrays)))


def _nemo_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """NeMo Automodel `CachedEagle3Dataset.__getitem__` (cache format 2): the sample padded back to the cache's
    seq_length S, its keys in the reader's order, top-k target probabilities scattered back to full width.

    The padding is rebuilt exactly where the trainer can see it: input_ids (the pad id shifted left, then the
    shift's 0), attention_mask, loss_mask and position_mask.  The pad tokens' aux states and target
    distributions, which the trainer masks out (attention_mask 0, position_mask False), were not kept: zeros."""
    s, t = int(info.source_info["seq_length"]), len(raw.input_ids)
    vocab = int(info.source_info["draft_vocab_size"])

    def padded(tensor: torch.Tensor, *trailing: int) -> torch.Tensor:
        out = allocate((s, *trailing), tensor.dtype)
        out[:t] = tensor.reshape(t, *trailing)
        out[t:] = 0
        return out

    ids = padded(raw.input_ids)
    if t < s:
        ids[t:] = raw.input_ids[t - 1]  # the pad id, where the shifted padding put it
        ids[s - 1] = 0  # the shift's zero fill
    aux = cast_to(raw.aux_hidden_states, dtype, allocate)
    if "target_probs" in raw.extras:
        probs = padded(raw.extras["target_probs"], vocab)
    else:
        values = raw.extras["target_probs_values"]
        probs = allocate((s, vocab), values.dtype)
        probs.zero_()
        probs[:t].scatter_(-1, raw.extras["target_probs_indices"].to(torch.long), values)
    item: Item = {
        "input_ids": ids,
        "attention_mask": padded(torch.ones(t, dtype=torch.int64)),
        "loss_mask": padded(raw.loss_mask),
        "aux_hidden_states": padded(aux, aux.shape[1]),
        "position_mask": padded(raw.extras["position_mask"], 1),
        "target_probs": probs,
    }
    return transform(item) if transform is not None else item


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


register_flavors(
    Flavor("nemo-eagle3", None, None, 0, _nemo_item, NemoCollate, needs_target_probs=True, truncates=False,
           extras=_nemo_extras),
)
