"""SpecForge's ``data_{i}.ckpt`` (or gzipped ``.ckpt.gz``) files, from each of its offline pipelines.

EAGLE-3 and DSpark write the same two arrays under other keys: the captured layers concatenated and the
post-norm last state (DSpark applies ``lm_head`` to it directly).  `SpecForgeCkpt` reads each file by the key
set it has, so a folder holding both kinds converts into one store whose arrays mean the same.

DFlash and Domino (and DFlash2, whose files are DFlash's) keep the captured layers only: ``hidden_states``
[1, T, K*H], K the draft's ``dflash_config.target_layer_ids``, and no last state.  Nothing in such a file tells H
from K, so `SpecForgeDFlashCkpt` reads them from the ``config.json`` at the top of the source folder: the
verifier's (its ``hidden_size``) or the DFlash draft's (its ``hidden_size`` is the verifier's, and its
``target_layer_ids`` give K), which the store keeps.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import Companion, Detected, Detection, SampleShape, SourceFormat, SourceSample
from h5feed.formats.checks import (
    CheckedSample,
    aux_and_last,
    fmt_shape,
    mask_vector,
    require_keys,
    require_tensor,
    token_vector,
)
from h5feed.formats.discovery import SourceFile
from h5feed.formats.registry import register_format
from h5feed.formats.safe_load import gz_head_dict, load_torch_dict
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.io.paths import regular_file
from h5feed.store.layout import LastStateNorm

__all__ = ["CKPT_FILES", "DFLASH_KEYS", "DSPARK_KEYS", "EAGLE3_KEYS", "TARGET_CONFIG", "CapturedLayers", "SpecForgeCkpt",
           "SpecForgeDFlashCkpt"]

# (aux, last) keys of each SpecForge pipeline's files; the last key of DSpark's tells them apart, since AngelSlim's
# files have `hidden_states` too (beside `target_hiddens`).
EAGLE3_KEYS = ("aux_hidden_state", "hidden_state")
DSPARK_KEYS = ("hidden_states", "target_last_hidden_states")
DFLASH_KEYS = ("input_ids", "loss_mask", "hidden_states")  # DFlash, Domino, DFlash2: every key their files hold
CKPT_FILES = "data_{i}.ckpt[.gz]"  # the key group of the formats whose files are named so (AngelSlim's too)
TARGET_CONFIG = "config.json"  # where a DFlash-family source says H (and K)
_MAX_CONFIG_BYTES = 1 << 20  # a model config is a few KB: a larger file is not one, and is not read whole
_PATTERN = re.compile(r"data_(\d+)\.ckpt(?:\.gz)?")
_WHAT = "data_{i}.ckpt or data_{i}.ckpt.gz"
_EXTENSIONS = (".ckpt", ".ckpt.gz")


@register_format
class SpecForgeCkpt(TorchDictFormat):
    """C: SpecForge ``data_{i}.ckpt[.gz]``: ``input_ids`` [T] or [1, T], ``loss_mask`` [T], and either EAGLE-3's
    ``aux_hidden_state`` [1, T, K*H] + ``hidden_state`` [1, T, H] or DSpark's ``hidden_states`` [1, T, K*H] +
    ``target_last_hidden_states`` [1, T, H]; the last state is post-norm in both."""

    name = "specforge-ckpt"
    detection = Detection(Detected.BY_NAME, CKPT_FILES, CKPT_FILES,
                          ("SpecForge EAGLE-3 ('aux_hidden_state' + 'hidden_state')",
                           "SpecForge DSpark ('hidden_states' + 'target_last_hidden_states')"))
    last_state_norm: LastStateNorm | None = "post"
    pattern = _PATTERN
    what = _WHAT
    extensions = _EXTENSIONS

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return EAGLE3_KEYS[0] in keys or DSPARK_KEYS[1] in keys

    def _check(self, path: Path, d: dict) -> CheckedSample:
        aux_key, last_key = _keys_of(path, d)
        require_keys(path, d, ("input_ids", aux_key, last_key), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = aux_and_last(path, d, aux_key, last_key, ids.shape[0], batched=True)
        mask = mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens, allow_batch_dim=True)
        return CheckedSample(ids, mask, aux, last, shape)


def _keys_of(path: Path, d: dict) -> tuple[str, str]:
    """The (aux, last) keys of a file, by the pipeline that wrote it."""
    if EAGLE3_KEYS[0] in d:
        return EAGLE3_KEYS
    if DSPARK_KEYS[1] in d:
        return DSPARK_KEYS
    found = ", ".join(repr(k) for k in d) or "none"
    raise SourceError(path, f"keys ({found}) are neither SpecForge EAGLE-3's ('aux_hidden_state' + 'hidden_state') "
                      "nor SpecForge DSpark's ('hidden_states' + 'target_last_hidden_states'): if another pipeline "
                      "wrote it, name that pipeline's format with --format (SpecForge DFlash's and Domino's files, "
                      "'hidden_states' alone, are specforge-dflash-ckpt and convert into a store of their own)")


@dataclass(frozen=True)
class CapturedLayers:
    """What a DFlash-family source's ``config.json`` says of its files' ``hidden_states`` [1, T, K*H]."""

    path: Path
    hidden_size: int | None  # H: the config's hidden_size (or its text_config's)
    num_layers: int | None  # K: len(dflash_config.target_layer_ids), when the config has them

    def hidden_size_of(self, path: Path, width: int) -> int:
        """H for a file whose ``hidden_states`` are `width` wide, refusing a width the config contradicts."""
        h = self.hidden_size or width // (self.num_layers or 1)
        k = self.num_layers or width // h
        if width == 0 or width != k * h:
            said = " and ".join(part for part in (f"hidden_size {self.hidden_size}" if self.hidden_size else "",
                                                  f"{self.num_layers} target_layer_ids" if self.num_layers else "")
                                if part)
            raise SourceError(path, f"'hidden_states' is {width} wide, but {self.path} says {said}: the file holds K "
                              "captured layers of H values each, K*H wide; convert it with the config of the verifier "
                              "and draft that captured it")
        return h


@register_format
class SpecForgeDFlashCkpt(SourceFormat):
    """C': SpecForge DFlash / Domino / DFlash2 ``data_{i}.ckpt[.gz]``: ``input_ids`` [T] (or [1, T]),
    ``loss_mask`` [T] and ``hidden_states`` [1, T, K*H] (or [T, K*H]), the captured target layers
    concatenated; no last state.  H (or K) comes from the source folder's ``config.json``, kept in the store."""

    name = "specforge-dflash-ckpt"
    # 'hidden_states' is in AngelSlim's and DSpark's files too: asked after them, the files with nothing else claim it
    detection = Detection(Detected.BY_NAME, CKPT_FILES, CKPT_FILES, ("SpecForge DFlash/Domino ('hidden_states' alone)",),
                          asked_last=True)
    last_state_norm: LastStateNorm | None = None
    has_last_state = False
    pattern = _PATTERN
    what = _WHAT
    extensions = _EXTENSIONS

    def __init__(self) -> None:
        self._configs: dict[tuple[str, int], CapturedLayers] = {}
        self._lock = threading.Lock()

    def probe(self, source: SourceFile) -> SampleShape:
        head = gz_head_dict(source.path) if source.path.name.endswith(".gz") else None
        return self._check(source, head if head is not None else load_torch_dict(source.path)).shape

    def load(self, source: SourceFile) -> SourceSample:
        return self._check(source, load_torch_dict(source.path)).materialize(source.path)

    def claims(self, keys: Mapping[str, Any]) -> bool:
        return "hidden_states" in keys

    def companions(self, root: Path) -> list[Companion]:
        layers = self.captured_layers(root)
        return [Companion(layers.path, TARGET_CONFIG, copy=True)]

    def captured_layers(self, root: Path) -> CapturedLayers:
        """What the ``config.json`` at `root` says of H and K (read once per version of the file)."""
        path = Path(os.path.abspath(root)) / TARGET_CONFIG
        try:
            stamp = regular_file(path).stat().st_mtime_ns
        except OSError as exc:
            raise SourceError(path, "missing: SpecForge DFlash-family files hold the captured target layers "
                              "concatenated ('hidden_states' [1, T, K*H]) and no last state, so nothing in them tells "
                              "the hidden size H: copy (or link) the verifier's config.json (its hidden_size), or the "
                              "DFlash draft's config.json (its dflash_config.target_layer_ids give K), into "
                              f"{path.parent}") from exc
        with self._lock:
            cached = self._configs.get((str(path), stamp))
        if cached is None:
            cached = _parse_config(path)
            with self._lock:
                self._configs[(str(path), stamp)] = cached
        return cached

    def _check(self, source: SourceFile, d: dict) -> CheckedSample:
        path = source.path
        _refuse_other_pipelines(path, d)
        require_keys(path, d, DFLASH_KEYS, self.name)
        ids = token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        hidden = _captured_states(path, require_tensor(path, d, "hidden_states"), ids.shape[0])
        h = self.captured_layers(source.root).hidden_size_of(path, int(hidden.shape[1]))
        mask = mask_vector(path, d["loss_mask"], "loss_mask", ids.shape[0], allow_batch_dim=True)
        return CheckedSample(ids, mask, hidden, None, SampleShape(ids.shape[0], h, int(hidden.shape[1]) // h,
                                                                  hidden.dtype))


def _refuse_other_pipelines(path: Path, d: dict) -> None:
    """A file with more than DFlash's keys holds more than a DFlash store keeps: refuse it, saying whose it is."""
    if EAGLE3_KEYS[0] in d or DSPARK_KEYS[1] in d:
        whose = "EAGLE-3" if EAGLE3_KEYS[0] in d else "DSpark"
        raise SourceError(path, f"is a SpecForge {whose} file (it holds a last hidden state), not a DFlash-family one: "
                          "files with and without a last state convert into separate stores (convert this one's "
                          "folder with --format specforge-ckpt)")
    unknown = [k for k in d if k not in DFLASH_KEYS]
    if unknown:
        raise SourceError(path, f"has key(s) {', '.join(map(repr, unknown))} that SpecForge's DFlash-family files do "
                          f"not have ({', '.join(map(repr, DFLASH_KEYS))}); h5feed keeps every key the trainer reads "
                          "and will not drop others in silence")


def _captured_states(path: Path, hidden: torch.Tensor, t: int) -> torch.Tensor:
    """``hidden_states`` as [T, K*H], from [1, T, K*H] or [T, K*H] (what SpecForge's DFlash-family reader takes)."""
    if not hidden.dtype.is_floating_point:
        raise SourceError(path, f"'hidden_states' has dtype {hidden.dtype}; hidden states must be floating point")
    if hidden.dim() == 3 and hidden.shape[0] == 1:
        hidden = hidden[0]
    if hidden.dim() != 2:
        raise SourceError(path, f"'hidden_states' must be [1, T, K*H] (or [T, K*H]), got shape {fmt_shape(hidden)}")
    if hidden.shape[0] != t:
        raise SourceError(path, f"'hidden_states' has {hidden.shape[0]} tokens but 'input_ids' has {t}")
    return hidden


def _parse_config(path: Path) -> CapturedLayers:
    """H (``hidden_size``, or ``text_config.hidden_size``) and K (``dflash_config.target_layer_ids``) of a config."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
        if len(data) > _MAX_CONFIG_BYTES:
            raise SourceError(path, f"is over {_MAX_CONFIG_BYTES} bytes: not a model's config.json")
        config = json.loads(data)
    except OSError as exc:
        raise SourceError(path, f"cannot be read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(path, f"is not JSON ({exc}): expected the verifier's or the DFlash draft's config.json") from exc
    if not isinstance(config, dict):
        raise SourceError(path, "is not a JSON object: expected the verifier's or the DFlash draft's config.json")
    text = config.get("text_config")
    hidden_size = config.get("hidden_size", text.get("hidden_size") if isinstance(text, dict) else None)
    dflash = config.get("dflash_config")
    layer_ids = dflash.get("target_layer_ids") if isinstance(dflash, dict) else None
    if hidden_size is not None and not _positive_int(hidden_size):
        raise SourceError(path, f"hidden_size {hidden_size!r} is not a positive integer")
    if layer_ids is not None and not (isinstance(layer_ids, list) and layer_ids and all(map(_layer_id, layer_ids))):
        raise SourceError(path, f"dflash_config.target_layer_ids {layer_ids!r} is not a list of layer numbers")
    if hidden_size is None and layer_ids is None:
        raise SourceError(path, "says neither hidden_size (the verifier's config.json has it) nor "
                          "dflash_config.target_layer_ids (the DFlash draft's has them): one of them tells the hidden "
                          "size of the files' 'hidden_states' [1, T, K*H]")
    return CapturedLayers(path, hidden_size, len(layer_ids) if layer_ids is not None else None)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _layer_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
