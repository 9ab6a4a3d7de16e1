"""BatchLoader: batches decoded straight into recycled slots equal the trainer's collate of h5feed's items.

The reference is what a trainer runs today: a DataLoader over `HiddenStatesStream` with
`trainer_collate` (itself checked against the released collates in test_trainer_collate.py).
"""

from __future__ import annotations

import gc
import time
import warnings

import pytest
import torch
from conftest import BATCH_H, BATCH_LENGTHS

import h5feed
from h5feed import BatchLoader, StoreError, trainer_collate
from h5feed.loading.datasets import HiddenStatesStream, StreamLoader
from h5feed.loading.slots import FREE
from h5feed.store import Store

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

H, K, LENGTHS = BATCH_H, 3, BATCH_LENGTHS
N = len(LENGTHS)


@pytest.fixture(scope="module")
def specforge_store(synthetic_store):
    return synthetic_store("ba_specforge", "specforge-ckpt", N, H, LENGTHS, chunk_tokens=16, seed=8)


def store_for(flavor, batch_loader_store, specforge_store):
    return (specforge_store if flavor.startswith("specforge") else batch_loader_store).path


def reference(path, flavor, max_len, batch_size, hidden_states_dtype=None, **schedule):
    """What the trainer gets today: DataLoader(HiddenStatesStream) with the trainer's collate."""
    stream = HiddenStatesStream(path, flavor, max_len, hidden_states_dtype=hidden_states_dtype,
                                schedule=h5feed.ScheduleOptions(**schedule))
    collate = trainer_collate(flavor, max_len, hidden_states_dtype=stream.hidden_states_dtype)
    return list(StreamLoader(stream, batch_size=batch_size, collate_fn=collate))


def copies(loader):
    """Every batch of a pass, copied out of its slot (so the slot goes back at once)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]


def assert_same_batches(got, want, assert_same_batch):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_batch(g, w)


# =========================================================================== equal batches


@pytest.mark.parametrize("flavor", ["speculators-legacy", "speculators", "specforge", "specforge-shifted"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("max_len", [20, 64])
def test_threads_equal_collated_items(batch_loader_store, specforge_store, assert_same_batch, flavor, batch_size,
                                      max_len):
    path = store_for(flavor, batch_loader_store, specforge_store)
    dtype = torch.bfloat16 if flavor == "speculators-legacy" else None
    loader = BatchLoader(path, flavor=flavor, max_len=max_len, hidden_states_dtype=dtype, batch_size=batch_size,
                         schedule=h5feed.ScheduleOptions(seed=3), decode=h5feed.ThreadsOptions(threads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no batch may leave the slot ring
        got = copies(loader)
    want = reference(path, flavor, max_len, batch_size, hidden_states_dtype=dtype, seed=3)
    assert_same_batches(got, want, assert_same_batch)


def test_cast_to_float32_in_the_batch(batch_loader_store, assert_same_batch):
    """speculators 0.4's default dtype is float32: decoded bf16 rows are cast once, into their place."""
    got = copies(BatchLoader(batch_loader_store.path, flavor="speculators-legacy", max_len=40, batch_size=2))
    assert got[0]["hidden_states"].dtype == torch.float32
    assert_same_batches(got, reference(batch_loader_store.path, "speculators-legacy", 40, 2), assert_same_batch)


@pytest.mark.parametrize(("flavor", "context"), [("speculators", "fork"), ("specforge-shifted", "fork"),
                                                 ("speculators-legacy", "spawn"), ("specforge", "forkserver")])
def test_workers_equal_collated_items(batch_loader_store, specforge_store, assert_same_batch, flavor, context):
    path = store_for(flavor, batch_loader_store, specforge_store)
    loader = BatchLoader(path, flavor=flavor, max_len=40, batch_size=2, schedule=h5feed.ScheduleOptions(seed=5),
                         decode=h5feed.WorkersOptions(num_workers=2, multiprocessing_context=context))
    assert_same_batches(copies(loader), reference(path, flavor, 40, 2, seed=5), assert_same_batch)
    counted = loader.dataset.counters.snapshot()
    assert [w.samples for w in counted.workers] == [8, 6]  # 7 batches of 2: 4 to worker 0, 3 to worker 1


def test_drop_last_leaves_out_the_short_batch(specforge_store, assert_same_batch):
    want = reference(specforge_store.path, "specforge", 40, 4, seed=1)  # 14 samples: 3 batches of 4, one of 2
    for num_workers in (0, 2):
        loader = BatchLoader(specforge_store.path, flavor="specforge", max_len=40, batch_size=4, drop_last=True,
                             num_workers=num_workers, schedule=h5feed.ScheduleOptions(seed=1))
        assert len(loader) == 3
        assert_same_batches(copies(loader), want[:3], assert_same_batch)


def test_speculators_trainer_drives_it_as_its_dataloader(batch_loader_store, assert_same_batch):
    """What speculators 0.9's `Trainer.train_epoch` does with its train_loader, on CPU (it would `.to(local_rank)`)."""
    train_loader = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=64, batch_size=3,
                               schedule=h5feed.ScheduleOptions(seed=6), decode=h5feed.ThreadsOptions(threads=2))
    for epoch in range(2):
        if hasattr(train_loader.batch_sampler, "set_epoch"):
            train_loader.batch_sampler.set_epoch(epoch)
        num_steps = len(train_loader)
        stream = HiddenStatesStream(batch_loader_store.path, "speculators", 64, schedule=h5feed.ScheduleOptions(seed=6))
        stream.set_epoch(epoch)
        want = list(StreamLoader(stream, batch_size=3, collate_fn=trainer_collate("speculators", 64)))
        steps = 0
        for local_step, batch in enumerate(train_loader, 1):
            gpu_batch = {k: v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v
                         for k, v in batch.items()}
            assert_same_batch(gpu_batch, want[local_step - 1])
            steps = local_step
        assert steps == num_steps == 5


# =========================================================================== slots


def test_a_kept_batch_is_never_overwritten(batch_loader_store, assert_same_batch):
    """The trainer keeps every batch: the slots run out, later batches come in fresh memory, none is overwritten."""
    loader = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=1,
                         decode=h5feed.ThreadsOptions(threads=1, prefetch=1))
    with pytest.warns(UserWarning, match="holds more batches than the 3 slots"):
        kept = list(loader)
    assert_same_batches(kept, reference(batch_loader_store.path, "speculators", 40, 1), assert_same_batch)


def test_workers_never_overwrite_a_kept_batch(batch_loader_store, assert_same_batch):
    loader = BatchLoader(batch_loader_store.path, flavor="speculators-legacy", max_len=24,
                         hidden_states_dtype=torch.bfloat16, batch_size=1, schedule=h5feed.ScheduleOptions(seed=2),
                         decode=h5feed.WorkersOptions(num_workers=2, multiprocessing_context="fork"))
    with pytest.warns(UserWarning, match="holds more batches"):
        kept = list(loader)
    want = reference(batch_loader_store.path, "speculators-legacy", 24, 1, hidden_states_dtype=torch.bfloat16, seed=2)
    assert_same_batches(kept, want, assert_same_batch)


def test_slots_are_recycled_only_after_release(batch_loader_store, assert_same_batch):
    """One slot more than a plain loop needs (prefetch 1 + 2), for the view the trainer keeps a while."""
    loader = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=1,
                         decode=h5feed.ThreadsOptions(threads=1, prefetch=1, slots_per_worker=4))
    want = reference(batch_loader_store.path, "speculators", 40, 1)
    held = None
    addresses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for j, batch in enumerate(loader):
            addresses.append(batch["hidden_states"].data_ptr())
            assert_same_batch(batch, want[j])
            if j == 2:
                held = batch["hidden_states"][0, :5]  # a view of the slot outlives the batch dict
                held_address, held_copy = batch["hidden_states"].data_ptr(), held.clone()
            elif j > 2 and held is not None:
                assert addresses[-1] != held_address  # the slot under the view is not handed out again
            if j == 8:
                assert torch.equal(held, held_copy)
                held = None  # released: the slot may come back
    assert len(set(addresses)) <= 4  # four slots, reused: 14 batches
    del batch
    states = loader.backend.writer.ring.states
    deadline = time.monotonic() + 10  # with CUDA, a thread frees a slot once its release event has completed
    while not (states == FREE).all() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (states == FREE).all()  # every slot came back once its batch was dropped


def test_pad_rows_of_a_reused_slot_are_zero(specforge_store, assert_same_batch):
    """SpecForge batches change their padded length: a short batch in a slot that held a long one is exact."""
    loader = BatchLoader(specforge_store.path, flavor="specforge", max_len=100, batch_size=2,
                         schedule=h5feed.ScheduleOptions(shuffle=False),
                         decode=h5feed.ThreadsOptions(threads=1, prefetch=1))
    want = reference(specforge_store.path, "specforge", 100, 2, shuffle=False)
    for batch, expected in zip(loader, want, strict=True):
        assert_same_batch(batch, expected)


def test_a_pass_dropped_midway_stops_its_readers(batch_loader_store):
    import threading

    loader = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=1,
                         decode=h5feed.ThreadsOptions(threads=2))
    iterator = iter(loader)
    next(iterator)
    assert any(t.name.startswith("h5feed-batch") for t in threading.enumerate())
    del iterator  # as a `for` loop left with break: the loader does not keep its pass alive
    assert not any(t.name.startswith("h5feed-batch") for t in threading.enumerate())
    assert len(copies(loader)) == N  # and the next pass starts afresh


# =========================================================================== the store read


def test_read_rows_into_equals_read_sample(batch_loader_store):
    store = Store(batch_loader_store.path)
    for i in (0, 6, 11):
        sample = store.read_sample(i)
        t = sample.num_tokens
        for start, stop in ((0, t), (1, t), (0, t - 1), (min(3, t), min(40, t)), (t, t)):
            out = torch.empty(stop - start, K * H, dtype=torch.uint16)
            store.read_rows_into(i, "aux_hidden_states", start, stop, out)
            assert torch.equal(out, sample.aux_hidden_states[start:stop].view(torch.uint16))
            ids = torch.empty(stop - start, dtype=torch.int64)
            store.read_rows_into(i, "input_ids", start, stop, ids)
            assert torch.equal(ids, sample.input_ids[start:stop])


def test_read_rows_into_checks_the_chunks_and_the_output(batch_loader_store, tmp_path, flip_byte):
    import shutil

    shutil.copytree(batch_loader_store.path, tmp_path / "store")
    flip_byte(tmp_path / "store", 6, "last_hidden_states", chunk=0, at=10)
    store = Store(tmp_path / "store")
    with pytest.raises(StoreError, match="sample 6 .*inner chunk 0 fails its checksum"):
        store.read_rows_into(6, "last_hidden_states", 1, 100, torch.empty(99, H, dtype=torch.uint16))
    with pytest.raises(ValueError, match="contiguous torch.uint16 tensor of shape \\(5, 32\\)"):
        store.read_rows_into(6, "last_hidden_states", 0, 5, torch.empty(5, H, dtype=torch.bfloat16))
    with pytest.raises(IndexError, match="rows \\[0, 101\\) out of range for sample 6 of 100 tokens"):
        store.read_rows_into(6, "input_ids", 0, 101, torch.empty(101, dtype=torch.int64))


def test_a_damaged_store_fails_the_batch(batch_loader_store, tmp_path, flip_byte):
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(batch_loader_store.path, copy)
    shard = flip_byte(copy, 6, "aux_hidden_states", chunk=2, at=100)
    loader = BatchLoader(copy, flavor="speculators", max_len=200, schedule=h5feed.ScheduleOptions(samples=[6]),
                         decode=h5feed.ThreadsOptions(threads=1))
    with pytest.raises(StoreError, match=f"{shard}: sample 6 .*inner chunk 2 fails its checksum"):
        list(loader)


def test_monitor_reads_the_loaders_counters(batch_loader_store):
    import h5feed

    loader = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=3,
                         decode=h5feed.ThreadsOptions(threads=2))
    assert sum(1 for _ in h5feed.monitor(loader, every=60)) == len(loader) == 5
    counted = loader.dataset.counters.snapshot()
    assert counted.total("samples") == N and counted.total("bytes_read") > 0


# =========================================================================== arguments


def test_arguments_are_checked(batch_loader_store):
    with pytest.raises(ValueError, match="cannot run a per-item transform"):
        BatchLoader(HiddenStatesStream(batch_loader_store.path, "speculators", 20, transform=lambda item: item))
    stream = HiddenStatesStream(batch_loader_store.path, "speculators", 20)
    with pytest.raises(ValueError, match="max_len, schedule belong to the HiddenStatesStream"):
        BatchLoader(stream, max_len=20, schedule=h5feed.ScheduleOptions(seed=1))
    loader = BatchLoader(stream, batch_size=4)
    assert len(loader) == 4 and loader.dataset.store is stream.store


# =========================================================================== CUDA (skipped without it)


@pytest.mark.gpu(nvcomp=False)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_batches_equal_and_slots_are_page_locked(batch_loader_store, assert_same_batch, num_workers):
    want = reference(batch_loader_store.path, "speculators", 40, 2)
    on_cpu = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=2,
                         num_workers=num_workers)
    for batch, expected in zip(on_cpu, want, strict=True):
        assert batch["hidden_states"].is_pinned()
        assert_same_batch({k: v.to("cuda", non_blocking=True).cpu() if isinstance(v, torch.Tensor) else v
                           for k, v in batch.items()}, expected)
    on_gpu = BatchLoader(batch_loader_store.path, flavor="speculators", max_len=40, batch_size=2,
                         num_workers=num_workers, device="cuda")
    got = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in on_gpu]  # copies
    assert_same_batches(got, want, assert_same_batch)
    gc.collect()
