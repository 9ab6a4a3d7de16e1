"""decode="cuda": the trainer's batches decoded on the GPU, so that the CPU only reads and checks files.

Reader threads, one batch each, copy its samples' still-compressed chunk frames,
every one checked against its crc32c (`Store.copy_frames_into`), into the batch's
region of one page-locked staging memory.  A delivery thread (`h5feed.loading.delivery`)
sends the frames of up to `decode_group` consecutive staged batches to the GPU in one
copy and decodes them in one nvCOMP batch on a stream of its own (`h5feed.gpu`:
the GPU decodes several times faster per byte in large batches), each chunk's rows
written straight into their place in the trainer's batch (no temporary, no placement
copy, pads zeroed), one group ahead of the trainer.  The trainer's thread only makes
its stream wait for the batch's event.  The batches equal, tensor for tensor, what
`DataLoader(HiddenStatesStream(...), collate_fn=trainer_collate(flavor, max_len),
pin_memory=True)` yields, already on the GPU.  A staging region is reused once the
event recorded after its copy to the GPU has completed.  Without CUDA or nvCOMP, use
decode="cpu" (a clear error says so).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from h5feed import tracing
from h5feed.errors import CorruptSampleError
from h5feed.flavors import Batch, BatchPlan, RowKey, TensorSpec, TrainerCollate
from h5feed.gpu import CudaBloscDecoder, FramePlacement, why_unavailable
from h5feed.loading.backends.base import DecodeBackend, ReadyBatch, register_backend
from h5feed.loading.datasets import HiddenStatesStream
from h5feed.loading.delivery import TrainerStream
from h5feed.loading.options import Batching
from h5feed.loading.placement import place_items
from h5feed.loading.readahead import ReadAhead
from h5feed.store import Store
from h5feed.store.fp8 import dequantize_into
from h5feed.store.layout import HIDDEN_ARRAYS, HIDDEN_SCALES

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


Staged = TypeVar("Staged")
Decoded = TypeVar("Decoded")


def decode_in_groups(staging: ReadAhead[Any, Staged], region_of: Callable[[Staged], int],
                     decode: Callable[[list[Staged]], list[Decoded]], group: int, ahead: int) -> Iterator[Decoded]:
    """The staged batches, decoded in groups, in order: what the GPU backend's delivery thread runs.

    Regions come in blocks of `group` (a batch's region is its place in the ring of staging memory), and a
    group is the staged batches from its head to the end of the head's block, so that its frames go to the
    GPU in one copy.  A group is decoded once all its batches are staged, while no more than `ahead` decoded
    batches would then be in hand; only when nothing decoded is left (the trainer would wait) is a group
    decoded with what is staged so far, at least its head, waited for."""
    decoded: deque[Decoded] = deque()

    def size_from(head: Staged) -> int:
        return group - region_of(head) % group

    def whole_group_staged() -> bool:
        head = staging.ready()
        if head is None:
            return False
        wanted = size_from(head)
        ready = staging.ready_count(wanted)
        return ready == wanted or staging.exhausted and ready == staging.in_flight()

    def decode_next_group() -> None:
        batches = [staging.take()]
        while len(batches) < size_from(batches[0]) and staging.ready() is not None:
            batches.append(staging.take())
        decoded.extend(decode(batches))

    while staging or decoded:
        if not decoded:
            decode_next_group()
        while len(decoded) + group <= ahead and whole_group_staged():
            decode_next_group()
        yield decoded.popleft()


def store_refusal(store: Store) -> str | None:
    """Why this store's chunks cannot be decoded on the GPU; None when they can (Blosc-zstd, byte shuffle, format 2
    or later; exact or FP8 hidden states)."""
    codec = store.info.codec
    if codec.cname == "zstd" and codec.shuffle == "shuffle" and store.info.sharded:
        return None
    return (f"decode on the GPU needs a format-2 store with the zstd codec (this one: format "
            f"{store.info.format_version}, {codec})")


def gpu_decode_refusal(store: Store) -> str | None:
    """Why decode="cuda" cannot decode this store here (no CUDA, no nvCOMP, another codec); None when it can."""
    return why_unavailable() or store_refusal(store)


@dataclass(frozen=True)
class CudaOptions:
    """The cuda backend's own options.

    threads: reader threads (file reads, crc32c checks and one copy into pinned memory each).
    prefetch: batches staged ahead (read by the threads in parallel); at least decode_group, so that a whole
        group can be staged while the one before is decoded.
    decode_group: consecutive staged batches decoded in one GPU call (None: 8, or prefetch or decode_ahead if less).  The GPU
        decodes several times faster per byte in large calls (on an H200, Kimi-shaped samples: 2.9 ms of zstd a
        sample in calls of 4, 1.2 in calls of 16), and what it spends decoding it takes from the step beside it.
    decode_ahead: batches decoded ahead of the trainer on the GPU (each holds its batch's GPU memory); at least
        decode_group (None: two groups).
    device: the CUDA device the batches arrive on.
    """

    threads: int = 2
    prefetch: int = 8
    decode_group: int | None = None
    decode_ahead: int | None = None
    device: torch.device | str = "cuda"

    def __post_init__(self) -> None:
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, not {self.prefetch}")
        if self.decode_group is None:
            object.__setattr__(self, "decode_group", max(1, min(8, self.prefetch, self.decode_ahead or 8)))
        if self.decode_ahead is None:
            object.__setattr__(self, "decode_ahead", 2 * self.decode_group)
        if self.decode_group < 1:
            raise ValueError(f"decode_group must be >= 1, not {self.decode_group}")
        if self.prefetch < self.decode_group:
            raise ValueError(f"prefetch ({self.prefetch}) must be at least decode_group ({self.decode_group}): "
                             "a group is decoded once all its batches are staged")
        if self.decode_ahead < self.decode_group:
            raise ValueError(f"decode_ahead ({self.decode_ahead}) must be at least decode_group "
                             f"({self.decode_group}): a group's batches are decoded ahead together")


@register_backend
class CudaBackend(DecodeBackend):
    """Reader threads stage each batch's checked, compressed frames; the delivery thread decodes them on the GPU.

    `gpu_decode_ms` adds up the GPU time spent decoding (copy in, zstd, unshuffle): what decoding
    takes from training on that GPU.
    """

    name = "cuda"
    delivery_thread = "h5feed-gpu-decode"
    memory = "staging memory"
    Options = CudaOptions

    @classmethod
    def default_options(cls, num_workers: int, device: torch.device | str | None) -> CudaOptions:
        return CudaOptions() if device is None else CudaOptions(device=device)

    @classmethod
    def unavailable(cls) -> str | None:
        return why_unavailable()

    @classmethod
    def refusal(cls, store: Store) -> str | None:
        return store_refusal(store)

    def __init__(self, stream: HiddenStatesStream, collate: TrainerCollate, batching: Batching,
                 options: CudaOptions) -> None:
        reason = why_unavailable()
        if reason is not None:
            raise RuntimeError(f"decode on the GPU is not available ({reason}); use h5feed.BatchLoader, which "
                               "decodes on the CPU")
        store = stream.store
        reason = store_refusal(store)
        if reason is not None:
            raise ValueError(f"{store.path}: {reason}; use h5feed.BatchLoader(decode='cpu')")
        self.stream, self.collate, self.batching, self.options = stream, collate, batching, options
        self.threads, self.prefetch = options.threads, options.prefetch
        assert options.decode_group is not None and options.decode_ahead is not None  # resolved by the options
        self.decode_group, self.decode_ahead = options.decode_group, options.decode_ahead
        self.device = torch.device(options.device)
        info = store.info
        self._trailing: dict[str, TensorSpec] = self.collate.trailing()
        self._arrays = sorted({rk.array for rk in self.collate.row_keys if rk.array is not None}
                              | ({HIDDEN_SCALES} if info.fp8 else set()))  # an FP8 store's states need their scales
        longest = max((stream.tokens_to_read(i) for i in stream.indices), default=1)
        chunks = -(-longest // info.chunk_tokens)
        per_sample = sum(chunks * (info.chunk_tokens * info.row_nbytes(a) + _FRAME_SLACK) for a in self._arrays)
        # a region is reused only after its batch was decoded; groups are blocks of decode_group regions (a whole
        # number of them in the ring), so that each group's frames go to the GPU in one copy
        self._regions = -(-(self.prefetch + self.decode_group) // self.decode_group) * self.decode_group
        self._region_bytes = batching.batch_size * per_sample
        self._staging = torch.empty(self._regions * self._region_bytes, dtype=torch.uint8, pin_memory=True)
        self._copied: list[torch.cuda.Event | None] = [None] * self._regions
        self._decoder = CudaBloscDecoder(self.device, stream=torch.cuda.Stream(self.device))
        self.gpu_decode_ms = 0.0
        self._pending_timings: deque[Any] = deque()

    def close(self) -> None:
        """The pinned staging memory goes back."""
        self.__dict__.pop("_staging", None)

    @property
    def holds_memory(self) -> bool:
        return "_staging" in vars(self)

    def pass_stopped(self) -> None:
        self._collect_timings(wait=True)

    # --- the delivery thread: staged batches decoded on the GPU, a group at a time ----------------
    def ready_batches(self, trainer: TrainerStream | None) -> Generator[ReadyBatch, None, None]:
        """Each staged batch, decoded straight into the trainer's batch on the decode stream, in order.

        Decoding runs in whole groups of `decode_group` staged batches, while the trainer still has decoded
        batches in hand (up to `decode_ahead`): few, large GPU calls, ahead of need.  A call of one batch at a
        time, made as each is staged, costs the step beside it two to three times the GPU time per sample.  Only
        when the trainer would otherwise wait (nothing decoded is left), or at the pass's end, is a group decoded
        short, with what is staged then."""
        assert trainer is not None  # batches arrive on the GPU
        stream = self.stream
        stream.counters.worker().start()
        # drawn as each batch is submitted, `prefetch` batches ahead of the one taken: the batch that used its
        # region before was decoded by then, and its copy to the GPU is queued or done (the event)
        work = ((indices, j % self._regions, self._copied[j % self._regions])
                for j, indices in enumerate(stream.schedule.worker_batches(self.batching.drop_last)))

        def announce(batch: tuple[list[int], int, torch.cuda.Event | None]) -> None:
            for i in batch[0]:
                stream.store.will_need(i, stream.tokens_to_read(i))

        with torch.cuda.device(self.device), ReadAhead(
                work, lambda batch: self._stage(*batch), threads=self.threads, depth=self.prefetch,
                announce=announce, name="h5feed-gpu-read") as staging:

            def decode(group: list[_Staged]) -> list[ReadyBatch]:
                with tracing.section("h5feed: decode on the GPU", "delivery", batches=len(group)):
                    return self._decode(group, trainer)

            yield from decode_in_groups(staging, lambda staged: staged.region, decode, self.decode_group,
                                        self.decode_ahead)

    # --- reader threads: compressed, checked frames into pinned memory ----------------------------
    def _stage(self, indices: list[int], region: int, copied: torch.cuda.Event | None) -> _Staged:
        """The batch's frames, staged; with on_corrupt="skip" a damaged sample's are dropped and the batch is the
        sound rest (as `BatchLoader`'s)."""
        stream, store = self.stream, self.stream.store
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

    def _decode(self, group: list[_Staged], trainer: TrainerStream) -> list[ReadyBatch]:
        """Queue the group's decode on the decode stream, each frame's rows straight into their place in its batch
        (whose memory is kept for the trainer's stream from here)."""
        side = self._decoder.stream
        placements: list[FramePlacement] = []
        conversions: list[Callable[[], object]] = []  # rows decoded into a temporary, then written into the batch
        results: list[ReadyBatch] = []
        with torch.cuda.stream(side):
            batches, first_frame = [], 0  # frames are numbered across the group, as the spans are
            for staged in group:
                batches.append(self._placed(staged, first_frame, placements, conversions) if staged.indices else None)
                first_frame += len(staged.spans)
            sound = [staged for staged in group if staged.indices]
            if sound:
                spans = [span for staged in sound for span in staged.spans]
                timing = self._decoder.decode_placed(self._staging, spans, placements)
                self._pending_timings.append(timing)
                self.stream.counters.worker().add_delivered(timing.decoded_bytes)  # the monitor's "decoded"
                for staged in sound:
                    self._copied[staged.region] = timing.copy_done
            for convert in conversions:
                convert()
            for staged, placed in zip(group, batches):
                ready = torch.cuda.Event()
                if placed is not None:
                    batch, plan = placed
                    self.collate.derive_rows(batch, plan)
                    self.collate.write_summary(batch, plan)
                    ready.record(side)
                    trainer.adopt(batch)
                    results.append(ReadyBatch(batch, staged.scheduled, ready))
                else:
                    results.append(ReadyBatch(None, staged.scheduled, ready))
        self._collect_timings(wait=False)
        return results

    def _placed(self, staged: _Staged, first_frame: int, placements: list[FramePlacement],
                conversions: list[Callable[[], object]]) -> tuple[Batch, BatchPlan]:
        """The staged batch's tensors, pads zeroed, with a placement for every decoded chunk's rows.

        The batch's frames are frames `first_frame`, ... of the group's decode.  Rows whose batch dtype is
        not the stored one are decoded into a temporary and cast afterwards, and an FP8 store's hidden states
        into temporaries with their tokens' scales, dequantized afterwards (`conversions`, on the decode stream)."""
        store, collate, info = self.stream.store, self.collate, self.stream.store.info
        c = info.chunk_tokens
        frame_of = {target: first_frame + f for f, target in enumerate(staged.targets)}
        plan = collate.plan([collate.item_rows(int(store.sample_lengths[i])) for i in staged.indices])
        batch = {key: torch.empty(shape, dtype=dtype, device=self.device)
                 for key, (shape, dtype) in collate.specs(plan, self._trailing).items()}

        def decode_to(n: int, array: str, lo: int, into: torch.Tensor) -> None:
            """Stored rows [lo, lo + len(into)) of the batch's sample n's `array` decoded into `into`."""
            row_bytes, hi = info.row_nbytes(array), lo + into.shape[0]
            for chunk in range(lo // c, -(-hi // c)):
                first, last = max(lo, chunk * c), min(hi, (chunk + 1) * c)
                placements.append(FramePlacement(frame_of[(n, array, chunk)], (first - chunk * c) * row_bytes,
                                            into[first - lo : last - lo]))

        def place_rows(n: int, rows: dict[RowKey, torch.Tensor]) -> None:
            for rk, dest in rows.items():
                if rk.array is None:
                    continue  # derive_rows writes these
                stored = info.logical_dtype(rk.array)
                if info.fp8 and rk.array in HIDDEN_ARRAYS:
                    fp8 = torch.empty((dest.shape[0], info.width(rk.array)), dtype=stored, device=self.device)
                    scales = torch.empty(dest.shape[0], dtype=torch.float32, device=self.device)
                    decode_to(n, rk.array, rk.shift, fp8)
                    decode_to(n, HIDDEN_SCALES, rk.shift, scales)
                    conversions.append(functools.partial(dequantize_into, fp8, scales, dest.view(fp8.shape)))
                elif dest.dtype == stored:
                    decode_to(n, rk.array, rk.shift, dest)
                else:
                    into = torch.empty(dest.shape, dtype=stored, device=self.device)
                    decode_to(n, rk.array, rk.shift, into)
                    conversions.append(functools.partial(dest.copy_, into))

        place_items(collate.row_keys, plan, batch, place_rows, windows=staged.windows)
        return batch, plan

    def _collect_timings(self, wait: bool) -> None:
        """Add up the GPU time of decodes that have finished (or of all, waiting for them)."""
        while self._pending_timings and (wait or self._pending_timings[0].events[-1].query()):
            self.gpu_decode_ms += self._pending_timings.popleft().gpu_times().total_ms
