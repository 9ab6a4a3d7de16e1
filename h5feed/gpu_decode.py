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
(`h5feed.gpu_unshuffle`) undoes the byte shuffle of every block, writing
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

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
    "FrameTable",
    "GpuTimes",
    "Placement",
    "Stream",
    "UnsupportedFrame",
    "available",
    "decode_into_cuda",
    "parse_frame",
    "parse_frames",
    "reference_decode_into",
    "reference_decode_placed",
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
MAX_HELD_CALLS = 8  # calls whose nvCOMP objects a decoder keeps while its stream is busy


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


@dataclass(frozen=True)
class FrameTable:
    """Every frame of a batch parsed at once (`parse_frames`): per-frame columns and one row per stored stream.

    Stream offsets are absolute in the buffer the frames lie in; `stream_frame` says whose stream each is.
    """

    offsets: np.ndarray  # int64 [frames]: where each frame starts in the buffer
    nbytes: np.ndarray  # int64 [frames]
    typesize: np.ndarray  # int64 [frames]
    blocksize: np.ndarray  # int64 [frames]
    shuffled: np.ndarray  # bool [frames]
    stream_frame: np.ndarray  # int64 [streams]
    stream_src: np.ndarray  # int64 [streams]: first byte of the stored stream in the buffer
    stream_csize: np.ndarray  # int64 [streams]
    stream_dst: np.ndarray  # int64 [streams]: first decoded byte in its frame
    stream_size: np.ndarray  # int64 [streams]
    stream_raw: np.ndarray  # bool [streams]

    def frame(self, i: int) -> BloscFrame:
        """Frame i as `parse_frame` describes it (stream offsets relative to the frame again)."""
        rows = np.flatnonzero(self.stream_frame == i)
        base = int(self.offsets[i])
        streams = tuple(
            Stream(int(self.stream_src[r]) - base, int(self.stream_csize[r]), int(self.stream_dst[r]),
                   int(self.stream_size[r]), bool(self.stream_raw[r]))
            for r in rows
        )
        return BloscFrame(int(self.nbytes[i]), int(self.typesize[i]), int(self.blocksize[i]),
                          bool(self.shuffled[i]), streams)


def _gather(buffer: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """`width` bytes at each offset, uint8 [len(at), width]; offsets are clamped into the buffer first.

    Clamping keeps every read inside the buffer; a row read from a clamped offset is
    garbage, and every caller refuses such a row by a bounds check of its own.
    """
    at = np.clip(at, 0, max(buffer.size - width, 0))
    return buffer[at[:, None] + np.arange(width)] if buffer.size >= width else np.zeros((at.size, width), np.uint8)


def _le(raw: np.ndarray) -> np.ndarray:
    """Little-endian unsigned integers of the rows of a uint8 [n, width] array, as uint64."""
    return (raw.astype(np.uint64) << (np.arange(raw.shape[1], dtype=np.uint64) * np.uint64(8))).sum(
        axis=1, dtype=np.uint64
    )


def _i32(raw: np.ndarray) -> np.ndarray:
    """Little-endian signed 32-bit integers of the rows of a uint8 [n, 4] array, as int64."""
    return np.ascontiguousarray(raw).view("<i4").reshape(-1).astype(np.int64)


def _zstd_sizes_match(buffer: np.ndarray, start: np.ndarray, length: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Whether each zstd stream at start (length bytes) has a valid header that records `size` decoded bytes.

    The vector form of `_zstd_content_size`: a False row is one that function would refuse, or whose
    recorded size differs; its frame then goes through `parse_frame` for the exact error.
    """
    head = _gather(buffer, start, 5)
    descriptor = head[:, 4].astype(np.int64)
    fcs_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
    fcs_bytes = np.where(fcs_flag == 0, single_segment, 1 << fcs_flag)  # 0/1, 2, 4, 8
    at = start + 5 + 1 - single_segment
    width = np.arange(8)
    recorded = _le(np.where(width < fcs_bytes[:, None], _gather(buffer, at, 8), 0))
    recorded = recorded + np.where(fcs_bytes == 2, np.uint64(256), np.uint64(0))
    return (
        (length >= 6)
        & (_le(head[:, :4]) == ZSTD_MAGIC)
        & ((descriptor >> 3) & 1 == 0)  # reserved bit
        & (descriptor & 3 == 0)  # no dictionary
        & (fcs_bytes > 0)
        & (at + fcs_bytes <= start + length)
        & (recorded == size.astype(np.uint64))
    )


def parse_frames(buffer: np.ndarray, spans: Sequence[tuple[int, int]]) -> FrameTable:
    """Parse the frames at `buffer[offset : offset + length]` of each span in bulk: numpy over all their headers.

    Frames written as the store writes them (zstd blocks, one stream per block) are parsed
    and checked as whole columns, in a few numpy operations for the batch; any other frame
    (memcpyed, split blocks, empty) and any frame a vector check refuses goes through
    `parse_frame`, so a damaged frame raises exactly its `FrameError`, with its index in the batch.
    """
    if buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise ValueError("frames must lie in a 1-D uint8 buffer")
    spans_array = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    offsets, lengths = spans_array[:, 0], spans_array[:, 1]
    if ((offsets < 0) | (lengths < 0) | (offsets + lengths > buffer.size)).any():
        bad = int(np.flatnonzero((offsets < 0) | (lengths < 0) | (offsets + lengths > buffer.size))[0])
        raise ValueError(f"span {bad} {tuple(spans[bad])} lies outside the buffer's {buffer.size} bytes")
    head = _gather(buffer, offsets, HEADER_SIZE)
    version, flags, typesize = (head[:, k].astype(np.int64) for k in (0, 2, 3))
    nbytes, blocksize, cbytes = (_i32(head[:, k : k + 4]) for k in (4, 8, 12))
    shuffled = (flags & FLAG_SHUFFLE != 0) & (typesize > 1)
    nblocks = -(-nbytes // np.maximum(blocksize, 1))
    first_stream = HEADER_SIZE + 4 * nblocks
    splittable = (flags & FLAG_DONT_SPLIT == 0) & (typesize <= MAX_SPLITS) & (
        blocksize // np.maximum(typesize, 1) >= MIN_BUFFERSIZE
    )
    vector = (
        (lengths >= HEADER_SIZE)
        & (version == BLOSC_VERSION)
        & (cbytes == lengths)
        & (flags & (FLAG_FUTURE | FLAG_MEMCPYED) == 0)
        & (typesize >= 1)
        & (nbytes > 0)
        & (blocksize > 0)
        & (blocksize <= MAX_BLOCKSIZE)
        & (flags >> 5 == CODEC_ZSTD)
        & ~((flags & FLAG_BITSHUFFLE != 0) & ~shuffled)
        & (first_stream <= lengths)
        & ~(splittable & (nbytes >= blocksize))  # split blocks: several streams each
    )
    frames = np.flatnonzero(vector)
    counts = nblocks[frames]
    block_frame = np.repeat(frames, counts)
    block = np.arange(block_frame.size) - np.repeat(np.cumsum(counts) - counts, counts)
    base, total = offsets[block_frame], lengths[block_frame]
    size = np.minimum(blocksize[block_frame], nbytes[block_frame] - block * blocksize[block_frame])
    start = _i32(_gather(buffer, base + HEADER_SIZE + 4 * block, 4))
    csize = _i32(_gather(buffer, base + start, 4))
    raw = csize == size
    sound = (first_stream[block_frame] <= start) & (start <= total - 4) & (csize > 0) & (csize <= total - start - 4)
    sound &= raw | _zstd_sizes_match(buffer, base + start + 4, csize, size)
    vector[block_frame[~sound]] = False
    keep = vector[block_frame]
    columns = [block_frame[keep], base[keep] + start[keep] + 4, csize[keep],
               (block * blocksize[block_frame])[keep], size[keep], raw[keep]]
    for i in np.flatnonzero(~vector).tolist():  # the rest, one by one, in order: the first damaged one raises
        offset, length = int(offsets[i]), int(lengths[i])
        try:
            parsed = parse_frame(buffer[offset : offset + length])
        except FrameError as e:
            raise type(e)(e.problem, i) from None
        nbytes[i], typesize[i], blocksize[i], shuffled[i] = (
            parsed.nbytes, parsed.typesize, parsed.blocksize, parsed.shuffled
        )
        rows = [(i, offset + s.src, s.csize, s.dst, s.size, s.raw) for s in parsed.streams]
        if rows:
            columns = [np.concatenate([c, np.asarray(v, dtype=c.dtype)]) for c, v in zip(columns, zip(*rows))]
    order = np.lexsort((columns[3], columns[0]))  # frame by frame, streams in block order
    return FrameTable(offsets, nbytes, typesize, blocksize, shuffled, *(c[order] for c in columns))


@dataclass(frozen=True)
class Placement:
    """Where decoded bytes go: `out` (a contiguous tensor) receives frame `frame`'s bytes from byte `skip` on.

    It takes `out.nbytes` bytes, which must lie inside the frame: a chunk's rows
    `[skip / row_bytes, ...)` written straight into their rows of a batch, say.
    A frame may have several placements, or none (then it is decoded for nothing).
    """

    frame: int
    skip: int
    out: torch.Tensor


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"output tensor of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(-1).view(torch.uint8)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class _Pieces:
    """The unshuffle of a batch, one row per (placement, Blosc block) it touches.

    Row r writes bytes [lo, hi) of a decoded block of `size` bytes (shuffled by `typesize`;
    1 for bytes stored as they are) read at `src` of the scratch buffer, to byte `dst` of
    placement `placement`'s output.  Byte p < size - size % typesize of a block comes from
    byte (p % typesize) * (size // typesize) + p // typesize of its shuffled form; the rest
    from byte p.  One kernel runs all rows; the torch fallback runs runs of equal rows.
    """

    placement: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    typesize: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


@dataclass(frozen=True)
class _Plan:
    """Where every stream of a batch is read from (the staged bytes) and decoded to, and how it is unshuffled."""

    table: FrameTable
    outs: list[torch.Tensor]  # flat uint8 views, one per placement
    zstd: tuple[list[int], list[int], list[int], list[int]]  # staged offsets and sizes, scratch offsets and sizes
    raw: list[tuple[int, int, int]]  # (staged offset, scratch offset, bytes): stored streams, copied as they are
    pieces: _Pieces
    scratch_nbytes: int


def _placements(frames: int, outs: Sequence[torch.Tensor]) -> list[Placement]:
    """Frame i decoded whole into outs[i]: the placements of `decode`'s and `decode_from_pinned`'s outputs."""
    if not frames or frames != len(outs):
        raise ValueError(f"{frames} frames and {len(outs)} output tensors: need as many, at least one")
    return [Placement(i, 0, out) for i, out in enumerate(outs)]


def _plan(table: FrameTable, placements: Sequence[Placement], first: int, whole: bool) -> _Plan:
    """Lay a parsed batch out: the staged bytes start at byte `first` of the frames' buffer.

    nvCOMP's zstd decoder reads and writes at any byte offset (its required
    input and output alignment is 1; only its temporary buffer needs 8), so
    streams are decoded where they lie in the frame, to their place in their
    frame's region of the scratch buffer.  `whole`: each placement must take its
    frame's every byte (`decode`'s contract), else any range inside the frame.
    """
    outs, frame, skip, length = [], [], [], []
    for p in placements:
        outs.append(view := _byte_view(p.out))
        if not 0 <= p.frame < table.nbytes.size:
            raise ValueError(f"a placement names frame {p.frame}; the batch has {table.nbytes.size}")
        nbytes = int(table.nbytes[p.frame])
        if whole and view.numel() != nbytes:
            raise ValueError(f"frame {p.frame} of the batch decodes to {nbytes} bytes, its output holds {view.numel()}")
        if p.skip < 0 or p.skip + view.numel() > nbytes:
            raise ValueError(f"frame {p.frame} of the batch decodes to {nbytes} bytes: bytes {p.skip}.."
                             f"{p.skip + view.numel()} of it do not exist")
        frame.append(p.frame)
        skip.append(p.skip)
        length.append(view.numel())
    frame_at = np.asarray(frame, dtype=np.int64)
    skip_at, length_at = np.asarray(skip, dtype=np.int64), np.asarray(length, dtype=np.int64)
    regions = (table.nbytes + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    scratch_base = np.cumsum(regions) - regions
    zstd_rows, raw_rows = ~table.stream_raw, table.stream_raw
    src = table.stream_src - first
    dst = scratch_base[table.stream_frame] + table.stream_dst
    zstd = (src[zstd_rows].tolist(), table.stream_csize[zstd_rows].tolist(), dst[zstd_rows].tolist(),
            table.stream_size[zstd_rows].tolist())
    raw = list(zip(src[raw_rows].tolist(), dst[raw_rows].tolist(), table.stream_size[raw_rows].tolist()))
    # the unshuffle: a block is a Blosc block of a shuffled frame, or the whole of an unshuffled one
    block = np.where(table.shuffled, table.blocksize, np.maximum(table.nbytes, 1))[frame_at]
    first_block = skip_at // block
    counts = np.where(length_at > 0, (skip_at + length_at - 1) // block - first_block + 1, 0)
    placement = np.repeat(np.arange(len(outs)), counts)
    k = np.repeat(first_block, counts) + np.arange(placement.size) - np.repeat(np.cumsum(counts) - counts, counts)
    f, piece_block = frame_at[placement], block[placement]
    block_start = k * piece_block
    size = np.minimum(piece_block, table.nbytes[f] - block_start)
    want_from, want_to = skip_at[placement], (skip_at + length_at)[placement]
    lo = np.maximum(want_from, block_start) - block_start
    hi = np.minimum(want_to, block_start + size) - block_start
    pieces = _Pieces(placement, scratch_base[f] + block_start, block_start + lo - want_from, size,
                     np.where(table.shuffled[f], table.typesize[f], 1), lo, hi)
    return _Plan(table, outs, zstd, raw, pieces, int(regions.sum()))


def _unshuffle_blocks(src: torch.Tensor, dst: torch.Tensor, nblocks: int, size: int, typesize: int) -> None:
    """Undo Blosc's byte shuffle of `nblocks` blocks of `size` bytes each, src -> dst (flat uint8, same device)."""
    n = size // typesize
    s, d = src.view(nblocks, size), dst.view(nblocks, size)
    d[:, : n * typesize].view(nblocks, n, typesize).copy_(
        s[:, : n * typesize].view(nblocks, typesize, n).transpose(1, 2)
    )
    if size % typesize:
        d[:, n * typesize :].copy_(s[:, n * typesize :])


def _unshuffle_torch(plan: _Plan, scratch: torch.Tensor) -> None:
    """The unshuffle with torch ops: one transpose per run of whole blocks that follow each other in src and dst.

    The CPU reference and the fallback where Triton is missing; the GPU path runs
    the same rows in one Triton kernel (`h5feed.gpu_unshuffle`).
    """
    p = plan.pieces
    rows = zip(*(c.tolist() for c in (p.placement, p.src, p.dst, p.size, p.typesize, p.lo, p.hi)))
    run: list[int] | None = None  # [placement, src, dst, size, typesize, count] of whole blocks
    for placement, src, dst, size, typesize, lo, hi in rows:
        whole = lo == 0 and hi == size
        if (whole and run is not None and run[0] == placement and run[3] == size and run[4] == typesize
                and run[1] + run[5] * size == src and run[2] + run[5] * size == dst):
            run[5] += 1
            continue
        _unshuffle_run(plan, scratch, run)
        run = [placement, src, dst, size, typesize, 1] if whole else None
        if not whole:  # part of one block: unshuffle it whole, keep its part
            block = torch.empty(size, dtype=torch.uint8, device=scratch.device)
            _unshuffle_blocks(scratch[src : src + size], block, 1, size, typesize)
            plan.outs[placement][dst : dst + hi - lo].copy_(block[lo:hi])
    _unshuffle_run(plan, scratch, run)


def _unshuffle_run(plan: _Plan, scratch: torch.Tensor, run: list[int] | None) -> None:
    if run is not None:
        placement, src, dst, size, typesize, count = run
        nbytes = count * size
        _unshuffle_blocks(scratch[src : src + nbytes], plan.outs[placement][dst : dst + nbytes], count, size, typesize)


def _stage(frames: Sequence[Buffer]) -> tuple[list[tuple[int, int]], int]:
    """Spans of the frames packed one after another (each on a cache line) and the bytes they take."""
    spans, end = [], 0
    for i, frame in enumerate(frames):
        view = memoryview(frame)
        if not view.c_contiguous:
            raise UnsupportedFrame("frame bytes are not contiguous", i)
        n = view.nbytes
        spans.append((end, n))
        end = _round_up(end + n, STAGE_ALIGN)
    return spans, end


def _copy_frames(frames: Sequence[Buffer], spans: Sequence[tuple[int, int]], into: np.ndarray) -> None:
    for frame, (at, n) in zip(frames, spans):
        into[at : at + n] = np.frombuffer(frame, np.uint8)


def reference_decode_placed(frames: Sequence[Buffer], placements: Sequence[Placement]) -> None:
    """The GPU path's algorithm on the CPU (numcodecs' zstd per stream): decode frames into CPU placements.

    Same bulk parser, layout and unshuffle rows as the GPU path, run with the
    torch unshuffle; only the zstd decoder, the host-to-device copy and the
    unshuffle kernel differ.  For tests and checks; the CPU fallback of a loader
    is `numcodecs.blosc.decompress`, which is faster.
    """
    if not frames:
        raise ValueError("no frames to decode")
    _reference_decode(frames, placements, whole=False)


def reference_decode_into(frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> None:
    """`reference_decode_placed` of frames[i] whole into outs[i] (CPU tensors of exactly the decoded size)."""
    _reference_decode(frames, _placements(len(frames), outs), whole=True)


def _reference_decode(frames: Sequence[Buffer], placements: Sequence[Placement], whole: bool) -> None:
    from numcodecs import zstd

    spans, nbytes = _stage(frames)
    staged = np.empty(nbytes, np.uint8)
    _copy_frames(frames, spans, staged)
    plan = _plan(parse_frames(staged, spans), placements, 0, whole)
    scratch = torch.empty(plan.scratch_nbytes, dtype=torch.uint8)
    decoded = scratch.numpy()
    for src, csize, dst, size in zip(*plan.zstd):
        zstd.decompress(staged[src : src + csize], decoded[dst : dst + size])
    for src, dst, size in plan.raw:
        decoded[dst : dst + size] = staged[src : src + size]
    _unshuffle_torch(plan, scratch)


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
    """`h5feed.gpu_unshuffle.unshuffle_rows`, or None where Triton cannot be imported (then torch unshuffles)."""
    try:
        from h5feed.gpu_unshuffle import unshuffle_rows
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

    def __del__(self) -> None:
        torch.cuda.caching_allocator_delete(self.ptr)


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
        return buf if buf.numel() >= n else torch.empty(_round_up(n + n // 8, 1 << 20), dtype=torch.uint8, **kw)

    def decode(self, frames: Sequence[Buffer], outs: Sequence[torch.Tensor]) -> CudaDecodeTiming:
        """Decode frames[i] into outs[i] (contiguous CUDA tensors of exactly the decoded size).

        The frames are copied into the decoder's pinned buffer first; frames
        already in page-locked memory go through `decode_from_pinned` instead.
        """
        placements = _placements(len(frames), outs)
        with self._lock:
            start = time.perf_counter()
            spans, nbytes = _stage(frames)
            if self._pinned_free is not None:
                self._pinned_free.synchronize()
            self._pinned = self._grown(self._pinned, nbytes, pin_memory=True)
            host = self._pinned.numpy()
            _copy_frames(frames, spans, host)
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
        return self._decode_pinned(source, spans, _placements(len(spans), outs), whole=True)

    def decode_placed(
        self, source: torch.Tensor, spans: Sequence[tuple[int, int]], placements: Sequence[Placement]
    ) -> CudaDecodeTiming:
        """`decode_from_pinned`, writing each placement's range of its frame's decoded bytes straight into its `out`.

        For a loader: one call per group of batches, with a placement per
        (chunk, row range of the batch it fills), e.g. the chunk of rows
        [1536, 1792) of a 1750-token sample placed as
        `Placement(frame, 0, batch["hidden_states"][row, offset + 1536 : offset + 1750])`.
        Bytes of a frame no placement takes are decoded and dropped; pads are the caller's.
        """
        if not spans:
            raise ValueError("no frames to decode")
        return self._decode_pinned(source, spans, placements, whole=False)

    def _decode_pinned(
        self, source: torch.Tensor, spans: Sequence[tuple[int, int]], placements: Sequence[Placement], whole: bool
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

    def _plan(self, table: FrameTable, placements: Sequence[Placement], first: int, whole: bool) -> _Plan:
        plan = _plan(table, placements, first, whole)
        if any(out.device != self.device for out in plan.outs):
            raise ValueError(f"every output must be on {self.device}")
        return plan

    def _launch(self, plan: _Plan, host: torch.Tensor, parse_s: float, stage_s: float) -> CudaDecodeTiming:
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
                _unshuffle_torch(plan, self._scratch)
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

    def _unshuffle_kernel(self, plan: _Plan) -> None:
        """All the plan's unshuffle rows in one kernel; destinations as offsets from the lowest output address."""
        p = plan.pieces
        if not p.size.size:
            return
        addresses = np.array([out.data_ptr() for out in plan.outs], dtype=np.int64)
        base = int(np.argmin(addresses))
        rows = np.stack([p.src, addresses[p.placement] - addresses[base] + p.dst, p.size, p.typesize, p.lo, p.hi], 1)
        on_device = torch.from_numpy(rows).pin_memory().to(self.device, non_blocking=True)
        self._kernel(self._scratch, plan.outs[base], on_device, int((p.hi - p.lo).max()))

    def _decode_streams(self, plan: _Plan) -> tuple[object, ...]:
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
