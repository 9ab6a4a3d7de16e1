"""The decode plan of a batch of frames: where each stored stream is read from and decoded to, and the byte
unshuffle rows that write each block's bytes into its destination (`FramePlacement`: not a flavor's `Placement`
of an item's rows in the batch, but where one frame's decoded bytes go), with the torch unshuffle and a CPU
reference of the whole decode.

Why apart from the decoder: the plan is the GPU path's algorithm less nvCOMP and the Triton kernel, so
`reference_decode_into` and `reference_decode_placed` run it on the CPU with numcodecs' zstd and CI checks it
bit for bit against `numcodecs.blosc`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from h5feed.gpu.frames import FrameTable, UnsupportedFrame, parse_frames

if TYPE_CHECKING:
    from collections.abc import Buffer

STAGE_ALIGN = 64  # each frame starts on a cache line in the pinned staging buffer
SCRATCH_ALIGN = 4096  # each frame's decoded bytes start on a page in the scratch buffer


@dataclass(frozen=True)
class FramePlacement:
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


def round_up(n: int, to: int) -> int:
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
class DecodePlan:
    """Where every stream of a batch is read from (the staged bytes) and decoded to, and how it is unshuffled."""

    table: FrameTable
    outs: list[torch.Tensor]  # flat uint8 views, one per placement
    zstd: tuple[list[int], list[int], list[int], list[int]]  # staged offsets and sizes, scratch offsets and sizes
    raw: list[tuple[int, int, int]]  # (staged offset, scratch offset, bytes): stored streams, copied as they are
    pieces: _Pieces
    scratch_nbytes: int


def whole_placements(frames: int, outs: Sequence[torch.Tensor]) -> list[FramePlacement]:
    """Frame i decoded whole into outs[i]: the placements of `decode`'s and `decode_from_pinned`'s outputs."""
    if not frames or frames != len(outs):
        raise ValueError(f"{frames} frames and {len(outs)} output tensors: need as many, at least one")
    return [FramePlacement(i, 0, out) for i, out in enumerate(outs)]


def plan_decode(table: FrameTable, placements: Sequence[FramePlacement], first: int, whole: bool) -> DecodePlan:
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
    return DecodePlan(table, outs, zstd, raw, pieces, int(regions.sum()))


def _unshuffle_blocks(src: torch.Tensor, dst: torch.Tensor, nblocks: int, size: int, typesize: int) -> None:
    """Undo Blosc's byte shuffle of `nblocks` blocks of `size` bytes each, src -> dst (flat uint8, same device)."""
    n = size // typesize
    s, d = src.view(nblocks, size), dst.view(nblocks, size)
    d[:, : n * typesize].view(nblocks, n, typesize).copy_(
        s[:, : n * typesize].view(nblocks, typesize, n).transpose(1, 2)
    )
    if size % typesize:
        d[:, n * typesize :].copy_(s[:, n * typesize :])


def unshuffle_torch(plan: DecodePlan, scratch: torch.Tensor) -> None:
    """The unshuffle with torch ops: one transpose per run of whole blocks that follow each other in src and dst.

    The CPU reference and the fallback where Triton is missing; the GPU path runs
    the same rows in one Triton kernel (`h5feed.gpu.unshuffle`).
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


def _unshuffle_run(plan: DecodePlan, scratch: torch.Tensor, run: list[int] | None) -> None:
    if run is not None:
        placement, src, dst, size, typesize, count = run
        nbytes = count * size
        _unshuffle_blocks(scratch[src : src + nbytes], plan.outs[placement][dst : dst + nbytes], count, size, typesize)


def stage_spans(frames: Sequence[Buffer]) -> tuple[list[tuple[int, int]], int]:
    """Spans of the frames packed one after another (each on a cache line) and the bytes they take."""
    spans, end = [], 0
    for i, frame in enumerate(frames):
        view = memoryview(frame)
        if not view.c_contiguous:
            raise UnsupportedFrame("frame bytes are not contiguous", i)
        n = view.nbytes
        spans.append((end, n))
        end = round_up(end + n, STAGE_ALIGN)
    return spans, end


def copy_frames(frames: Sequence[Buffer], spans: Sequence[tuple[int, int]], into: np.ndarray) -> None:
    for frame, (at, n) in zip(frames, spans):
        into[at : at + n] = np.frombuffer(frame, np.uint8)


def reference_decode_placed(frames: Sequence[Buffer], placements: Sequence[FramePlacement]) -> None:
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
    _reference_decode(frames, whole_placements(len(frames), outs), whole=True)


def _reference_decode(frames: Sequence[Buffer], placements: Sequence[FramePlacement], whole: bool) -> None:
    from numcodecs import zstd

    spans, nbytes = stage_spans(frames)
    staged = np.empty(nbytes, np.uint8)
    copy_frames(frames, spans, staged)
    plan = plan_decode(parse_frames(staged, spans), placements, 0, whole)
    scratch = torch.empty(plan.scratch_nbytes, dtype=torch.uint8)
    decoded = scratch.numpy()
    for src, csize, dst, size in zip(*plan.zstd):
        zstd.decompress(staged[src : src + csize], decoded[dst : dst + size])
    for src, dst, size in plan.raw:
        decoded[dst : dst + size] = staged[src : src + size]
    unshuffle_torch(plan, scratch)

