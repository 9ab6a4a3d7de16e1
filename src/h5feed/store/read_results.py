"""What a read of a store hands back (`RawSample`: one sample's tensors as stored) and what it cost (`ReadStats`).

Why apart from the reader: these two are what every consumer of a read holds (the flavors build a trainer's items
from a RawSample; the loaders' counters implement ReadStats' methods in shared memory), and none of them needs the
reader's machinery to do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RawSample:
    """One sample's tensors as stored: hidden states in their logical dtype (an FP8 store's: float8_e4m3fn, with
    their scales; `h5feed.store.fp8.dequantized` gives them as read), views of one buffer each."""

    input_ids: torch.Tensor  # int64 [t]
    loss_mask: torch.Tensor  # int64 [t]
    aux_hidden_states: torch.Tensor  # [t, K*H]
    last_hidden_state: torch.Tensor | None  # [t, H]; None when the store holds none (`info.has_last_state`)
    num_tokens: int  # tokens of the whole sample (t may be fewer when truncated)
    has_loss_mask: bool
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the optional arrays read, [t, width] or [t]
    hidden_scales: torch.Tensor | None = None  # an FP8 store's: float32 [t], each token's (`h5feed.store.fp8`)


@dataclass
class ReadStats:
    """What reads cost: bytes from storage, bytes delivered, seconds in I/O and in checking + decoding.

    `Store` reports through the three `add_*` methods, which `metrics.WorkerCounters`
    implements too (in shared memory, thread-safe).
    """

    bytes_read: int = 0
    bytes_delivered: int = 0
    read_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add_read(self, nbytes: int, seconds: float) -> None:
        self.bytes_read += nbytes
        self.read_seconds += seconds

    def add_decode(self, seconds: float) -> None:
        self.decode_seconds += seconds

    def add_delivered(self, nbytes: int) -> None:
        self.bytes_delivered += nbytes
