"""Decode once, straight into the batch: the trainer's batches, built where the GPU copy reads them.

One `BatchLoader` owns what every way of decoding shares: the stream it reads and the
trainer's collate bound to the store, the pass on the trainer's thread, the delivery thread
(`h5feed.loading.delivery`) that makes each batch ready one ahead of the trainer, `close`, and
the controls (`LoaderControls`: epochs, resume, `with`).  Decoding itself is a backend's
(`h5feed.loading.backends`), chosen by name through the registry: `workers` (DataLoader worker
processes) or `threads` (reader threads in this process), which decode on the CPU into a ring of
page-locked slots, or `cuda`, which decodes on the GPU.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Generator, Iterator
from typing import Any, Literal

import torch

from h5feed.flavors import Batch, trainer_collate
from h5feed.loading.auto import AutoChoice, choose_backend
from h5feed.loading.backends import DecodeBackend, ReadyBatch, backend_of, get_backend
from h5feed.loading.backends.cuda import CudaOptions
from h5feed.loading.controls import LoaderControls
from h5feed.loading.datasets import HiddenStatesStream, stream_of
from h5feed.loading.delivery import Delivery, TrainerStream
from h5feed.loading.options import Batching, ScheduleOptions, StoreLike
from h5feed.store import Store

Decode = Literal["cpu", "cuda", "auto"]


def chosen_backend(decode: Decode | object, num_workers: int, device: torch.device | str | None,
                   store: Store) -> tuple[type[DecodeBackend], object, AutoChoice | None]:
    """The backend `BatchLoader(decode=..., num_workers=..., device=...)` asks for, its options, and what
    decode="auto" chose (None for the others)."""
    if not isinstance(decode, str):  # a backend's options: they name it and hold its settings
        backend = backend_of(decode)
        given = [name for name, value in (("num_workers", num_workers), ("device", device)) if value]
        if given:
            raise ValueError(f"{' and '.join(given)} given beside decode={type(decode).__name__}(...): set "
                             f"{'them' if len(given) > 1 else 'it'} there")
        return backend, decode, None
    if decode not in ("cpu", "cuda", "auto"):
        raise ValueError(f"decode must be 'cpu', 'cuda', 'auto' or a backend's options, not {decode!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0: reader threads in this process), not {num_workers}")
    auto: AutoChoice | None = None
    if decode == "auto":
        auto = choose_backend(store, num_workers)
        name, num_workers = auto.backend, auto.num_workers or num_workers
    elif decode == "cuda":
        if num_workers:
            raise ValueError("num_workers belongs to decode='cpu'; decode='cuda' reads with threads in this process "
                             "(decode=h5feed.CudaOptions(threads=..., prefetch=...))")
        name = "cuda"
    else:
        name = "workers" if num_workers else "threads"
    backend = get_backend(name)
    return backend, backend.default_options(num_workers, device), auto


class BatchLoader(LoaderControls):
    """The trainer's batches, decoded straight into their final layout, on the CPU or on the GPU.

    Yields exactly what `DataLoader(HiddenStatesStream(...), batch_size=..., collate_fn=
    trainer_collate(flavor, max_len), pin_memory=True)` yields, in the same order, with
    the same sharding and resume (`state_dict`, `set_epoch` as the stream's).

    Args:
        data: an h5feed store (a path or URL, its `StoreOptions`, or an open `Store`), or a `HiddenStatesStream`
            (then leave out flavor, max_len, hidden_states_dtype and schedule: the stream has its own, and with
            it a transform-free stream's on_corrupt and missing_loss_mask).
        flavor, max_len, hidden_states_dtype: as `HiddenStatesStream` / `trainer_collate`; without a flavor,
            speculators-legacy where the store fits it, else a ValueError naming the flavors that do.
        batch_size: items per batch (speculators packs them into one max_len row).
        drop_last: leave out the last batch when it is short (SpecForge's loader does).
        num_workers: DataLoader worker processes; 0: reader threads in this process.
        device: when given (e.g. "cuda"), batches arrive on it: the delivery thread queues the copy
            from the page-locked slot on a stream of its own, and the trainer's stream waits for it
            (an event; `next()` itself does not wait); otherwise they are CPU tensors in the slot,
            page-locked when CUDA is available.  With decode="cuda", the GPU they are decoded on.
        decode: where the chunks are decoded: "cpu" (default: worker processes or threads, into the ring),
            "cuda" (threads read and check the compressed chunks, the GPU decodes them; batches arrive on the
            GPU), "auto" (what leaves the training step fastest here, `h5feed.loading.auto`: without a GPU,
            reader threads; with one, worker processes (up to 4) where each GPU has 2 cores or more, the GPU
            decoder where it has fewer; `auto` says what it took and why), or a backend's own options, which
            name it and set what the words leave at their defaults: `WorkersOptions(num_workers=4, prefetch=3)`,
            `ThreadsOptions(threads=2)`, `CudaOptions(decode_group=16, prefetch=16)` (then num_workers and
            device are set there).  An FP8 store's batches hold its hidden states dequantized as hs-connectors'
            FP8Transfer returns them (bf16).
        schedule: which samples in what order on which rank (`ScheduleOptions`, as the stream's).

    With on_corrupt="skip" (a stream's), a batch is its scheduled samples less the damaged ones.
    A worker that dies raises a `WorkerDiedError` naming it, its pid and the sample it was reading.
    `close()` (or the end of a `with` block) gives the backend's memory back; so does dropping the loader.
    `backend` is the `DecodeBackend` in use; `gpu_decode_ms` the GPU time spent decoding (decode="cuda");
    `auto` what decode="auto" chose and why (None otherwise).
    """

    def __init__(
        self,
        data: HiddenStatesStream | StoreLike,
        *,
        flavor: str | None = None,
        max_len: int | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        num_workers: int = 0,
        device: torch.device | str | None = None,
        decode: Decode | object = "cpu",
        schedule: ScheduleOptions | None = None,
    ) -> None:
        batching = Batching(batch_size, drop_last)
        stream = stream_of(data, flavor, max_len, hidden_states_dtype, schedule)
        if stream.transform is not None:
            raise ValueError("BatchLoader decodes stored rows straight into the batch, so it cannot run a per-item "
                             "transform; apply noise to the batch instead (see examples/), or use a DataLoader over "
                             "the stream with trainer_collate")
        backend, options, self.auto = chosen_backend(decode, num_workers, device, stream.store)
        store = stream.store
        self.collate = trainer_collate(stream.flavor.name, stream.max_len,
                                       hidden_states_dtype=stream.hidden_states_dtype or store.info.torch_dtype
                                       ).for_store(store.info)
        stream = stream.for_loader(batch_size)  # the loader's own: the stream passed in deals as it did
        self.backend: DecodeBackend = backend(stream, self.collate, batching, options)
        self.dataset = stream  # what h5feed.monitor reads its counters from
        self.batch_size, self.drop_last, self.device = batch_size, drop_last, self.backend.device
        # as a DataLoader has them (h5feed.monitor reads them)
        self.num_workers, self.multiprocessing_context = self.backend.num_workers, self.backend.multiprocessing_context
        self._closed = False
        self._active: weakref.ref[Generator[Batch, None, None]] | None = None  # weak: a dropped pass ends at once
        self._warned = False

    @property
    def gpu_decode_ms(self) -> float:
        """The GPU time spent decoding so far (copy in, zstd, unshuffle): what decoding takes from training on that
        GPU; 0 for the CPU backends."""
        return self.backend.gpu_decode_ms

    # --- what DataLoader users call ----------------------------------------------------------
    def __len__(self) -> int:
        samples = len(self.dataset)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        """One pass over this rank's batches; starting another ends the one before."""
        if self._closed:
            raise ValueError(f"this {type(self).__name__} is closed (its {self.backend.memory} was given back): make a "
                             "new one")
        self._end_pass()
        batches = self._batches()
        self._active = weakref.ref(batches)
        return batches

    def close(self) -> None:
        """End the current pass (its workers or threads stop) and give the backend's memory back, at once or, while
        the trainer still holds batches of it, when it drops the last.  The loader cannot be iterated again."""
        if self._closed:
            return
        self._end_pass()
        self._closed = True
        self.backend.close()

    def _end_pass(self) -> None:
        """Stop the current pass's delivery thread and what it reads with; what it held goes back to the backend."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None
        self.backend.reclaim()

    # --- one pass ----------------------------------------------------------------------------
    def _batches(self) -> Generator[Batch, None, None]:
        """The pass on the trainer's thread: each batch, made ready by the delivery thread, is only handed over."""
        stream = self.dataset
        stream.schedule.begin_pass()  # every pass starts at the stream's start: a second one replays the epoch
        trainer = TrainerStream(self.device) if self.device is not None else None
        delivery = Delivery(functools.partial(self.backend.ready_batches, trainer),
                            on_take=functools.partial(self._wait_for_copy, trainer), name=self.backend.delivery_thread)
        try:
            for ready in delivery:
                stream.note_consumed(ready.passed)
                if ready.batch is not None:  # None: only damaged samples were left, the position moved past them
                    yield self._hand_over(ready)  # the generator keeps no reference to the batch while it waits
        finally:
            delivery.close()
            self.backend.pass_stopped()

    @staticmethod
    def _wait_for_copy(trainer: TrainerStream | None, ready: ReadyBatch) -> None:
        """On a GPU: the trainer's stream waits for the batch's copy or decode (on the trainer's thread, as it takes
        it)."""
        if trainer is not None and ready.ready is not None and ready.batch is not None:
            trainer.take(ready.batch, ready.ready)

    def _hand_over(self, ready: ReadyBatch) -> Batch:
        """The ready batch, taken out of `ready`, in the trainer's structure."""
        batch, ready.batch = ready.batch, None
        assert batch is not None
        if ready.in_fresh_memory and not self._warned:
            self._warned = True
            warnings.warn(self.backend.crowded_warning(), stacklevel=3)
        return self.collate.finish(batch)


class CudaBatchLoader(BatchLoader):
    """`BatchLoader(decode="cuda")` under a name of its own: batches decoded on the GPU from compressed frames that
    reader threads read and check (see `BatchLoader` for the arguments; `options`, the backend's own)."""

    def __init__(self, data: HiddenStatesStream | StoreLike, options: CudaOptions | None = None, **kwargs: Any) -> None:
        super().__init__(data, decode=options or "cuda", **kwargs)
