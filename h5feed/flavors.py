"""The items each trainer's own Dataset yields, built from one stored sample.

Each flavor is a faithful re-statement of a trainer's `__getitem__` (see
notes/trainer_semantics.md for the code it follows, key by key):

- ``speculators-legacy``: speculators 0.4 `Eagle3SampleFileDataset` (cast, lengths,
  position_ids, transform, then the shift).
- ``speculators``: speculators 0.5+ `BaseDataset` (no shift; the collate shifts).
- ``specforge``: SpecForge `OfflineEagle3Dataset.process_data` (window of max_len
  tokens, last loss-mask position zeroed, no shift).
- ``specforge-shifted``: the same for SpecForge builds before 2026-01-22, whose
  dataset shifted `input_ids` and `target` left by one with a zero fill.

A flavor also says how many tokens of a sample its trainer can ever use, so the
reader never touches rows the collate would cut away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from h5feed.store import Allocator, LastStateNorm, RawSample

FlavorName = Literal["speculators-legacy", "speculators", "specforge", "specforge-shifted"]
Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Item = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Flavor:
    name: FlavorName
    last_state_norm: LastStateNorm  # what the trainer's `verifier_last_hidden_states` / `target` must be
    default_hidden_states_dtype: torch.dtype | None  # None: keep the stored dtype
    extra_tokens: int  # tokens read beyond max_len: the shift needs one more
    build: Callable[[RawSample, torch.dtype | None, Transform | None, Allocator], Item]

    def tokens_to_read(self, num_tokens: int, max_len: int | None) -> int:
        return num_tokens if max_len is None else min(num_tokens, max_len + self.extra_tokens)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, allocate: Allocator) -> torch.Tensor:
    """`tensor.to(dtype)`, but into memory from `allocate` (shared memory in a worker: no copy on hand-off)."""
    if dtype is None or tensor.dtype == dtype:
        return tensor
    return allocate(tuple(tensor.shape), dtype).copy_(tensor)


def _speculators_item(raw: RawSample, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator) -> Item:
    """speculators `BaseDataset.__getitem__`: standardized keys, cast, lengths, position_ids, transform."""
    t = len(raw.input_ids)
    item: Item = {
        "hidden_states": _cast(raw.aux_hidden_states, dtype, allocate),
        "input_ids": raw.input_ids,
        "verifier_last_hidden_states": _cast(raw.last_hidden_state, dtype, allocate),
        "loss_mask": raw.loss_mask,
        "lengths": torch.tensor([t], dtype=torch.long),
        "position_ids": torch.arange(t, dtype=torch.long),
    }
    return transform(item) if transform is not None else item


def _speculators_legacy_item(
    raw: RawSample, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    """speculators 0.4: the 0.5 item, then `shift_batch` (keys in its order)."""
    item = _speculators_item(raw, dtype, transform, allocate)
    return {
        "input_ids": item["input_ids"][1:],
        "hidden_states": item["hidden_states"][:-1],
        "verifier_last_hidden_states": item["verifier_last_hidden_states"][1:],
        "loss_mask": item["loss_mask"][1:],
        "lengths": item["lengths"] - 1,
        "position_ids": item["position_ids"][1:],
    }


def _specforge_item(raw: RawSample, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator) -> Item:
    """SpecForge `process_data`: batch dim, last loss-mask position of the window zeroed (in place, like SpecForge)."""
    loss_mask = raw.loss_mask[None, :]
    loss_mask[0, -1] = 0
    item: Item = {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": _cast(raw.last_hidden_state, dtype, allocate)[None],
        "hidden_state": _cast(raw.aux_hidden_states, dtype, allocate)[None],
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
    raw: RawSample, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    item = _specforge_item(raw, dtype, None, allocate)
    item["target"] = _shift_left(item["target"], allocate)
    item["input_ids"] = _shift_left(item["input_ids"], allocate)
    return transform(item) if transform is not None else item


FLAVORS: dict[str, Flavor] = {
    f.name: f
    for f in (
        Flavor("speculators-legacy", "pre", torch.float32, 1, _speculators_legacy_item),
        Flavor("speculators", "pre", torch.bfloat16, 1, _speculators_item),
        Flavor("specforge", "post", None, 0, _specforge_item),
        Flavor("specforge-shifted", "post", None, 0, _specforge_shifted_item),
    )
}


def get_flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(f"unknown flavor {name!r}: choose one of {', '.join(FLAVORS)}") from None

