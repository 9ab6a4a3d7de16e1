"""The collates of Model-Optimizer, AngelSlim and NeMo Automodel, for the items of their flavors.

Each restates the released collate (notes/trainer_semantics.md §6-8), so that batches of
h5feed's items equal, tensor for tensor, what the trainer's own collate makes of its own
dataset's items:

- ``modelopt*``: Model-Optimizer `EagleOfflineDataCollator(train_len)`: every key zero-padded or
  cut to `train_len` and stacked; the hidden states under `base_model_outputs`, with
  `base_hidden_prenorm` (0.46+), which must be the same for the whole batch.
- ``angelslim``: AngelSlim `DataCollatorWithPadding`: [1, T] items concatenated into [B, N],
  zero-padded to the longest; `inputs_embeds` and `position_ids` are not batched (its LLM path).
- ``nemo-eagle3``: NeMo Automodel `_collate_cached`: the fixed-length items stacked.

They live here until h5feed/collate.py (speculators, SpecForge: `trainer_collate`) takes them in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from h5feed.flavors import get_flavor

Batch = dict[str, Any]
Collate = Callable[[Sequence[dict[str, Any]]], Batch]

_MODELOPT_TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "labels")
_MODELOPT_HIDDEN_KEYS = ("base_model_hidden_states", "aux_hidden_states")
NEMO_CACHE_KEYS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask", "target_probs")


def _stack_to_length(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """[B, length, ...]: each tensor's first `length` rows, zero-padded to `length`."""
    out = tensors[0].new_zeros((len(tensors), length, *tensors[0].shape[1:]))
    for row, tensor in enumerate(tensors):
        n = min(length, tensor.shape[0])
        out[row, :n] = tensor[:n]
    return out


class ModelOptCollate:
    """Model-Optimizer `EagleOfflineDataCollator(train_len)` (0.44 to 0.46)."""

    def __init__(self, train_len: int) -> None:
        self.train_len = train_len

    def __call__(self, features: Sequence[dict[str, Any]]) -> Batch:
        batch: Batch = {k: _stack_to_length([f[k] for f in features], self.train_len) for k in _MODELOPT_TOKEN_KEYS}
        outputs: Batch = {k: _stack_to_length([f[k] for f in features], self.train_len) for k in _MODELOPT_HIDDEN_KEYS}
        if "base_hidden_prenorm" in features[0]:
            flags = {bool(f["base_hidden_prenorm"]) for f in features}
            if len(flags) > 1:
                raise ValueError(f"base_hidden_prenorm is not constant across the batch (got {flags}); "
                                 "do not mix pre-norm and post-norm dumps")
            outputs["base_hidden_prenorm"] = flags.pop()
        batch["base_model_outputs"] = outputs
        return batch


class AngelSlimCollate:
    """AngelSlim `DataCollatorWithPadding` (its LLM offline path)."""

    def __call__(self, features: Sequence[dict[str, Any]]) -> Batch:
        longest = max(f["input_ids"].shape[1] for f in features)

        def padded(key: str) -> torch.Tensor:
            return _stack_to_length([f[key][0] for f in features], longest)

        batch: Batch = {k: padded(k) for k in ("input_ids", "attention_mask", "loss_mask")}
        for key in ("hidden_states", "target_hiddens"):
            batch[key] = padded(key) if all(key in f for f in features) else None
        return batch


class NemoCollate:
    """NeMo Automodel `_collate_cached`: `torch.stack` of each cache key, in the reader's key order."""

    def __call__(self, features: Sequence[dict[str, Any]]) -> Batch:
        return {key: torch.stack([f[key] for f in features], dim=0) for key in NEMO_CACHE_KEYS}


def pipeline_collate(flavor: str, max_len: int | None = None) -> Collate:
    """The collate of the flavor's trainer; `max_len` is Model-Optimizer's `training_seq_len` (required there)."""
    name = get_flavor(flavor).name
    if name.startswith("modelopt"):
        if max_len is None:
            raise ValueError(f"flavor {name!r}: Model-Optimizer's collate pads or cuts to training_seq_len: "
                             "max_len is required")
        return ModelOptCollate(max_len)
    if name == "angelslim":
        return AngelSlimCollate()
    if name == "nemo-eagle3":
        return NemoCollate()
    raise ValueError(f"flavor {name!r} is served by h5feed.collate.trainer_collate, not here")
