"""FP8 hidden states as hs-connectors' `fp8` backend keeps them: float8_e4m3fn, and one float32 scale per token.

A token's scale covers all its hidden states (every aux layer and the last state):
``scale = max(amax / 448, 1e-12)``, ``fp8 = (x.float() / scale).to(float8_e4m3fn)``; they are read back as
``fp8.to(bfloat16) * scale.to(bfloat16)``, in bfloat16, which is what `hs_connectors.FP8Transfer` returns.
Each step here is the same single, correctly rounded torch operation as there (the amax is exact in any order,
and a product of two bfloat16 values rounds once), so a store quantized by h5feed holds the bytes the fp8 backend
writes for the same activations, and every read equals FP8Transfer's, bit for bit.  h5feed restates the
arithmetic instead of importing hs-connectors, which readers of a store do not need.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from h5feed.store.buffers import Allocator
from h5feed.store.reader import RawSample

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1e-12  # the scale of a token whose states are all zero
# The scale of a token whose amax is the largest float32 (bfloat16's and float16's largest are below it): ~7.6e35.
MAX_SCALE = torch.finfo(torch.float32).max / FP8_MAX
DEQUANTIZED_DTYPE = torch.bfloat16  # what FP8Transfer returns by default, and what an FP8 store delivers


def token_scales(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [T]: each token's scale over all its hidden states, given as parts [T, w_i] (the aux layers, the
    last state) in any float dtype.  The amax is taken in the parts' own dtype (exact: no copy in float32)."""
    amax = functools.reduce(torch.maximum, (part.abs().amax(dim=1) for part in parts))
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def invalid_scales(scales: torch.Tensor) -> torch.Tensor:
    """bool, the shape of `scales` (float32): the scales `token_scales` never gives for finite hidden states, whatever
    their dtype: not finite, below MIN_SCALE (zero, negative, subnormal) or above MAX_SCALE.  Read back, such a
    scale turns a token's values into zeros, flipped signs, NaN or Inf; a file holding one is damaged."""
    return ~((scales >= MIN_SCALE) & (scales <= MAX_SCALE))  # NaN fails both comparisons


def quantize(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [t, w]: rows [t, w] of hidden states divided by their tokens' scales [t] (`token_scales`)."""
    return (rows.float() / scales[:, None]).to(FP8_DTYPE)


def dequantize_into(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` [t, w] = fp8 [t, w] * scales [t], as FP8Transfer computes it (in bfloat16); an `out` of another
    float dtype gets that bfloat16 product cast (exact into float32, as a trainer's own cast of it would be).
    On the CPU or the GPU alike: a product of two bfloat16 values is rounded once, so both give the same bits."""
    if fp8.device.type == "cpu":
        return _dequantize_on_cpu(fp8, scales, out)
    scaled = fp8.to(DEQUANTIZED_DTYPE), scales.to(DEQUANTIZED_DTYPE)[:, None]  # one fast kernel each on the GPU
    if out.dtype == DEQUANTIZED_DTYPE:
        return torch.mul(*scaled, out=out)
    return out.copy_(torch.mul(*scaled))


# The 256 float8_e4m3fn values, in bfloat16 (each one is exactly a bfloat16 value).
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(DEQUANTIZED_DTYPE)


def _dequantize_on_cpu(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each token's 256 possible products (`_FP8_VALUES` times its scale, each the same single bfloat16 multiply
    as the elementwise one) looked up for its values: one gather a value and no temporary, 2-3x faster than
    casting and multiplying every value (torch 2.13 casts float8 one value at a time on the CPU)."""
    products = _FP8_VALUES[None, :] * scales.to(DEQUANTIZED_DTYPE)[:, None]  # [t, 256]
    if out.dtype != DEQUANTIZED_DTYPE:
        products = products.to(out.dtype)
    table, codes, into = _as_numpy(products), fp8.view(torch.uint8).numpy(), _as_numpy(out)
    for token in range(codes.shape[0]):
        np.take(table[token], codes[token], out=into[token], mode="clip")  # a code is < 256: nothing to check
    return out


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy sees it: bfloat16 as its int16 bits (numpy has no bfloat16)."""
    return t.view(torch.int16).numpy() if t.dtype == DEQUANTIZED_DTYPE else t.numpy()


def dequantized(raw: RawSample, allocate: Allocator) -> RawSample:
    """An FP8 store's sample with its hidden states in bfloat16 (in memory from `allocate`), as FP8Transfer
    returns them; any other sample as it is."""
    if raw.hidden_scales is None:
        return raw

    def restored(fp8: torch.Tensor) -> torch.Tensor:
        return dequantize_into(fp8, raw.hidden_scales, allocate(tuple(fp8.shape), DEQUANTIZED_DTYPE))

    last = raw.last_hidden_state
    return RawSample(raw.input_ids, raw.loss_mask, restored(raw.aux_hidden_states),
                     None if last is None else restored(last), raw.num_tokens, raw.has_loss_mask, raw.extras)
