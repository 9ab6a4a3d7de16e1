"""Which samples a loader reads, in which order, and how far the trainer got: one schedule for every loader.

Each epoch's order is a permutation seeded by (seed, epoch).  Rank r of W takes every
W-th sample of it; within a rank, worker w of K (DataLoader worker processes, or one
for threads in the trainer's process) takes the batches j with j % K == w, so that the
batches, taken from the workers in turn, are the rank's sequence in order.  A position
in the epoch order is then all a resume needs, whatever the worker count
(README "Sharding and resuming").  A damaged sample skipped (on_corrupt="skip") still
counts as passed: the position never depends on what was damaged.

How a loader deals the schedule (its batch size, and that it counts what the trainer takes) is
its own: it reads a copy (`for_loader`) that shares the epoch and the resume position
(`Progress`) with the stream it was given, so the stream's own dealing stays as it was while
`set_epoch` and `load_state_dict` on either reach both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch.distributed as dist
from torch.utils.data import get_worker_info

Shuffle = bool | Literal["locality"]


def current_worker() -> tuple[int, int]:
    """(this DataLoader worker's id, the worker count); (0, 1) outside a DataLoader worker."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def in_batches(sequence: Sequence[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """`sequence` cut into batches of `batch_size` (the last one short, or left out with drop_last)."""
    batches = [list(sequence[j : j + batch_size]) for j in range(0, len(sequence), batch_size)]
    return batches[:-1] if drop_last and batches and len(batches[-1]) < batch_size else batches


@dataclass
class Progress:
    """How far an epoch has got: one object shared by a stream's schedule and the copies its loaders deal."""

    epoch: int = 0
    start: int = 0  # position in the epoch order where a pass starts (a resume's)
    consumed: int = 0  # this rank's samples the trainer has passed since `start`, skipped ones included


@dataclass
class SampleSchedule:
    """The epoch's order of the selected samples, this rank's and each worker's share of it, and the resume position.

    Args:
        indices: the selected store indices.
        disk_order: the selected store indices in the order they lie on disk (for shuffle="locality").
        shuffle: False, True, or "locality": blocks of `locality_block` samples that lie next to each
            other on disk shuffled, and the samples within each block.
        seed: the shuffle seed; the epoch is added.
        equal_per_rank: pad each rank to the same count by repeating samples (as DistributedSampler does).
        batch_size: samples per batch: a worker deals whole batches.
        rank, world_size: None: from torch.distributed when it is initialised, else 0 and 1.
        progress: the epoch and the resume position (shared with the copies `for_loader` makes).
        counted_by_loader: a loader counts what the trainer takes, by batch; else the stream, by item.
    """

    indices: list[int]
    disk_order: list[int] | None = field(default=None, repr=False)
    shuffle: Shuffle = True
    locality_block: int = 32
    seed: int = 0
    equal_per_rank: bool = True
    batch_size: int = 1
    rank: int | None = None
    world_size: int | None = None
    progress: Progress = field(default_factory=Progress)
    counted_by_loader: bool = False

    def __post_init__(self) -> None:
        if self.shuffle == "locality" and self.disk_order is None:
            raise ValueError("shuffle='locality' needs the selected samples in their order on disk (disk_order)")

    def for_loader(self, batch_size: int) -> SampleSchedule:
        """This schedule as a loader deals it: in its batches of `batch_size`, counted by the loader.  The copy
        shares `progress`, so the epoch and the resume position stay one, whoever sets or advances them."""
        return replace(self, batch_size=batch_size, counted_by_loader=True)

    # --- order and sharding ------------------------------------------------------------------
    def rank_and_world_size(self) -> tuple[int, int]:
        if self.rank is not None:
            return self.rank, self.world_size or 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """Store indices in this epoch's global order (the same on every rank)."""
        epoch = self.progress.epoch if epoch is None else epoch
        indices = np.asarray(self.indices)
        if not self.shuffle:
            return indices.tolist()
        rng = np.random.default_rng([self.seed, epoch])
        if self.shuffle == "locality":
            by_disk = np.asarray(self.disk_order)
            blocks = [by_disk[i : i + self.locality_block] for i in range(0, len(by_disk), self.locality_block)]
            return [int(x) for b in rng.permutation(len(blocks)) for x in rng.permutation(blocks[b])]
        return indices[rng.permutation(len(indices))].tolist()

    def rank_sequence(self) -> list[int]:
        """This rank's samples from the resume position on, in the order the trainer gets them."""
        rank, world = self.rank_and_world_size()
        order = self.epoch_order()
        remaining = order[self.progress.start :]
        if self.equal_per_rank and remaining and len(remaining) % world:
            pad = world - len(remaining) % world
            remaining = remaining + (order * (pad // max(len(order), 1) + 1))[:pad]
        return remaining[rank::world]

    def worker_sequence(self, worker: int = 0, workers: int = 1) -> list[int]:
        """Worker `worker` of `workers`'s samples: its batches of the rank's sequence, one after another."""
        sequence, b = self.rank_sequence(), self.batch_size
        return [s for j in range(worker, -(-len(sequence) // b), workers) for s in sequence[j * b : (j + 1) * b]]

    def worker_batches(self, drop_last: bool, worker: int = 0, workers: int = 1) -> list[list[int]]:
        """Worker `worker` of `workers`'s batches (only the rank's last batch can be short)."""
        return in_batches(self.worker_sequence(worker, workers), self.batch_size, drop_last)

    def __len__(self) -> int:
        return len(self.rank_sequence())

    # --- epochs and resume: in `progress`, changed in place (the loaders' copies share it) -----
    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning."""
        progress = self.progress
        if epoch != progress.epoch:
            progress.epoch, progress.start, progress.consumed = epoch, 0, 0

    def begin_pass(self) -> None:
        """A pass starts at `start`: a second one without set_epoch replays the epoch."""
        self.progress.consumed = 0

    def note_consumed(self, samples: int) -> None:
        """Count samples the trainer has passed (taken, or skipped as damaged)."""
        self.progress.consumed += samples

    def state_dict(self, end: int | None = None) -> dict[str, Any]:
        """Where this epoch stands: a position in the epoch order that does not depend on the worker count.

        Only a rank's last batch can be short, and it is counted whole: the position is clamped to where the
        order ends, `end` (a following stream's, which grows with its store), else the selection's length."""
        _, world = self.rank_and_world_size()
        progress = self.progress
        position = min(progress.start + progress.consumed * world, len(self.indices) if end is None else end)
        return {"epoch": progress.epoch, "seed": self.seed, "position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this stream has seed {self.seed}")
        progress = self.progress
        progress.epoch, progress.start, progress.consumed = int(state["epoch"]), int(state["position"]), 0
