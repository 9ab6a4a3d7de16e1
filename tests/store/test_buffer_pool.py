"""BufferPool hands a big buffer out again only when nothing outside the pool refers to it."""

import torch

import h5feed
from h5feed import StoreSettings
from h5feed.store import BufferPool

MB = 1 << 20


def test_released_buffer_is_reused_held_buffer_is_not():
    pool = BufferPool(capacity=4)
    a = pool((2 * MB,), torch.uint8)
    a_ptr = a.data_ptr()
    b = pool((2 * MB,), torch.uint8)
    assert b.data_ptr() != a_ptr  # a is still held
    view = a[10:20]
    del a
    c = pool((2 * MB,), torch.uint8)
    assert c.data_ptr() != a_ptr  # a view of a still holds its storage
    del view
    d = pool((MB, 2), torch.bfloat16)
    assert d.data_ptr() == a_ptr and d.shape == (MB, 2) and d.dtype == torch.bfloat16


def test_sizes_round_up_so_shorter_samples_fit_and_small_buffers_bypass_the_pool():
    pool = BufferPool(capacity=2)
    big = pool((3 * MB,), torch.uint8)
    ptr = big.data_ptr()
    del big
    shorter = pool((MB + 5,), torch.uint8)  # fits in the 16 MiB-rounded storage
    assert shorter.data_ptr() == ptr
    small = pool((1000,), torch.uint8)
    assert small.untyped_storage().nbytes() == 1000


def test_capacity_bounds_the_pooled_buffers():
    pool = BufferPool(capacity=2)
    held = [pool((2 * MB,), torch.uint8) for _ in range(3)]
    assert len(pool._storages) == 2
    ptrs = {t.data_ptr() for t in held}
    del held
    again = [pool((2 * MB,), torch.uint8) for _ in range(2)]
    assert {t.data_ptr() for t in again} <= ptrs


def test_items_through_dataloader_workers_stay_intact_with_big_buffers(tmp_path):
    """Buffers above the pool's threshold, handed from workers to the trainer: a buffer reused while the
    trainer still reads it (the queue moved it into shared memory) would corrupt later items."""
    from torch.utils.data import DataLoader

    from h5feed import HiddenStatesDataset, HiddenStatesStream, Store, convert
    from h5feed.testing.synthetic import write_synthetic

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 8, 1024, lengths=(300, 400), seed=3)
    convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False, settings=StoreSettings(chunk_tokens=128))
    store = Store(tmp_path / "store")
    expected = [store.read_sample(i).aux_hidden_states[:-1].clone() for i in range(len(store))]
    assert expected[0].nbytes > BufferPool.MIN_BYTES
    dataset = HiddenStatesDataset(store, hidden_states_dtype=torch.bfloat16)
    items = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert all(torch.equal(item["hidden_states"], want) for item, want in zip(items, expected))
    stream = HiddenStatesStream(store, hidden_states_dtype=torch.bfloat16,
                                schedule=h5feed.ScheduleOptions(shuffle=False),
                                reading=h5feed.ReadOptions(threads=2, prefetch=3))
    items = list(stream)  # in-process: the pool does reuse here, once items are released
    assert all(torch.equal(item["hidden_states"], want) for item, want in zip(items, expected))


def _with_sharing_flag(item):
    """A collate_fn (in the worker) that hands the item on as it is, noting whether it was decoded into shared memory."""
    return item, item["hidden_states"].is_shared()


def test_worker_learns_that_items_leave_uncollated_and_decodes_into_shared_memory(tmp_path):
    from torch.utils.data import DataLoader

    from h5feed import HiddenStatesDataset, Store, convert
    from h5feed.testing.synthetic import write_synthetic

    write_synthetic(tmp_path / "src", "speculators-legacy-pt", 10, 1024, lengths=(300, 400), seed=5)
    convert(tmp_path / "src", tmp_path / "store", workers=0, progress=False, settings=StoreSettings(chunk_tokens=128))
    store = Store(tmp_path / "store")
    expected = [store.read_sample(i).aux_hidden_states[:-1].clone() for i in range(len(store))]
    dataset = HiddenStatesDataset(store, hidden_states_dtype=torch.bfloat16)
    got = list(DataLoader(dataset, batch_size=None, num_workers=1, collate_fn=_with_sharing_flag))
    flags = [shared for _, shared in got]
    assert flags[0] is False and flags[-1] is True, flags  # pooled plain memory first, shared once a send is seen
    assert all(torch.equal(item["hidden_states"], want) for (item, _), want in zip(got, expected))
