"""The key, dtype and shape checks every format makes of a sample, each error naming the file and the key."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h5feed.errors import SourceError
from h5feed.formats.base import SampleShape, SourceSample

__all__ = [
    "CheckedSample", "aux_and_last", "check_hidden", "check_token_values", "fmt_shape", "ids_to_int64", "is_integer_dtype",
    "mask_to_int64", "mask_vector", "refuse_unbacked_tensors", "refuse_unknown_keys", "require_keys",
    "require_tensor", "token_vector",
]


def fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def require_keys(path: Path, d: Collection[str], keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        found = ", ".join(repr(k) for k in d)
        raise SourceError(
            path,
            f"missing key(s) {', '.join(repr(k) for k in missing)} for format {fmt} (found keys: {found or 'none'})",
        )


def require_tensor(path: Path, d: dict, key: str) -> torch.Tensor:
    v = d[key]
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected a tensor")
    return v


def refuse_unbacked_tensors(path: Path, d: Mapping[Any, Any]) -> None:
    """Every tensor of `d` (a value, or an item of a list value) holds the values its shape claims.

    An expanded view (a stride of 0) or a tensor on the meta device claims T tokens while holding a few bytes or
    none: the first copy of it (`.contiguous()`, a move to the host) would allocate all it claims, gigabytes for
    a file of kilobytes.  Checked first, before any copy: only shapes, strides and storage sizes are read."""
    for key, value in d.items():
        tensors = [(f"{key!r}", value)] if isinstance(value, torch.Tensor) else \
            [(f"{key!r}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)] \
            if isinstance(value, (list, tuple)) else []
        for label, t in tensors:
            if t.device.type == "meta":
                raise SourceError(path, f"{label} is a meta tensor {fmt_shape(t)}: it has a shape but no values "
                                  "(made on the meta device, or saved from one); save the tensor's values")
            claimed, held = t.numel() * t.element_size(), t.untyped_storage().nbytes()
            if held < claimed:
                raise SourceError(path, f"{label} claims {fmt_shape(t)} ({claimed} bytes) but holds {held} bytes: a "
                                  "view that repeats its values (expand, a stride of 0) would be copied to its full "
                                  "size; save or give the tensor itself (.contiguous() makes one of a view)")


def _vector(path: Path, v: Any, key: str, expected: str) -> torch.Tensor:
    """v as a tensor; a list of integers is converted."""
    if isinstance(v, (list, tuple)):
        try:
            v = torch.as_tensor(v)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SourceError(path, f"{key!r} is a list that is not a flat list of integers ({e})") from e
    if not isinstance(v, torch.Tensor):
        raise SourceError(path, f"{key!r} is a {type(v).__name__}, expected {expected}")
    return v


def token_vector(path: Path, v: Any, key: str, allow_batch_dim: bool = False) -> torch.Tensor:
    """The token ids: an integer tensor [T] (or [1, T] where allowed), T >= 1."""
    v = _vector(path, v, key, "an integer tensor [T]")
    if not is_integer_dtype(v.dtype):
        raise SourceError(path, f"{key!r} has dtype {v.dtype}; token ids must be an integer dtype")
    if allow_batch_dim and v.dim() == 2 and v.shape[0] == 1:
        v = v[0]
    if v.dim() != 1:
        want = "[T] or [1, T]" if allow_batch_dim else "[T]"
        raise SourceError(path, f"{key!r} must be 1-D {want}, got shape {fmt_shape(v)}")
    if v.shape[0] == 0:
        raise SourceError(path, f"empty sample: {key!r} has 0 tokens")
    return v


def mask_vector(path: Path, v: Any, key: str, num_tokens: int, allow_batch_dim: bool = False) -> torch.Tensor | None:
    """The loss mask: None when missing or None, else an integer/bool tensor [T]."""
    if v is None:
        return None
    v = _vector(path, v, key, "an integer tensor [T] or None")
    if not (is_integer_dtype(v.dtype) or v.dtype == torch.bool):
        raise SourceError(path, f"{key!r} has dtype {v.dtype}; a loss mask must be integer (0/1) or bool")
    if allow_batch_dim and v.dim() == 2 and v.shape[0] == 1:
        v = v[0]
    if v.dim() != 1:
        raise SourceError(path, f"{key!r} must be 1-D [T], got shape {fmt_shape(v)}")
    if v.shape[0] != num_tokens:
        raise SourceError(path, f"{key!r} has {v.shape[0]} entries but the sample has {num_tokens} tokens")
    return v


def check_hidden(path: Path, t: torch.Tensor, label: str, dims: str) -> None:
    if not t.dtype.is_floating_point:
        raise SourceError(path, f"{label} has dtype {t.dtype}; hidden states must be floating point")
    if t.dim() != dims.count(",") + 1:
        raise SourceError(path, f"{label} must be {dims} ({dims.count(',') + 1}-D), got shape {fmt_shape(t)}")


def aux_and_last(
    path: Path, d: dict, aux_key: str, last_key: str, t: int, batched: bool
) -> tuple[torch.Tensor, torch.Tensor, SampleShape]:
    """The aux [T, K*H] and last [T, H] tensors of d, each stored as [1, T, ...] when batched."""
    aux, last = require_tensor(path, d, aux_key), require_tensor(path, d, last_key)
    lead = "[1, T, " if batched else "[T, "
    check_hidden(path, aux, repr(aux_key), lead + "K*H]")
    check_hidden(path, last, repr(last_key), lead + "H]")
    for key, x in ((aux_key, aux), (last_key, last)):
        if batched and x.shape[0] != 1:
            raise SourceError(
                path, f"{key!r} has a leading batch dim of {x.shape[0]}, expected 1 (shape {fmt_shape(x)})"
            )
        if x.shape[int(batched)] != t:
            raise SourceError(path, f"{key!r} has {x.shape[int(batched)]} tokens but 'input_ids' has {t}")
    if batched:
        aux, last = aux[0], last[0]
    h = int(last.shape[1])
    if h == 0 or aux.shape[1] == 0 or aux.shape[1] % h != 0:
        raise SourceError(
            path,
            f"{aux_key!r} width {aux.shape[1]} is not a positive multiple of the hidden size "
            f"{h} of {last_key!r}; expected {lead}K*H]",
        )
    if aux.dtype != last.dtype:
        raise SourceError(path, f"{aux_key!r} is {aux.dtype} but {last_key!r} is {last.dtype}; expected one dtype")
    return aux, last, SampleShape(t, h, int(aux.shape[1]) // h, aux.dtype)


def ids_to_int64(path: Path, ids: torch.Tensor, key: str) -> torch.Tensor:
    """int64 copy/view of token ids, refusing conversions that would change a value."""
    if ids.dtype == torch.uint64:
        as_int64 = ids.contiguous().view(torch.int64)  # same bits: values above 2**63-1 turn negative
        if bool((as_int64 < 0).any()):
            raise SourceError(path, f"{key!r} is uint64 with values above the int64 range; cannot convert losslessly")
        return as_int64
    return ids.to(torch.int64).contiguous()  # every other integer dtype widens without loss


def check_token_values(path: Path, sample: SourceSample) -> None:
    """Token ids are >= 0 and a loss mask holds only 0 and 1: a trainer indexes its embedding with the ids and
    weights its loss with the mask, so another value would train on garbage or fail far from its cause.  Every
    sample is checked so, converted or appended (O(T): the ids and mask only)."""
    ids, mask = sample.input_ids, sample.loss_mask
    negative = (ids < 0).nonzero()
    if len(negative):
        token = int(negative[0])
        raise SourceError(path, f"'input_ids' holds {int(ids[token])} at token {token} ({len(negative)} negative "
                          "ids): token ids are >= 0; the pipeline that wrote it padded or marked them otherwise")
    if mask is not None:
        other = ((mask != 0) & (mask != 1)).nonzero()
        if len(other):
            token = int(other[0])
            raise SourceError(path, f"'loss_mask' holds {int(mask[token])} at token {token} ({len(other)} such "
                              "values): a loss mask holds 0 (no loss on the token) or 1 (loss on it), nothing else")


def mask_to_int64(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.to(torch.int64).contiguous()


def refuse_unknown_keys(path: Path, d: Collection[str], known: tuple[str, ...], fmt: str) -> None:
    """A key h5feed does not know would be lost in the store: refuse rather than drop it."""
    unknown = [k for k in d if k not in known]
    if unknown:
        raise SourceError(path, f"has key(s) {', '.join(map(repr, unknown))} that format {fmt} does not have; "
                          "h5feed keeps every key the trainer reads and will not drop others in silence")


@dataclass
class CheckedSample:
    """A validated sample, its large tensors as the file holds them (mapped, not copied)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    aux: list[torch.Tensor] | torch.Tensor  # list: concatenate along -1
    last: torch.Tensor | None  # None: the format stores no last state (the shape's hidden_size says H)
    shape: SampleShape
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [T, width] or [T], as the shape lists them

    def materialize(self, path: Path) -> SourceSample:
        return SourceSample(
            input_ids=ids_to_int64(path, self.input_ids, "input_ids"),
            loss_mask=mask_to_int64(self.loss_mask),
            aux_parts=list(self.aux) if isinstance(self.aux, list) else [self.aux],
            last_hidden_state=self.last.contiguous() if self.last is not None else None,
            extras={name: tensor.contiguous() for name, tensor in self.extras.items()},
            hidden_size=self.shape.hidden_size,
            layout=self.shape.layout,
            last_state_norm=self.shape.last_state_norm,
        )
