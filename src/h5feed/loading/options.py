"""What a loader is made of, as typed, frozen option objects, each checked once, when it is made.

A loader's keyword arguments fall into a few groups, and each group is one object here:
where the store is (`StoreOptions`), what its items look like (`ItemOptions`), which samples
in what order on which rank (`ScheduleOptions`), and how they are dealt as batches
(`Batching`); each decode backend has its own (`h5feed.loading.backends`).  The loaders and
the streams build them from their keyword arguments, so a call's arguments are checked by the
same code whatever it makes, and a mistake is named before any file is opened or thread started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from h5feed.loading.schedule import Shuffle
from h5feed.store import Store

if TYPE_CHECKING:
    from h5feed.loading.follow import Follow

SampleSelector = Sequence[int | str | os.PathLike[str]]
OnCorrupt = Literal["raise", "skip"]


@dataclass(frozen=True)
class StoreOptions:
    """Where the store is: its path or URL and how to reach it (fsspec's storage options, the node cache), or a
    `Store` already open, which has its own."""

    location: Store | str | os.PathLike[str]
    storage_options: Mapping[str, Any] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.location, Store) and (self.storage_options or self.cache_dir is not None
                                                 or self.cache_limit is not None):
            raise ValueError("storage_options, cache_dir and cache_limit open a store from its location; "
                             "an open Store already has its own: pass its path or URL instead")

    def open(self) -> Store:
        """The store to read: the one given open, or opened from its location with these options."""
        if isinstance(self.location, Store):
            return self.location
        return Store(self.location, storage_options=self.storage_options, cache_dir=self.cache_dir,
                     cache_limit=self.cache_limit)


@dataclass(frozen=True)
class ItemOptions:
    """What the trainer's items look like: its flavor (None: the loaders' default where the store fits it), the
    tokens an item keeps, the hidden states' dtype, and what a damaged sample does (raise, or be skipped)."""

    flavor: str | None = None
    max_len: int | None = None
    hidden_states_dtype: torch.dtype | None = None
    on_corrupt: OnCorrupt = "raise"

    def __post_init__(self) -> None:
        if self.on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', not {self.on_corrupt!r}")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError("max_len must be a positive number of tokens or None")


@dataclass(frozen=True)
class ScheduleOptions:
    """Which samples, in what order, on which rank: the selection, the shuffle and its seed, the ranks' shares, and
    whether to follow a writer that is still appending (`Follow`)."""

    samples: SampleSelector | None = None
    shuffle: Shuffle = True
    locality_block: int = 32
    seed: int = 0
    equal_per_rank: bool = True
    rank: int | None = None
    world_size: int | None = None
    follow: Follow | None = None

    def __post_init__(self) -> None:
        if self.follow is not None and (self.shuffle or self.samples is not None):
            raise ValueError("follow= reads every sample of the store in the order they were published: "
                             "pass shuffle=False and no samples=")


@dataclass(frozen=True)
class Batching:
    """How a loader deals the schedule's samples: `batch_size` items a batch, the last short batch left out with
    `drop_last`."""

    batch_size: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {self.batch_size}")
