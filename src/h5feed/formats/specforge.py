"""SpecForge's ``data_{i}.ckpt`` (or gzipped ``.ckpt.gz``) files."""

from __future__ import annotations

import re
from pathlib import Path

from h5feed.formats.base import FormatName
from h5feed.formats.checks import CheckedSample, aux_and_last, mask_vector, require_keys, token_vector
from h5feed.formats.torch_dict import TorchDictFormat
from h5feed.store.layout import LastStateNorm

__all__ = ["SpecForgeCkpt"]


class SpecForgeCkpt(TorchDictFormat):
    """C: SpecForge ``data_{i}.ckpt[.gz]``: ``aux_hidden_state`` [1, T, K*H], ``hidden_state`` [1, T, H] (post-norm)."""

    name: FormatName = "specforge-ckpt"
    last_state_norm: LastStateNorm | None = "post"
    pattern = re.compile(r"data_(\d+)\.ckpt(?:\.gz)?")
    what = "data_{i}.ckpt or data_{i}.ckpt.gz"
    extensions = (".ckpt", ".ckpt.gz")

    def _check(self, path: Path, d: dict) -> CheckedSample:
        require_keys(path, d, ("input_ids", "aux_hidden_state", "hidden_state"), self.name)
        ids = token_vector(path, d["input_ids"], "input_ids", allow_batch_dim=True)
        aux, last, shape = aux_and_last(path, d, "aux_hidden_state", "hidden_state", ids.shape[0], batched=True)
        mask = mask_vector(path, d.get("loss_mask"), "loss_mask", shape.num_tokens, allow_batch_dim=True)
        return CheckedSample(ids, mask, aux, last, shape)
