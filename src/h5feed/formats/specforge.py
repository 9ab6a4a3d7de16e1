"""SpecForge's ``data_{i}.ckpt`` (or gzipped ``.ckpt.gz``) files, from its EAGLE-3 or its DSpark pipeline.

Both pipelines write the same files under ``rows_{g}-{g+2000}/`` with other keys for the same two arrays: the
aux layers concatenated and the post-norm last state (DSpark applies ``lm_head`` to it directly).  Each file is
read by the key set it has, so a folder holding both kinds converts into one store whose arrays mean the same.
"""

from __future__ import annotations

import re
from pathlib import Path

from h5feed.errors import SourceError
from h5feed.formats.base import FormatName
from h5feed.formats.checks import CheckedSample, aux_and_last, mask_vector, require_keys, token_vector
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm

__all__ = ["DSPARK_KEYS", "EAGLE3_KEYS", "SpecForgeCkpt"]

# (aux, last) keys of each SpecForge pipeline's files; the last key of DSpark's tells them apart, since AngelSlim's
# files have `hidden_states` too (beside `target_hiddens`).
EAGLE3_KEYS = ("aux_hidden_state", "hidden_state")
DSPARK_KEYS = ("hidden_states", "target_last_hidden_states")


class SpecForgeCkpt(TorchDictFormat):
    """C: SpecForge ``data_{i}.ckpt[.gz]``: ``input_ids`` [T] or [1, T], ``loss_mask`` [T], and either EAGLE-3's
    ``aux_hidden_state`` [1, T, K*H] + ``hidden_state`` [1, T, H] or DSpark's ``hidden_states`` [1, T, K*H] +
    ``target_last_hidden_states`` [1, T, H]; the last state is post-norm in both."""

    name: FormatName = "specforge-ckpt"
    last_state_norm: LastStateNorm | None = "post"
    pattern = re.compile(r"data_(\d+)\.ckpt(?:\.gz)?")
    what = "data_{i}.ckpt or data_{i}.ckpt.gz"
    extensions = (".ckpt", ".ckpt.gz")

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
                      "wrote it, name that pipeline's format with --format")
