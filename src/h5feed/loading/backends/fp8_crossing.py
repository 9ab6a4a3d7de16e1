"""An FP8 store's hidden states cross to the GPU as they are stored, and are dequantized there.

With `device=` a GPU, the CPU backends (`workers`, `threads`) put each batch's hidden states into its slot as the
store keeps them, FP8 codes and one float32 scale a token, instead of dequantizing them to bfloat16 on the CPU.
The CPU's work, the slot and the copy to the GPU are then about half of an exact store's (the dequantization was
the CPU backends' dearest step on an FP8 store), and the GPU's multiply, one elementwise kernel a key on the
delivery thread's copy stream, gives the same bits as the CPU's (`h5feed.store.fp8.dequantize_into`).

The scales are row keys of their own (`<key>.fp8_scales`, the hidden key's shift), so the placement writes them,
zeroes their pads and keeps the ring's dirty marks as for any other key: a pad's code and scale are both 0, and
0 x 0 is the 0 every pad holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from h5feed.flavors import Batch, RowKey, TensorSpec, TrainerCollate
from h5feed.store import HIDDEN_ARRAYS, HIDDEN_SCALES
from h5feed.store.fp8 import FP8_DTYPE, dequantize_into

SCALES_SUFFIX = ".fp8_scales"


@dataclass(frozen=True)
class ScaledKey:
    """A batch key of FP8 hidden states in the slot, the key of its tokens' scales, and the dtype the trainer gets."""

    key: str
    scales_key: str
    shift: int
    dtype: torch.dtype


@dataclass(frozen=True)
class DeviceDequantization:
    """Which of a collate's keys cross as FP8 codes and scales, and how they become the trainer's tensors
    (`NONE`: no key; every method then gives back what it was given)."""

    keys: tuple[ScaledKey, ...]
    NONE: ClassVar[DeviceDequantization]

    @classmethod
    def of(cls, collate: TrainerCollate) -> DeviceDequantization:
        """The hidden-state keys of `collate` (bound to an FP8 store)."""
        trailing = collate.trailing()
        return cls(tuple(ScaledKey(rk.key, rk.key + SCALES_SUFFIX, rk.shift, trailing[rk.key][1])
                         for rk in collate.row_keys if rk.array in HIDDEN_ARRAYS))

    def row_keys(self, row_keys: Sequence[RowKey]) -> list[RowKey]:
        """The collate's row keys and, after them, one of scales for each FP8 key."""
        return [*row_keys, *(RowKey(sk.scales_key, HIDDEN_SCALES, sk.shift) for sk in self.keys)]

    def trailing(self, trailing: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Per-position shapes and dtypes in the slot: FP8 codes as bytes, a float32 scale each."""
        out = dict(trailing)
        for sk in self.keys:
            out[sk.key] = (trailing[sk.key][0], torch.uint8)
            out[sk.scales_key] = ((), torch.float32)
        return out

    def specs(self, specs: dict[str, TensorSpec], trailing: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The slot's tensors of one batch: the collate's `specs` (made with `trailing`), and the scales."""
        out = dict(specs)
        for sk in self.keys:
            shape = specs[sk.key][0][:2]  # [B, N]
            out[sk.scales_key] = (shape, trailing[sk.scales_key][1])
        return out

    def dequantized(self, batch: Batch) -> Batch:
        """The trainer's batch, on the device `batch` is on: each FP8 key multiplied out by its scales (in bfloat16,
        then the trainer's dtype), the scales dropped; the keys' order kept."""
        scales_keys = {sk.scales_key for sk in self.keys}
        out = {key: value for key, value in batch.items() if key not in scales_keys}
        for sk in self.keys:
            codes, scales = batch[sk.key], batch[sk.scales_key]
            rows, positions, width = codes.shape
            result = torch.empty((rows, positions, width), dtype=sk.dtype, device=codes.device)
            dequantize_into(codes.view(FP8_DTYPE).view(rows * positions, width), scales.reshape(rows * positions),
                            result.view(rows * positions, width))
            out[sk.key] = result
        return out


DeviceDequantization.NONE = DeviceDequantization(())
