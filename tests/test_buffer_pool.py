"""BufferPool hands a big buffer out again only when nothing outside the pool refers to it."""

import torch

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
