"""The on-disk layout of an h5feed store, and the fast reader of one sample.

A store is one Zarr v3 group (see README "Store layout"):

    aux_hidden_states   [rows, K*H]  storage dtype (bf16 bits as uint16)
    last_hidden_states  [rows, H]
    input_ids           [rows]       int64
    loss_mask           [rows]       int64
    index/sample_start  [N] int64    first row of each sample (a multiple of chunk_tokens)
    index/sample_length [N] int64    tokens of each sample
    index/source_path   [N] str      path of the source file, relative to the source root
    index/source_index  [N] int64    the i of data_{i}.pt
    index/checksum      [N, 4] uint32  crc32c of aux, last, input_ids, loss_mask bytes
    index/has_loss_mask [N] bool     False where the source had no loss mask (stored as ones)

Every sample starts on a chunk boundary, so conversion workers never share a
chunk and a reader never decodes a neighbour's rows.  The reader below finds the
chunk files itself and decodes them with numcodecs straight into a
preallocated buffer: zarr-python is used to write and to describe the store,
and stays off the hot path of reading.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from numcodecs import blosc

from h5feed.errors import StoreError

STORE_FORMAT_VERSION = 1
ATTRS_KEY = "h5feed"
HIDDEN_ARRAYS = ("aux_hidden_states", "last_hidden_states")
TOKEN_ARRAYS = ("input_ids", "loss_mask")
CHECKSUMMED = HIDDEN_ARRAYS + TOKEN_ARRAYS

LastStateNorm = Literal["pre", "post"]

# Read a compressed chunk's pages in one go (Linux), rather than one page fault at a time.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

# Bits of a float dtype stored as an unsigned integer of the same width:
# zarr-python 3 has no bfloat16, and uint keeps every bit pattern exact.
_STORAGE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.uint16,
    torch.float16: torch.uint16,
    torch.float32: torch.uint32,
}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The unsigned integer dtype that carries `dtype`'s bits on disk."""
    try:
        return _STORAGE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"h5feed stores bfloat16, float16 or float32 hidden states, not {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class StoreInfo:
    """The self-description kept in the group's attributes."""

    source_format: str
    hidden_size: int
    num_aux_layers: int
    dtype: str  # logical torch dtype name, e.g. "bfloat16"
    last_state_norm: LastStateNorm
    codec: dict[str, Any]
    chunk_tokens: int
    status: Literal["converting", "complete"] = "converting"
    source_root: str = ""
    num_samples: int = 0
    num_tokens: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    format_version: int = STORE_FORMAT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, attrs: dict[str, Any]) -> StoreInfo:
        return cls(**attrs)


@dataclass
class RawSample:
    """One sample's tensors as stored: hidden states in their logical dtype, views of one buffer each."""

    input_ids: torch.Tensor  # int64 [t]
    loss_mask: torch.Tensor  # int64 [t]
    aux_hidden_states: torch.Tensor  # [t, K*H]
    last_hidden_state: torch.Tensor  # [t, H]
    num_tokens: int  # tokens of the whole sample (t may be fewer when truncated)
    has_loss_mask: bool


@dataclass
class ReadStats:
    """What reads cost: bytes from storage, bytes delivered, seconds in I/O and in decoding.

    `Store.read_sample` reports through the three `add_*` methods, which
    `metrics.WorkerCounters` implements too (in shared memory, thread-safe).
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


Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def plain_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Ordinary memory (huge pages where the kernel gives them): the cheapest to fill, and right
    whenever the tensor stays in this process or a collate copies it anyway (speculators', SpecForge's)."""
    return torch.empty(shape, dtype=dtype)


def shared_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Shared memory inside a DataLoader worker, so that an item handed on uncollated passes a file
    descriptor instead of being copied (what default_collate does too); plain memory elsewhere.
    Filling fresh shared memory costs about twice plain memory (no huge pages)."""
    if torch.utils.data.get_worker_info() is None:
        return plain_allocator(shape, dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # references to a storage, as torch.utils.weak counts them


class BufferPool:
    """An allocator that hands out big buffers again once nothing outside the pool refers to them.

    A fresh 100 MB buffer costs ~30 ms of page faults (the kernel zeroes every page, 4 KB at a
    time), a third of what decoding it costs; a reused one costs nothing.  A buffer that was sent
    to another process has been moved into shared memory in place, and leaves the pool.
    """

    MIN_BYTES = 1 << 20  # smaller buffers are cheap to make
    ROUND_BYTES = 16 << 20  # sizes are rounded up so that samples of different lengths share buffers

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.saw_sends = False  # a buffer was moved into shared memory: items leave this process as they are
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or _use_count is None:
            return plain_allocator(shape, dtype)
        with self._lock:  # find and claim (set_ adds a reference) in one step
            storage = self._claim(nbytes)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _claim(self, nbytes: int) -> torch.UntypedStorage:
        # Sending a tensor to another process (a DataLoader worker's result queue) moves its storage
        # into shared memory in place: from then on the other process reads it, so never reuse it.
        kept = [s for s in self._storages if not s.is_shared()]
        self.saw_sends = self.saw_sends or len(kept) < len(self._storages)
        self._storages = kept
        free = [s for s in self._storages if _use_count(s._cdata) == 1]
        fitting = [s for s in free if s.nbytes() >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.nbytes())
        storage = torch.UntypedStorage(-(-nbytes // self.ROUND_BYTES) * self.ROUND_BYTES)
        if len(self._storages) >= self.capacity and free:  # make room: drop a free one that is too small
            self._storages.remove(min(free, key=lambda s: s.nbytes()))
        if len(self._storages) < self.capacity:
            self._storages.append(storage)
        return storage


def chunk_codec(codec: str) -> dict[str, Any]:
    """The zarr v3 compressor configuration for a `--codec` name."""
    if codec == "zstd":
        return {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20}
    if codec == "lz4":
        return {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "blocksize": 1 << 20}
    if codec == "none":
        return {"name": "none"}
    raise ValueError(f"unknown codec {codec!r}: choose zstd, lz4 or none")


class Store:
    """A finished h5feed store, opened for reading.

    Cheap to pickle (only the path travels), so DataLoader workers under fork,
    spawn or forkserver each open their own file handles lazily.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.info = read_info(self.path)
        if self.info.status != "complete":
            raise StoreError(
                self.path,
                "conversion has not finished (status "
                f"{self.info.status!r}); run the same `h5feed convert` command again to resume it",
            )
        self._load_index()
        self._chunk_nbytes = {
            name: self.info.chunk_tokens * width * _itemsize(name, self.info) for name, width in self._widths().items()
        }
        self._compressed = self.info.codec.get("name") != "none"

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def _widths(self) -> dict[str, int]:
        h, k = self.info.hidden_size, self.info.num_aux_layers
        return {"aux_hidden_states": k * h, "last_hidden_states": h, "input_ids": 1, "loss_mask": 1}

    def _load_index(self) -> None:
        import zarr

        try:
            group = zarr.open_group(self.path, mode="r")
            index = group["index"]
            self.sample_starts = np.asarray(index["sample_start"][:], dtype=np.int64)
            self.sample_lengths = np.asarray(index["sample_length"][:], dtype=np.int64)
            self.source_paths: list[str] = [str(p) for p in index["source_path"][:]]
            self.source_indices = np.asarray(index["source_index"][:], dtype=np.int64)
            self.checksums = np.asarray(index["checksum"][:], dtype=np.uint32)
            self.has_loss_mask = np.asarray(index["has_loss_mask"][:], dtype=bool)
        except (KeyError, FileNotFoundError) as exc:
            raise StoreError(self.path, f"the sample index is missing or damaged ({exc})") from exc

    def __len__(self) -> int:
        return len(self.sample_lengths)

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def num_aux_layers(self) -> int:
        return self.info.num_aux_layers

    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's tensors (aux, last, input_id, loss-mask value), uncompressed."""
        return sum(w * _itemsize(name, self.info) for name, w in self._widths().items())

    def _tokens_to_read(self, i: int, max_tokens: int | None) -> int:
        n = int(self.sample_lengths[i])
        return n if max_tokens is None else min(n, max_tokens)

    def read_sample(
        self,
        i: int,
        max_tokens: int | None = None,
        *,
        allocate: Allocator = plain_allocator,
        stats: ReadStats | None = None,
        read_ahead: bool = True,
    ) -> RawSample:
        """Read the first `max_tokens` tokens (all when None) of sample i, touching only their chunks.

        `read_ahead=False` when the caller already asked for them (`will_need`), as the stream does.
        """
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        stats = stats if stats is not None else ReadStats()
        t = self._tokens_to_read(i, max_tokens)
        start = int(self.sample_starts[i])
        if read_ahead:
            self.will_need(i, max_tokens)
        arrays = {name: self._read_rows(name, start, t, allocate, stats) for name in CHECKSUMMED}
        dtype = self.info.torch_dtype
        return RawSample(
            input_ids=arrays["input_ids"],
            loss_mask=arrays["loss_mask"],
            aux_hidden_states=arrays["aux_hidden_states"].view(dtype),
            last_hidden_state=arrays["last_hidden_states"].view(dtype),
            num_tokens=int(self.sample_lengths[i]),
            has_loss_mask=bool(self.has_loss_mask[i]),
        )

    def will_need(self, i: int, max_tokens: int | None = None) -> None:
        """Ask the kernel to start reading sample i's chunk files now, without waiting for them.

        From a cold cache this lets the disk work on later chunks (or on the next
        sample) while this thread decodes; on cached files it costs microseconds.
        """
        first = int(self.sample_starts[i]) // self.info.chunk_tokens
        count = max(1, math.ceil(self._tokens_to_read(i, max_tokens) / self.info.chunk_tokens))
        for name in CHECKSUMMED:
            for chunk in range(first, first + count):
                read_ahead(self.chunk_path(name, chunk))

    def _read_rows(self, name: str, start: int, rows: int, allocate: Allocator, stats: ReadStats) -> torch.Tensor:
        """Decode whole chunks into a buffer rounded up to the chunk size; return a view of the rows."""
        c = self.info.chunk_tokens
        first = start // c
        count = max(1, math.ceil(rows / c))
        width = self._widths()[name]
        shape: tuple[int, ...] = (count * c, width) if name in HIDDEN_ARRAYS else (count * c,)
        buffer = allocate(shape, _storage_torch_dtype(name, self.info))
        flat = buffer.numpy().reshape(count, -1)
        nbytes = self._chunk_nbytes[name]
        for j in range(count):
            self._read_chunk(name, first + j, flat[j], nbytes, stats)
        stats.add_delivered(rows * width * buffer.element_size())
        return buffer[:rows]

    def chunk_path(self, name: str, chunk: int) -> Path:
        return self.path / chunk_key(name, chunk)

    def _read_chunk(self, name: str, chunk: int, out: np.ndarray, nbytes: int, stats: ReadStats) -> None:
        """Uncompressed: read straight into `out`.  Compressed: map the file (populated in one go)
        and decode from the page cache into `out`, so the compressed bytes are never copied."""
        path = self.chunk_path(name, chunk)
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                if not self._compressed:
                    got = f.readinto(memoryview(out).cast("B"))
                    stats.add_read(got, time.perf_counter() - t0)
                    if got != nbytes:
                        raise StoreError(path, f"chunk holds {got} bytes, expected {nbytes}: the store is damaged")
                    return
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise StoreError(path, "chunk file is empty: the store is damaged")
                data = mmap.mmap(f.fileno(), size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except FileNotFoundError:
            raise StoreError(path, "chunk file is missing: the store is damaged; run `h5feed verify`") from None
        t1 = time.perf_counter()
        stats.add_read(size, t1 - t0)
        try:
            blosc.decompress(data, out)
        except Exception as exc:  # numcodecs raises RuntimeError/ValueError on bad frames
            raise StoreError(path, f"chunk cannot be decoded ({exc}): the store is damaged") from exc
        finally:
            data.close()
        stats.add_decode(time.perf_counter() - t1)


def read_ahead(path: Path) -> None:
    """Ask the kernel to start reading `path` into the page cache, without waiting for it.
    A missing file is left to the read that follows to report."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def chunk_key(name: str, chunk: int) -> str:
    """Where zarr v3's default chunk key encoding puts chunk `chunk` (of the token axis) of array `name`."""
    return f"{name}/c/{chunk}/0" if name in HIDDEN_ARRAYS else f"{name}/c/{chunk}"


def chunk_encoder(codec: dict[str, Any], itemsize: int) -> Callable[[np.ndarray], bytes]:
    """Encode one chunk exactly as zarr's codec pipeline does for `codec` (little-endian bytes, then Blosc)."""
    if codec["name"] == "none":
        return lambda chunk: chunk.tobytes()
    shuffles = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
    from numcodecs import Blosc

    blosc_codec = Blosc.from_config({"cname": codec["cname"], "clevel": codec["clevel"], "blocksize": codec["blocksize"],
                                     "shuffle": shuffles[codec["shuffle"]], "typesize": itemsize})
    return lambda chunk: bytes(blosc_codec.encode(chunk))


def _storage_torch_dtype(name: str, info: StoreInfo) -> torch.dtype:
    return storage_dtype(info.torch_dtype) if name in HIDDEN_ARRAYS else torch.int64


def _itemsize(name: str, info: StoreInfo) -> int:
    return _storage_torch_dtype(name, info).itemsize


def read_info(path: Path) -> StoreInfo:
    """Read the store's attributes without zarr, with errors that say what is wrong."""
    meta_path = path / "zarr.json"
    if not meta_path.exists():
        raise StoreError(path, "not an h5feed store (no zarr.json); create one with `h5feed convert SRC DST`")
    try:
        meta = json.loads(meta_path.read_text())
        attrs = meta["attributes"][ATTRS_KEY]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise StoreError(path, f"a Zarr group but not an h5feed store ({exc!r})") from exc
    if attrs.get("format_version") != STORE_FORMAT_VERSION:
        raise StoreError(
            path, f"store format version {attrs.get('format_version')} is not {STORE_FORMAT_VERSION}; reconvert it"
        )
    return StoreInfo.from_json(attrs)


def crc32c(array: np.ndarray, crc: int = 0) -> int:
    """crc32c of an array's bytes, continuing `crc`: a sample's chunks can be checksummed one by one."""
    import google_crc32c

    data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    data.flags.writeable = False  # google_crc32c takes read-only buffers only
    return int(google_crc32c.extend(crc, data))


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """crc32c of each tensor's bytes, the checksum recorded at conversion and checked by verify."""
    return [crc32c(tensor.contiguous().numpy()) for tensor in tensors]
