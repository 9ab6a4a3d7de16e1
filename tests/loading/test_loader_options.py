"""The loader's option objects: each group of keyword arguments is a frozen, typed object checked when it is made,
and BatchLoader builds them from the arguments it is given (the calls of the README unchanged)."""

from __future__ import annotations

import dataclasses

import pytest

from h5feed import BatchLoader, Follow, Store
from h5feed.loading.backends.cuda import CudaOptions
from h5feed.loading.backends.threads import ThreadsOptions
from h5feed.loading.backends.workers import WorkersOptions
from h5feed.loading.options import Batching, ItemOptions, ScheduleOptions, StoreOptions
import h5feed

LENGTHS = [30, 12, 50, 7, 41]


@pytest.fixture(scope="module")
def store_path(synthetic_store):
    return synthetic_store("options", "speculators-legacy-pt", len(LENGTHS), 32, LENGTHS, chunk_tokens=16).path


@pytest.mark.parametrize(("make", "message"), [
    (lambda path: StoreOptions(Store(path), cache_dir="/tmp/cache"),
     "storage_options, cache_dir and cache_limit open a store from its location; an open Store already has its own"),
    (lambda path: ItemOptions(on_corrupt="ignore"), "on_corrupt must be 'raise' or 'skip', not 'ignore'"),
    (lambda path: ItemOptions(max_len=0), "max_len must be a positive number of tokens or None"),
    (lambda path: ScheduleOptions(follow=Follow()), "follow= reads every sample of the store in the order they were "
                                                    "published: pass shuffle=False and no samples="),
    (lambda path: Batching(batch_size=0), "batch_size must be >= 1, not 0"),
    (lambda path: WorkersOptions(num_workers=-1), r"num_workers must be >= 0 \(0: reader threads in this process\)"),
    (lambda path: WorkersOptions(num_workers=1000), "num_workers=1000: an h5feed loader runs at most 64"),
    (lambda path: WorkersOptions(num_workers=2, prefetch=0), "prefetch must be >= 1, not 0"),
    (lambda path: ThreadsOptions(prefetch=0), "prefetch must be >= 1, not 0"),
    (lambda path: CudaOptions(prefetch=0), "prefetch must be >= 1, not 0"),
], ids=["store", "on_corrupt", "max_len", "follow", "batch_size", "num_workers", "too_many_workers",
        "workers_prefetch", "threads_prefetch", "cuda_prefetch"])
def test_each_option_object_names_what_is_wrong_when_it_is_made(store_path, make, message):
    with pytest.raises(ValueError, match=message):
        make(store_path)


def test_option_objects_are_frozen():
    for options in (StoreOptions("somewhere"), ItemOptions(), ScheduleOptions(), Batching(), ThreadsOptions(),
                    WorkersOptions(num_workers=1), CudaOptions()):
        field = dataclasses.fields(options)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, field, None)


def test_the_loader_builds_its_backends_options_from_its_arguments(store_path):
    with BatchLoader(store_path, max_len=64,
                     decode=h5feed.ThreadsOptions(threads=3, prefetch=5, slots_per_worker=9)) as loader:
        assert loader.backend.options == ThreadsOptions(threads=3, prefetch=5, slots_per_worker=9)
    with BatchLoader(store_path, max_len=64, decode=h5feed.WorkersOptions(num_workers=2, timeout=30)) as loader:
        assert loader.backend.options == WorkersOptions(num_workers=2, timeout=30)  # the defaults for the rest


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size must be >= 1, not 0"),
    ({"num_workers": -1}, r"num_workers must be >= 0 \(0: reader threads in this process\), not -1"),
    ({"decode": "gpu"}, "decode must be 'cpu', 'cuda', 'auto' or a backend's options, not 'gpu'"),
    ({"decode": {"threads": 2}}, r"decode= takes 'cpu', 'cuda', 'auto' or a backend's options \(WorkersOptions, "
                                 r"ThreadsOptions, CudaOptions\), not dict"),
    ({"decode": "cuda", "num_workers": 2}, "num_workers belongs to decode='cpu'; decode='cuda' reads with threads"),
    ({"decode": ThreadsOptions(threads=2), "device": "cuda"},
     r"device given beside decode=ThreadsOptions\(...\): set it there"),
    ({"decode": WorkersOptions(num_workers=2), "num_workers": 2, "device": "cpu"},
     r"num_workers and device given beside decode=WorkersOptions\(...\): set them there"),
], ids=["batch_size", "num_workers", "decode_word", "decode_type", "cuda_workers", "device_twice", "both_twice"])
def test_the_loader_checks_its_arguments(store_path, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BatchLoader(store_path, max_len=64, **kwargs)


def test_a_backends_options_name_it_and_hold_its_settings(store_path):
    with BatchLoader(store_path, max_len=64, decode=WorkersOptions(num_workers=1, prefetch=3)) as loader:
        assert loader.backend.name == "workers" and loader.num_workers == 1 and loader.backend.options.prefetch == 3
    with BatchLoader(store_path, max_len=64, decode=ThreadsOptions(threads=3)) as loader:
        assert loader.backend.name == "threads" and loader.backend.threads == 3
    with BatchLoader(store_path, max_len=64, num_workers=2) as loader:  # the words: the backend's defaults
        assert loader.backend.options == WorkersOptions(num_workers=2)
