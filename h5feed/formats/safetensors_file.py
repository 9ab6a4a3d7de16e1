"""Opening a safetensors file: its tensors' shapes and dtypes from the header alone, and errors that name it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError

__all__ = ["open_safetensors", "tensor_meta"]


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
