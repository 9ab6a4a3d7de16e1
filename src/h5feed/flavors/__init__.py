"""Trainer flavors: for each trainer, the items its Dataset yields and its collate, on one batch layout.

`get_flavor(name)` gives a flavor, `trainer_collate(name, max_len)` its trainer's collate. The
interface is in `h5feed.flavors.base`; each trainer is one module that registers its flavors:
speculators (``speculators-legacy``, ``speculators``), SpecForge (``specforge``,
``specforge-shifted``, ``specforge-dflash``, ``specforge-dspark``), Model-Optimizer (``modelopt``, ``modelopt-answer-only``,
``modelopt-0.45``), AngelSlim (``angelslim``), NeMo Automodel (``nemo-eagle3``).
"""

# each module registers its flavors when imported: this is the order they are listed in
# isort: off
from h5feed.flavors import speculators, specforge, modelopt, angelslim, nemo  # noqa: F401
# isort: on
from h5feed.flavors.base import (
    FLAVORS,
    Batch,
    BatchPlan,
    Flavor,
    Item,
    RowKey,
    TensorSpec,
    TrainerCollate,
    Transform,
    flavors_for_norm,
    get_flavor,
    trainer_collate,
)

__all__ = ["FLAVORS", "Batch", "BatchPlan", "Flavor", "Item", "RowKey", "TensorSpec", "TrainerCollate",
           "Transform", "flavors_for_norm", "get_flavor", "trainer_collate"]
