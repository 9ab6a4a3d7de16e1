"""Blosc1 frames of the store's chunks parsed on the CPU: one frame at a time (`parse_frame`), or all of a
batch's at once with numpy (`parse_frames`), every offset and size checked against the frame's length.

Why apart from the decoder: parsing needs neither CUDA nor nvCOMP, so CI checks it bit for bit against
numcodecs, and a frame the GPU path cannot take is refused here before any GPU work.  The chunks are the
store's (its format: `h5feed.store.format`, written by `h5feed.store.layout`, read on the CPU by
`h5feed.store.reader`).

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

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from h5feed.errors import H5feedError

if TYPE_CHECKING:
    from collections.abc import Buffer

HEADER = struct.Struct("<BBBBiii")
HEADER_SIZE = 16
BLOSC_VERSION = 2
FLAG_SHUFFLE, FLAG_MEMCPYED, FLAG_BITSHUFFLE, FLAG_FUTURE, FLAG_DONT_SPLIT = 0x01, 0x02, 0x04, 0x08, 0x10
CODEC_ZSTD = 4
MAX_SPLITS, MIN_BUFFERSIZE = 16, 128  # c-blosc: a block is split only within these bounds
MAX_BLOCKSIZE = (2**31 - 1 - 255 * 4) // 3  # c-blosc's BLOSC_MAX_BLOCKSIZE
ZSTD_MAGIC = 0xFD2FB528


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

