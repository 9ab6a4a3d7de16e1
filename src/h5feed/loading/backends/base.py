"""What a decode backend is, and the registry of them.

`h5feed.loading.batch_loader.BatchLoader` owns what every loader does the same way: the stream and
the trainer's collate, the pass on the trainer's thread, the delivery thread
(`h5feed.loading.delivery`), `close` and the controls (`LoaderControls`).  What differs between
loaders is where and how the stored chunks become the batch's tensors: that is a `DecodeBackend`.
Each backend is one module that registers itself (`register_backend`) when
`h5feed.loading.backends` is imported: `workers` (DataLoader worker processes) and `threads`
(reader threads in the trainer's process) decode on the CPU into the slot ring
(`h5feed.loading.backends.ring`); `cuda` stages the compressed frames with reader threads and
decodes them on the GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from h5feed.flavors import Batch
from h5feed.loading.delivery import TrainerStream
from h5feed.errors import unknown_name
from h5feed.store import Store


@dataclass
class ReadyBatch:
    """What the delivery thread hands the trainer's thread: a batch (None: only damaged samples were left), the
    schedule's samples it moves the position past, and on a GPU the event its copy or decode completes."""

    batch: Batch | None
    passed: int
    ready: torch.cuda.Event | None = None
    in_fresh_memory: bool = False  # no slot was free: the trainer holds more batches than the ring keeps


class DecodeBackend(ABC):
    """Turns the stream's scheduled batches into the trainer's batches, for `BatchLoader`.

    A backend is made as `Backend(stream, collate, batching, options)`: the loader's stream, the
    trainer's collate bound to the store, the loader's `Batching` and options of its own
    (`Options`, a frozen dataclass that checks them, which a user may pass as `BatchLoader(decode=...)`
    to name the backend and set them); nothing starts before the first pass.
    `ready_batches` runs in the loader's delivery thread, one batch ahead of the trainer; everything
    else runs on the trainer's thread.  A backend keeps what it allocates (slots, staging memory)
    until `close`.
    """

    name: ClassVar[str]  # the registry's name for it
    Options: ClassVar[type]  # its own options: a frozen dataclass, which `BatchLoader(decode=...)` takes as it is
    delivery_thread: ClassVar[str]  # the name of the pass's delivery thread (the monitor and tests look for it)
    memory: ClassVar[str]  # what `close` gives back, in words for the user who iterates a closed loader
    device: torch.device | None  # where batches arrive; None: CPU memory
    gpu_decode_ms: float = 0.0  # GPU time spent decoding, added up (backends that decode on the GPU)
    num_workers: int = 0  # worker processes it decodes in, and how they start: as a DataLoader has them
    multiprocessing_context: Any = None

    @classmethod
    @abstractmethod
    def default_options(cls, num_workers: int, device: torch.device | str | None) -> Any:
        """Its options for a loader that named the backend by a word (`decode="cpu"`, ...) and set only
        `num_workers` and `device`: the rest at their defaults."""

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run in this process (decode="auto" then picks another); None when it can."""
        return None

    @classmethod
    def refusal(cls, store: Store) -> str | None:
        """Why this backend cannot read this store (decode="auto" then picks another); None when it can."""
        return None

    @abstractmethod
    def ready_batches(self, trainer: TrainerStream | None) -> Iterator[ReadyBatch]:
        """The pass's batches, in the stream's order, each ready to hand over (on `device`, its copy or decode
        queued ahead of `ready`); runs in the delivery thread.  `trainer` is the trainer's CUDA stream when
        batches arrive on a GPU."""

    def pass_stopped(self) -> None:
        """The pass's delivery thread has stopped (on the trainer's thread)."""

    def reclaim(self) -> None:
        """Before a pass starts and at close: what an ended pass filled and never handed out is free again."""

    @abstractmethod
    def close(self) -> None:
        """Give the backend's memory back, at once or once the trainer drops the batches it still holds."""

    @property
    @abstractmethod
    def holds_memory(self) -> bool:
        """Whether the backend's memory (slots, staging) is still held: until `close`, and after it while the
        trainer holds a batch in it."""

    def crowded_warning(self) -> str:
        """What to tell a trainer whose batch came in fresh memory (`ReadyBatch.in_fresh_memory`)."""
        return "h5feed: the trainer holds more batches than the loader keeps; the rest are built in fresh memory"


BACKENDS: dict[str, type[DecodeBackend]] = {}  # by name, in the order their modules registered them


def register_backend(backend: type[DecodeBackend]) -> type[DecodeBackend]:
    """Make a backend known by its name (each backend's module registers its own when it is imported)."""
    if backend.name in BACKENDS:
        raise ValueError(f"a decode backend named {backend.name!r} is registered already")
    BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> type[DecodeBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(unknown_name("decode backend", name, BACKENDS)) from None


def backend_of(options: object) -> type[DecodeBackend]:
    """The backend whose options `options` are (a `BatchLoader(decode=...)` given an options object)."""
    for backend in BACKENDS.values():
        if type(options) is backend.Options:
            return backend
    names = ", ".join(backend.Options.__name__ for backend in BACKENDS.values())
    raise TypeError(f"decode= takes 'cpu', 'cuda', 'auto' or a backend's options ({names}), not "
                    f"{type(options).__name__}")
