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
- ``modelopt``: NVIDIA Model-Optimizer 0.46+ `OfflineSupervisedDataset` (answer_only_loss=False:
  loss mask of ones; ``modelopt-answer-only``: the stored one), with `labels` and
  `base_hidden_prenorm`; ``modelopt-0.45``: releases before that flag (post-norm only).
- ``angelslim``: Tencent AngelSlim `OfflineEagle3Dataset` (the stored dict, batch dim kept,
  plus `attention_mask`).
- ``nemo-eagle3``: NVIDIA NeMo Automodel `CachedEagle3Dataset` (every sample padded to the
  cache's seq_length, ids pre-shifted, the full draft-vocab target distribution).

A flavor also says how many tokens of a sample its trainer can ever use, so the
reader never touches rows the collate would cut away, which optional arrays it
reads, and what a store must hold to serve it (`check_store`): a NeMo cache has no
last state and no token 0, and the other stores have no target distribution.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from h5feed.errors import StoreError, unknown_name
from h5feed.formats import position_ids_from_rows
from h5feed.store import Allocator, LastStateNorm, RawSample, StoreInfo

FlavorName = Literal["speculators-legacy", "speculators", "specforge", "specforge-shifted", "modelopt",
                     "modelopt-answer-only", "modelopt-0.45", "angelslim", "nemo-eagle3"]
Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
Item = dict[str, Any]
Build = Callable[[RawSample, StoreInfo, "torch.dtype | None", "Transform | None", Allocator], Item]
TARGET_PROBS_ARRAYS = (("target_probs",), ("target_probs_values", "target_probs_indices"))
_NORM_WORDS = {"pre": "before the final norm (pre-norm)", "post": "after the final norm (post-norm)"}


@dataclass(frozen=True)
class Flavor:
    name: FlavorName
    last_state_norm: LastStateNorm | None  # what the trainer's last state must be; None: either (the item says)
    default_hidden_states_dtype: torch.dtype | None  # None: keep the stored dtype
    extra_tokens: int  # tokens read beyond max_len: the shift needs one more
    build: Build
    needs_target_probs: bool = False  # serves a NeMo cache (and only that); the others need a last state
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
        if not info.has_last_state or info.ids_shifted:
            raise StoreError(path, f"flavor {self.name!r} needs the verifier's last hidden state and every token from "
                             f"token 0, but this store ({whence}) holds no last hidden state and its input_ids and "
                             "loss_mask are shifted left by one (token 0 is gone), as a NeMo Automodel EAGLE-3 cache "
                             "stores them: serve it with flavor 'nemo-eagle3'")
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


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, allocate: Allocator) -> torch.Tensor:
    """`tensor.to(dtype)`, but into memory from `allocate` (shared memory in a worker: no copy on hand-off)."""
    if dtype is None or tensor.dtype == dtype:
        return tensor
    return allocate(tuple(tensor.shape), dtype).copy_(tensor)


def _speculators_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
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


def _specforge_item(
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
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
    raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None, allocate: Allocator
) -> Item:
    item = _specforge_item(raw, info, dtype, None, allocate)
    item["target"] = _shift_left(item["target"], allocate)
    item["input_ids"] = _shift_left(item["input_ids"], allocate)
    return transform(item) if transform is not None else item


def _modelopt_item(answer_only_loss: bool, prenorm_key: bool) -> Build:
    """Model-Optimizer `OfflineSupervisedDataset.__getitem__`: labels = ids shifted left with -100 at the end;
    loss mask of ones unless answer_only_loss; 0.46+ adds `base_hidden_prenorm` (the consumer re-applies the
    final norm when it is True), here from the norm the store recorded."""

    def build(raw: RawSample, info: StoreInfo, dtype: torch.dtype | None, transform: Transform | None,
              allocate: Allocator) -> Item:
        ids = raw.input_ids
        labels = torch.full_like(ids, IGNORE_TOKEN_ID)
        labels[:-1] = ids[1:]
        assert raw.last_hidden_state is not None  # check_store refused stores without one
        item: Item = {
            "input_ids": ids,
            "base_model_hidden_states": _cast(raw.last_hidden_state, dtype, allocate),
            "aux_hidden_states": _cast(raw.aux_hidden_states, dtype, allocate),
            "attention_mask": torch.ones_like(ids),
            "loss_mask": raw.loss_mask if answer_only_loss else torch.ones_like(ids),
            "labels": labels,
        }
        if prenorm_key:
            item["base_hidden_prenorm"] = info.last_state_norm == "pre"
        return transform(item) if transform is not None else item

    return build


IGNORE_TOKEN_ID = -100  # transformers' LabelSmoother.ignore_index, which Model-Optimizer's labels use


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
        "hidden_states": _cast(raw.aux_hidden_states, dtype, allocate)[None],
        "target_hiddens": _cast(raw.last_hidden_state, dtype, allocate)[None],
    }
    if "inputs_embeds" in raw.extras:
        tensors["inputs_embeds"] = _cast(raw.extras["inputs_embeds"], dtype, allocate)[None]
    if "position_ids" in raw.extras:
        tensors["position_ids"] = position_ids_from_rows(raw.extras["position_ids"], layout["position_ids"])
    none = set(layout.get("none", ()))
    item = {key: None if key in none else tensors[key] for key in layout.get("keys", _ANGELSLIM_KEYS)}
    item["attention_mask"] = torch.ones_like(item["input_ids"])
    return transform(item) if transform is not None else item


_ANGELSLIM_KEYS = ("input_ids", "loss_mask", "hidden_states", "target_hiddens")  # its HF backend's files


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
    aux = _cast(raw.aux_hidden_states, dtype, allocate)
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


FLAVORS: dict[str, Flavor] = {
    f.name: f
    for f in (
        Flavor("speculators-legacy", "pre", torch.float32, 1, _speculators_legacy_item),
        Flavor("speculators", "pre", torch.bfloat16, 1, _speculators_item),
        Flavor("specforge", "post", None, 0, _specforge_item),
        Flavor("specforge-shifted", "post", None, 0, _specforge_shifted_item),
        Flavor("modelopt", None, None, 1, _modelopt_item(False, True), reads_loss_mask=False),
        Flavor("modelopt-answer-only", None, None, 1, _modelopt_item(True, True)),
        Flavor("modelopt-0.45", "post", None, 1, _modelopt_item(False, False), reads_loss_mask=False),
        Flavor("angelslim", "post", None, 0, _angelslim_item, truncates=False,
               extras=lambda info: tuple(n for n in ("inputs_embeds", "position_ids") if n in info.extra_arrays)),
        Flavor("nemo-eagle3", None, None, 0, _nemo_item, needs_target_probs=True, truncates=False,
               extras=_nemo_extras),
    )
}


def flavors_for_norm(norm: LastStateNorm | None) -> list[str]:
    """The flavors whose trainers take a last hidden state of this norm (NeMo's cache, which has none, aside)."""
    return [f.name for f in FLAVORS.values() if f.last_state_norm in (None, norm) and not f.needs_target_probs]


def get_flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(unknown_name("flavor", name, FLAVORS)) from None

