"""Decode the store's Blosc1/zstd chunks on the GPU with nvCOMP, bit for bit as numcodecs does on the CPU.

Why: a Kimi-shaped sample is ~100 MB decoded and ~40 ms of one CPU core to
decode.  Shipping the compressed bytes (1.44x fewer) to the GPU and decoding
there leaves the CPU only the file reads.  The chunk codec stays as it is:
Blosc1 frames of zstd blocks with byte shuffle, as
``numcodecs.Blosc(cname="zstd", clevel=1, shuffle=1, blocksize=1 << 20)``
writes them (zarr's crc32c wrapper is checked and stripped by the caller).

How: the Blosc header is parsed on the CPU (`parse_frame`, every offset checked
against the frame); a batch of frames is copied into one reused pinned buffer
(or is already in pinned memory: `CudaBloscDecoder.decode_from_pinned`), sent
to the GPU in one copy, and the zstd streams of all their blocks are decoded as
one nvCOMP batch into a scratch buffer; stored (raw) blocks are copied; then
the byte shuffle is undone per block with a torch transpose that writes
straight into the destination tensors.  `reference_decode_into` runs the same
layout on the CPU with numcodecs' zstd, so CI (no GPU) checks the parser, the
layout and the unshuffle bit for bit against `numcodecs.blosc`.

nvCOMP's zstd decoder assumes valid input: callers keep the crc32c check of
every chunk before decoding, and anything this module does not support raises
`UnsupportedFrame` before any GPU work, so the caller decodes that batch on the
CPU instead::

    if gpu_decode.available():
        try:
            timing = gpu_decode.decode_into_cuda(frames, outs)
        except gpu_decode.UnsupportedFrame:
            ...  # decode on the CPU: numcodecs.blosc.decompress(frame, cpu_out), then copy
    else:
        for frame, out in zip(frames, cpu_outs):
            numcodecs.blosc.decompress(frame, out)

`DamagedFrame` means the bytes are not a valid frame: the CPU path fails too.

Frame layout (c-blosc 1.21 ``blosc.c``): a 16-byte header (version 2,
versionlz, flags, typesize u8, nbytes, blocksize, cbytes as little-endian
i32); flags 0x01 byte shuffle, 0x02 memcpyed, 0x04 bitshuffle, 0x10
dont_split, bits 5-7 the codec (zstd = 4).  A memcpyed frame holds the plain
bytes after the header.  Otherwise ``bstarts[nblocks]`` (absolute i32 offsets)
follow, and each block is ``typesize`` streams when split (never for the
leftover last block) or one stream, each ``{i32 csize; bytes}``: a zstd frame,
or the bytes themselves when ``csize`` equals the stream's decoded size.  The
shuffle is per block: byte j of element i sits at ``j * (size // typesize) +
i``; a block's last ``size % typesize`` bytes are not shuffled.
"""

from __future__ import annotations

import functools
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from h5feed.errors import H5feedError

if TYPE_CHECKING:
    from collections.abc import Buffer

__all__ = [
    "BloscFrame",
    "CudaBloscDecoder",
    "CudaDecodeTiming",
    "DamagedFrame",
    "FrameError",
    "GpuTimes",
    "Stream",
    "UnsupportedFrame",
    "available",
    "decode_into_cuda",
    "parse_frame",
    "reference_decode_into",
    "why_unavailable",
]

HEADER = struct.Struct("<BBBBiii")
HEADER_SIZE = 16
BLOSC_VERSION = 2
FLAG_SHUFFLE, FLAG_MEMCPYED, FLAG_BITSHUFFLE, FLAG_FUTURE, FLAG_DONT_SPLIT = 0x01, 0x02, 0x04, 0x08, 0x10
CODEC_ZSTD = 4
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128  # c-blosc: a block is split only within these bounds
MAX_BLOCKSIZE = (2**31 - 1 - 255 * 4) // 3  # c-blosc's BLOSC_MAX_BLOCKSIZE
ZSTD_MAGIC = 0xFD2FB528
STAGE_ALIGN = 64  # each frame starts on a cache line in the pinned staging buffer
SCRATCH_ALIGN = 4096  # each frame's decoded bytes start on a page in the scratch buffer


class FrameError(H5feedError, ValueError):
    """A chunk frame this module cannot decode; `index` is its place in the batch (None for one frame)."""

    def __init__(self, problem: str, index: int | None = None) -> None:
        self.problem = problem
        self.index = index
        super().__init__(problem if index is None else f"frame {index} of the batch: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return type(self), (self.problem, self.index)


class UnsupportedFrame(FrameError):
    """A valid Blosc frame the GPU path does not decode (another codec, bitshuffle, ...): decode it on the CPU."""


class DamagedFrame(FrameError):
    """Bytes that are not a valid Blosc1 frame: offsets or sizes out of bounds, a truncated frame."""


@dataclass(frozen=True)
class Stream:
    """One stored stream: `csize` bytes at `src` in the frame decode to `size` bytes at `dst` of the frame's bytes."""

    src: int
    csize: int
    dst: int
    size: int
    raw: bool  # stored as the bytes themselves (incompressible), not as a zstd frame


@dataclass(frozen=True)
class BloscFrame:
    """What `parse_frame` found: sizes, whether a byte shuffle is to be undone, and the streams in block order."""

    nbytes: int
    typesize: int
    blocksize: int
    shuffled: bool
    streams: tuple[Stream, ...]


def _zstd_content_size(mv: memoryview, start: int, length: int) -> int:
    """Frame_Content_Size of the zstd frame header at mv[start:start+length] (RFC 8878 3.1.1.1)."""
    if length < 6 or int.from_bytes(mv[start : start + 4], "little") != ZSTD_MAGIC:
        raise DamagedFrame(f"stream at byte {start} is not a zstd frame")
    descriptor = mv[start + 4]
    fcs_flag, single_segment, reserved, dict_flag = (
        descriptor >> 6,
        (descriptor >> 5) & 1,
        (descriptor >> 3) & 1,
        descriptor & 3,
    )
    if reserved:
        raise DamagedFrame(f"zstd frame at byte {start} has its reserved header bit set")
    if dict_flag:
        raise UnsupportedFrame(f"zstd frame at byte {start} needs a dictionary")
    fcs_bytes = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if not fcs_bytes:
        raise UnsupportedFrame(f"zstd frame at byte {start} does not record its decoded size")
    pos = start + 5 + (0 if single_segment else 1)
    if pos + fcs_bytes > start + length:
        raise DamagedFrame(f"zstd frame header at byte {start} runs past its stream")
    size = int.from_bytes(mv[pos : pos + fcs_bytes], "little")
    return size + 256 if fcs_bytes == 2 else size


def parse_frame(frame: Buffer) -> BloscFrame:
    """Parse one Blosc1 frame, checking every offset and size against its length; raise `FrameError` if unusable."""
    mv = memoryview(frame)
    if not mv.c_contiguous:
        raise UnsupportedFrame("frame bytes are not contiguous")
    mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    total = len(mv)
    if total < HEADER_SIZE:
        raise DamagedFrame(f"{total} bytes cannot hold the 16-byte Blosc header")
    version, _, flags, typesize, nbytes, blocksize, cbytes = HEADER.unpack_from(mv, 0)
    if version != BLOSC_VERSION:
        raise UnsupportedFrame(f"Blosc format version {version}, expected {BLOSC_VERSION}")
    if cbytes != total:
        raise DamagedFrame(f"header says {cbytes} bytes, the frame has {total}")
    if flags & FLAG_FUTURE:
        raise UnsupportedFrame(f"unknown Blosc flags 0x{flags:02x}")
    if nbytes < 0 or typesize < 1:
        raise DamagedFrame(f"impossible header: nbytes {nbytes}, typesize {typesize}")
    if nbytes == 0:
        return BloscFrame(0, typesize, blocksize, False, ())
    if flags & FLAG_MEMCPYED:
        if cbytes != nbytes + HEADER_SIZE:
            raise DamagedFrame(
                f"memcpyed frame of {nbytes} bytes must be {nbytes + HEADER_SIZE} bytes long, not {cbytes}"
            )
        return BloscFrame(nbytes, typesize, blocksize, False, (Stream(HEADER_SIZE, nbytes, 0, nbytes, True),))
    if not 0 < blocksize <= MAX_BLOCKSIZE:
        raise DamagedFrame(f"impossible block size {blocksize}")
    codec = flags >> 5
    if codec != CODEC_ZSTD:
        raise UnsupportedFrame(f"Blosc codec {codec} (only zstd, {CODEC_ZSTD}, is decoded on the GPU)")
    shuffled = bool(flags & FLAG_SHUFFLE) and typesize > 1
    if flags & FLAG_BITSHUFFLE and not shuffled:
        raise UnsupportedFrame("bitshuffle is not decoded on the GPU")
    nblocks = -(-nbytes // blocksize)
    first_stream = HEADER_SIZE + 4 * nblocks
    if first_stream > total:
        raise DamagedFrame(f"{nblocks} block offsets do not fit in {total} bytes")
    splittable = not flags & FLAG_DONT_SPLIT and typesize <= MAX_SPLITS and blocksize // typesize >= MIN_BUFFERSIZE
    streams = []
    for block, start in enumerate(np.frombuffer(mv, "<i4", nblocks, HEADER_SIZE).tolist()):
        size = min(blocksize, nbytes - block * blocksize)
        nsplits = typesize if splittable and size == blocksize else 1
        neblock = size // nsplits
        if neblock * nsplits != size:
            raise DamagedFrame(f"block {block} of {size} bytes cannot be split in {nsplits} equal streams")
        pos = start
        for split in range(nsplits):
            if not first_stream <= pos <= total - 4:
                raise DamagedFrame(
                    f"block {block} stream {split} starts at byte {pos}, outside {first_stream}..{total - 4}"
                )
            (csize,) = struct.unpack_from("<i", mv, pos)
            pos += 4
            if not 0 < csize <= total - pos:
                raise DamagedFrame(f"block {block} stream {split}: {csize} bytes at byte {pos} do not fit in {total}")
            raw = csize == neblock
            if not raw and (content := _zstd_content_size(mv, pos, csize)) != neblock:
                raise DamagedFrame(f"block {block} stream {split} decodes to {content} bytes, expected {neblock}")
            streams.append(Stream(pos, csize, block * blocksize + split * neblock, neblock, raw))
            pos += csize
    return BloscFrame(nbytes, typesize, blocksize, shuffled, tuple(streams))


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"output tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class _Plan:
    """Where every stream of a batch is read from (the staging buffer) and decoded to (the scratch buffer)."""

    frames: list[BloscFrame]
    outs: list[torch.Tensor]  # flat uint8 views of the destinations
    scratch_base: list[int]  # where each frame's decoded (still shuffled) bytes start in scratch
    zstd: tuple[list[int], list[int], list[int], list[int]]  # staging offsets and sizes, scratch offsets and sizes
    raw: list[tuple[int, int, int]]  # (staging offset, scratch offset, bytes): stored streams, copied as they are
    scratch_nbytes: int


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _parse_batch(frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> tuple[list[BloscFrame], list[torch.Tensor]]:
    """Parse every frame and check its output; a `FrameError` names the frame's index in the batch."""
    if not frames or len(frames) != len(outs):
        raise ValueError(f"{len(frames)} frames and {len(outs)} output tensors: need as many, at least one")
    parsed, views = [], []
    for i, (frame, out) in enumerate(zip(frames, outs)):
        try:
            parsed.append(f := parse_frame(frame))
        except FrameError as e:
            raise type(e)(e.problem, i) from None
        views.append(view := _byte_view(out))
        if view.numel() != f.nbytes:
            raise ValueError(f"frame {i} of the batch decodes to {f.nbytes} bytes, its output holds {view.numel()}")
    return parsed, views


def _plan(parsed: list[BloscFrame], views: list[torch.Tensor], where: Sequence[int]) -> _Plan:
    """Lay a parsed batch out: frame i sits at byte where[i] of the staging buffer, its streams inside it.

    nvCOMP's zstd decoder reads and writes at any byte offset (its required
    input and output alignment is 1; only its temporary buffer needs 8), so
    streams are decoded where they lie in the frame and to where they belong.
    """
    scratch_base, raw = [], []
    zstd: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    scratch = 0
    for f, at in zip(parsed, where):
        scratch_base.append(scratch)
        for s in f.streams:
            if s.raw:
                raw.append((at + s.src, scratch + s.dst, s.size))
            else:
                for column, value in zip(zstd, (at + s.src, s.csize, scratch + s.dst, s.size)):
                    column.append(value)
        scratch = _round_up(scratch + f.nbytes, SCRATCH_ALIGN)
    return _Plan(parsed, views, scratch_base, zstd, raw, scratch)


def _packed(frames: Sequence[Buffer]) -> tuple[list[int], int]:
    """Offsets of the frames packed one after another (each on a cache line) and the bytes they take."""
    where, end = [], 0
    for frame in frames:
        where.append(end)
        end = _round_up(end + memoryview(frame).nbytes, STAGE_ALIGN)
    return where, end


def _copy_frames(frames: Sequence[Buffer], where: Sequence[int], into: np.ndarray) -> None:
    for frame, at in zip(frames, where):
        data = np.frombuffer(frame, np.uint8)
        into[at : at + data.size] = data


def _unshuffle_blocks(src: torch.Tensor, dst: torch.Tensor, nblocks: int, size: int, typesize: int) -> None:
    """Undo Blosc's byte shuffle of `nblocks` blocks of `size` bytes each, src -> dst (flat uint8, same device)."""
    n = size // typesize
    s, d = src.view(nblocks, size), dst.view(nblocks, size)
    d[:, : n * typesize].view(nblocks, n, typesize).copy_(
        s[:, : n * typesize].view(nblocks, typesize, n).transpose(1, 2)
    )
    if size % typesize:
        d[:, n * typesize :].copy_(s[:, n * typesize :])


def _unshuffle(plan: _Plan, scratch: torch.Tensor) -> None:
    """Write each frame's decoded bytes from scratch into its output, undoing the shuffle block by block."""
    for f, base, out in zip(plan.frames, plan.scratch_base, plan.outs):
        decoded = scratch[base : base + f.nbytes]
        if not f.shuffled:
            out.copy_(decoded)
            continue
        full, leftover = divmod(f.nbytes, f.blocksize)
        edge = full * f.blocksize
        if full:
            _unshuffle_blocks(decoded[:edge], out[:edge], full, f.blocksize, f.typesize)
        if leftover:
            _unshuffle_blocks(decoded[edge:], out[edge:], 1, leftover, f.typesize)


def reference_decode_into(frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> None:
    """The GPU path's algorithm on the CPU (numcodecs' zstd per stream): decode each frame into its CPU tensor.

    Same parser, layout, staging and unshuffle as `decode_into_cuda`; only the
    zstd decoder and the host-to-device copy differ.  For tests and checks; the
    CPU fallback of a loader is `numcodecs.blosc.decompress`, which is faster.
    """
    from numcodecs import zstd

    parsed, views = _parse_batch(frames, outs)
    where, nbytes = _packed(frames)
    staged = np.empty(nbytes, np.uint8)
    _copy_frames(frames, where, staged)
    plan = _plan(parsed, views, where)
    scratch = torch.empty(plan.scratch_nbytes, dtype=torch.uint8)
    decoded = scratch.numpy()
    for src, csize, dst, size in zip(*plan.zstd):
        zstd.decompress(staged[src : src + csize], decoded[dst : dst + size])
    for src, dst, size in plan.raw:
        decoded[dst : dst + size] = staged[src : src + size]
    _unshuffle(plan, scratch)


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


class CudaBloscDecoder:
    """Decodes batches of frames on one CUDA stream, keeping its nvCOMP codec and buffers between calls.

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
    ) -> None:
        reason = why_unavailable()
        if reason is not None:
            raise RuntimeError(f"GPU decode is not available: {reason}")
        from nvidia import nvcomp

        self._nvcomp = nvcomp
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        self.sync_free = sync_free
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

    @staticmethod
    def _grown(buf: torch.Tensor, n: int, **kw) -> torch.Tensor:
        return buf if buf.numel() >= n else torch.empty(_round_up(n + n // 8, 1 << 20), dtype=torch.uint8, **kw)

    def decode(self, frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> CudaDecodeTiming:
        """Decode frames[i] into outs[i] (contiguous CUDA tensors of exactly the decoded size).

        The frames are copied into the decoder's pinned buffer first; frames
        already in page-locked memory go through `decode_from_pinned` instead.
        """
        with self._lock:
            start = time.perf_counter()
            parsed, views = self._parse(frames, outs)
            where, nbytes = _packed(frames)
            plan = _plan(parsed, views, where)
            parsed_at = time.perf_counter()
            if self._pinned_free is not None:
                self._pinned_free.synchronize()
            self._pinned = self._grown(self._pinned, nbytes, pin_memory=True)
            _copy_frames(frames, where, self._pinned.numpy())
            staged_at = time.perf_counter()
            timing = self._launch(plan, self._pinned[:nbytes], parsed_at - start, staged_at - parsed_at)
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
        if source.device.type != "cpu" or source.dtype != torch.uint8 or source.dim() != 1 or not source.is_pinned():
            raise ValueError("source must be a 1-D pinned uint8 CPU tensor")
        with self._lock:
            start = time.perf_counter()
            host = source.numpy()
            for i, (offset, length) in enumerate(spans):
                if offset < 0 or length < 0 or offset + length > host.size:
                    raise ValueError(f"span {i} ({offset}, {length}) lies outside the source's {host.size} bytes")
            frames = [host[offset : offset + length] for offset, length in spans]
            parsed, views = self._parse(frames, outs)
            first, end = min(o for o, _ in spans), max(o + n for o, n in spans)
            plan = _plan(parsed, views, [offset - first for offset, _ in spans])
            return self._launch(plan, source[first:end], time.perf_counter() - start, 0.0)

    def _parse(
        self, frames: Sequence[Buffer], outs: Sequence[torch.Tensor]
    ) -> tuple[list[BloscFrame], list[torch.Tensor]]:
        parsed, views = _parse_batch(frames, outs)
        if any(view.device != self.device for view in views):
            raise ValueError(f"every output must be on {self.device}")
        return parsed, views

    def _launch(self, plan: _Plan, host: torch.Tensor, parse_s: float, stage_s: float) -> CudaDecodeTiming:
        """Queue the copy in, the zstd batch, the stored streams' copies and the unshuffle on the stream."""
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(4))
        caller = torch.cuda.current_stream(self.device)
        if caller != self.stream:  # outputs may have work pending on the caller's stream, and are used on ours
            self.stream.wait_stream(caller)
            for out in plan.outs:
                out.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            self._staged = self._grown(self._staged, host.numel(), device=self.device)
            self._scratch = self._grown(self._scratch, plan.scratch_nbytes, device=self.device)
            events[0].record()
            self._staged[: host.numel()].copy_(host, non_blocking=True)
            events[1].record()
            self._decode_streams(plan)
            events[2].record()
            _unshuffle(plan, self._scratch)
            events[3].record()
        return CudaDecodeTiming(
            frames=len(plan.frames),
            streams=sum(len(f.streams) for f in plan.frames),
            compressed_bytes=host.numel(),
            decoded_bytes=sum(f.nbytes for f in plan.frames),
            parse_s=parse_s,
            stage_s=stage_s,
            events=events,  # type: ignore[arg-type]
        )

    def _decode_streams(self, plan: _Plan) -> None:
        """nvCOMP zstd on all compressed streams at once, then the stored streams copied as they are."""
        src_offsets, src_sizes, dst_offsets, dst_sizes = plan.zstd
        if src_offsets:
            nvcomp, s = self._nvcomp, self.stream.cuda_stream
            srcs = nvcomp.as_arrays(self._staged, src_offsets, src_sizes, s)
            dsts = nvcomp.as_arrays(self._scratch, dst_offsets, dst_sizes, s)
            if self.sync_free:
                config = self._codec.decompression_config(self._codec.compression_config(dst_sizes))
                self._codec.decode(srcs, out=dsts, decompression_config=config)
            else:
                self._codec.decode(srcs, out=dsts)
        for src, dst, size in plan.raw:
            self._scratch[dst : dst + size].copy_(self._staged[src : src + size])


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
