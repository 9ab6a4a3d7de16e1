"""Tencent AngelSlim's ``rank_*/rows_*/data_{i}.ckpt`` files (HF and vLLM backends)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Companion, Detected, Detection, ExtraArray
from h5feed.formats.checks import (
    CheckedSample,
    aux_and_last,
    fmt_shape,
    is_integer_dtype,
    mask_vector,
    refuse_unknown_keys,
    require_keys,
    require_tensor,
    token_vector,
)
from h5feed.formats.registry import register_format
from h5feed.formats.safe_load import load_torch_dict
from h5feed.formats.specforge import CKPT_FILES
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm, dtype_name

__all__ = ["AngelSlimCkpt", "position_ids_from_rows", "position_ids_to_rows"]


# How AngelSlim's backends shape `position_ids`, and how to take it to [T, width] (token-major) and back.
_POSITION_LAYOUTS: dict[tuple[int, ...], str] = {(-1,): "[T]", (1, -1): "[1, T]", (3, -1): "[3, T]",
                                                  (3, 1, -1): "[3, 1, T]"}


def position_ids_to_rows(p: torch.Tensor) -> torch.Tensor:
    """AngelSlim's `position_ids` ([T], [1, T], [3, T] or [3, 1, T]) as token-major rows: [T] or [T, 3]."""
    return p.reshape(-1, p.shape[-1]).t().squeeze(-1) if p.dim() > 1 else p


def position_ids_from_rows(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of `position_ids_to_rows` for the shape `layout` recorded at conversion."""
    t = rows.shape[0]
    planes = rows.reshape(t, -1).t()  # [1 or 3, T]
    return {"[T]": planes[0], "[1, T]": planes, "[3, T]": planes, "[3, 1, T]": planes[:, None, :]}[layout]


@register_format
class AngelSlimCkpt(TorchDictFormat):
    """F: AngelSlim ``rank_<r>/rows_<s>-<s+5000>/data_<i>.ckpt``: ``hidden_states`` [1, T, K*H] is the AUX concat,
    ``target_hiddens`` [1, T, H] the last state, ``input_ids`` and ``loss_mask`` [1, T]; the vLLM backend adds
    ``inputs_embeds`` [1, T, H] and ``position_ids`` (possibly None), kept as optional arrays.
    ``vocab_mapping.pt`` beside the rank folders is kept in the store.

    The HF backend's ``target_hiddens`` is post-norm; the vLLM backend's is post-norm unless its norm hook did
    not fire, when it falls back to the pre-norm state and says so only in its log: such files need the
    user's ``--last-state-norm``.
    """

    name = "angelslim-ckpt"
    detection = Detection(Detected.BY_NAME, CKPT_FILES, CKPT_FILES, ("AngelSlim ('hidden_states' + 'target_hiddens')",))
    last_state_norm: LastStateNorm | None = None
    pattern = re.compile(r"data_(\d+)\.ckpt")
    what = "data_{i}.ckpt"
    extensions = (".ckpt",)
    norm_hint = ("AngelSlim's vLLM backend writes the post-norm state unless its norm hook did not fire, and "
                 "then the pre-norm one, saying so only in its log")
    _required = ("input_ids", "loss_mask", "hidden_states", "target_hiddens")
    _optional = ("inputs_embeds", "position_ids")  # written by the vLLM backends

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return "target_hiddens" in keys

    def _check(self, path: Path, d: dict) -> CheckedSample:
        require_keys(path, d, self._required, self.name)
        refuse_unknown_keys(path, d, self._required + self._optional, self.name)
        for key in ("input_ids", "loss_mask"):
            if require_tensor(path, d, key).dim() != 2:
                raise SourceError(path, f"{key!r} must be [1, T] as AngelSlim writes it, got shape {fmt_shape(d[key])}")
        ids = token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = aux_and_last(path, d, "hidden_states", "target_hiddens", ids.shape[0], batched=True)
        t = shape.num_tokens
        mask = mask_vector(path, d["loss_mask"], "loss_mask", t, allow_batch_dim=True)
        layout: dict[str, Any] = {"keys": list(d), "none": [k for k in self._optional if k in d and d[k] is None]}
        extras: dict[str, torch.Tensor] = {}
        embeds = d.get("inputs_embeds")
        if embeds is not None:
            extras["inputs_embeds"] = self._embeddings(path, embeds, d["target_hiddens"])
        positions = d.get("position_ids")
        if positions is not None:
            layout["position_ids"] = self._position_layout(path, positions, t)
            extras["position_ids"] = position_ids_to_rows(positions)
        norm: LastStateNorm | None = "post" if not any(k in d for k in self._optional) else None
        specs = tuple(ExtraArray(k, dtype_name(v.dtype), int(v.shape[1]) if v.dim() == 2 else 1) for k, v in extras.items())
        shape = replace(shape, extras=specs, layout=json.dumps(layout), last_state_norm=norm)
        return CheckedSample(ids, mask, aux, last, shape, extras)

    @staticmethod
    def _embeddings(path: Path, embeds: Any, last: torch.Tensor) -> torch.Tensor:
        """`inputs_embeds` [1, T, H], in the last state's shape and dtype, as [T, H]."""
        if not isinstance(embeds, torch.Tensor):
            raise SourceError(path, f"'inputs_embeds' is {_describe(embeds)}, expected a tensor [1, T, H] or None")
        if embeds.dim() == 3 and embeds.shape[1] != last.shape[1]:
            raise SourceError(path, f"'inputs_embeds' has {embeds.shape[1]} tokens but 'input_ids' has {last.shape[1]}")
        if embeds.shape != last.shape or embeds.dtype != last.dtype:
            raise SourceError(path, f"'inputs_embeds' is {fmt_shape(embeds)} {embeds.dtype}; expected "
                              f"{fmt_shape(last)} {last.dtype}, as 'target_hiddens'")
        return embeds[0]

    @staticmethod
    def _position_layout(path: Path, p: Any, t: int) -> str:
        if not isinstance(p, torch.Tensor) or not is_integer_dtype(p.dtype) or p.dtype not in (torch.int64, torch.int32):
            raise SourceError(path, f"'position_ids' is {_describe(p)}, expected an int64 or int32 tensor")
        layout = _POSITION_LAYOUTS.get((*p.shape[:-1], -1)) if p.dim() else None
        if layout is None or p.shape[-1] != t:
            raise SourceError(path, f"'position_ids' has shape {fmt_shape(p)}; expected [T], [1, T], [3, T] or "
                              f"[3, 1, T] with T = {t}")
        return layout

    def companions(self, root: Path) -> list[Companion]:
        path = Path(os.path.abspath(root)) / "vocab_mapping.pt"
        if not path.is_file():
            return []
        mapping = load_torch_dict(path)  # a pickle that needs code is refused here
        for key in ("d2t", "t2d"):
            if not isinstance(mapping.get(key), torch.Tensor):
                raise SourceError(path, f"is not AngelSlim's vocab mapping: no tensor {key!r} "
                                  f"(found keys: {', '.join(map(repr, mapping)) or 'none'})")
        return [Companion(path, "vocab_mapping.pt", copy=True)]


def _describe(v: Any) -> str:
    return f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
