"""NVIDIA Model-Optimizer's ``<conversation_id>.pt`` dumps (its HF, vLLM and TRT-LLM dumpers)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Detected, Detection
from h5feed.formats.checks import (
    CheckedSample,
    aux_and_last,
    mask_vector,
    refuse_unknown_keys,
    require_keys,
    token_vector,
)
from h5feed.formats.registry import register_format
from h5feed.formats.speculators import PT_FILES
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm

__all__ = ["ModelOptPt"]


@register_format
class ModelOptPt(TorchDictFormat):
    """E: Model-Optimizer ``<conversation_id>.pt``: ``hidden_states`` [T, H] is the LAST state (not a list), the aux
    concat [T, K*H] is ``aux_hidden_states`` (HF and vLLM dumpers, newer TRT-LLM) or ``hidden_state_features``
    (the TRT-LLM dumper), with ``loss_mask`` [T] (not in the first release) and ``conversation_id``.

    The last state's norm is what a file says (the optional ``hidden_states_prenorm`` flag Model-Optimizer's
    dataset reads; ``hidden_state_features`` marks TRT-LLM, whose capture of the last layer is post-norm) or
    what the user states: the HF dumper writes the post-norm state and the vLLM dumper the pre-norm one, and
    neither says which (see `last_state_norm_of`).
    """

    name = "modelopt-pt"
    # any *.pt file may be a dump: they count only where the data_{i}.pt search passed over nothing but them, and
    # their keys are told apart from speculators' (a dump may be named data_{i}.pt)
    detection = Detection(Detected.BY_LEFTOVERS, "Model-Optimizer's <conversation_id>.pt", PT_FILES,
                          ("Model-Optimizer ('hidden_states' + 'aux_hidden_states' or 'hidden_state_features')",))
    last_state_norm: LastStateNorm | None = None
    pattern = re.compile(r"(.+)\.pt")
    what = "<conversation_id>.pt"
    extensions = (".pt",)
    numbered = False
    norm_hint = ("Model-Optimizer's HF and TRT-LLM dumpers write the post-norm state and its vLLM dumper the "
                 "pre-norm one; only the optional 'hidden_states_prenorm' flag says which")
    aux_keys = ("aux_hidden_states", "hidden_state_features")
    _known_keys = ("input_ids", "hidden_states", *aux_keys, "loss_mask", "conversation_id", "hidden_states_prenorm")

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return "hidden_states" in keys and any(k in keys for k in self.aux_keys)

    def _check(self, path: Path, d: dict) -> CheckedSample:
        require_keys(path, d, ("input_ids", "hidden_states"), self.name)
        aux_key = next((k for k in self.aux_keys if k in d), None)
        if aux_key is None:
            raise SourceError(path, f"has neither 'aux_hidden_states' nor 'hidden_state_features' (the aux layers) for "
                              f"format {self.name} (found keys: {', '.join(map(repr, d))})")
        refuse_unknown_keys(path, d, self._known_keys, self.name)
        if isinstance(d["hidden_states"], (list, tuple)):
            raise SourceError(path, "'hidden_states' is a list, as in a speculators legacy file; in a Model-Optimizer "
                              "dump it is the last hidden state [T, H]")
        ids = token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = aux_and_last(path, d, aux_key, "hidden_states", ids.shape[0], batched=False)
        mask = mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens)
        _check_conversation_id(path, d.get("conversation_id"))
        return CheckedSample(ids, mask, aux, last, replace(shape, last_state_norm=_stated_norm(path, d, aux_key)))


def _check_conversation_id(path: Path, conversation_id: Any) -> None:
    """Model-Optimizer names each dump `<conversation_id>.pt`: the store keeps the id as that name
    (`index/source_path`), so a renamed file would record a wrong id."""
    if conversation_id is None:
        return
    if isinstance(conversation_id, bool) or not isinstance(conversation_id, (str, int)):
        raise SourceError(path, f"'conversation_id' is a {type(conversation_id).__name__}, expected a string or an int")
    if f"{conversation_id}.pt" != path.name:
        raise SourceError(path, f"'conversation_id' is {conversation_id!r} but the file is named {path.name}: "
                          "Model-Optimizer names each dump <conversation_id>.pt and the store keeps the id as the "
                          "file name, so the two must agree")


def _stated_norm(path: Path, d: dict, aux_key: str) -> LastStateNorm | None:
    flag = d.get("hidden_states_prenorm")
    if isinstance(flag, torch.Tensor) and flag.numel() == 1:
        flag = flag.item()
    if flag is not None:
        if not isinstance(flag, (bool, int)):
            raise SourceError(path, f"'hidden_states_prenorm' is a {type(flag).__name__}, expected a bool")
        return "pre" if flag else "post"
    return "post" if aux_key == "hidden_state_features" else None
