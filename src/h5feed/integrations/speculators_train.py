"""`python -m h5feed.speculators_train ARGS` (its entry module runs `main`): speculators' `train` command, able to
read an h5feed store.

The arguments are speculators' own (``speculators train --help``) plus ``--hidden-states-backend h5feed
--h5feed-store STORE`` (a converted store), or ``--hidden-states-backend h5feed-tap --h5feed-store STORE
--mooncake-master HOST:PORT`` (hidden states streamed from vLLM through Mooncake, kept in STORE as they come).
speculators builds its parser's backend flags from hs-connectors' registry, so h5feed's backends are registered
first, then speculators' `train` runs as it does, its code unchanged
(``torchrun ... -m h5feed.speculators_train ARGS`` runs it on several GPUs, as ``-m speculators.train`` does).

It needs speculators 0.9 (``pip install 'speculators>=0.9,<0.10'``, which brings transformers and
hs-connectors) and a GPU: both are checked before anything runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
import torch

from h5feed.integrations.requirements import missing_install

NEEDS = ("speculators 0.9 (`pip install 'speculators>=0.9,<0.10'`, which brings transformers and hs-connectors) "
         "and a GPU")
WITHOUT_TRAINING = ("--dump-config", "--help", "-h")  # arguments that make speculators print and stop


def unmet_requirement(argv: Sequence[str]) -> str | None:
    """What this machine lacks for the command, or None.  Said up front: without speculators the command would end
    on an import error, and without a GPU only once speculators' Trainer moves the model there, after the
    verifier, the draft model and the data loaders were set up."""
    missing = missing_install((("speculators", "speculators"), ("hs_connectors", "hs-connectors"),
                               ("transformers", "transformers")), "speculators", "0.9",
                              "its train command and backends differ")
    if missing is not None:
        return missing
    if not any(arg in WITHOUT_TRAINING for arg in argv) and not torch.accelerator.is_available():
        return "torch sees no GPU (speculators' Trainer places the model on one)"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Run speculators' `train` with `argv` (default: this command's arguments)."""
    unmet = unmet_requirement(sys.argv[1:] if argv is None else argv)
    if unmet is not None:
        raise SystemExit(f"python -m h5feed.speculators_train: {unmet}; it needs {NEEDS}")
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    import h5feed.integrations.speculators_tap  # noqa: F401  (registers both backends before speculators' parser exists)

    train(TrainConfig.resolve(None if argv is None else list(argv)))  # None: sys.argv, which speculators records

