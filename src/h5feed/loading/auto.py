"""What `BatchLoader(decode="auto")` picks: the backend that leaves the trainer's step fastest here.

A loader is judged by the trainer's samples/s against its step alone, not by its own speed.
Measured with a Kimi-shaped EAGLE-3 drafter step on a 16-core GPU box (`h5feed bench`,
`bench/loader/node_bench.py`; bench/RESULTS.md): with all 16 cores for one GPU, worker processes give
the step 98.1-98.7% of its speed alone once running, on 1.2-1.4 loader cores; reader threads
96-98% (they share the trainer's interpreter); the GPU decoder 94-96% on 0.3-0.4 cores, its
3-5 GPU ms a sample running beside the step's kernels (the step 1.04-1.05x).  With eight
ranks on those cores (two a GPU) worker processes are CPU-bound (94-95% of the node's step
rate).  So the GPU decoder is taken only where cores are scarce: where a GPU has fewer than
`CPU_DECODE_CORES_PER_GPU` cores of its own; everywhere else, worker processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from h5feed.loading.backends import get_backend
from h5feed.store import Store

CPU_DECODE_CORES_PER_GPU = 2.0  # cores a GPU for worker processes to feed a Kimi-shaped step (1.2-1.6 measured,
# and the trainer's own)
MAX_AUTO_WORKERS = 4  # more workers than this read no faster per GPU and cost the node's cores


@dataclass(frozen=True)
class AutoChoice:
    """The backend `decode="auto"` takes (a registry name), the worker processes it starts with ("workers"), and
    why, in words (`BatchLoader.auto_reason`)."""

    backend: str
    num_workers: int | None
    reason: str


def cores_per_gpu() -> float | None:
    """The CPU cores each training process on this node has to feed its GPU: the cores this process may use over
    the ranks on this node (torchrun's LOCAL_WORLD_SIZE; one without it); None without a CUDA device."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return len(os.sched_getaffinity(0)) / max(ranks_here, 1)


def choose_backend(store: Store, num_workers: int = 0) -> AutoChoice:
    """The backend for `decode="auto"` on `store`: worker processes where num_workers asks for them; else by the
    cores each GPU has here (`cores_per_gpu`)."""
    if num_workers:
        return AutoChoice("workers", None, "num_workers= asks for worker processes")
    per_gpu = cores_per_gpu()
    if per_gpu is None:
        return AutoChoice("threads", None, "no GPU here: the training step runs on the CPU, beside reader threads")
    gpu = get_backend("cuda")
    why_not_gpu = gpu.unavailable() or gpu.refusal(store)
    if per_gpu < CPU_DECODE_CORES_PER_GPU and why_not_gpu is None:
        return AutoChoice("cuda", None, f"{per_gpu:.1f} cores a GPU (fewer than {CPU_DECODE_CORES_PER_GPU:.0f}): "
                          "CPU decode would starve the step; the GPU decodes")
    workers = max(1, min(MAX_AUTO_WORKERS, int(per_gpu)))
    why = (f"{per_gpu:.1f} cores a GPU: worker processes leave the training step fastest"
           if per_gpu >= CPU_DECODE_CORES_PER_GPU else
           f"{per_gpu:.1f} cores a GPU, but the GPU cannot decode here ({why_not_gpu})")
    return AutoChoice("workers", workers, why)
