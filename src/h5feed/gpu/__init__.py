"""Decode of the store's chunks on the GPU, split by job.

- `h5feed.gpu.frames`: Blosc1 frame parsing, one frame or a whole batch's at once (CPU only).
- `h5feed.gpu.plan`: a batch's decode plan and byte unshuffle rows, with a CPU reference of the
  whole decode (CPU only: CI checks it bit for bit against numcodecs).
- `h5feed.gpu.nvcomp`: the nvCOMP decoder (`CudaBloscDecoder`, `decode_into_cuda`) and whether it can
  run here (`why_unavailable`).
- `h5feed.gpu.unshuffle`: the Triton unshuffle kernel, imported only on the GPU path.

Importing this package needs neither CUDA, nvCOMP nor Triton.
"""

from h5feed.gpu.frames import (
    BloscFrame,
    DamagedFrame,
    FrameError,
    FrameTable,
    Stream,
    UnsupportedFrame,
    parse_frame,
    parse_frames,
)
from h5feed.gpu.nvcomp import CudaBloscDecoder, CudaDecodeTiming, GpuTimes, available, decode_into_cuda, why_unavailable
from h5feed.gpu.plan import FramePlacement, reference_decode_into, reference_decode_placed

__all__ = [
    "BloscFrame",
    "CudaBloscDecoder",
    "CudaDecodeTiming",
    "DamagedFrame",
    "FrameError",
    "FramePlacement",
    "FrameTable",
    "GpuTimes",
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
