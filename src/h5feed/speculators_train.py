"""`python -m h5feed.speculators_train ARGS`: speculators' `train` command, able to read an h5feed store.

The arguments are speculators' own (``speculators train --help``) plus ``--hidden-states-backend h5feed
--h5feed-store STORE``.  speculators builds its parser's backend flags from hs-connectors' registry, so
h5feed's backend is registered first, then speculators' `train` runs as it does, its code unchanged
(``torchrun ... -m h5feed.speculators_train ARGS`` runs it on several GPUs, as ``-m speculators.train`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import h5feed.integrations.speculators  # noqa: F401  (registers the backend before speculators' parser exists)


def main(argv: Sequence[str] | None = None) -> None:
    """Run speculators' `train` with `argv` (default: this command's arguments)."""
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(None if argv is None else list(argv)))  # None: sys.argv, which speculators records


if __name__ == "__main__":
    main()
