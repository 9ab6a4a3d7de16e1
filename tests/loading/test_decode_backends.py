"""Every decode backend through one conformance suite: whatever decodes them (worker processes, reader threads, the
GPU), `BatchLoader`'s batches equal each flavor's trainer collate, resume where `state_dict` says, shard over
ranks, skip damaged samples, give their memory back, and name a worker that died; `decode="auto"` chooses through
the registry.  The GPU backend's cases run where CUDA and nvCOMP are (marked `gpu`)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    PIPELINE_CASE_IDS,
    PIPELINE_CASES,
    assert_a_killed_worker_is_named,
    assert_same,
    inner_chunk_span,
    pipeline_reference,
    restated_collate,
)

import h5feed
from h5feed import (
    BatchLoader,
    HiddenStatesDataset,
    HiddenStatesStream,
    StoreSettings,
    StreamLoader,
    ThreadsOptions,
    trainer_collate,
)
from h5feed.gpu import why_unavailable
from h5feed.loading.backends import BACKENDS, DecodeBackend
from h5feed.loading.backends.cuda import CudaOptions, store_refusal
from h5feed.store import Store

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

EVERY_BACKEND = [pytest.param(name, marks=pytest.mark.gpu if name == "cuda" else ()) for name in BACKENDS]
WITH_WORKER_PROCESSES = ["workers"]
# each backend's own arguments here: two reader threads, two worker processes, or decode on the GPU
OWN = {"workers": {"num_workers": 2}, "threads": {"decode": ThreadsOptions(threads=2)},
       "cuda": {"decode": CudaOptions(threads=2)}}


def test_every_registered_backend_is_in_the_suite() -> None:
    assert list(BACKENDS) == list(OWN) == ["workers", "threads", "cuda"]  # a new one is added here


def loader_on(backend: str, data: Any, multiprocessing_context: str | None = None, **kwargs: Any) -> BatchLoader:
    """The backend's loader; the schedule's arguments (seed=, rank=, ...) go into its `ScheduleOptions`."""
    schedule = {name: kwargs.pop(name) for name in list(kwargs) if name in ("seed", "shuffle", "rank", "world_size")}
    own = OWN[backend] if multiprocessing_context is None else {  # the workers backend's own option
        "decode": h5feed.WorkersOptions(num_workers=2, multiprocessing_context=multiprocessing_context)}
    loader = BatchLoader(data, **own, **kwargs, schedule=h5feed.ScheduleOptions(**schedule) if schedule else None)
    assert loader.backend.name == backend
    return loader


def on_host(value: Any, backend: str) -> Any:
    """A batch copied out of the loader's memory onto the CPU (so a slot goes back at once); the GPU backend's
    batches are on the GPU."""
    if isinstance(value, torch.Tensor):
        assert value.is_cuda == (backend == "cuda")
        return value.clone().cpu()
    if isinstance(value, dict):
        return {key: on_host(v, backend) for key, v in value.items()}
    return value


def one_pass(loader: BatchLoader, backend: str, epoch: int = 0) -> list[Any]:
    import warnings

    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no batch may leave the slot ring
        return [on_host(batch, backend) for batch in loader]


# =========================================================================== the trainer's batches


@pytest.mark.parametrize("backend", EVERY_BACKEND)
@pytest.mark.parametrize(("name", "flavor", "max_len"), PIPELINE_CASES, ids=PIPELINE_CASE_IDS)
def test_batches_equal_each_flavors_trainer_collate(pipeline_store: Any, backend: str, name: str, flavor: str,
                                                    max_len: int | None) -> None:
    """Key by key and bit for bit the trainer's released collate (restated in conftest) over the flavor's
    items, for two epochs and two batch sizes; every worker's counters count the samples it was dealt."""
    path = pipeline_store(name)
    for batch_size in (1, 3):
        loader = loader_on(backend, path, flavor=flavor, max_len=max_len, batch_size=batch_size, seed=4)
        for epoch in (0, 1):
            got = one_pass(loader, backend, epoch)
            want = pipeline_reference(path, flavor, max_len, batch_size, epoch, seed=4)
            assert len(got) == len(want) == len(loader)
            assert_same(got, want, f"batch_size {batch_size}, epoch {epoch}")
        workers = max(loader.num_workers, 1)
        dealt = [2 * sum(map(len, loader.dataset.schedule.worker_batches(False, w, workers))) for w in range(workers)]
        assert [w.samples for w in loader.dataset.counters.snapshot().workers] == dealt  # two epochs
        assert (loader.gpu_decode_ms > 0) == (backend == "cuda")


# =========================================================================== resume and sharding


def copies(loader: BatchLoader, backend: str) -> list[Any]:
    return [on_host(batch, backend) for batch in loader]


def assert_same_batches(got: list[Any], want: list[Any], assert_same_batch: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_batch(g, w)


@pytest.mark.parametrize("backend", EVERY_BACKEND)
def test_resume_continues_with_the_batches_not_delivered(batch_loader_store: Any, assert_same_batch: Any,
                                                         backend: str) -> None:
    def make() -> BatchLoader:
        return loader_on(backend, batch_loader_store.path, flavor="speculators", max_len=30, batch_size=2, seed=4)

    full = copies(make(), backend)
    loader = make()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 0, "seed": 4, "position": 6}
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(copies(resumed, backend), full[3:], assert_same_batch)


@pytest.mark.parametrize("backend", EVERY_BACKEND)
def test_two_ranks_and_epochs(batch_loader_store: Any, assert_same_batch: Any, backend: str) -> None:
    for rank in range(2):
        loader = loader_on(backend, batch_loader_store.path, flavor="speculators", max_len=30, batch_size=2, rank=rank,
                           world_size=2, seed=9)
        for epoch in range(2):
            loader.set_epoch(epoch)
            got = copies(loader, backend)
            stream = HiddenStatesStream(batch_loader_store.path, "speculators", 30,
                                        schedule=h5feed.ScheduleOptions(seed=9, rank=rank, world_size=2))
            stream.set_epoch(epoch)
            want = list(StreamLoader(stream, batch_size=2, collate_fn=trainer_collate("speculators", 30)))
            assert_same_batches(got, want, assert_same_batch)


# =========================================================================== damaged samples


@pytest.mark.parametrize("backend", EVERY_BACKEND)
@pytest.mark.parametrize(("name", "flavor", "max_len", "array"), [
    ("modelopt-hf", "modelopt", 12, "aux_hidden_states"),
    ("nemo-topk", "nemo-eagle3", None, "target_probs_values"),  # an optional array, decoded beside the batch
])
def test_skip_leaves_out_exactly_the_damaged_samples(pipeline_store: Any, tmp_path: Path, name: str, flavor: str,
                                                     max_len: int | None, array: str, backend: str) -> None:
    """on_corrupt="skip": each batch of the schedule, collated from its sound samples (read from the sound
    store); a retried batch leaves no row of the abandoned attempt behind."""
    sound, damaged = pipeline_store(name), tmp_path / "damaged"
    shutil.copytree(sound, damaged)
    for sample in (1, 6):
        path, offset, length = inner_chunk_span(damaged, sample, array, 0)
        data = bytearray(path.read_bytes())
        data[offset + length // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    stream = HiddenStatesStream(damaged, flavor, max_len, on_corrupt="skip", schedule=h5feed.ScheduleOptions(seed=1))
    loader = loader_on(backend, stream, batch_size=3)
    sequence, items = loader.dataset.rank_sequence(), HiddenStatesDataset(sound, flavor, max_len)
    want = [restated_collate(flavor, max_len)([items[i] for i in sequence[j : j + 3] if i not in (1, 6)])
            for j in range(0, len(sequence), 3)]
    assert_same([on_host(batch, backend) for batch in loader], want)
    assert loader.dataset.counters.snapshot().total("corrupt") == 2


# =========================================================================== memory and threads given back


@pytest.mark.parametrize("backend", EVERY_BACKEND)
def test_dropping_a_pass_midway_stops_its_delivery_thread_and_gives_the_memory_back(batch_loader_store: Any,
                                                                                     backend: str) -> None:
    loader = loader_on(backend, batch_loader_store.path, flavor="speculators-legacy", max_len=64)
    delivery = loader.backend.delivery_thread
    batches = iter(loader)
    next(batches)
    assert any(t.name == delivery for t in threading.enumerate())
    del batches
    assert not any(t.name == delivery for t in threading.enumerate())
    assert loader.backend.holds_memory
    loader.close()
    deadline = time.monotonic() + 10  # with CUDA the last slot goes back once its copy's event has completed
    while loader.backend.holds_memory and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loader.backend.holds_memory  # the memory went with the loader's close


# =========================================================================== a worker that dies


@pytest.mark.parametrize("backend", WITH_WORKER_PROCESSES)
def test_a_killed_worker_is_named_with_its_pid_and_sample(damaged_and_sound: Any, monkeypatch: Any,
                                                          backend: str) -> None:
    _, sound = damaged_and_sound
    assert_a_killed_worker_is_named(monkeypatch, sound, "read_rows_into", lambda stream: loader_on(
        backend, stream, multiprocessing_context="fork"))


# =========================================================================== decode="auto"


class _GpuStandIn(DecodeBackend):
    """Takes the cuda backend's place in the registry: available, and refusing what the cuda backend refuses."""

    name, delivery_thread, memory, Options = "cuda", "h5feed-gpu-decode", "staging memory", CudaOptions

    def __init__(self, stream: Any, collate: Any, batching: Any, options: CudaOptions) -> None:
        self.device, self.options = torch.device(options.device), options

    @classmethod
    def default_options(cls, num_workers: int, device: Any) -> CudaOptions:
        return CudaOptions()

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @classmethod
    def refusal(cls, store: Store) -> str | None:
        return store_refusal(store)

    def ready_batches(self, trainer: Any) -> Any:
        raise AssertionError("not iterated here")

    def close(self) -> None:
        pass

    @property
    def holds_memory(self) -> bool:
        return False


@pytest.mark.parametrize(("cores_a_gpu", "kwargs", "chosen", "workers"), [
    (16.0, {}, "workers", 4),  # cores to spare: worker processes leave the step fastest
    (3.0, {}, "workers", 3),
    (2.0, {}, "workers", 2),
    (1.5, {}, "cuda", 0),  # cores scarce: the GPU decodes
    (1.5, {"num_workers": 2}, "workers", 2),  # num_workers asks for worker processes
    (1.5, {"device": "cuda"}, "cuda", 0),  # where batches arrive does not choose the backend
    (None, {}, "threads", 0),  # no GPU: the step runs on the CPU
    (None, {"num_workers": 2}, "workers", 2),
])
def test_auto_takes_what_leaves_the_step_fastest(batch_loader_store: Any, monkeypatch: Any, cores_a_gpu: float | None,
                                                 kwargs: dict[str, Any], chosen: str, workers: int) -> None:
    monkeypatch.setitem(BACKENDS, "cuda", _GpuStandIn)
    monkeypatch.setattr("h5feed.loading.auto.cores_per_gpu", lambda: cores_a_gpu)
    with BatchLoader(batch_loader_store.path, decode="auto", flavor="speculators", max_len=30, **kwargs) as loader:
        assert (loader.backend.name, loader.num_workers) == (chosen, workers)
        assert loader.auto is not None and loader.auto.backend == chosen and loader.auto.reason


def test_cores_a_gpu_are_the_cores_over_the_ranks_on_this_node(monkeypatch: Any) -> None:
    from h5feed.loading import auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto.cores_per_gpu() == 16.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert auto.cores_per_gpu() == 2.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto.cores_per_gpu() is None


def test_auto_stays_on_the_cpu_where_the_gpu_cannot_run(batch_loader_store: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr("h5feed.loading.auto.cores_per_gpu", lambda: 1.0)
    if why_unavailable() is None:
        pytest.skip("CUDA and nvCOMP are here")
    with BatchLoader(batch_loader_store.path, decode="auto", flavor="speculators", max_len=30) as loader:
        assert (loader.backend.name, loader.num_workers) == ("workers", 1)
        assert "the GPU cannot decode here (no CUDA device" in loader.auto.reason


def test_auto_stays_on_the_cpu_for_a_store_the_gpu_cannot_decode(tmp_path: Path, monkeypatch: Any) -> None:
    from h5feed import convert
    from h5feed.testing.synthetic import write_synthetic

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 3, 32, lengths=[5, 9, 3], seed=1)
    convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False,
            settings=StoreSettings(chunk_tokens=16, codec="none"))
    assert store_refusal(Store(tmp_path / "store")) is not None
    monkeypatch.setitem(BACKENDS, "cuda", _GpuStandIn)
    monkeypatch.setattr("h5feed.loading.auto.cores_per_gpu", lambda: 1.0)
    with BatchLoader(tmp_path / "store", decode="auto", flavor="speculators", max_len=30) as loader:
        assert (loader.backend.name, loader.num_workers) == ("workers", 1)
