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
from h5feed.store.read_results import RawSample

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


# Values dequantized per pass on the CPU: the fastest measured (bench/loader/fp8_cpu_decode.py's shape, 2-core AVX2 VM),
# where numpy's and torch's per-call costs are small next to a pass's work and its temporaries (3 MiB) stay cached.
CPU_BLOCK_VALUES = 1 << 19


def _dequantize_on_cpu(fp8: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The same bits as `fp8.to(bfloat16) * scales.to(bfloat16)[:, None]`, in a few vectorised passes over blocks of
    tokens: torch 2.13 casts float8 one value at a time on the CPU, and numpy gathers from a table (each token's 256
    products, as this did before) one value at a time too.

    A float8_e4m3fn code with its sign moved to bit 15 and its exponent and mantissa to bits 13-7 is the float16
    bit pattern of value/256, exactly: float8's subnormals become float16's, which the CPU's float16 conversion
    reads exactly whatever its denormal mode.  Converted to float32 and
    multiplied by scale*256 (exact: a power of two times a bfloat16), each value gets the float32 product that
    torch's bfloat16 multiply forms (v*s of two bfloat16 values: exact, or rounded once alike when it is out of
    float32's range), rounded to bfloat16 by the same conversion.  Blocks of tokens holding a NaN code, or whose
    scale*256 is not finite, are computed by the formula itself, their NaNs given the bits torch's vectorised
    multiply gives every NaN (0xFFFF) wherever they fall."""
    tokens, width = fp8.shape
    if tokens == 0 or width == 0:
        return out
    scales = scales.to(DEQUANTIZED_DTYPE)
    factors = scales.float() * 256
    unusual_factors = ~torch.isfinite(factors)
    codes = fp8.view(torch.uint8).numpy()
    rows = max(1, CPU_BLOCK_VALUES // width)
    halves = np.empty((min(rows, tokens), width), np.int16)
    halves_tensor = torch.from_numpy(halves)
    values = torch.empty(halves.shape, dtype=torch.float32)
    for start in range(0, tokens, rows):
        stop = min(start + rows, tokens)
        block, n = codes[start:stop], stop - start
        # float8_e4m3fn's NaNs, 0xFF and 0x7F, are the largest codes unsigned and signed (it has no infinities)
        if bool(unusual_factors[start:stop].any()) or block.max() == 0xFF or block.view(np.int8).max() == 0x7F:
            products = fp8[start:stop].to(DEQUANTIZED_DTYPE) * scales[start:stop, None]
            products.view(torch.int16)[products.isnan()] = -1
            out[start:stop].copy_(products)
            continue
        as_half = halves[:n]
        np.copyto(as_half, block.view(np.int8))  # sign-extended: the sign lands in bits 15 and 14
        np.multiply(as_half, 128, out=as_half)  # shifted 7 left: numpy multiplies 16-bit integers in SIMD, shifts not
        np.bitwise_and(as_half, ~0x4000, out=as_half)  # bit 14 is float16's exponent's highest: cleared
        product = values[:n]
        product.copy_(halves_tensor[:n].view(torch.float16))
        product.mul_(factors[start:stop, None])
        if out.dtype == DEQUANTIZED_DTYPE:
            out[start:stop].copy_(product)
        else:  # rounded to bfloat16 in the halves, which are read already, then cast
            out[start:stop].copy_(halves_tensor[:n].view(DEQUANTIZED_DTYPE).copy_(product))
    return out


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
