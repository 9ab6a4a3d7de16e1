"""A store handed over by someone else: its attributes, index and shard files may say anything.

Each tamper below is refused with its own message, before anything is sized from the tampered figure:
opening and reading stay under `MAX_RSS_GROWTH` of memory (sampled while they run) and `MAX_SECONDS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import zarr
from s3_server import S3, bucket_fixture, s3_fixture  # noqa: F401 (fixtures s3, bucket)

import h5feed
from h5feed import BatchLoader, HiddenStatesDataset, StoreSettings, convert
from h5feed.errors import CorruptSampleError, StoreError
from h5feed.io import open_url
from h5feed.store import Store
from h5feed.store.layout import CRC_BYTES, INDEX_COLUMNS, IndexDigest, crc32c, shard_index_nbytes
from h5feed.store.sources import DamagedObject, LocalSource
from h5feed.testing.synthetic import write_synthetic

H = 32  # three aux layers: aux rows are 96 wide
CHUNK = 16
LENGTHS = [20, 35, 40, 8, 33, 17]  # shards of 48 rows (the longest sample, whole chunks): 288 rows in all
SHARD = 48
AUX_CHUNK_NBYTES = CHUNK * 3 * H * 2 + 16 + CRC_BYTES  # rows, Blosc's header, crc32c
MAX_RSS_GROWTH = 200 << 20
MAX_SECONDS = 10.0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    write_synthetic(root / "src", "speculators-legacy-pt", len(LENGTHS), H, lengths=LENGTHS, seed=2)
    convert(root / "src", root / "store", workers=0, progress=False, settings=StoreSettings(chunk_tokens=CHUNK))
    return root / "store"


@pytest.fixture
def dst(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the store, to tamper with."""
    return Path(shutil.copytree(pristine, tmp_path / "store"))


def hint(dst: Path) -> str:
    return f"the store is damaged or was edited: run `h5feed verify {dst}`, or convert it again"


# --- tampering ---------------------------------------------------------------------------------------------


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def edit_attributes(dst: Path, **changes: Any) -> None:
    edit_json(dst / "zarr.json", lambda meta: meta["attributes"]["h5feed"].update(changes))


def set_rows(dst: Path, array: str, rows: int) -> None:
    """An array's zarr.json claiming `rows` rows (what an editor changes along with the attributes)."""
    edit_json(dst / array / "zarr.json", lambda meta: meta["shape"].__setitem__(0, rows))


def rewrite_column(dst: Path, column: str, change: Callable[[np.ndarray], None], *, record_digest: bool) -> None:
    """Rewrite an index column through zarr (its chunk checksums recomputed); with `record_digest` the index's
    digest too, as an editor who knows h5feed would: then only the data can tell."""
    index = zarr.open_group(dst, mode="r+")["index"]
    values = index[column][...]
    change(values)
    index[column][...] = values
    if record_digest:
        index.update_attributes(IndexDigest.of({name: index[name][...] for name in INDEX_COLUMNS}).to_attributes())


def shard_of(dst: Path, sample: int, array: str = "aux_hidden_states") -> Path:
    return shard_of_row(dst, int(Store(dst).sample_starts[sample]), array)


def shard_of_row(dst: Path, row: int, array: str = "aux_hidden_states") -> Path:
    return dst / array / "c" / str(row // SHARD) / "0"


def rewrite_shard_index(shard: Path, entries: dict[int, tuple[int, int]]) -> None:
    """Set inner chunks' (offset, length) in a shard's index, its crc32c recomputed: the index looks sound."""
    data = bytearray(shard.read_bytes())
    n = shard_index_nbytes(SHARD // CHUNK)
    index = np.frombuffer(bytes(data[-n:-CRC_BYTES]), dtype="<u8").reshape(-1, 2).copy()
    for k, entry in entries.items():
        index[k] = entry
    body = index.tobytes()
    data[-n:] = body + crc32c(body).to_bytes(CRC_BYTES, "little")
    shard.write_bytes(bytes(data))


# --- bounded memory and time -------------------------------------------------------------------------------


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Fail if this process's RSS grows by more than MAX_RSS_GROWTH at any moment (sampled every 2 ms)
    or the block takes more than MAX_SECONDS."""
    process = psutil.Process()
    start_rss, peak, done = process.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss - start_rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - t0
        done.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss - start_rss)
    assert peak[0] < MAX_RSS_GROWTH, f"RSS grew by {peak[0] >> 20} MB"
    assert seconds < MAX_SECONDS, f"took {seconds:.1f} s"


def refused_at_open(dst: Path) -> str:
    """The message Store, HiddenStatesDataset and BatchLoader all refuse `dst` with, each within the bounds."""
    messages = []
    for open_store in (Store, HiddenStatesDataset, lambda path: BatchLoader(path, flavor="speculators-legacy")):
        with bounded(), pytest.raises(StoreError) as err:
            open_store(dst)
        messages.append(str(err.value))
    assert messages[1:] == messages[:-1]
    return messages[0]


def refused_on_read(dst: Path, sample: int) -> str:
    """The message reading `sample` fails with, through Store and HiddenStatesDataset, each within the bounds."""
    messages = []
    for read in (lambda: Store(dst).read_sample(sample), lambda: HiddenStatesDataset(dst)[sample]):
        with bounded(), pytest.raises(CorruptSampleError) as err:
            read()
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    return messages[0]


# --- attributes and metadata --------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, problem", [
    ({"chunk_tokens": 0}, "store attributes are damaged: chunk_tokens is 0, not a positive whole number"),
    ({"hidden_size": -32}, "store attributes are damaged: hidden_size is -32, not a positive whole number"),
    ({"shard_tokens": 40}, "store attributes are damaged: shard_tokens 40 is not a multiple of chunk_tokens 16"),
    ({"num_samples": "6"}, "store attributes are damaged: num_samples is '6', not a whole number of at least 0"),
    ({"dtype": "int32"}, ("store attributes are damaged: the dtype of aux_hidden_states is not one h5feed stores "
                          "(h5feed stores bfloat16, float16 or float32 hidden states, not torch.int32)")),
], ids=["chunk-tokens-0", "negative-hidden-size", "shard-not-whole-chunks", "count-not-a-number", "integer-dtype"])
def test_impossible_attributes_are_refused_at_open(dst, changes, problem):
    edit_attributes(dst, **changes)
    assert refused_at_open(dst) == f"{dst}: {problem}; {hint(dst)}"


SIZES = "hidden_size {h}, num_aux_layers 3, chunk_tokens {c}, shard_tokens {s}"


@pytest.mark.parametrize("changes, array, problem", [
    ({"hidden_size": 2**17}, "aux_hidden_states", "row width 393216, but aux_hidden_states/zarr.json says 96"),
    ({"num_aux_layers": 1, "hidden_size": 96}, "last_hidden_states",
     "row width 96, but last_hidden_states/zarr.json says 32"),
    ({"shard_tokens": 96}, "aux_hidden_states", "shard shape 96 x 96, but aux_hidden_states/zarr.json says 48 x 96"),
    ({"chunk_tokens": 8}, "aux_hidden_states", "chunk shape 8 x 96, but aux_hidden_states/zarr.json says 16 x 96"),
    ({"dtype": "float32"}, "aux_hidden_states", "dtype uint32, but aux_hidden_states/zarr.json says uint16"),
], ids=["hidden-size-2^17", "hidden-size-for-last", "shard-tokens", "chunk-tokens", "dtype"])
def test_attributes_that_disagree_with_the_arrays_are_refused_at_open(dst, changes, array, problem):
    edit_attributes(dst, **changes)
    sizes = SIZES.format(h=changes.get("hidden_size", H), c=changes.get("chunk_tokens", CHUNK),
                         s=changes.get("shard_tokens", SHARD))
    if "num_aux_layers" in changes:
        sizes = sizes.replace("num_aux_layers 3", "num_aux_layers 1")
    assert refused_at_open(dst) == f"{dst}: the store's attributes ({sizes}) give {array} {problem}; {hint(dst)}"


def test_arrays_of_different_rows_are_bounded_by_the_smallest(dst):
    """A writer grows the arrays one after another, so a reader may open a store whose arrays differ in rows:
    the smallest bounds the samples, whatever another claims."""
    before = [Store(dst).read_sample(i).aux_hidden_states for i in range(len(Store(dst)))]
    with bounded():
        set_rows(dst, "input_ids", 2**21)  # claims more: allocates nothing, changes nothing
        store = Store(dst)
    assert store.total_rows == 288 and all(torch.equal(store.read_sample(i).aux_hidden_states, b)
                                           for i, b in enumerate(before))
    set_rows(dst, "loss_mask", 64)  # holds fewer than the samples need: refused
    problem = refused_at_open(dst)
    assert problem.startswith(f"{dst}: the sample index is damaged: sample ") and "ends past the arrays' 64 rows" in problem


def test_hidden_size_2_17_with_metadata_to_match_is_refused_at_open(dst):
    """Attributes and metadata agree on 2^17, the shards hold rows of 96: the longest sample's first chunk tells."""
    edit_attributes(dst, hidden_size=2**17)
    for array, width in (("aux_hidden_states", 3 * 2**17), ("last_hidden_states", 2**17)):
        edit_json(dst / array / "zarr.json", lambda meta, w=width: _set_width(meta, w))
    sizes = SIZES.format(h=2**17, c=CHUNK, s=SHARD)
    assert refused_at_open(dst) == (f"{dst}: the store's attributes ({sizes}) give aux_hidden_states chunks of "
                                    f"{CHUNK * 3 * 2**17 * 2} bytes, but the first chunk in {shard_of_row(dst, 96)} "
                                    f"holds {CHUNK * 3 * H * 2}; {hint(dst)}")


def _set_width(meta: dict[str, Any], width: int) -> None:
    meta["shape"][1] = width
    sharding = meta["codecs"][0]["configuration"]
    meta["chunk_grid"]["configuration"]["chunk_shape"][1] = width
    sharding["chunk_shape"][1] = width


# --- the index ------------------------------------------------------------------------------------------------


def test_a_claimed_2_26_samples_is_refused_at_once(dst):
    edit_attributes(dst, num_samples=2**26)
    assert refused_at_open(dst) == (f"{dst}: the store's attributes say 67108864 samples, but index/sample_length "
                                    f"holds 6; {hint(dst)}")


def test_a_claimed_2_26_samples_with_index_metadata_to_match_is_refused_at_once(dst):
    """The columns' zarr.json say 2^26 rows too: their stored chunks hold one chunk's rows (zarr would read
    the rest as zeros, 4.5 GB of them)."""
    edit_attributes(dst, num_samples=2**26)
    for column in INDEX_COLUMNS:
        set_rows(dst / "index", column, 2**26)
    assert refused_at_open(dst) == (f"{dst}: the store's attributes say 67108864 samples, but index/sample_length "
                                    f"holds 16384; {hint(dst)}")


def test_a_checksum_column_of_the_wrong_width_is_refused_at_open(dst):
    index = zarr.open_group(dst, mode="r+")["index"]
    values = index["checksum"][...]
    del index["checksum"]
    index.create_array("checksum", data=values[:, :3], chunks=(16384, 3))
    assert refused_at_open(dst) == (f"{dst}: index/checksum has 3 columns, not one for each of the 4 arrays; "
                                    f"{hint(dst)}")


def test_a_sample_length_of_2_21_is_refused_at_open(dst):
    rewrite_column(dst, "sample_length", lambda v: v.__setitem__(5, 2**21), record_digest=True)
    assert refused_at_open(dst) == (f"{dst}: the sample index is damaged: sample 5 (start 240, 2097152 tokens) ends "
                                    "past the arrays' 288 rows; run the `h5feed convert` command that made the store "
                                    "again to rebuild the index")


def test_a_sample_length_of_2_21_with_arrays_to_match_is_refused_before_its_buffers_are_sized(dst):
    """The arrays' zarr.json claim the rows too: the shard that would hold the sample's last row does not exist,
    which a read checks before it allocates for the sample's length."""
    rewrite_column(dst, "sample_length", lambda v: v.__setitem__(5, 2**21), record_digest=True)
    for array in ("aux_hidden_states", "last_hidden_states", "input_ids", "loss_mask"):
        set_rows(dst, array, 240 + -(-(2**21) // SHARD) * SHARD)  # whole shards
    last = shard_of_row(dst, 240 + 2**21 - 1)
    problem = (f"{last}: sample 5 (converted from data_5.pt): the index gives it 2097152 tokens, but the file that "
               f"would hold its last row does not exist; the store is damaged: run `h5feed verify {dst}`")
    assert refused_on_read(dst, 5) == problem
    with bounded(), pytest.raises(CorruptSampleError) as err:
        Store(dst).max_sample_tokens  # noqa: B018 (what a loader sizes from is checked when asked)
    assert str(err.value) == problem


def test_the_checked_longest_sample_is_exposed_for_loaders(dst):
    store = Store(dst)
    assert store.max_sample_tokens == max(LENGTHS) and store.hidden_size == H


@pytest.mark.parametrize("column, change", [
    ("sample_length", lambda v: v.__setitem__(1, v[1] + 1)),
    ("sample_length", lambda v: v.__setitem__(1, v[1] - 1)),
    ("sample_length", lambda v: v.__setitem__(1, SHARD)),  # to the shard's end: the last chunk's padding
    ("sample_start", lambda v: v.__setitem__(1, v[1] + SHARD)),
    ("source_path", lambda v: v.__setitem__(1, "data_4.pt")),
    ("source_index", lambda v: v.__setitem__(1, 7)),
    ("has_loss_mask", lambda v: v.__setitem__(1, not v[1])),
], ids=["length+1", "length-1", "length-to-shard-end", "start-shifted", "source-path", "source-index", "loss-mask"])
def test_a_rewritten_index_row_is_refused_at_open(dst, column, change):
    rewrite_column(dst, column, change, record_digest=False)
    message = refused_at_open(dst)
    if column == "sample_start":  # the rows' order tells first
        assert message == (f"{dst}: the sample index is damaged: sample 2 (start 96, 40 tokens) overlaps sample "
                           "1; run the `h5feed convert` command that made the store again to rebuild the index")
        return
    assert re.fullmatch(re.escape(f"{dst}: the sample index fails the checksum recorded at conversion (crc32c ")
                        + r"0x[0-9a-f]{8}, recorded 0x[0-9a-f]{8}\): its rows were changed; " + re.escape(hint(dst)),
                        message), message


@pytest.mark.parametrize("length", [36, 34, 32, SHARD], ids=["+1", "-1", "a-chunk-less", "to-shard-end"])
def test_a_rewritten_length_with_its_digest_is_refused_on_read(dst, length):
    """The editor re-records the index's digest: the per-sample checksum, over exactly `sample_length` rows of
    the token arrays, still tells (sample 1 has 35 tokens; its shard ends at 48)."""
    rewrite_column(dst, "sample_length", lambda v: v.__setitem__(1, length), record_digest=True)
    message = refused_on_read(dst, 1)
    assert re.fullmatch(re.escape(f"{dst / 'index'}: sample 1 (converted from data_1.pt): its input_ids of the "
                                  f"{length} tokens the index gives it fail the checksum recorded at conversion (crc32c ")
                        + r"0x[0-9a-f]{8}, recorded 0x[0-9a-f]{8}\)"
                        + re.escape(f": the index does not describe the stored data; the store is damaged: run "
                                    f"`h5feed verify {dst}`"), message), message
    store = Store(dst)
    with pytest.raises(CorruptSampleError, match="its input_ids of the .* tokens the index gives it fail"):
        store.read_rows_into(1, "input_ids", 0, length, torch.empty(length, dtype=torch.int64))
    assert torch.equal(store.read_sample(0).input_ids, Store(dst).read_sample(0).input_ids)  # the others read


def test_a_store_converted_before_index_digests_still_opens_and_reads(dst, pristine):
    edit_json(dst / "index" / "zarr.json", lambda meta: meta["attributes"].clear())
    store, sound = Store(dst), Store(pristine)
    assert len(store) == len(LENGTHS)
    for i in range(len(LENGTHS)):
        assert torch.equal(store.read_sample(i).aux_hidden_states.view(torch.int16),
                           sound.read_sample(i).aux_hidden_states.view(torch.int16))


# --- shard files ----------------------------------------------------------------------------------------------


def test_a_sparse_8_gb_shard_is_refused_before_it_is_read(dst):
    shard = shard_of(dst, 2)
    os.truncate(shard, 8 << 30)  # sparse: costs no disk, would cost 8 GB of memory read whole
    max_nbytes = (SHARD // CHUNK) * AUX_CHUNK_NBYTES + shard_index_nbytes(SHARD // CHUNK)
    assert refused_on_read(dst, 2) == (f"{shard}: sample 2 (converted from data_2.pt): is 8589934592 bytes, more than "
                                       f"an object of its array can take ({max_nbytes}), and again when read afresh; "
                                       f"the store is damaged: run `h5feed verify {dst}`")


def test_a_shard_index_offset_near_2_64_is_refused(dst):
    """offset + length wraps in uint64 to a small number: the bounds check must not add them."""
    shard = shard_of(dst, 2)
    rewrite_shard_index(shard, {0: (2**64 - 8, 16)})
    assert refused_on_read(dst, 2) == (f"{shard}: sample 2 (converted from data_2.pt): shard index points outside "
                                       f"the shard, and again when read afresh; the store is damaged: run `h5feed verify {dst}`")


def test_a_shard_index_chunk_longer_than_a_chunk_can_be_is_refused(dst):
    shard = shard_of(dst, 2)
    body = shard.stat().st_size - shard_index_nbytes(SHARD // CHUNK)
    rewrite_shard_index(shard, {0: (0, body)})  # inside the shard, but three chunks long
    assert refused_on_read(dst, 2) == (f"{shard}: sample 2 (converted from data_2.pt): shard index gives inner chunk "
                                       f"0 {body} bytes, more than a chunk of this array can take ({AUX_CHUNK_NBYTES}), "
                                       f"and again when read afresh; the store is damaged: run `h5feed verify {dst}`")


# --- a bucket ---------------------------------------------------------------------------------------------------


def upload(store: Path, s3: S3, bucket: str) -> str:
    url = f"s3://{bucket}/hs.zarr"
    objects = open_url(url, s3.storage_options)
    for path in sorted(store.rglob("*")):
        if path.is_file():
            objects.put_atomic(path.relative_to(store).as_posix(), path.read_bytes())
    return url


def test_a_hostile_store_in_a_bucket_is_refused_before_any_sample_is_fetched(dst, s3, bucket):
    edit_attributes(dst, num_samples=2**26)
    for column in INDEX_COLUMNS:
        set_rows(dst / "index", column, 2**26)
    url = upload(dst, s3, bucket)
    s3.proxy.reset()
    for open_store in (Store, lambda url, **options: HiddenStatesDataset(h5feed.StoreOptions(url, **options))):
        with bounded(), pytest.raises(StoreError) as err:
            open_store(url, storage_options=s3.storage_options)
        assert str(err.value) == (f"{url}: the store's attributes say 67108864 samples, but index/sample_length "
                                  f"holds 16384; the store is damaged or was edited: run `h5feed verify {url}`, or "
                                  "convert it again")
    assert [r for r in s3.proxy.requests() if "/c/" in r.path and "/index/" not in r.path] == []


def test_a_rewritten_length_in_a_bucket_is_refused_on_read(dst, s3, bucket):
    rewrite_column(dst, "sample_length", lambda v: v.__setitem__(1, 34), record_digest=True)
    url = upload(dst, s3, bucket)
    with bounded(), pytest.raises(CorruptSampleError, match=re.escape(
            f"{url}/index: sample 1 (converted from data_1.pt): its input_ids of the 34 tokens the index gives it "
            "fail the checksum recorded at conversion")):
        HiddenStatesDataset(h5feed.StoreOptions(url, storage_options=s3.storage_options))[1]


@pytest.mark.parametrize("cache", [False, True])
def test_an_oversized_shard_in_a_bucket_is_refused_before_it_is_fetched(dst, s3, bucket, tmp_path, cache):
    """The listing's size is the bucket's claim: an object larger than its array's objects can be is refused
    before a byte of it is asked for (through the node cache too), not fetched whole into memory."""
    shard = shard_of(dst, 2)
    key = shard.relative_to(dst).as_posix()
    url = upload(dst, s3, bucket)
    open_url(url, s3.storage_options).put_atomic(key, bytes(2 << 20))
    max_nbytes = (SHARD // CHUNK) * AUX_CHUNK_NBYTES + shard_index_nbytes(SHARD // CHUNK)
    s3.proxy.reset()
    options = {"cache_dir": tmp_path / "cache"} if cache else {}
    with bounded(), pytest.raises(CorruptSampleError) as err:
        HiddenStatesDataset(h5feed.StoreOptions(url, storage_options=s3.storage_options, **options))[2]
    if cache:  # the cache downloads to its disk (bounded by cache_limit) and checks the download: it is not sound
        assert str(err.value).startswith(f"{url}/{key}: sample 2 (converted from data_2.pt): shard index fails its")
    else:
        assert str(err.value).startswith(f"{url}/{key}: sample 2 (converted from data_2.pt): is 2097152 bytes, more "
                                         f"than an object of its array can take ({max_nbytes})")
        assert [r for r in s3.proxy.requests("GET") if key in r.path] == []


def test_a_damaged_object_carries_its_file_as_a_field_through_a_pickle(tmp_path):
    """What the sources raise for an object's bytes: its file (or URL) in `where`, the problem as its message, which
    the reader turns into the CorruptSampleError naming the sample and that file."""
    key = "aux_hidden_states/c/0/0"
    with pytest.raises(DamagedObject) as err, LocalSource(tmp_path).open(key, range(1), whole=True):
        pass
    assert err.value.where == tmp_path / key and err.value.problem == str(err.value) == "is missing"
    copy = pickle.loads(pickle.dumps(err.value))
    assert (type(copy), copy.where, copy.problem) == (DamagedObject, tmp_path / key, "is missing")
