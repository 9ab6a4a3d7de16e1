"""What a trainer calls on a batch loader besides iterating it, answered by the loader's stream.

`BatchLoader` delivers the same batches on the same schedule whatever its decode backend: each
epoch, each resume and each `with` block goes through the stream (`HiddenStatesStream`) it was
made on, so these controls are written once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

    from h5feed.loading.datasets import HiddenStatesStream


class LoaderControls:
    """`set_epoch`, `batch_sampler`, `state_dict` / `load_state_dict` and `with` for a loader over `self.dataset`."""

    dataset: HiddenStatesStream

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    @property
    def batch_sampler(self) -> Self:
        """speculators' Trainers call `train_loader.batch_sampler.set_epoch(epoch)` each epoch: this loader takes it."""
        return self

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
