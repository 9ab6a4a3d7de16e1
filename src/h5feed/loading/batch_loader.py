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
import os
import warnings
import weakref
from collections.abc import Generator, Iterator
from typing import Any, Literal

import torch

from h5feed.flavors import Batch, trainer_collate
from h5feed.loading.auto import AutoChoice, choose_backend
from h5feed.loading.backends import DecodeBackend, ReadyBatch, arguments_of, get_backend
from h5feed.loading.controls import LoaderControls
from h5feed.loading.datasets import HiddenStatesStream, stream_of
from h5feed.loading.delivery import Delivery, TrainerStream
from h5feed.loading.options import Batching
from h5feed.store import Store

Decode = Literal["cpu", "cuda", "auto"]


class BatchLoader(LoaderControls):
    """The trainer's batches, decoded straight into their final layout, on the CPU or on the GPU.

    Yields exactly what `DataLoader(HiddenStatesStream(...), batch_size=..., collate_fn=
    trainer_collate(flavor, max_len), pin_memory=True)` yields, in the same order, with
    the same sharding and resume (`state_dict`, `set_epoch` as the stream's).

    Args:
        data: an h5feed store (path or `Store`), or a `HiddenStatesStream` (then leave out
            the stream's own arguments).
        decode: where the chunks are decoded: "cpu" (default: worker processes or threads, into
            the ring), "cuda" (threads read and check the compressed chunks, the GPU decodes them;
            batches arrive on the GPU), or "auto": what leaves the training step fastest here
            (`h5feed.loading.auto`): without a GPU, reader threads; with one, worker processes (up to 4)
            where each GPU has 2 cores or more, the GPU decoder where it has fewer (and CUDA, nvCOMP and
            a Blosc-zstd store allow it); `auto` says what it took and why.  An FP8 store's
            batches hold its hidden states dequantized as hs-connectors' FP8Transfer returns them (bf16).
        flavor, max_len, hidden_states_dtype: as `HiddenStatesStream` / `trainer_collate`; without a flavor,
            speculators-legacy where the store fits it, else a ValueError naming the flavors that do.
        batch_size: items per batch (speculators packs them into one max_len row).
        drop_last: leave out the last batch when it is short (SpecForge's loader does).
        num_workers: DataLoader worker processes; 0: `threads` reader threads in this process.
        threads: reader threads with num_workers=0 (default: the cores this process may use, at most 4;
            with decode="cuda", 2: file reads, crc32c checks and one copy into pinned memory each).
        prefetch: batches in flight per worker (the DataLoader's prefetch_factor), or in all
            with threads (default 2); with decode="cuda", batches staged ahead (default 8).
        device: when given (e.g. "cuda"), batches arrive on it: the delivery thread queues the copy
            from the page-locked slot on a stream of its own, and the trainer's stream waits for it
            (an event; `next()` itself does not wait); otherwise they are CPU tensors in the slot,
            page-locked when CUDA is available.  With decode="cuda", the GPU they are decoded on
            (default "cuda").
        slots_per_worker: slots each worker (or the threads) may fill; the default, the batches in
            flight + 2, covers a trainer that holds the batch it is given (in flight: with threads,
            max(prefetch, threads), the delivery thread's ready batch among them; with workers,
            prefetch + 1, the ready batch besides).
        multiprocessing_context, worker_init_fn, timeout: passed to the DataLoader.
        decode_group: with decode="cuda", consecutive staged batches decoded in one GPU call (default: prefetch,
            at most 8): the GPU decodes faster per byte in large calls, and what it spends decoding it takes from
            the step.
        decode_ahead: with decode="cuda", batches decoded ahead of the trainer on the GPU, each holding its
            batch's GPU memory (default: two groups).
        **stream_kwargs: `HiddenStatesStream`'s other arguments (samples, shuffle, seed, rank, on_corrupt, ...).

    With on_corrupt="skip", a batch is its scheduled samples less the damaged ones.
    A worker that dies raises a `WorkerDiedError` naming it, its pid and the sample it was reading.
    `close()` (or the end of a `with` block) gives the backend's memory back; so does dropping the loader.
    `backend` is the `DecodeBackend` in use; `gpu_decode_ms` the GPU time spent decoding (decode="cuda");
    `auto` what decode="auto" chose and why (None for "cpu" and "cuda").
    """

    def __init__(
        self,
        data: HiddenStatesStream | Store | str | os.PathLike[str],
        *,
        decode: Decode = "cpu",
        flavor: str | None = None,
        max_len: int | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        num_workers: int = 0,
        threads: int | None = None,
        prefetch: int | None = None,
        device: torch.device | str | None = None,
        slots_per_worker: int | None = None,
        multiprocessing_context: Any = None,
        worker_init_fn: Any = None,
        timeout: float = 0,
        decode_group: int | None = None,
        decode_ahead: int | None = None,
        **stream_kwargs: Any,
    ) -> None:
        if decode not in ("cpu", "cuda", "auto"):
            raise ValueError(f"decode must be 'cpu', 'cuda' or 'auto', not {decode!r}")
        batching = Batching(batch_size, drop_last)
        arguments = {"num_workers": num_workers, "threads": threads, "prefetch": prefetch, "device": device,
                     "slots_per_worker": slots_per_worker, "multiprocessing_context": multiprocessing_context,
                     "worker_init_fn": worker_init_fn, "timeout": timeout, "decode_group": decode_group,
                     "decode_ahead": decode_ahead}  # the backends' own: each takes those its options have
        cpu_takes, gpu_takes = arguments_of("workers", "threads"), arguments_of("cuda")
        cpu_only = [name for name, value in arguments.items() if name in cpu_takes - gpu_takes and value]
        gpu_only = [name for name, value in arguments.items() if name in gpu_takes - cpu_takes and value is not None]
        if decode == "cuda" and cpu_only:
            raise ValueError(f"{', '.join(cpu_only)} belong to decode='cpu'; decode='cuda' reads with threads in this "
                             "process (threads=, prefetch=)")
        if decode == "cpu" and gpu_only:
            raise ValueError(f"{', '.join(gpu_only)} belong to decode='cuda'")
        stream = stream_of(data, flavor, max_len, hidden_states_dtype, stream_kwargs)
        if stream.transform is not None:
            raise ValueError("BatchLoader decodes stored rows straight into the batch, so it cannot run a per-item "
                             "transform; apply noise to the batch instead (see examples/), or use a DataLoader over "
                             "the stream with trainer_collate")
        if decode == "auto":
            self.auto: AutoChoice | None = choose_backend(stream.store, {name: value for name, value in arguments.items()
                                                                        if value})
            if self.auto.backend != "cuda" and gpu_only:
                raise ValueError(f"{', '.join(gpu_only)} belong to decode='cuda'; decode='auto' decodes on the CPU "
                                 f"here ({self.auto.reason})")
            arguments["num_workers"] = self.auto.num_workers or num_workers
            backend = get_backend(self.auto.backend)
        else:
            self.auto = None
            backend = get_backend("cuda" if decode == "cuda" else "workers" if num_workers else "threads")
        store = stream.store
        self.collate = trainer_collate(stream.flavor.name, stream.max_len,
                                       hidden_states_dtype=stream.hidden_states_dtype or store.info.torch_dtype
                                       ).for_store(store.info)
        stream = stream.for_loader(batch_size)  # the loader's own: the stream passed in deals as it did
        self.backend: DecodeBackend = backend.from_arguments(stream, self.collate, batching, arguments)
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
    reader threads read and check (see `BatchLoader` for the arguments)."""

    def __init__(self, data: HiddenStatesStream | Store | str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(data, decode="cuda", **kwargs)
