"""Decode the store's Blosc1/zstd chunks on the GPU with nvCOMP, bit for bit as numcodecs does on the CPU.

Why: a Kimi-shaped sample is ~100 MB decoded and ~40 ms of one CPU core to
decode.  Shipping the compressed bytes (1.44x fewer) to the GPU and decoding
there leaves the CPU only the file reads.  The chunk codec stays as it is:
Blosc1 frames of zstd blocks with byte shuffle, as
``numcodecs.Blosc(cname="zstd", clevel=1, shuffle=1, blocksize=1 << 20)``
writes them (zarr's crc32c wrapper is checked and stripped by the caller).

How, per call, whatever the number of frames: the headers and block offsets of
all frames are parsed and checked at once with numpy (`parse_frames`; a frame
it does not take as a column, memcpyed or split or refused, goes through the
validating `parse_frame`, so errors stay exact); the frames, copied into one
reused pinned buffer or already in one (`CudaBloscDecoder.decode_from_pinned`),
go to the GPU in one copy; every zstd stream is decoded in one nvCOMP batch
into a scratch buffer, stored (raw) streams copied; then one Triton kernel
(`h5feed.gpu.unshuffle`) undoes the byte shuffle of every block, writing
straight into the destinations: whole output tensors, or with
`CudaBloscDecoder.decode_placed` any byte range of a frame into a row view of
the trainer's batch, so a loader needs no temporary and no placement copy.
Without Triton, torch transposes unshuffle, one per run of blocks.
`reference_decode_into` and `reference_decode_placed` run the same parser,
layout and unshuffle rows on the CPU with numcodecs' zstd, so CI (no GPU)
checks them bit for bit against `numcodecs.blosc`.

nvCOMP's zstd decoder assumes valid input: callers keep the crc32c check of
every chunk before decoding, and anything this module does not support raises
`UnsupportedFrame` before any GPU work, so the caller decodes that batch on the
CPU instead::

    if gpu.available():
        try:
            timing = gpu.decode_into_cuda(frames, outs)
        except gpu.UnsupportedFrame:
            ...  # decode on the CPU: numcodecs.blosc.decompress(frame, cpu_out), then copy
    else:
        for frame, out in zip(frames, cpu_outs):
            numcodecs.blosc.decompress(frame, out)

`DamagedFrame` means the bytes are not a valid frame: the CPU path fails too.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch

from h5feed.gpu.frames import FrameTable, parse_frames
from h5feed.gpu.plan import (
    DecodePlan,
    FramePlacement,
    copy_frames,
    plan_decode,
    round_up,
    stage_spans,
    unshuffle_torch,
    whole_placements,
)

if TYPE_CHECKING:
    from collections.abc import Buffer

MAX_HELD_CALLS = 8  # calls whose nvCOMP objects a decoder keeps while its stream is busy


@functools.cache
def why_unavailable() -> str | None:
    """None when GPU decode can run here, else why not (no CUDA device, nvCOMP missing)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        import nvidia.nvcomp  # noqa: F401
    except (ImportError, OSError) as e:
        return f"nvCOMP cannot be imported ({e}); install it with: pip install 'h5feed[gpu]'"
    return None


def available() -> bool:
    """Whether CUDA and nvCOMP are usable; when not, decode on the CPU with `numcodecs.blosc.decompress`."""
    return why_unavailable() is None


class GpuTimes(NamedTuple):
    """GPU milliseconds of one batch, from CUDA events on the decode stream."""

    h2d_ms: float  # compressed bytes, pinned -> device
    decode_ms: float  # nvCOMP zstd batch and the copies of stored streams
    unshuffle_ms: float  # byte unshuffle into the outputs
    total_ms: float


@dataclass(frozen=True)
class CudaDecodeTiming:
    """What one batch cost: CPU seconds at once, GPU milliseconds (`gpu_times`) once its GPU work is done."""

    frames: int
    streams: int
    compressed_bytes: int  # bytes sent to the GPU
    decoded_bytes: int
    parse_s: float  # CPU: header parsing and layout
    stage_s: float  # CPU: waiting for the pinned buffer and copying the frames into it
    events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]
    launch_s: float = 0.0  # CPU: queueing the GPU work (copy in, zstd batch, unshuffle)

    @property
    def copy_done(self) -> torch.cuda.Event:
        """Completes once the compressed bytes are on the GPU: the host buffer they came from is free again."""
        return self.events[1]

    def gpu_times(self) -> GpuTimes:
        """GPU time per stage; waits for the batch's GPU work to finish."""
        start, h2d, decoded, end = self.events
        end.synchronize()
        return GpuTimes(
            start.elapsed_time(h2d), h2d.elapsed_time(decoded), decoded.elapsed_time(end), start.elapsed_time(end)
        )


@functools.cache
def _triton_unshuffle() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None:
    """`h5feed.gpu.unshuffle.unshuffle_rows`, or None where Triton cannot be imported (then torch unshuffles)."""
    try:
        from h5feed.gpu.unshuffle import unshuffle_rows
    except ImportError:
        return None
    return unshuffle_rows


class _CachedDeviceBuffer:
    """Device memory nvCOMP asks for, taken from torch's caching allocator on nvCOMP's stream.

    Why: nvCOMP's own allocator calls cudaMalloc and cudaFree for its temporary
    buffers, and cudaFree waits for the whole device, the trainer's kernels
    included: every decode would then stall the training step.  Blocks from
    torch's cache come and go without a device synchronization, and are reused
    only in the order of the stream they were taken on.
    """

    def __init__(self, nbytes: int, stream: object) -> None:
        self.ptr = torch.cuda.caching_allocator_alloc(max(nbytes, 1), device=stream.device,  # type: ignore[attr-defined]
                                                      stream=stream.ptr)  # type: ignore[attr-defined]
        # held by the buffer: at the interpreter's exit this module's globals (torch, sys) may already be gone
        self._release = torch.cuda.caching_allocator_delete
        self._exiting = sys.is_finalizing

    def __del__(self) -> None:
        if not self._exiting():  # at exit the process's device memory goes with it; torch may be half torn down
            self._release(self.ptr)


_allocator_lock = threading.Lock()
_allocator_set = False


def _use_torch_allocator(nvcomp: object) -> None:
    """Route nvCOMP's device allocations through torch's caching allocator (once per process)."""
    global _allocator_set
    with _allocator_lock:
        if not _allocator_set:
            nvcomp.set_device_allocator(_CachedDeviceBuffer)  # type: ignore[attr-defined]
            _allocator_set = True


class CudaBloscDecoder:
    """Decodes batches of frames on one CUDA stream, keeping its nvCOMP codec and buffers between calls.

    Per call, whatever the batch's size: the frame headers are parsed in bulk
    (`parse_frames`), the compressed bytes go to the GPU in one copy, every zstd
    stream is decoded in one nvCOMP batch, and the byte unshuffle of every block
    is one Triton kernel writing straight into the outputs (with `decode_placed`,
    rows of the trainer's batch: no temporary, no placement copy).  Without Triton,
    or with `unshuffle="torch"`, torch transposes do it, one per run of blocks.

    Buffers (pinned staging, device staging, device scratch) grow to the
    largest batch seen and are reused.  All GPU work is queued on `stream`; the
    outputs are ready for work queued on it after a call returns.  One call at
    a time per decoder (a lock guards it).  `sync_free` hands nvCOMP the
    decoded sizes the Blosc headers give; False lets nvCOMP read them from the
    zstd headers on the GPU, which waits for the stream once per batch.
    """

    def __init__(
        self,
        device: torch.device | int | None = None,
        stream: torch.cuda.Stream | None = None,
        sync_free: bool = True,
        unshuffle: Literal["auto", "triton", "torch"] = "auto",
    ) -> None:
        reason = why_unavailable()
        if reason is not None:
            raise RuntimeError(f"GPU decode is not available: {reason}")
        from nvidia import nvcomp

        self._nvcomp = nvcomp
        _use_torch_allocator(nvcomp)
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.sync_free = sync_free
        self._kernel = None if unshuffle == "torch" else _triton_unshuffle()
        if unshuffle == "triton" and self._kernel is None:
            raise RuntimeError("the Triton unshuffle kernel needs triton: pip install triton, or pass unshuffle='torch'")
        self._codec = nvcomp.Codec(
            algorithm="Zstd",
            bitstream_kind=nvcomp.BitstreamKind.RAW,
            device_id=self.device.index,
            cuda_stream=self.stream.cuda_stream,
        )
        self._pinned = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):  # freed on growth, reused only in this stream's order
            self._staged = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._pinned_free: torch.cuda.Event | None = None  # the last copy out of self._pinned has completed
        self._lock = threading.Lock()
        # nvCOMP's objects of the calls before, kept while their work may still be queued: freed as the call
        # returned, they waited for the GPU (on the H200, with nvCOMP's own allocator, each call returned only
        # once its zstd kernel had run); they go at a later call that finds the stream idle (or
        # MAX_HELD_CALLS calls later).
        self._nvcomp_held: list[tuple[object, ...]] = []

    @property
    def unshuffle(self) -> str:
        """"triton" (one kernel per batch) or "torch" (a transpose per run of blocks)."""
        return "torch" if self._kernel is None else "triton"

    @staticmethod
    def _grown(buf: torch.Tensor, n: int, **kw) -> torch.Tensor:
        return buf if buf.numel() >= n else torch.empty(round_up(n + n // 8, 1 << 20), dtype=torch.uint8, **kw)

    def decode(self, frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> CudaDecodeTiming:
        """Decode frames[i] into outs[i] (contiguous CUDA tensors of exactly the decoded size).

        The frames are copied into the decoder's pinned buffer first; frames
        already in page-locked memory go through `decode_from_pinned` instead.
        """
        placements = whole_placements(len(frames), outs)
        with self._lock:
            start = time.perf_counter()
            spans, nbytes = stage_spans(frames)
            if self._pinned_free is not None:
                self._pinned_free.synchronize()
            self._pinned = self._grown(self._pinned, nbytes, pin_memory=True)
            host = self._pinned.numpy()
            copy_frames(frames, spans, host)
            staged_at = time.perf_counter()
            plan = self._plan(parse_frames(host, spans), placements, 0, whole=True)
            timing = self._launch(plan, self._pinned[:nbytes], time.perf_counter() - staged_at, staged_at - start)
            self._pinned_free = timing.copy_done
            return timing

    def decode_from_pinned(
        self, source: torch.Tensor, spans: Sequence[tuple[int, int]], outs: Sequence[torch.Tensor]
    ) -> CudaDecodeTiming:
        """Decode frames that lie in page-locked memory, `source[offset : offset + length]` for each span.

        This is the path for a loader that reads chunk files straight into a
        pinned slot: the bytes from the first span's start to the last span's
        end go to the GPU in one copy, with no copy on the CPU.  The caller may
        overwrite `source` once the result's `copy_done` event has completed.
        """
        return self._decode_pinned(source, spans, whole_placements(len(spans), outs), whole=True)

    def decode_placed(
        self, source: torch.Tensor, spans: Sequence[tuple[int, int]], placements: Sequence[FramePlacement]
    ) -> CudaDecodeTiming:
        """`decode_from_pinned`, writing each placement's range of its frame's decoded bytes straight into its `out`.

        For a loader: one call per group of batches, with a placement per
        (chunk, row range of the batch it fills), e.g. the chunk of rows
        [1536, 1792) of a 1750-token sample placed as
        `FramePlacement(frame, 0, batch["hidden_states"][row, offset + 1536 : offset + 1750])`.
        Bytes of a frame no placement takes are decoded and dropped; pads are the caller's.
        """
        if not spans:
            raise ValueError("no frames to decode")
        return self._decode_pinned(source, spans, placements, whole=False)

    def _decode_pinned(
        self, source: torch.Tensor, spans: Sequence[tuple[int, int]], placements: Sequence[FramePlacement],
        whole: bool,
    ) -> CudaDecodeTiming:
        if source.device.type != "cpu" or source.dtype != torch.uint8 or source.dim() != 1 or not source.is_pinned():
            raise ValueError("source must be a 1-D pinned uint8 CPU tensor")
        with self._lock:
            start = time.perf_counter()
            host = source.numpy()
            for i, (offset, length) in enumerate(spans):
                if offset < 0 or length < 0 or offset + length > host.size:
                    raise ValueError(f"span {i} ({offset}, {length}) lies outside the source's {host.size} bytes")
            first, end = min(o for o, _ in spans), max(o + n for o, n in spans)
            plan = self._plan(parse_frames(host, spans), placements, first, whole)
            return self._launch(plan, source[first:end], time.perf_counter() - start, 0.0)

    def _plan(self, table: FrameTable, placements: Sequence[FramePlacement], first: int, whole: bool) -> DecodePlan:
        plan = plan_decode(table, placements, first, whole)
        if any(out.device != self.device for out in plan.outs):
            raise ValueError(f"every output must be on {self.device}")
        return plan

    def _launch(self, plan: DecodePlan, host: torch.Tensor, parse_s: float, stage_s: float) -> CudaDecodeTiming:
        """Queue the copy in, the zstd batch, the stored streams' copies and the unshuffle on the stream."""
        start = time.perf_counter()
        if self.stream.query() or len(self._nvcomp_held) >= MAX_HELD_CALLS:
            self._nvcomp_held.clear()  # with nothing queued on the stream, freeing them waits for nothing
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
        caller = torch.cuda.current_stream(self.device)
        if caller != self.stream:  # outputs may have work pending on the caller's stream, and are used on ours
            self.stream.wait_stream(caller)
            storages = {out.untyped_storage().data_ptr(): out for out in plan.outs}
            for out in storages.values():
                out.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            self._staged = self._grown(self._staged, host.numel(), device=self.device)
            self._scratch = self._grown(self._scratch, plan.scratch_nbytes, device=self.device)
            events[0].record()
            self._staged[: host.numel()].copy_(host, non_blocking=True)
            events[1].record()
            self._nvcomp_held.append(self._decode_streams(plan))
            events[2].record()
            if self._kernel is None:
                unshuffle_torch(plan, self._scratch)
            else:
                self._unshuffle_kernel(plan)
            events[3].record()
        return CudaDecodeTiming(
            frames=len(plan.table.nbytes),
            streams=len(plan.table.stream_src),
            compressed_bytes=host.numel(),
            decoded_bytes=int(plan.table.nbytes.sum()),
            parse_s=parse_s,
            stage_s=stage_s,
            events=events,  # type: ignore[arg-type]
            launch_s=time.perf_counter() - start,
        )

    def _unshuffle_kernel(self, plan: DecodePlan) -> None:
        """All the plan's unshuffle rows in one kernel; destinations as offsets from the lowest output address."""
        p = plan.pieces
        if not p.size.size:
            return
        addresses = np.array([out.data_ptr() for out in plan.outs], dtype=np.int64)
        base = int(np.argmin(addresses))
        rows = np.stack([p.src, addresses[p.placement] - addresses[base] + p.dst, p.size, p.typesize, p.lo, p.hi], 1)
        on_device = torch.from_numpy(rows).pin_memory().to(self.device, non_blocking=True)
        self._kernel(self._scratch, plan.outs[base], on_device, int((p.hi - p.lo).max()))

    def _decode_streams(self, plan: DecodePlan) -> tuple[object, ...]:
        """nvCOMP zstd on all compressed streams at once, then the stored streams copied as they are.

        Returns nvCOMP's objects of the call, which the caller keeps until the decode is done.
        """
        src_offsets, src_sizes, dst_offsets, dst_sizes = plan.zstd
        held: tuple[object, ...] = ()
        if src_offsets:
            nvcomp, s = self._nvcomp, self.stream.cuda_stream
            srcs = nvcomp.as_arrays(self._staged, src_offsets, src_sizes, s)
            dsts = nvcomp.as_arrays(self._scratch, dst_offsets, dst_sizes, s)
            if self.sync_free:
                config = self._codec.decompression_config(self._codec.compression_config(dst_sizes))
                held = (srcs, dsts, config, self._codec.decode(srcs, out=dsts, decompression_config=config))
            else:
                held = (srcs, dsts, self._codec.decode(srcs, out=dsts))
        for src, dst, size in plan.raw:
            self._scratch[dst : dst + size].copy_(self._staged[src : src + size])
        return held


_decoders: dict[tuple[int, int], CudaBloscDecoder] = {}
_decoders_lock = threading.Lock()


def decode_into_cuda(
    frames: Sequence[Buffer], outs: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None
) -> CudaDecodeTiming:
    """Decode a batch of Blosc frames into CUDA tensors (each contiguous, of exactly its frame's decoded size).

    Work is queued on `stream` (default: the outputs' device's current stream)
    and the call returns without waiting for it; `.gpu_times()` on the result
    waits and reports the GPU time.  Raises `UnsupportedFrame` / `DamagedFrame`
    before any GPU work when a frame cannot be decoded here.  Several samples'
    chunks per call: throughput grows with the batch.
    """
    if not outs:
        raise ValueError("no output tensors")
    device = outs[0].device
    if device.type != "cuda":
        raise ValueError(f"outputs must be CUDA tensors, got {device}")
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    with _decoders_lock:
        decoder = _decoders.get(key)
        if decoder is None:
            decoder = _decoders[key] = CudaBloscDecoder(device, stream)
    return decoder.decode(frames, outs)
