"""What a trainer flavor is, and the registry of them.

A flavor (`Flavor`) says which items its trainer's own Dataset yields from one stored sample
(`build`, a faithful re-statement of its `__getitem__`: see notes/trainer_semantics.md), how many
tokens of a sample the trainer can ever use (so the reader never touches rows the collate would cut
away), which optional arrays it reads, what a store must hold to serve it (`check_store`), and its
trainer's collate (`collate`).

A collate (`TrainerCollate`) builds batches equal, tensor for tensor, to those of the collate the
trainer runs, and describes them as a layout (`plan`: where each sample's rows go, `specs`: the
batch tensors, `derive_rows`: what is computed rather than read, `finish`: the trainer's structure),
so that `h5feed.loading` decodes stored rows straight into their place in the batch; `__call__`
copies each item's rows once into a batch allocated once (no cat, no pad), in shared memory inside a
DataLoader worker.

Each trainer's module (`h5feed.flavors.speculators`, ...) registers its flavors here
(`register_flavors`); `get_flavor` and `trainer_collate` read the registry.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from h5feed.errors import StoreError, unknown_name
from h5feed.loading.placement import place_items
from h5feed.store import HIDDEN_ARRAYS, Allocator, LastStateNorm, RawSample, StoreInfo, shared_allocator

Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Item = dict[str, Any]
Build = Callable[[RawSample, StoreInfo, "torch.dtype | None", "Transform | None", Allocator], Item]
CollateFactory = Callable[["Flavor", "int | None", "torch.dtype | None"], "TrainerCollate"]
Batch = dict[str, Any]
TensorSpec = tuple[tuple[int, ...], torch.dtype]  # shape, dtype
TARGET_PROBS_ARRAYS = (("target_probs",), ("target_probs_values", "target_probs_indices"))
_NORM_WORDS = {"pre": "before the final norm (pre-norm)", "post": "after the final norm (post-norm)"}


@dataclass(frozen=True)
class Flavor:
    name: str  # its name in the registry (`FLAVORS`), which the loaders and `trainer_collate` take
    last_state_norm: LastStateNorm | None  # what the trainer's last state must be; None: either (the item says)
    default_hidden_states_dtype: torch.dtype | None  # None: keep the stored dtype
    extra_tokens: int  # tokens read beyond max_len: the shift needs one more
    build: Build
    collate: CollateFactory  # its trainer's collate: `trainer_collate` builds it
    needs_target_probs: bool = False  # serves a NeMo cache (and only that)
    needs_last_state: bool = True  # False: its items hold the aux states only (SpecForge's DFlash family)
    reads_loss_mask: bool = True  # False: the trainer never looks at the stored loss mask
    truncates: bool = True  # False: the trainer's dataset yields whole samples; max_len does not apply
    extras: Callable[[StoreInfo], tuple[str, ...]] = lambda info: ()  # the optional arrays its items use

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickled by name (DataLoader workers under spawn): builders may be closures."""
        return get_flavor, (self.name,)

    def tokens_to_read(self, num_tokens: int, max_len: int | None) -> int:
        if max_len is None or not self.truncates:
            return num_tokens
        return min(num_tokens, max_len + self.extra_tokens)

    def check_store(self, path: str | os.PathLike[str], info: StoreInfo, max_len: int | None) -> None:
        """Refuse a store that lacks what the trainer's items need, saying what is missing and why."""
        whence = f"converted from {info.source_format}"
        if self.needs_target_probs:
            if not info.ids_shifted or not any(set(names) <= set(info.extra_arrays) for names in TARGET_PROBS_ARRAYS):
                raise StoreError(path, f"flavor {self.name!r} serves NeMo Automodel's cached EAGLE-3 items: it needs "
                                 "the draft-vocab target distribution, position_mask and ids shifted left by one, "
                                 f"which only a store converted from a NeMo EAGLE-3 cache holds ({whence})")
            seq_length = info.source_info["seq_length"]
            if max_len not in (None, seq_length):
                raise ValueError(f"flavor {self.name!r} yields the cache's fixed seq_length ({seq_length}) tokens: "
                                 f"max_len must be None or {seq_length}, not {max_len}")
            return
        if info.ids_shifted:
            raise StoreError(path, f"flavor {self.name!r} needs the verifier's last hidden state and every token from "
                             f"token 0, but this store ({whence}) holds no last hidden state and its input_ids and "
                             "loss_mask are shifted left by one (token 0 is gone), as a NeMo Automodel EAGLE-3 cache "
                             "stores them: serve it with flavor 'nemo-eagle3'")
        if self.needs_last_state and not info.has_last_state:
            raise StoreError(path, f"flavor {self.name!r} needs the verifier's last hidden state, which this store "
                             f"({whence}) does not hold: its samples have the captured layers only, as SpecForge's "
                             "DFlash and Domino files do: serve it with flavor 'specforge-dflash'")
        held, wanted = info.last_state_norm, self.last_state_norm
        if wanted is not None and held != wanted:
            raise StoreError(
                path,
                f"flavor {self.name!r} needs the verifier's last hidden state {_NORM_WORDS[wanted]}, but this store "
                f"holds it {_NORM_WORDS[held]} ({whence}); the two cannot be converted into each other without "  # type: ignore[index]
                f"the verifier's final-norm weight. Flavors that fit this store: {', '.join(flavors_for_norm(held))}",
            )
        if max_len is not None and not self.truncates:
            raise ValueError(f"flavor {self.name!r} yields whole samples, as its trainer's dataset does: "
                             "max_len does not apply (pass None)")


def cast_to(tensor: torch.Tensor, dtype: torch.dtype | None, allocate: Allocator) -> torch.Tensor:
    """`tensor.to(dtype)`, but into memory from `allocate` (shared memory in a worker: no copy on hand-off)."""
    if dtype is None or tensor.dtype == dtype:
        return tensor
    return allocate(tuple(tensor.shape), dtype).copy_(tensor)


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


FLAVORS: dict[str, Flavor] = {}  # by name, in the order the trainers' modules registered them


def register_flavors(*flavors: Flavor) -> None:
    """Make flavors known by name (each trainer's module registers its own when it is imported)."""
    for flavor in flavors:
        if flavor.name in FLAVORS:
            raise ValueError(f"a flavor named {flavor.name!r} is registered already")
        FLAVORS[flavor.name] = flavor


def flavors_for_norm(norm: LastStateNorm | None) -> list[str]:
    """The flavors whose trainers take a last hidden state of this norm (NeMo's cache, which has none, aside)."""
    return [f.name for f in FLAVORS.values() if f.last_state_norm in (None, norm) and not f.needs_target_probs]


def get_flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(unknown_name("flavor", name, FLAVORS)) from None


def trainer_collate(
    flavor: str, max_len: int | None = None, *, hidden_states_dtype: torch.dtype | None = None
) -> TrainerCollate:
    """The collate of the flavor's trainer, for `DataLoader(collate_fn=...)` over h5feed's items: one entry
    point for every flavor, the same layout BatchLoader decodes into.

    Args:
        flavor: ``speculators-legacy`` (0.4 `create_collate_fn(max_len)`), ``speculators``
            (0.7+ `CollateFn(max_len, ..., preprocess=shift_batch)`), ``specforge`` or
            ``specforge-shifted`` (`DataCollatorWithPadding`), ``specforge-dflash``, ``specforge-dspark``
            (SpecForge 0.2's `pad_and_concatenate_features`), ``modelopt``, ``modelopt-answer-only``,
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
    return f.collate(f, max_len, dtype)
