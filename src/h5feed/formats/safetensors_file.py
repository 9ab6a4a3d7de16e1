"""Opening a safetensors file: its tensors' shapes and dtypes from the header alone, and errors that name it; the
per-token scales of FP8 hidden states, as hs-connectors' fp8 backend writes them beside `hidden_states`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import SampleShape
from h5feed.formats.checks import fmt_shape
from h5feed.store.fp8 import FP8_MAX, MAX_SCALE, MIN_SCALE, invalid_scales
from h5feed.store.layout import HIDDEN_SCALES

__all__ = ["check_fp8_scales", "fp8_scales", "open_safetensors", "tensor_meta"]


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open`` the file, turning the library's errors into SourceErrors that name it.

    Keep the body to safetensors calls and checks: RuntimeError, ValueError and
    TypeError raised in it are reported as a corrupt file too.
    """
    from safetensors import SafetensorError, safe_open  # lazily: the other formats work without it

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except OSError as e:
        raise SourceError(path, f"cannot be opened: {e.strerror or e}") from e
    except (SafetensorError, RuntimeError, ValueError, TypeError) as e:
        raise SourceError(path, f"truncated or corrupt safetensors file ({type(e).__name__}: {e})") from e


def tensor_meta(f: Any, key: str) -> torch.Tensor:
    """A meta tensor with the shape and dtype of tensor ``key`` of an open file: reads none of its data."""
    sl = f.get_slice(key)
    shape = sl.get_shape()
    dtype = (sl[:0] if shape else f.get_tensor(key)).dtype  # an empty slice, or the one value of a 0-D tensor
    return torch.empty(shape, dtype=dtype, device="meta")


def check_fp8_scales(path: Path, f: Any, hidden: torch.Tensor) -> None:
    """FP8 hidden states (`hidden`, a meta tensor [T, ...]) come as hs-connectors' fp8 backend writes them:
    float8_e4m3fn, with their float32 scales [T, 1, 1] (`hidden_states_scales`); no other file has scales.  The
    scales are read (4 bytes a token) and each must be one the fp8 backend can write (`invalid_scales`)."""
    fp8, has_scales = hidden.dtype == torch.float8_e4m3fn, HIDDEN_SCALES in f.keys()  # noqa: SIM118 (no dict)
    if hidden.dtype.itemsize == 1 and not fp8:
        raise SourceError(path, f"'hidden_states' has dtype {hidden.dtype}; FP8 files are read as hs-connectors' "
                          "fp8 backend writes them, in float8_e4m3fn")
    if fp8 and not has_scales:
        raise SourceError(path, f"'hidden_states' is float8_e4m3fn without its {HIDDEN_SCALES!r}: hs-connectors' "
                          "fp8 backend writes both; the file is incomplete or was written otherwise")
    if has_scales and not fp8:
        raise SourceError(path, f"{HIDDEN_SCALES!r} beside 'hidden_states' of dtype {hidden.dtype}: scales belong "
                          "to float8_e4m3fn hidden states, as hs-connectors' fp8 backend writes them")
    if has_scales:
        scales = tensor_meta(f, HIDDEN_SCALES)
        if scales.dtype != torch.float32 or tuple(scales.shape) != (hidden.shape[0], 1, 1):
            raise SourceError(path, f"{HIDDEN_SCALES!r} is {scales.dtype} {fmt_shape(scales)}; expected float32 "
                              f"[{hidden.shape[0]}, 1, 1], one scale per token")
        values = f.get_tensor(HIDDEN_SCALES).view(-1)
        bad = invalid_scales(values).nonzero()
        if len(bad):
            token = int(bad[0])
            raise SourceError(path, f"token {token} has the scale {values[token].item():g} in {HIDDEN_SCALES!r}: "
                              f"hs-connectors' fp8 backend writes max(amax / {FP8_MAX:g}, {MIN_SCALE:g}) of finite "
                              f"hidden states, between {MIN_SCALE:g} and {MAX_SCALE:.2g}, and this one would be read "
                              f"back as zeros, flipped signs, NaN or Inf ({len(bad)} token(s) of {len(values)} have "
                              "such scales); the file is damaged: write it again")


def fp8_scales(f: Any, shape: SampleShape) -> torch.Tensor | None:
    """float32 [T]: the scales of a file's FP8 hidden states (checked by `check_fp8_scales`); None for others."""
    return f.get_tensor(HIDDEN_SCALES).view(shape.num_tokens) if shape.dtype == torch.float8_e4m3fn else None
