"""speculators' ``data_{i}.pt`` formats: the legacy list of layers and v0's pre-concatenated tensors (0.5+'s
``hs_{i}.safetensors`` are `h5feed.formats.speculators_safetensors`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Detected, Detection, SampleShape
from h5feed.formats.checks import (
    CheckedSample,
    aux_and_last,
    check_hidden,
    fmt_shape,
    mask_vector,
    refuse_unknown_keys,
    require_keys,
    token_vector,
)
from h5feed.formats.registry import register_format
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm

__all__ = ["PT_FILES", "SpeculatorsLegacyPt", "SpeculatorsV0Pt"]

PT_FILES = "data_{i}.pt"  # the key group of the formats whose files are named so (Model-Optimizer's too, named so or not)


_KEYS_OF = {"speculators-legacy-pt": "a 'hidden_states' list", "speculators-v0-pt": "'hidden_state' + 'target'"}


def _one_of_the_other_kind(path: Path, found: str, read_as: str) -> SourceError:
    """A data_{i}.pt file of the other speculators generation among those of one: both are named data_{i}.pt, so
    only their keys tell them apart; say which the file is rather than which keys it lacks."""
    return SourceError(path, f"is a {found} file ({_KEYS_OF[found]}), but this source is read as {read_as} (its "
                       f"first file's format, or --format): convert the two kinds of file from separate folders")


@register_format
class SpeculatorsLegacyPt(TorchDictFormat):
    """A: ``data_{i}.pt`` with ``hidden_states`` = list of K+1 [T, H] tensors (last one pre-norm)."""

    name = "speculators-legacy-pt"
    detection = Detection(Detected.BY_NAME, PT_FILES, PT_FILES, ("speculators legacy ('hidden_states' list)",))
    last_state_norm: LastStateNorm | None = "pre"
    pattern = re.compile(r"data_(\d+)\.pt")
    what = "data_{i}.pt"
    extensions = (".pt",)

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return isinstance(keys.get("hidden_states"), (list, tuple))

    def _check(self, path: Path, d: dict) -> CheckedSample:
        if "hidden_states" not in d and "hidden_state" in d and "target" in d:
            raise _one_of_the_other_kind(path, "speculators-v0-pt", self.name)
        require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        refuse_unknown_keys(path, d, ("input_ids", "hidden_states", "loss_mask"), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids")
        t = ids.shape[0]
        hs = d["hidden_states"]
        if not isinstance(hs, (list, tuple)):
            raise SourceError(
                path,
                f"'hidden_states' is a {type(hs).__name__}, expected a list of K+1 tensors [T, H] "
                "(K auxiliary layers, then the last layer)",
            )
        if len(hs) < 2:
            raise SourceError(
                path,
                f"'hidden_states' is a list of {len(hs)} tensor(s); expected K+1 >= 2 "
                "(K auxiliary layers, then the last layer)",
            )
        first = None
        for j, h in enumerate(hs):
            label = f"'hidden_states'[{j}]"
            if not isinstance(h, torch.Tensor):
                raise SourceError(path, f"{label} is a {type(h).__name__}, expected a tensor [T, H]")
            check_hidden(path, h, label, "[T, H]")
            if h.shape[0] != t:
                raise SourceError(path, f"{label} has {h.shape[0]} tokens but 'input_ids' has {t}")
            if first is None:
                first = h
            elif h.shape[1] != first.shape[1] or h.dtype != first.dtype:
                raise SourceError(
                    path,
                    f"{label} is {fmt_shape(h)} {h.dtype} but 'hidden_states'[0] is "
                    f"{fmt_shape(first)} {first.dtype}; every layer must have the same H and dtype",
                )
        assert first is not None
        mask = mask_vector(path, d.get("loss_mask"), "loss_mask", t)
        return CheckedSample(ids, mask, list(hs[:-1]), hs[-1], SampleShape(t, int(first.shape[1]), len(hs) - 1, first.dtype))


@register_format
class SpeculatorsV0Pt(TorchDictFormat):
    """B: ``data_{i}.pt`` with ``hidden_state`` [T, K*H] and ``target`` [T, H] (post-norm)."""

    name = "speculators-v0-pt"
    detection = Detection(Detected.BY_NAME, PT_FILES, PT_FILES, ("speculators v0 ('hidden_state' + 'target')",))
    last_state_norm: LastStateNorm | None = "post"
    pattern = re.compile(r"data_(\d+)\.pt")
    what = "data_{i}.pt"
    extensions = (".pt",)

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return "hidden_state" in keys and "target" in keys

    def _check(self, path: Path, d: dict) -> CheckedSample:
        if isinstance(d.get("hidden_states"), (list, tuple)) and "hidden_state" not in d:
            raise _one_of_the_other_kind(path, "speculators-legacy-pt", self.name)
        require_keys(path, d, ("input_ids", "hidden_state", "target"), self.name)
        refuse_unknown_keys(path, d, ("input_ids", "hidden_state", "target", "loss_mask"), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids")
        aux, last, shape = aux_and_last(path, d, "hidden_state", "target", ids.shape[0], batched=False)
        return CheckedSample(ids, mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens), aux, last, shape)

