"""Decode backends: where and how a `BatchLoader`'s batches are decoded, one module per backend.

The interface and the registry are in `h5feed.loading.backends.base`; each backend's module
registers itself: `workers` (DataLoader worker processes) and `threads` (reader threads), both
decoding on the CPU into the slot ring (`ring`), and `cuda` (decode on the GPU).
"""

# each module registers its backend when imported: this is the order they are listed in
# isort: off
from h5feed.loading.backends import workers, threads, cuda  # noqa: F401
# isort: on
from h5feed.loading.backends.base import (
    BACKENDS,
    DecodeBackend,
    ReadyBatch,
    backend_of,
    get_backend,
    register_backend,
)

__all__ = ["BACKENDS", "DecodeBackend", "ReadyBatch", "backend_of", "get_backend", "register_backend"]
