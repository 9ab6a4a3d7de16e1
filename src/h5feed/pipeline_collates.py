"""Deprecated: `h5feed.trainer_collate(flavor, max_len)` is the collate of every flavor's trainer."""

from __future__ import annotations

import warnings

from h5feed.flavors import TrainerCollate, trainer_collate


def pipeline_collate(flavor: str, max_len: int | None = None) -> TrainerCollate:
    """Deprecated alias of `h5feed.trainer_collate(flavor, max_len)`, which now serves every flavor."""
    warnings.warn("h5feed.pipeline_collate is deprecated: use h5feed.trainer_collate(flavor, max_len), the same "
                  "collate, which BatchLoader also decodes into", DeprecationWarning, stacklevel=2)
    return trainer_collate(flavor, max_len)
