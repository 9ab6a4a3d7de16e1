"""What the trainer imports: a drop-in map-style Dataset and a prefetching, sharded IterableDataset.

Both read through `Store.read_sample` (only the rows the flavor can use, decoded
straight into shared memory inside DataLoader workers; an FP8 store's dequantized as
hs-connectors' FP8Transfer does) and build the trainer's
own items with `h5feed.flavors`.  Both own a `LoaderCounters` table that the
main process can read while training runs (`dataset.counters.snapshot()`).
"""

from __future__ import annotations

import copy
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, default_convert, get_worker_info

from h5feed.errors import CorruptSampleError, StoreError, WorkerDiedError
from h5feed.flavors import FLAVORS, Flavor, Item, Transform, get_flavor
from h5feed.loading.follow import FollowedPositions, FollowedShare, open_followed
from h5feed.loading.options import (
    ItemOptions,
    OnCorrupt,
    ReadOptions,
    SampleSelector,
    ScheduleOptions,
    StoreLike,
    StoreOptions,
    open_store,
)
from h5feed.loading.readahead import ReadAhead
from h5feed.loading.schedule import SampleSchedule, current_worker
from h5feed.observe.metrics import LoaderCounters, WorkerCounters, check_worker_count
from h5feed.store import Allocator, BufferPool, Store, shared_allocator
from h5feed.store.fp8 import dequantized

log = logging.getLogger(__name__)
_REAP_SECONDS = 1.0  # how long a worker whose pipe broke may take to show as dead


@dataclass(frozen=True)
class SkippedSample:
    """What a stream read by a `StreamLoader` yields in place of a damaged sample it skipped (on_corrupt="skip").

    It keeps every DataLoader batch to its scheduled samples, so a skip neither shifts nor
    reorders the batches after it; the loader's collate never sees it.
    """

    index: int  # the store index of the damaged sample


def split_samples(store: StoreLike, ratio: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """A seeded random split of a store's samples into (train, validation) store indices.

    speculators' own `split_files` shuffles in `os.walk` order with Python's global
    `random`; to reproduce a split made that way, pass its file lists as `samples=`.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], not {ratio}")
    n = len(open_store(store))
    order = np.random.default_rng(seed).permutation(n).tolist()
    cut = int(n * ratio)
    return sorted(order[:cut]), sorted(order[cut:])


def select_samples(store: Store, samples: SampleSelector | None) -> list[int]:
    """Store indices for a selection of store indices and/or source paths (as the trainer lists its files)."""
    if samples is None:
        return list(range(len(store)))
    by_path = {p: i for i, p in enumerate(store.source_paths)}
    root = Path(store.info.source_root)
    by_name: dict[str, list[int]] = {}
    for i, p in enumerate(store.source_paths):
        by_name.setdefault(Path(p).name, []).append(i)
    selected = []
    for s in samples:
        if isinstance(s, (int, np.integer)):
            if not 0 <= s < len(store):
                raise IndexError(f"sample {s} out of range for {store.path} ({len(store)} samples)")
            selected.append(int(s))
            continue
        path = Path(s)
        rel = path.relative_to(root).as_posix() if path.is_absolute() and path.is_relative_to(root) else path.as_posix()
        if rel in by_path:
            selected.append(by_path[rel])
        elif len(by_name.get(path.name, [])) == 1:
            selected.append(by_name[path.name][0])
        else:
            found = "several samples" if by_name.get(path.name) else "no sample"
            raise StoreError(store.path, f"{found} converted from {s}; the store holds files under {root}")
    return selected


class _FlavoredReader:
    """What the Dataset and the Stream share: the store, the flavor, the selection and the counters."""

    prefetch = 0  # samples read ahead (the Stream's)
    threads = 1  # reader threads (the Stream's)

    def __init__(
        self,
        store: StoreLike,
        flavor: str,
        max_len: int | None,
        transform: Transform | None,
        hidden_states_dtype: torch.dtype | None,
        samples: SampleSelector | None,
        missing_loss_mask: Literal["error", "ones"],
        shared_memory: bool | None,
        on_corrupt: OnCorrupt,
    ) -> None:
        ItemOptions(flavor, max_len, hidden_states_dtype, on_corrupt)  # checks them
        self.on_corrupt = on_corrupt
        self.store = open_store(store)
        self.shared_memory = shared_memory
        self.flavor: Flavor = get_flavor(flavor)
        self.max_len = max_len
        self.transform = transform
        self.hidden_states_dtype = hidden_states_dtype or self.flavor.default_hidden_states_dtype
        self.indices = select_samples(self.store, samples)
        self.flavor.check_store(self.store.path, self.store.info, max_len)  # norm, last state, what it reads
        self._extras = self.flavor.extras(self.store.info)  # the optional arrays its items use
        self._check_loss_masks(missing_loss_mask)
        self.counters = LoaderCounters()

    def _check_loss_masks(self, policy: str, indices: Sequence[int] | None = None) -> None:
        """Refuse samples (the selected ones, or `indices`) without a loss mask when the flavor reads one."""
        if not self.flavor.reads_loss_mask:
            return
        missing = [i for i in (self.indices if indices is None else indices) if not self.store.has_loss_mask[i]]
        if missing and policy == "error":
            names = ", ".join(self.store.source_paths[i] for i in missing[:3])
            raise StoreError(
                self.store.path,
                f"{len(missing)} sample(s) had no loss_mask in their source files ({names}...); the trainer would fail "
                "on them: pass missing_loss_mask='ones' to train on every token of those samples",
            )

    @property
    def approx_lengths(self) -> list[int]:
        """Exact token counts of the selected samples (speculators' batch samplers read this)."""
        return [int(self.store.sample_lengths[i]) for i in self.indices]

    def _buffer_pool(self) -> BufferPool:
        """This process's pool of decode buffers (made on first use: pools never cross processes)."""
        pool = self.__dict__.get("_pool")
        if pool is None:
            # two big buffers (aux, last) per sample being read, queued, or held by the trainer
            pool = self._pool = BufferPool(capacity=2 * (self.prefetch + self.threads + 2))
        return pool

    def _allocator(self) -> Allocator:
        """Pooled plain memory, unless items leave this DataLoader worker as they are (no copying
        collate): then fresh shared memory, which the hand-off passes without a copy.  With
        shared_memory=None that is learnt from the first item sent (the send moves its buffer)."""
        pool = self._buffer_pool()
        if get_worker_info() is None or self.shared_memory is False:
            return pool
        return shared_allocator if self.shared_memory or pool.saw_sends else pool

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_pool", None)
        return state

    def tokens_to_read(self, store_index: int) -> int:
        """Tokens of the sample the flavor reads (its window: max_len and the shift)."""
        return self.flavor.tokens_to_read(int(self.store.sample_lengths[store_index]), self.max_len)

    def _read_item(self, store_index: int, read_ahead: bool = True) -> Item | None:
        """The trainer's item for one sample, checked; None for a damaged sample when on_corrupt="skip"."""
        counters = self.counters.worker()
        self.store.io_stats = counters
        counters.begin_sample(store_index)
        tokens = self.tokens_to_read(store_index)
        allocate = self._allocator()
        try:
            raw = self.store.read_sample(store_index, tokens, allocate=allocate, stats=counters, read_ahead=read_ahead,
                                         extras=self._extras)
        except CorruptSampleError as error:
            self.skip_damaged(error, counters)
            return None
        item = self.flavor.build(dequantized(raw, allocate), self.store.info, self.hidden_states_dtype, self.transform,
                                 allocate)
        counters.end_sample(store_index, tokens)
        return item

    def skip_damaged(self, error: CorruptSampleError, counters: WorkerCounters) -> None:
        """The one policy for a damaged sample: raise its error, or (on_corrupt="skip") count it, log it and go on."""
        if self.on_corrupt == "raise":
            raise error
        counters.skip_corrupt(error.sample)
        log.error("skipping a damaged sample (on_corrupt='skip'): %s", error)


class HiddenStatesDataset(_FlavoredReader, Dataset[Item]):
    """Map-style drop-in for the trainers' own datasets: `dataset[i]` is the trainer's item for sample i.

    Args:
        store: an h5feed store: a local path, an fsspec URL (s3://, gs://, az://, https://, ...), or an open `Store`.
        flavor: whose items to yield: ``speculators-legacy`` (0.4, shifted), ``speculators`` (0.5+),
            ``specforge``, ``specforge-shifted`` (SpecForge before 2026-01-22), ``specforge-dflash`` (SpecForge
            0.2's DFlash and Domino), ``specforge-dspark``, ``modelopt``, ``modelopt-answer-only``,
            ``modelopt-0.45`` (Model-Optimizer), ``angelslim``, ``nemo-eagle3`` (NeMo Automodel's cache);
            docs/pipelines.md.
        max_len: the trainer's max_len: only the tokens its collate can use are read.
        transform: called with the item dict where the trainer calls it (speculators noise transforms).
            With a random transform and max_len, the noise is drawn on the rows read only.
        hidden_states_dtype: dtype of the hidden-state keys (speculators casts; default as the trainer's).
        samples: store indices and/or source paths (as in the trainer's own file lists) to select.
        missing_loss_mask: what to do with samples whose source had no loss mask.
        on_corrupt: what to do with a sample whose stored bytes fail their checksums: "raise" (default) a
            `CorruptSampleError` naming the sample, its source file and the damaged object, or "skip" it,
            count it (`counters.snapshot()`, the monitor) and log it. The Dataset then serves the next
            sound sample of its selection in its place (an index must give an item); the Stream leaves
            it out, and the batches of a StreamLoader or BatchLoader are the schedule's, each less its
            damaged samples (smaller; none for a batch of damaged samples only): a skip moves no later
            batch, and the resume position counts skipped samples as passed.  (A plain DataLoader over
            the Stream batches what its workers yield: after a skip its batches shift; use StreamLoader.)
        shared_memory: decode into shared memory inside DataLoader workers. Right when items are
            handed on uncollated (batch_size=None): the hand-off then passes a file descriptor, not
            a copy. Wrong when the collate copies anyway (speculators', SpecForge's): fresh shared
            memory costs about twice as much to fill as pooled plain memory. None (default): plain
            memory until the first item is seen leaving the worker as it is, shared from then on.
        storage_options: for a URL: the fsspec backend's options (credentials, endpoint_url, ...);
            by default each backend finds them itself (environment, config files).
        cache_dir, cache_limit: for a URL: a node-local cache of the store's objects (the first
            epoch fills it, later ones read it), at most `cache_limit` bytes; none by default.
    """

    def __init__(
        self,
        store: StoreLike,
        flavor: str = "speculators-legacy",
        max_len: int | None = None,
        transform: Transform | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        *,
        samples: SampleSelector | None = None,
        missing_loss_mask: Literal["error", "ones"] = "error",
        shared_memory: bool | None = None,
        on_corrupt: OnCorrupt = "raise",
    ) -> None:
        super().__init__(store, flavor, max_len, transform, hidden_states_dtype, samples, missing_loss_mask,
                         shared_memory, on_corrupt)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Item:
        n = len(self.indices)
        for offset in range(n):  # with on_corrupt="skip", the next sound sample stands in for a damaged one
            item = self._read_item(self.indices[(index + offset) % n])
            if item is not None:
                return item
        raise StoreError(self.store.path, f"every one of the {n} selected samples is damaged")


class HiddenStatesStream(_FlavoredReader, IterableDataset[Item]):
    """The fast path: a sharded, shuffled, prefetching IterableDataset of the same items.

    Each epoch's order is a permutation seeded by (seed, epoch).  Rank r of W takes
    every W-th sample of it; within a rank, DataLoader worker w takes the batches
    j with j % num_workers == w, so the DataLoader delivers the rank's sequence in
    order and a position in it is all a resume needs (README "Sharding and resuming").
    `threads` threads in each worker (or in the trainer's process with num_workers=0)
    read and decode up to `prefetch` samples ahead.

    Extra args (the rest as `HiddenStatesDataset`):
        batch_size: the DataLoader's batch_size, so workers deal whole batches (a `StreamLoader` or `BatchLoader`
            reads a copy dealt in its own: `for_loader`).
        schedule: which samples, in what order, on which rank, and whether to follow a writer
            (`ScheduleOptions`: samples, shuffle, seed, rank, world_size, follow, ...; default: every sample,
            shuffled with seed 0, this rank's share).
        reading: reader threads per worker, samples read ahead, shared memory (`ReadOptions`).
    """

    def __init__(
        self,
        store: StoreLike,
        flavor: str = "speculators-legacy",
        max_len: int | None = None,
        transform: Transform | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        *,
        batch_size: int = 1,
        missing_loss_mask: Literal["error", "ones"] = "error",
        on_corrupt: OnCorrupt = "raise",
        schedule: ScheduleOptions | None = None,
        reading: ReadOptions | None = None,
    ) -> None:
        schedule = schedule or ScheduleOptions()
        reading = reading or ReadOptions()
        if schedule.follow is not None and not isinstance(store, Store):  # its writer may not have published yet
            where = store if isinstance(store, StoreOptions) else StoreOptions(store)
            store = open_followed(where.location, schedule.follow, storage_options=where.storage_options,
                                  cache_dir=where.cache_dir, cache_limit=where.cache_limit)
        super().__init__(store, flavor, max_len, transform, hidden_states_dtype, schedule.samples, missing_loss_mask,
                         reading.shared_memory, on_corrupt)
        self.follow = schedule.follow
        self._missing_loss_mask = missing_loss_mask
        disk_order = None
        if schedule.shuffle == "locality":
            chosen = np.asarray(self.indices)
            disk_order = chosen[np.argsort(self.store.sample_starts[chosen], kind="stable")].tolist()
        self.schedule = SampleSchedule(self.indices, disk_order, schedule.shuffle, schedule.locality_block,
                                       schedule.seed, schedule.equal_per_rank, batch_size, schedule.rank,
                                       schedule.world_size)
        self.prefetch = reading.prefetch
        self.threads = reading.threads
        self.stands_in_for_skips = False  # a StreamLoader keeps its batches to the schedule (SkippedSample)

    def for_loader(self, batch_size: int) -> HiddenStatesStream:
        """The stream a loader reads: this one dealt in the loader's batches of `batch_size` and counted by the
        loader, so that this stream (read by a DataLoader, or by another loader) deals as it did.  It shares the
        opened store, the counters (the monitor's, this stream's too) and the epoch and resume position
        (`SampleSchedule.for_loader`): `set_epoch` and `load_state_dict` on either reach both."""
        view = copy.copy(self)  # through __getstate__: the copy makes a buffer pool of its own
        view.schedule = self.schedule.for_loader(batch_size)
        return view

    # --- order, sharding, epochs and resume: the schedule's --------------------------------------
    @property
    def batch_size(self) -> int:
        return self.schedule.batch_size

    @property
    def epoch(self) -> int:
        return self.schedule.progress.epoch

    @property
    def seed(self) -> int:
        return self.schedule.seed

    def rank_and_world_size(self) -> tuple[int, int]:
        return self.schedule.rank_and_world_size()

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """Store indices in this epoch's global order (the same on every rank)."""
        return self.schedule.epoch_order(epoch)

    def rank_sequence(self) -> list[int]:
        """This rank's samples from the resume position on, in the order the DataLoader delivers them."""
        return self.schedule.rank_sequence()

    def __len__(self) -> int:
        if self.follow is not None:
            raise TypeError("a stream that follows its writer has no length: it reads what the writer publishes")
        return len(self.schedule)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (call before each epoch, like DistributedSampler)."""
        self.schedule.set_epoch(epoch)

    def note_consumed(self, items: int) -> None:
        """Count items the trainer took (StreamLoader does this for you)."""
        self.schedule.note_consumed(items)

    def begin_pass(self) -> None:
        """A pass over the epoch starts (at the resume position): what the trainer took is counted from here."""
        self.schedule.begin_pass()
        if self.follow is not None:
            self.counters.begin_follow()

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands: a position in the epoch order that does not depend on worker count (a
        following stream's: in publication order, clamped to where its pass ended, once it has)."""
        if self.follow is None:
            return self.schedule.state_dict()
        end = self.counters.follow_end()
        return self.schedule.state_dict(end=sys.maxsize if end is None else end)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)

    # --- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Item | SkippedSample]:
        schedule = self.schedule
        sequence: Iterable[int]
        can_draw: Callable[[], bool] | None = None
        if self.follow is None:
            sequence = schedule.worker_sequence(*current_worker())
        else:
            share = FollowedShare(*schedule.rank_and_world_size(), *current_worker(), self.batch_size,
                                  schedule.progress.start, schedule.equal_per_rank)
            positions = FollowedPositions(self.store, self.follow, share, self.counters.worker())
            sequence, can_draw = self._loss_masks_checked(positions), positions.ready
        counting = get_worker_info() is None and not schedule.counted_by_loader
        if counting:
            self.begin_pass()
        for item in self._prefetched(sequence, can_draw):
            if counting:
                schedule.note_consumed(1)  # before the yield: the item is the trainer's once it has it
            yield item

    def _loss_masks_checked(self, positions: Iterable[int]) -> Iterator[int]:
        """A following worker's samples (`h5feed.loading.follow`), each checked for a loss mask as the samples
        present at the start were."""
        for index in positions:
            self._check_loss_masks(self._missing_loss_mask, [index])
            yield index

    def _prefetched(self, sequence: Iterable[int], can_draw: Callable[[], bool] | None = None,
                    ) -> Iterator[Item | SkippedSample]:
        """Items of `sequence` in order, read by `threads` threads at most `prefetch` samples ahead (drawn from
        `sequence` once `can_draw` says the next needs no wait, while items are in flight: `ReadAhead`).

        Reads release the GIL (file I/O, mmap, blosc), so threads decode in parallel: in
        the trainer's own process (num_workers=0) nothing crosses a process boundary at all.
        A damaged sample skipped (on_corrupt="skip") is left out, or, read by a StreamLoader,
        stood in for by a `SkippedSample`.
        """
        counters = self.counters.worker()
        counters.start()
        self.store.io_stats = counters  # before the first fetch ahead
        self._buffer_pool()  # made here, before the reader threads race to make it
        if self.prefetch < 1:
            for index in sequence:
                yield from self._delivered(index, self._read_item(index))
            return

        def announce(index: int) -> None:
            self.store.will_need(index, self.tokens_to_read(index), extras=self._extras)  # the disk starts now

        def read(index: int) -> tuple[int, Item | None]:
            return index, self._read_item(index, read_ahead=False)

        with ReadAhead(sequence, read, threads=self.threads, depth=max(self.prefetch, self.threads), announce=announce,
                       counters=counters, can_draw=can_draw) as reads:  # closed also when the consumer stops early
            for index, item in reads:
                yield from self._delivered(index, item)

    def _delivered(self, index: int, item: Item | None) -> Iterator[Item | SkippedSample]:
        """What the consumer gets for one sample of the sequence (None: damaged and skipped)."""
        if item is not None:
            yield item
        elif self.stands_in_for_skips:
            yield SkippedSample(index)


class StreamLoader(DataLoader):
    """A DataLoader over a `HiddenStatesStream` that counts what the trainer takes, for exact resume.

    Takes DataLoader's arguments; `state_dict()` / `load_state_dict()` delegate to the stream.  It reads the
    stream dealt in its batches (`HiddenStatesStream.for_loader`, its `dataset`): the stream passed in keeps its
    own batch_size and counting, and shares the epoch, the resume position and the counters with it.
    With on_corrupt="skip", each batch holds its scheduled samples less the damaged ones (it is
    smaller; one of nothing but damaged samples is not delivered), so a skip neither shifts nor
    reorders later batches, and the resume position counts the skipped samples as passed.
    A worker that dies raises a `WorkerDiedError` naming it, its pid and the sample it was reading.
    """

    def __init__(self, dataset: HiddenStatesStream, batch_size: int | None = 1, **kwargs: Any) -> None:
        check_worker_count(kwargs.get("num_workers", 0))
        stream = dataset.for_loader(batch_size or 1)  # the loader's own: `dataset` deals as it did
        stream.stands_in_for_skips = True
        if batch_size is None and stream.shared_memory is None:  # items leave the workers as they are
            stream.shared_memory = True  # (the stream would learn it too, after the first item)
        collate = kwargs.pop("collate_fn", None) or (default_collate if batch_size is not None else default_convert)
        super().__init__(stream, batch_size=batch_size, collate_fn=SoundItemsCollate(collate), **kwargs)

    def __iter__(self) -> Iterator[Any]:
        stream: HiddenStatesStream = self.dataset  # type: ignore[assignment]
        stream.begin_pass()
        iterator = super().__iter__()
        with naming_dead_workers(iterator, stream):
            for batch in iterator:
                stream.note_consumed(stream.batch_size)  # only the last batch can be short: position is clamped
                if not isinstance(batch, SkippedSample):
                    yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SoundItemsCollate:
    """A StreamLoader's collate: the trainer's, given only the sound items of a batch; a batch (or, with
    batch_size=None, an item) of nothing but skipped samples stays a `SkippedSample`, which the loader drops."""

    collate: Any

    def __call__(self, items: Any) -> Any:
        if isinstance(items, SkippedSample):
            return items
        if isinstance(items, list) and any(isinstance(item, SkippedSample) for item in items):
            sound = [item for item in items if not isinstance(item, SkippedSample)]
            return self.collate(sound) if sound else items[0]
        return self.collate(items)


@contextmanager
def naming_dead_workers(iterator: Any, reader: _FlavoredReader) -> Iterator[None]:
    """Around a pass over a DataLoader's iterator: a worker that died surfaces as a `WorkerDiedError` naming it, its
    pid and the sample its counters say it was reading, not as the broken pipe, EOF or bare pid it left behind."""
    try:
        yield
    except (RuntimeError, OSError, EOFError) as error:
        died = dead_worker_error(iterator, reader)
        if died is None:
            raise
        raise died from error


def dead_worker_error(iterator: Any, reader: _FlavoredReader) -> WorkerDiedError | None:
    """The error for a worker of this DataLoader iterator that has died; None when none has (within a moment)."""
    with _sigchld_held():
        workers = list(enumerate(getattr(iterator, "_workers", [])))  # torch's worker processes, by worker id
        deadline = time.monotonic() + (_REAP_SECONDS if workers else 0)
        while True:
            for worker, process in workers:
                if process.exitcode not in (None, 0):
                    return _worker_died(reader, worker, process.pid, process.exitcode)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)


@contextmanager
def _sigchld_held() -> Iterator[None]:
    """torch's SIGCHLD handler raises its own error (a bare pid) wherever the trainer's thread is when a worker dies:
    set aside while the death is looked into, it cannot replace the error that names the worker."""
    if threading.current_thread() is not threading.main_thread():  # torch sets its handler in the main thread only
        yield
        return
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _worker_died(reader: _FlavoredReader, worker: int, pid: int, exitcode: int) -> WorkerDiedError:
    store = reader.store
    row = next((w for w in reader.counters.snapshot().workers if w.worker == worker), None)
    sample = row.current_sample if row is not None and row.current_sample is not None else -1
    doing = (f"while reading sample {sample} (converted from {store.source_paths[sample]})" if sample >= 0
             else "between samples")
    if -exitcode in signal.valid_signals():
        how = (f"was killed by {signal.Signals(-exitcode).name} {doing}; something outside h5feed ended it (often "
               "the kernel's out-of-memory killer: see `dmesg`)")
    else:
        how = f"exited with status {exitcode} {doing} (its output says why)"
    return WorkerDiedError(store.path, f"DataLoader worker {worker} (pid {pid}) {how}; continue from the last "
                           "state_dict() in a new loader", worker, pid, sample)


def stream_of(data: HiddenStatesStream | StoreLike, flavor: str | None, max_len: int | None,
              hidden_states_dtype: torch.dtype | None, schedule: ScheduleOptions | None) -> HiddenStatesStream:
    """The stream a batch loader reads: the one passed in, or one made from a store and the schedule.
    A batch loader deals the batches of a store's samples as it is opened: a stream that follows its writer is
    refused (before a store with no sample yet is waited for)."""
    stream = data if isinstance(data, HiddenStatesStream) else None
    if (stream.follow if stream is not None else schedule.follow if schedule is not None else None) is not None:
        where = (stream.store.path if stream is not None else data.path if isinstance(data, Store)
                 else data.location if isinstance(data, StoreOptions) else data)
        raise ValueError(f"{where}: a stream that follows its writer (follow=) is read with StreamLoader; "
                         "BatchLoader and CudaBatchLoader deal the batches of the samples a store holds when opened")
    if stream is not None:
        given = {"flavor": flavor, "max_len": max_len, "hidden_states_dtype": hidden_states_dtype,
                 "schedule": schedule}
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} belong to the HiddenStatesStream passed in; set them there")
        return stream
    store = open_store(data)  # type: ignore[arg-type]
    return HiddenStatesStream(store, flavor or _default_flavor(store), max_len, hidden_states_dtype=hidden_states_dtype,
                              schedule=schedule)


def _default_flavor(store: Store) -> str:
    """speculators-legacy, the loaders' default, where it fits the store; otherwise a ValueError that names the
    flavors that do (the trainers' batches differ: a guess would hand one batches it does not expect)."""
    if store.info.has_last_state and store.info.last_state_norm == get_flavor("speculators-legacy").last_state_norm:
        return "speculators-legacy"  # where it refuses the store for another reason, its own error says why
    fits = [name for name in FLAVORS if _fits(name, store)]
    raise ValueError(f"{store.path}: no flavor given, and the default (speculators-legacy, which needs a pre-norm last "
                     f"hidden state) does not fit this store (converted from {store.info.source_format}): pass "
                     f"flavor=, the trainer whose batches to make: {', '.join(fits)}")


def _fits(flavor: str, store: Store) -> bool:
    try:
        get_flavor(flavor).check_store(store.path, store.info, None)
    except (ValueError, StoreError):
        return False
    return True
