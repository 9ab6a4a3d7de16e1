"""The one placement: each item's rows written straight into their place in the trainer's batch, pads zeroed
only where they may be non-zero.

Every path that builds a batch (the collate over items, the CPU decode into a ring slot,
the GPU decode) places rows the same way: the collate's plan says where item n's rows
go (batch row, offset, count), the caller's `fill` writes them there (a copy of the
item's tensor, a decode straight from the store, a copy from decoded GPU memory), and
what lies past each item's rows is zeroed, in a reused buffer only up to where its last
batch wrote (its dirty mark).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch


class RowKeyLike(Protocol):
    """A batch key with one entry per token position (`h5feed.flavors.RowKey`)."""

    @property
    def key(self) -> str: ...

    @property
    def array(self) -> str | None: ...  # the store array it is decoded from; None: h5feed computes it

    @property
    def shift(self) -> int: ...  # stored row of the sample that lands on the item's first row


class ItemPlace(Protocol):
    """Where one item's rows go (`h5feed.flavors.base.Placement`): batch row `row`, positions [offset, offset + count)."""

    @property
    def row(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def count(self) -> int: ...


class BatchLayout(Protocol):
    """Where every item of one batch goes (`h5feed.flavors.BatchPlan`)."""

    @property
    def batch_rows(self) -> int: ...

    @property
    def placements(self) -> Sequence[ItemPlace]: ...


Key = TypeVar("Key", bound=RowKeyLike)


def place_items(row_keys: Sequence[Key], plan: BatchLayout, batch: dict[str, Any],
                fill: Callable[[int, dict[Key, torch.Tensor]], None], *, windows: Sequence[int] | None = None,
                dirty: Sequence[int] | None = None) -> list[int]:
    """Each item's rows into their place in `batch`, then its pads zeroed; the dirty marks for the buffer's next use.

    Args:
        row_keys: the collate's row keys ([B, N] or [B, N, width] tensors of `batch`).
        fill: `fill(n, rows)` writes item n's rows: `rows` maps each row key the item has rows of
            to their destination, `batch[key][row, offset : offset + count]`.
        windows: the stored rows read of each item (paths that decode from the store): a key stored with
            shift s has windows[n] - s of them, one h5feed computes (`derive_rows`) all of the placement's.
            None: every item has all its placed rows (the collate over items).
        dirty: for each row key, the positions of the flattened [B*N] tensor a reused buffer may still hold
            from its last batch; None: fresh memory, all of them.
    """
    written = {rk.key: [0] * plan.batch_rows for rk in row_keys}
    for n, place in enumerate(plan.placements):
        rows: dict[Key, torch.Tensor] = {}
        for rk in row_keys:
            count = place.count
            if windows is not None and rk.array is not None:
                count = max(0, min(count, windows[n] - rk.shift))
            if count:
                rows[rk] = batch[rk.key][place.row, place.offset : place.offset + count]
            written[rk.key][place.row] = place.offset + count
        fill(n, rows)
    return [zero_pads(batch[rk.key], written[rk.key], None if dirty is None else int(dirty[k]))
            for k, rk in enumerate(row_keys)]


def zero_pads(tensor: torch.Tensor, written: Sequence[int], dirty_rows: int | None = None) -> int:
    """Zero positions [written[b], N) of each batch row b of a [B, N, ...] tensor, where they may be non-zero.

    `dirty_rows`: positions of the flattened [B*N] tensor (counted from its start) that may
    hold values from an earlier batch; None: all of them (fresh memory).  Returns the same
    count for after this batch, for the next reuse of the buffer.
    """
    batch_rows, positions = tensor.shape[0], tensor.shape[1]
    flat = tensor.reshape(batch_rows * positions, -1)
    end = flat.shape[0]
    dirty = end if dirty_rows is None else min(dirty_rows, end)
    data_end = 0
    for b, filled in enumerate(written):
        lo, hi = b * positions + filled, min((b + 1) * positions, dirty)
        if lo < hi:
            flat[lo:hi] = 0
        if filled:
            data_end = b * positions + filled
    return data_end if dirty_rows is None or dirty_rows <= end else dirty_rows
