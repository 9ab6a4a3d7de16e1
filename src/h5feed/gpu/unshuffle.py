"""The byte unshuffle of a whole batch of Blosc blocks in one Triton kernel (see `h5feed.gpu.nvcomp`).

Why a kernel: the blocks of a batch land in many outputs (rows of the trainer's
batch, at any offset), which no single torch view spans; one launch over a table
of rows replaces a transpose per block run.  Importing this module imports
Triton: `h5feed.gpu.nvcomp` does so only on the GPU path, and falls back to torch
when Triton is missing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 8192  # bytes one program writes per step
MAX_PROGRAMS_PER_ROW = 1024


@triton.jit
def _unshuffle_kernel(src_ptr, dst_ptr, rows_ptr, TILE: tl.constexpr):
    row = rows_ptr + tl.program_id(0) * 6  # src, dst, size, typesize, lo, hi
    src = tl.load(row)
    dst = tl.load(row + 1)
    size = tl.load(row + 2).to(tl.int32)
    typesize = tl.load(row + 3).to(tl.int32)
    lo = tl.load(row + 4).to(tl.int32)
    hi = tl.load(row + 5).to(tl.int32)
    elements = size // typesize
    shuffled_end = elements * typesize
    step = tl.num_programs(1) * TILE
    for start in range(lo + tl.program_id(1) * TILE, hi, step):
        p = start + tl.arange(0, TILE)
        inside = p < hi
        q = tl.where(p < shuffled_end, (p % typesize) * elements + p // typesize, p)
        value = tl.load(src_ptr + src + q, mask=inside)
        tl.store(dst_ptr + dst + (p - lo), value, mask=inside)


def unshuffle_rows(src: torch.Tensor, dst_base: torch.Tensor, rows: torch.Tensor, longest: int) -> None:
    """Queue the unshuffle of every row on the current stream.

    `rows` is an int64 CUDA tensor [n, 6]: row r writes bytes [lo, hi) of a block
    of `size` bytes, shuffled by `typesize`, that starts at byte `src` of `src`,
    to bytes from `dst` on of `dst_base` (which may point into any allocation
    after `dst_base`'s start: outputs of a batch need not share one tensor).  Byte
    p < size - size % typesize comes from byte (p % typesize) * (size // typesize)
    + p // typesize, the rest from byte p.  `longest` is the largest hi - lo.
    """
    if rows.numel() == 0 or longest <= 0:
        return
    programs = min(triton.cdiv(longest, TILE), MAX_PROGRAMS_PER_ROW)
    _unshuffle_kernel[(rows.shape[0], programs)](src, dst_base, rows, TILE=TILE, num_warps=8)
