"""What a loader is made of, as typed, frozen option objects, each checked once, when it is made.

A loader's settings fall into a few groups, and each group is one object here: where the
store is (`StoreOptions`, or simply its path, or a `Store` already open), what its items look
like (`ItemOptions`: the flavor, the tokens kept, the dtype, what a damaged sample does), which
samples in what order on which rank (`ScheduleOptions`), how a stream reads them
(`ReadOptions`), and how a loader deals them as batches (`Batching`); each decode backend has
its own (`h5feed.loading.backends`).  The loaders take the groups users set most as keyword
arguments and the rest as these objects, so a call's settings are checked by the same code
whatever it makes, and a mistake is named before any file is opened or thread started::

    stream = HiddenStatesStream(StoreOptions("s3://bucket/hs.zarr", cache_dir="/nvme/cache"), "speculators",
                                2048, schedule=ScheduleOptions(seed=0, shuffle="locality"),
                                reading=ReadOptions(threads=2, prefetch=4))
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from h5feed.loading.sample_folder import open_or_explain
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
        """The store to read: the one given open, or opened from its location with these options (a folder of
        sample files given instead is named so, with the `h5feed convert` that makes its store)."""
        if isinstance(self.location, Store):
            return self.location
        return open_or_explain(self.location, storage_options=self.storage_options, cache_dir=self.cache_dir,
                               cache_limit=self.cache_limit)


StoreLike = Store | str | os.PathLike[str] | StoreOptions  # what the loaders take as the store


def open_store(store: StoreLike) -> Store:
    """The store a loader reads: one given open, opened from a path or URL, or from its `StoreOptions`."""
    return store.open() if isinstance(store, StoreOptions) else StoreOptions(store).open()


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
    """Which samples, in what order, on which rank.

    samples: store indices and/or source paths (as in the trainer's own file lists) to select; None: all.
    shuffle: False, True, or "locality": shuffle blocks of `locality_block` samples that lie next to each other
        on disk, and the samples within each block (kinder to a cold cache).
    seed: the shuffle seed; the epoch is added (`set_epoch`).
    equal_per_rank: pad each rank to the same count by repeating samples (as DistributedSampler does), since
        unequal counts hang DDP; False reads every sample exactly once.
    rank, world_size: default from torch.distributed when it is initialised, else 0 and 1.
    follow: read the store while its writer appends (`h5feed.open_writer`): the samples in the order they were
        published, waiting for more until a bound (`Follow`); needs shuffle=False and a local store, and the
        stream has no length.  It opens once the first sample is published, each worker waits only for its own
        samples, `state_dict()` is a position in publication order, and with equal_per_rank a rank short of the
        last round's sample repeats one (`h5feed.loading.follow`).
    """

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
class ReadOptions:
    """How a stream reads its samples: `threads` reader threads in each DataLoader worker (or in the trainer's
    process with num_workers=0; with as many threads as cores, items are decoded straight into the trainer's
    memory, with no process hand-off at all), up to `prefetch` samples ahead of the one taken (at least `threads`;
    0: no read-ahead), and whether items leave the DataLoader's workers in fresh shared memory (`shared_memory`;
    None: learnt from the first item sent)."""

    threads: int = 1
    prefetch: int = 2
    shared_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, not {self.threads}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (0: no read-ahead), not {self.prefetch}")


@dataclass(frozen=True)
class Batching:
    """How a loader deals the schedule's samples: `batch_size` items a batch, the last short batch left out with
    `drop_last`."""

    batch_size: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {self.batch_size}")
