"""decode="cuda" (`CudaBatchLoader`): batches equal the DataLoader + trainer collate path, bit for bit (GPU box)."""

from __future__ import annotations

import pytest
import torch

import h5feed
from h5feed import HiddenStatesStream, StreamLoader
from h5feed.flavors import trainer_collate
from h5feed.gpu import why_unavailable


def test_without_cuda_the_error_names_the_cpu_loader(synthetic_store):
    if why_unavailable() is None:
        pytest.skip("CUDA and nvCOMP are here")
    from h5feed import CudaBatchLoader

    s = synthetic_store("gpu_loader", "speculators-legacy-pt", 6, 64, (20, 90))
    with pytest.raises(RuntimeError, match="decode on the GPU is not available .*use h5feed.BatchLoader"):
        CudaBatchLoader(s.path, max_len=64)


@pytest.mark.gpu
@pytest.mark.parametrize("flavor, fmt, batch_size, max_len", [
    ("speculators-legacy", "speculators-legacy-pt", 1, 64),
    ("speculators-legacy", "speculators-legacy-pt", 3, 64),
    ("speculators-legacy", "speculators-legacy-pt", 2, 150),
    ("speculators", "speculators-legacy-pt", 2, 80),
    ("specforge", "specforge-ckpt", 2, 50),
])
def test_gpu_batches_equal_the_trainers_collate(synthetic_store, assert_same_batch, flavor, fmt, batch_size, max_len):
    from h5feed import CudaBatchLoader

    s = synthetic_store(f"gpu_loader_{fmt}", fmt, 11, 64, (1, 120), chunk_tokens=16)
    want = list(StreamLoader(HiddenStatesStream(s.path, flavor, max_len, schedule=h5feed.ScheduleOptions(seed=3)), batch_size=batch_size,
                             collate_fn=trainer_collate(flavor, max_len)))
    loader = CudaBatchLoader(s.path, h5feed.CudaOptions(threads=2), flavor=flavor, max_len=max_len,
                             batch_size=batch_size, schedule=h5feed.ScheduleOptions(seed=3))
    got = list(loader)
    assert len(got) == len(want) == len(loader)
    for g, w in zip(got, want):
        assert all(not isinstance(v, torch.Tensor) or v.device.type in ("cuda", "cpu") for v in g.values())
        assert_same_batch({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in g.items()}, w)
    assert loader.gpu_decode_ms > 0
