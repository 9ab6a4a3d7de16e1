"""decode="cuda": the trainer's batches decoded on the GPU, so that the CPU only reads and checks files.

Reader threads, one batch each, copy its samples' still-compressed chunk frames,
every one checked against its crc32c (`Store.copy_frames_into`), into the batch's
region of one page-locked staging memory; the trainer's thread sends the frames of
up to `decode_group` consecutive staged batches to the GPU in one copy, decodes them
there in one nvCOMP batch (`h5feed.gpu_decode`: the GPU decodes several times faster
per byte in large batches) on a stream of its own, and places the rows where the
trainer's collate puts them (device-to-device copies, pads zeroed).  The batches
equal, tensor for tensor, what `DataLoader(HiddenStatesStream(...),
collate_fn=trainer_collate(flavor, max_len), pin_memory=True)` yields, already on
the GPU.  A region is reused once the event recorded after its copy to the GPU has completed.  Without CUDA or nvCOMP, use `BatchLoader` (a clear error says so).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from h5feed.collate import Batch, RowKey, TensorSpec, trainer_collate
from h5feed.errors import CorruptSampleError
from h5feed.gpu_decode import CudaBloscDecoder, why_unavailable
from h5feed.loading.datasets import HiddenStatesStream, stream_of
from h5feed.loading.placement import place_items
from h5feed.loading.readahead import ReadAhead
from h5feed.store import Store

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

_FRAME_SLACK = 4096  # bytes a Blosc frame of incompressible data may exceed its chunk by


@dataclass
class _Staged:
    """One batch's compressed frames in its region of the pinned staging memory, and where each decodes to."""

    scheduled: int  # the schedule's samples of the batch, damaged ones skipped (on_corrupt="skip") included
    indices: list[int]  # the sound ones, staged
    windows: list[int]  # rows read of each sample (the flavor's window)
    region: int  # which region of the staging memory
    spans: list[tuple[int, int]]  # (offset in the staging memory, length) of each frame
    targets: list[tuple[int, str, int]]  # (sample position in the batch, array, chunk) of each frame


def store_refusal(store: Store) -> str | None:
    """Why this store's chunks cannot be decoded on the GPU; None when they can (Blosc-zstd, byte shuffle, format 2)."""
    codec = store.info.codec
    if codec.get("cname") == "zstd" and codec.get("shuffle") == "shuffle" and store.info.sharded:
        return None
    return (f"decode on the GPU needs a format-2 store with the zstd codec (this one: format "
            f"{store.info.format_version}, {codec})")


def gpu_decode_refusal(store: Store) -> str | None:
    """Why `CudaBatchLoader` cannot decode this store here (no CUDA, no nvCOMP, another codec); None when it can."""
    return why_unavailable() or store_refusal(store)


class CudaBatchLoader:
    """The trainer's batches, decoded on the GPU from compressed frames that reader threads read and check.

    Args:
        data: an h5feed store (path or `Store`), or a `HiddenStatesStream` (then leave out its own arguments).
        flavor, max_len, hidden_states_dtype, batch_size, drop_last: as `BatchLoader`.
        threads: reader threads (file reads, crc32c checks and one copy into pinned memory each).
        prefetch: batches staged ahead (read by the threads in parallel).
        decode_group: consecutive staged batches decoded in one GPU call.
        device: the CUDA device the batches arrive on.
        **stream_kwargs: `HiddenStatesStream`'s other arguments (samples, shuffle, seed, rank, ...).

    `gpu_decode_ms` adds up the GPU time spent decoding (copy in, zstd, unshuffle): what decoding
    takes from training on that GPU.
    """

    def __init__(
        self,
        data: HiddenStatesStream | Store | str | os.PathLike[str],
        *,
        flavor: str | None = None,
        max_len: int | None = None,
        hidden_states_dtype: torch.dtype | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        threads: int = 2,
        prefetch: int = 8,
        decode_group: int = 4,
        device: torch.device | str = "cuda",
        **stream_kwargs: Any,
    ) -> None:
        reason = why_unavailable()
        if reason is not None:
            raise RuntimeError(f"decode on the GPU is not available ({reason}); use h5feed.BatchLoader, which "
                               "decodes on the CPU")
        stream = stream_of(data, flavor, max_len, hidden_states_dtype, stream_kwargs)
        store = stream.store
        reason = store_refusal(store)
        if reason is not None:
            raise ValueError(f"{store.path}: {reason}; use h5feed.BatchLoader(decode='cpu')")
        stream.batch_size, stream.schedule.counted_by_loader = batch_size, True
        self.dataset, self.batch_size, self.drop_last = stream, batch_size, drop_last
        self.threads, self.prefetch, self.decode_group = threads, prefetch, decode_group
        self.device = torch.device(device)
        self.collate = trainer_collate(stream.flavor.name, stream.max_len,
                                       hidden_states_dtype=stream.hidden_states_dtype or store.info.torch_dtype
                                       ).for_store(store.info)
        info = store.info
        self._trailing: dict[str, TensorSpec] = self.collate.trailing()
        self._arrays = sorted({rk.array for rk in self.collate.row_keys if rk.array is not None})
        longest = max((stream.tokens_to_read(i) for i in stream.indices), default=1)
        chunks = -(-longest // info.chunk_tokens)
        per_sample = sum(chunks * (info.chunk_tokens * info.row_nbytes(a) + _FRAME_SLACK) for a in self._arrays)
        self._regions = prefetch + decode_group  # a region is reused only after its batch was decoded
        self._region_bytes = batch_size * per_sample
        self._staging = torch.empty(self._regions * self._region_bytes, dtype=torch.uint8, pin_memory=True)
        self._closed = False
        self._active: weakref.ref[Generator[Batch, None, None]] | None = None  # the pass close() ends
        self._copied: list[torch.cuda.Event | None] = [None] * self._regions
        self._decoder = CudaBloscDecoder(self.device, stream=torch.cuda.Stream(self.device))
        self.gpu_decode_ms = 0.0
        self._pending_timings: deque[Any] = deque()

    def __len__(self) -> int:
        return len(self.dataset.schedule.worker_batches(self.drop_last))

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        """End the current pass and give the pinned staging memory back; the loader cannot be iterated again."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._closed = True
        self.__dict__.pop("_staging", None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Batch]:
        """One pass over this rank's batches."""
        if self._closed:
            raise ValueError("this CudaBatchLoader is closed (its staging memory was given back): make a new one")
        batches = self._batches()
        self._active = weakref.ref(batches)
        return batches

    def _batches(self) -> Generator[Batch, None, None]:
        stream = self.dataset
        stream.schedule.begin_pass()
        stream.counters.worker().start()
        # drawn as each batch is submitted, `prefetch` batches ahead of the one taken: the batch that used its
        # region before was decoded by then, and its copy to the GPU is queued or done (the event)
        work = ((indices, j % self._regions, self._copied[j % self._regions])
                for j, indices in enumerate(stream.schedule.worker_batches(self.drop_last)))

        def announce(batch: tuple[list[int], int, torch.cuda.Event | None]) -> None:
            for i in batch[0]:
                stream.store.will_need(i, stream.tokens_to_read(i))

        # each staged batch with its batch and the event that says it is placed; None: all its samples skipped
        decoded: deque[tuple[_Staged, tuple[Batch, torch.cuda.Event] | None]] = deque()
        with ReadAhead(work, lambda batch: self._stage(*batch), threads=self.threads, depth=self.prefetch,
                       announce=announce, name="h5feed-gpu-read") as staging:

            def decode_next_group() -> None:  # the staged batches at the head, up to decode_group of them
                group = [staging.take()]
                while (len(group) < self.decode_group and (ahead := staging.ready()) is not None
                       and ahead.region == group[-1].region + 1):  # one contiguous copy
                    group.append(staging.take())
                sound = [staged for staged in group if staged.indices]
                ready = iter(self._decode(sound) if sound else [])
                decoded.extend((staged, next(ready) if staged.indices else None) for staged in group)

            try:
                while staging or decoded:
                    if not decoded:
                        decode_next_group()
                    staged, placed = decoded.popleft()
                    if not decoded and staging.ready() is not None:
                        decode_next_group()  # queued now, it runs on the GPU while the trainer's step does
                    if placed is None:
                        stream.note_consumed(staged.scheduled)
                        continue
                    batch, ready = placed
                    consumer = torch.cuda.current_stream(self.device)
                    consumer.wait_event(ready)  # the trainer's kernels start once this batch is decoded and placed
                    for value in batch.values():
                        if isinstance(value, torch.Tensor) and value.is_cuda:
                            value.record_stream(consumer)  # made on the side stream, used on the trainer's
                    stream.note_consumed(staged.scheduled)
                    yield self.collate.finish(batch)
            finally:
                self._collect_timings(wait=True)

    # --- reader threads: compressed, checked frames into pinned memory ----------------------------
    def _stage(self, indices: list[int], region: int, copied: torch.cuda.Event | None) -> _Staged:
        """The batch's frames, staged; with on_corrupt="skip" a damaged sample's are dropped and the batch is the
        sound rest (as `BatchLoader`'s)."""
        stream, store = self.dataset, self.dataset.store
        counters = stream.counters.worker()
        if copied is not None:
            copied.synchronize()  # the GPU has the bytes this region held before
        start = region * self._region_bytes
        host = self._staging[start : start + self._region_bytes].numpy()
        staged = _Staged(len(indices), [], [], region, [], [])
        position = 0
        for i in indices:
            counters.begin_sample(i)
            window = stream.tokens_to_read(i)
            n, frames, sample_start = len(staged.indices), len(staged.spans), position
            try:
                for array in self._arrays:
                    for chunk, offset, length in store.copy_frames_into(i, array, window, host[position:], counters):
                        staged.spans.append((start + position + offset, length))
                        staged.targets.append((n, array, chunk))
                    position = staged.spans[-1][0] + staged.spans[-1][1] - start
            except CorruptSampleError as error:
                stream.skip_damaged(error, counters)  # raises it with on_corrupt="raise"
                del staged.spans[frames:], staged.targets[frames:]
                position = sample_start
                continue
            staged.indices.append(i)
            staged.windows.append(window)
            counters.end_sample(i, window)
        return staged

    # --- the trainer's thread: one GPU decode per group, then the collate's placement -------------
    def _decode(self, group: list[_Staged]) -> list[tuple[Batch, torch.cuda.Event]]:
        """Queue the group's decode and placement on the side stream: each batch with the event that says it is ready."""
        info = self.dataset.store.info
        c, side = info.chunk_tokens, self._decoder.stream
        with torch.cuda.stream(side):
            decoded = [{(n, array): torch.empty((-(-w // c) * c, info.width(array)) if info.is_matrix(array)
                                                else (-(-w // c) * c,), dtype=info.storage_dtype(array),
                                                device=self.device)
                        for n, w in enumerate(staged.windows) for array in self._arrays} for staged in group]
            spans = [span for staged in group for span in staged.spans]
            outs = [decoded[g][(n, array)][chunk * c : (chunk + 1) * c]
                    for g, staged in enumerate(group) for n, array, chunk in staged.targets]
            timing = self._decoder.decode_from_pinned(self._staging, spans, outs)
            for staged in group:
                self._copied[staged.region] = timing.copy_done
            self._pending_timings.append(timing)
            batches = []
            for staged, rows in zip(group, decoded):
                batches.append((self._place(staged.indices, staged.windows, rows), torch.cuda.Event()))
                batches[-1][1].record(side)
        self._collect_timings(wait=False)
        return batches

    def _place(self, indices: list[int], windows: list[int], decoded: dict[tuple[int, str], torch.Tensor]) -> Batch:
        """One batch of the trainer's collate, from its samples' decoded rows (on the current stream)."""
        store, collate = self.dataset.store, self.collate
        plan = collate.plan([collate.item_rows(int(store.sample_lengths[i])) for i in indices])
        batch = {key: torch.empty(shape, dtype=dtype, device=self.device)
                 for key, (shape, dtype) in collate.specs(plan, self._trailing).items()}

        def copy_rows(n: int, rows: dict[RowKey, torch.Tensor]) -> None:
            for rk, dest in rows.items():
                if rk.array is not None:  # the rest derive_rows writes
                    source = decoded[(n, rk.array)][rk.shift : rk.shift + dest.shape[0]]
                    dest.copy_(source.view(store.info.logical_dtype(rk.array)).view(dest.shape))

        place_items(collate.row_keys, plan, batch, copy_rows, windows=windows)
        collate.derive_rows(batch, plan)
        collate.write_summary(batch, plan)
        return batch

    def _collect_timings(self, wait: bool) -> None:
        """Add up the GPU time of decodes that have finished (or of all, waiting for them)."""
        while self._pending_timings and (wait or self._pending_timings[0].events[-1].query()):
            self.gpu_decode_ms += self._pending_timings.popleft().gpu_times().total_ms
